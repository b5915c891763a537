"""The PLE table's row ids of a token sequence, on the CPU, bit-exact with both engines.

Qwen3.8 Flash-Next's PLE (an Engram-style n-gram memory) reads, for every token ``t`` and every
PLE layer, ``(ngram_size - 1) × heads_per_ngram`` rows (16 with the defaults) whose ids are a pure
function of the token and its ``ngram_size - 1`` predecessors::

    mix_n    = XOR_{i < n} (token[t - i] * multiplier[i])        (int64, wrapping)
    id[n, h] = offset[h] + (mix_n mod size[h])                    (mod: the result is >= 0)

for n-gram orders ``n = 2 … ngram_size`` and ``heads_per_ngram`` heads ``h`` per order. A
predecessor older than the most recent EOS among the predecessors is replaced by the EOS id, and
a request starts with a history of EOS ids. Because the ids depend only on the tokens, the rows a
prefill chunk will need are known as soon as the request is (prompt-ahead prefetch).

Where this is, per engine (the property tests in ``tests/sglang/checks/check_ngram_hash.py`` and
``tests/vllm/checks/check_ngram_hash.py`` prove this module equal to each, bit for bit):

- sglang 0.5.23 ``models/qwen4_exp.py``: ``Qwen4ExpNGramEmbedding`` (``_build_layer_multipliers``,
  ``_build_head_vocab_and_offsets``, ``_hash_contexts``/``_shift_right_ignore_eos`` and the fused
  decode kernel ``kernels/ops/embeddings/qwen4_ngram.py``); the per-request history is the
  ``NGramPool`` (``mem_cache/ple_state_pool.py``, reset to EOS).
- vLLM 0.33.0 ``models/qwen4_exp/nvidia/ngram_embedding.py`` (``_make_layer_multipliers``,
  ``_make_vocab_layout``, ``compute_ngram_ids``) and the Triton kernel ``common/ops/ple.py``
  ``_ple_ngram_ids_kernel``; the history is ``Qwen4ExpModelState._prepare_ngram_context``.

The checkpoint may override the hash buffers (``layer_multipliers``, ``ngram_heads_vocab_sizes``,
``ngram_heads_offsets``): an adapter that has the loaded model builds its hasher with
:meth:`NGramHash.from_buffers` from those buffers, so it hashes with what the engine really uses.

Imports only the standard library and numpy (no engine, no torch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MASK64 = (1 << 64) - 1
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
SPLITMIX_M1 = 0xBF58476D1CE4E5B9
SPLITMIX_M2 = 0x94D049BB133111EB
LAYER_PRIME = 10007  # sglang _PRIME_1, vLLM _PLE_LAYER_PRIME
DEFAULT_SEED = 1234
# Deterministic Miller-Rabin bases for every n < 2^64 (Jim Sinclair's set).
_MR_BASES = (2, 325, 9375, 28178, 450775, 9780504, 1795265022)
_SMALL_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def splitmix64(x: int) -> int:
    x = (x + SPLITMIX_GAMMA) & MASK64
    x = ((x ^ (x >> 30)) * SPLITMIX_M1) & MASK64
    x = ((x ^ (x >> 27)) * SPLITMIX_M2) & MASK64
    return (x ^ (x >> 31)) & MASK64


def is_prime(n: int) -> bool:
    """Exact for every ``n < 2**64`` (deterministic Miller-Rabin)."""
    if n < 2:
        return False
    for p in _SMALL_PRIMES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        a %= n
        if a == 0:
            continue
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = pow(x, 2, n)
            if x == n - 1:
                break
        else:
            return False
    return True


def nth_prime_after(start: int, n: int) -> int:
    """The ``n``-th prime strictly greater than ``start`` (``n >= 1``)."""
    p = int(start)
    for _ in range(n):
        p += 1
        while not is_prime(p):
            p += 1
    return p


def layer_multipliers(*, ngram_size: int, unigram_vocab_size: int, seed: int, ple_layer_index: int) -> list[int]:
    """Odd splitmix64 multipliers below ``(2^63 - 1) // vocab``: a token times one never overflows."""
    half_bound = max(1, ((1 << 63) - 1) // max(int(unigram_vocab_size), 1) // 2)
    base = int(seed) + LAYER_PRIME * int(ple_layer_index)
    return [2 * (splitmix64((base + SPLITMIX_GAMMA * (i + 1)) & MASK64) % half_bound) + 1 for i in range(ngram_size)]


def head_layout(*, ngram_vocab_size_base: int, ngram_heads: int,
                ple_layer_index: int) -> tuple[list[int], list[int], int]:
    """Per-head partition sizes (distinct primes across all heads of all layers), offsets, total."""
    sizes, offsets, total = [], [], 0
    prime = int(ngram_vocab_size_base) - 1
    first = int(ple_layer_index) * ngram_heads
    prime = nth_prime_after(prime, first + 1)  # the (first + 1)-th prime after base - 1
    for h in range(ngram_heads):
        if h:
            prime = nth_prime_after(prime, 1)
        sizes.append(prime)
        offsets.append(total)
        total += prime
    return sizes, offsets, total


def _as_int64(values, what: str, n: int | None = None) -> np.ndarray:
    a = np.asarray(values)
    if a.ndim == 1 and a.size == 0 and (n is None or n == 0):
        return np.zeros(0, np.int64)  # [] has no integer dtype
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer) or (n is not None and a.size != n):
        raise ValueError(f"{what} must be a 1-D integer array{f' of {n} values' if n is not None else ''}, "
                         f"got {a.dtype} {a.shape}")
    if a.dtype == np.uint64 and a.size and int(a.max()) >= 1 << 63:
        raise ValueError(f"{what} has a value >= 2^63 ({int(a.max())})")
    return a.astype(np.int64, copy=False)


@dataclass(frozen=True)
class NGramHash:
    """The hash of one PLE layer: ``ids(tokens)`` are the table rows those tokens read.

    Build it with :meth:`from_config` (the engines' derivation from the model config) or
    :meth:`from_buffers` (the buffers of a loaded engine module, which a checkpoint may override).
    """

    multipliers: tuple[int, ...]  # ngram_size values: multiplier[i] scales token[t - i]
    head_sizes: tuple[int, ...]  # (ngram_size - 1) * heads_per_ngram partition sizes (> 0)
    head_offsets: tuple[int, ...]
    heads_per_ngram: int
    eos_token_id: int
    rows: int  # the table's rows (padded); every id is below it

    def __post_init__(self):
        order = len(self.multipliers)
        if order < 2 or self.heads_per_ngram < 1 or len(self.head_sizes) != (order - 1) * self.heads_per_ngram \
                or len(self.head_offsets) != len(self.head_sizes):
            raise ValueError(f"inconsistent n-gram hash: {order} multipliers, heads_per_ngram {self.heads_per_ngram}, "
                             f"{len(self.head_sizes)} sizes, {len(self.head_offsets)} offsets; expected "
                             f"(ngram_size - 1) * heads_per_ngram of each")
        if min(self.head_sizes) < 1 or min(self.head_offsets) < 0:
            raise ValueError("head sizes must be positive and offsets non-negative")
        top = max(o + s for o, s in zip(self.head_offsets, self.head_sizes, strict=False))
        if top > self.rows:
            raise ValueError(f"head partitions end at row {top}, beyond the table's {self.rows} rows")

    @property
    def ngram_size(self) -> int:
        return len(self.multipliers)

    @property
    def ngram_heads(self) -> int:
        """Rows per token (16 for Qwen3.8 Flash-Next)."""
        return len(self.head_sizes)

    @classmethod
    def from_config(cls, *, unigram_vocab_size: int, eos_token_id: int, ngram_size: int = 3, heads_per_ngram: int = 8,
                    ngram_vocab_size_base: int = 20_000_000, make_ngram_vocab_size_divisible_by: int = 128,
                    seed: int = DEFAULT_SEED, ple_layer_index: int = 0) -> NGramHash:
        """The engines' derivation. ``ple_layer_index`` is the index of the layer among the sorted
        unique ``ple_layer_ids`` (sglang ``ple_layer_index``, vLLM ``ple_dense_layer_id``);
        ``unigram_vocab_size`` is the model's ``vocab_size``; ``seed`` its ``seed`` (default 1234)."""
        if ngram_size < 2 or heads_per_ngram < 1 or ngram_vocab_size_base < 1 or make_ngram_vocab_size_divisible_by < 1:
            raise ValueError("ngram_size >= 2, heads_per_ngram >= 1, ngram_vocab_size_base >= 1 and a positive "
                             "make_ngram_vocab_size_divisible_by are required")
        heads = (ngram_size - 1) * heads_per_ngram
        mult = layer_multipliers(ngram_size=ngram_size, unigram_vocab_size=unigram_vocab_size, seed=seed,
                                 ple_layer_index=ple_layer_index)
        sizes, offsets, total = head_layout(ngram_vocab_size_base=ngram_vocab_size_base, ngram_heads=heads,
                                            ple_layer_index=ple_layer_index)
        div = int(make_ngram_vocab_size_divisible_by)
        return cls(tuple(mult), tuple(sizes), tuple(offsets), int(heads_per_ngram), int(eos_token_id),
                   -(-total // div) * div)

    @classmethod
    def from_buffers(cls, layer_multipliers: np.ndarray, ngram_heads_vocab_sizes: np.ndarray,
                     ngram_heads_offsets: np.ndarray, *, heads_per_ngram: int,
                     eos_token_id: int, rows: int) -> NGramHash:
        """From a loaded engine module's buffers (``.tolist()`` of the tensors, or any int sequence)."""
        m, s, o = (tuple(int(v) for v in _as_int64(x, name)) for x, name in (
            (layer_multipliers, "layer_multipliers"), (ngram_heads_vocab_sizes, "ngram_heads_vocab_sizes"),
            (ngram_heads_offsets, "ngram_heads_offsets")))
        return cls(m, s, o, int(heads_per_ngram), int(eos_token_id), int(rows))

    @classmethod
    def from_module(cls, module: object, *, rows: int) -> NGramHash:
        """From a loaded n-gram embedding module of either engine (sglang's and vLLM's ``Qwen4ExpNGramEmbedding``
        name these buffers alike); ``rows``: the table's row count."""
        return cls.from_buffers(module.layer_multipliers.tolist(), module.ngram_heads_vocab_sizes.tolist(),
                                module.ngram_heads_offsets.tolist(), heads_per_ngram=module.heads_per_ngram,
                                eos_token_id=module.eos_token_id, rows=rows)

    def ids(self, tokens: Sequence[int] | np.ndarray, history: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
        """Row ids ``[len(tokens), ngram_heads]`` (int64) of ``tokens``.

        Args:
            tokens: 1-D integer token ids (any values; products wrap in int64 like the engines').
            history: the ``ngram_size - 1`` tokens before ``tokens[0]`` (oldest first); default
                a request's start (all EOS). For a later chunk of a prompt pass the tokens before it.
        """
        t = _as_int64(tokens, "tokens")
        order = self.ngram_size
        ctx = order - 1
        hist = np.full(ctx, self.eos_token_id, np.int64) if history is None else _as_int64(history, "history", ctx)
        seq = np.concatenate([hist, t])
        n = t.size
        eos = self.eos_token_id
        m = np.array(self.multipliers, dtype=np.int64)
        out = np.empty((n, self.ngram_heads), np.int64)
        if n == 0:
            return out
        with np.errstate(over="ignore"):
            mix = seq[ctx:] * m[0]
            crossed = np.zeros(n, dtype=bool)
            hp = self.heads_per_ngram
            for shift in range(1, order):
                prev = seq[ctx - shift:ctx - shift + n]
                prev = np.where(crossed, eos, prev)  # older than an EOS among the predecessors: EOS
                crossed |= prev == eos
                mix = mix ^ (prev * m[shift])
                # mix now covers orders up to shift + 1: the heads of n-gram order shift + 1
                lo = (shift - 1) * hp
                sizes = np.array(self.head_sizes[lo:lo + hp], dtype=np.int64)
                offsets = np.array(self.head_offsets[lo:lo + hp], dtype=np.int64)
                np.add(np.remainder(mix[:, None], sizes[None, :]), offsets[None, :], out=out[:, lo:lo + hp])
        return out

    def chunk_ids(self, tokens: Sequence[int] | np.ndarray, start: int, stop: int) -> np.ndarray:
        """The flat row ids of prompt positions ``[start, stop)`` (token-major, head-minor): what
        the PLE lookup of that prefill chunk reads. ``tokens`` is the whole prompt."""
        t = _as_int64(tokens, "tokens")
        if not 0 <= start <= stop <= t.size:
            raise ValueError(f"chunk [{start}, {stop}) is outside the prompt's {t.size} tokens")
        ctx = self.ngram_size - 1
        hist = np.concatenate([np.full(max(0, ctx - start), self.eos_token_id, np.int64), t[max(0, start - ctx):start]])
        return self.ids(t[start:stop], hist).reshape(-1)


def qwen38_flash_next(*, unigram_vocab_size: int = 151_936, eos_token_id: int = 151_645,
                      ple_layer_index: int = 0) -> NGramHash:
    """The hash with Qwen3.8 Flash-Next's assumed defaults (16 heads, base 2e7: 320,001,536 rows for PLE
    index 0). The real ``config.json`` values are unverified; serve with :meth:`NGramHash.from_buffers`."""
    return NGramHash.from_config(unigram_vocab_size=unigram_vocab_size, eos_token_id=eos_token_id,
                                 ple_layer_index=ple_layer_index)


__all__ = ["NGramHash", "qwen38_flash_next", "layer_multipliers", "head_layout", "is_prime", "nth_prime_after",
           "splitmix64"]
