"""Our CPU n-gram hash (``sidecar/ngram.py``) == sglang 0.5.23's, bit for bit (runs in the sglang venv).

Reference: the real ``Qwen4ExpNGramEmbedding`` (its buffers built by ``_build_layer_multipliers``
and ``_build_head_vocab_and_offsets`` with sympy), its ids from the real prefill/decode path:
``_prepare_ple_batch`` → ``compute_ngram_ids`` (→ ``_hash_contexts``) → ``_commit_ple_batch``,
which carries each request's two-token history between chunks in a real ``NGramPool``; and the
fused decode kernel ``_qwen4_ngram_hash_kernel`` under ``TRITON_INTERPRET=1``. Stand-ins: the
forward batch (the attributes those functions read), the request pool around the real NGramPool,
and the PLE host table (a placeholder: hashing never reads it).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_ssd_stream.sidecar.ngram import NGramHash, qwen38_flash_next

VOCAB, EOS = 151_936, 151_645
PROFILE = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def sg():
    import sglang.srt.models.qwen4_exp as q
    from sglang.srt.configs.qwen4_exp import Qwen4ExpTextConfig
    from sglang.srt.mem_cache.ple_state_pool import NGramPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.runtime_context import get_parallel

    mp = pytest.MonkeyPatch()
    # Offloaded tables are built on meta and then allocated in host memory; hashing never reads them.
    mp.setattr(q, "allocate_ple_host_table",
               lambda shape, dtype, **kw: torch.empty((1,) * len(shape), dtype=dtype).expand(*shape))
    yield types.SimpleNamespace(q=q, Config=Qwen4ExpTextConfig, NGramPool=NGramPool, Mode=ForwardMode,
                                parallel=get_parallel)
    mp.undo()


_built: dict = {}


def embedding(sg, *, vocab=VOCAB, eos=EOS, ngram_size=3, heads=8, base=20_000_000, divisible=128, seed=1234, index=0):
    """The real module (cached per configuration)."""
    key = (vocab, eos, ngram_size, heads, base, divisible, seed, index)
    if key not in _built:
        kw = {} if seed is None else {"seed": seed}
        cfg = sg.Config(hidden_size=10 * (ngram_size - 1) * heads, vocab_size=vocab, eos_token_id=eos,
                        ngram_size=ngram_size, heads_per_ngram=heads, ngram_vocab_size_base=base,
                        make_ngram_vocab_size_divisible_by=divisible, ple_offload_embedding=True,
                        ple_embedding_dtype="float8_e4m3fn", **kw)
        with sg.parallel().override(tp_rank=0, tp_size=1, attn_tp_rank=0, attn_tp_size=1, moe_tp_rank=0,
                                    moe_tp_size=1):
            _built[key] = sg.q.Qwen4ExpNGramEmbedding(cfg, cfg.ple_embed_dim, ple_layer_index=index)
    return _built[key]


def ours_from(emb) -> NGramHash:
    return NGramHash.from_module(emb, rows=emb.ngram_embedding.org_vocab_size)


def test_production_table_layout(sg):
    """Qwen3.8 Flash-Next's assumed defaults: 16 heads, base 2e7, PLE index 0 -> 320,001,536 rows."""
    emb = embedding(sg)
    ours = qwen38_flash_next()
    assert ours == ours_from(emb)
    assert ours.rows == emb.ngram_embedding.org_vocab_size == 320_001_536


@settings(max_examples=40, **PROFILE)
@given(vocab=st.integers(2, 300_000), seed=st.integers(0, 2**40), index=st.integers(0, 4),
       ngram_size=st.integers(2, 4), heads=st.integers(1, 8), base=st.integers(2, 30_000_000),
       divisible=st.sampled_from([1, 8, 64, 128, 1000]))
def test_parameters_match_the_real_module(sg, vocab, seed, index, ngram_size, heads, base, divisible):
    emb = embedding(sg, vocab=vocab, seed=seed, index=index, ngram_size=ngram_size, heads=heads, base=base,
                    divisible=divisible)
    ours = NGramHash.from_config(unigram_vocab_size=vocab, eos_token_id=EOS, ngram_size=ngram_size,
                                 heads_per_ngram=heads, ngram_vocab_size_base=base,
                                 make_ngram_vocab_size_divisible_by=divisible, seed=seed, ple_layer_index=index)
    assert ours == ours_from(emb)


def test_default_seed_is_the_engines(sg):
    """A config without ``seed`` hashes with 1234 in sglang; so does from_config's default."""
    assert ours_from(embedding(sg, seed=None)) == NGramHash.from_config(unigram_vocab_size=VOCAB, eos_token_id=EOS)


class Pool:
    """The request pool around a real NGramPool (what _prepare/_commit_ple_batch call)."""

    def __init__(self, sg, slots: int, eos: int):
        self.ngram = sg.NGramPool(size=slots, context_len=2, eos_token_id=eos, device="cpu")
        self.ple_window_cache = None

    def get_mamba_indices(self, idx):
        return idx

    def get_ngram_context(self, idx):
        return self.ngram.get_context(idx)

    def set_ngram_context(self, idx, ctx):
        self.ngram.set_context(idx, ctx)


def forward_batch(sg, mode, slots, lens=None):
    return types.SimpleNamespace(
        tbo_parent_token_range=None, spec_algorithm=None, spec_info=None, _original_forward_mode=None,
        forward_mode=mode, global_num_token_non_padded_cpu=None,
        extend_seq_lens=None if lens is None else torch.tensor(lens), extend_seq_lens_cpu=lens,
        req_pool_indices=slots, out_cache_loc=None, mamba_track_indices=None, mamba_track_mask=None)


def step(sg, emb, pool, mode, tokens, slots, lens=None):
    """One forward's PLE ids through sglang's real batch preparation, hashing and history commit."""
    sg.q.get_req_to_token_pool = lambda: pool
    fb = forward_batch(sg, mode, slots, lens)
    batch = sg.q._prepare_ple_batch(torch.from_numpy(np.asarray(tokens, np.int64)), fb, ngram_size=emb.ngram_size,
                                    ngram_eos_token_id=emb.eos_token_id)
    ids = emb.compute_ngram_ids(batch)
    sg.q._commit_ple_batch(batch, fb)
    return ids.numpy()


def token_lists(vocab: int, eos: int, max_requests: int = 4, max_len: int = 40):
    tok = st.one_of(st.integers(0, vocab - 1), st.just(eos))  # EOS often: it resets the n-gram window
    return st.lists(st.lists(tok, max_size=max_len), min_size=1, max_size=max_requests)


@settings(max_examples=60, **PROFILE)
@given(data=st.data(), small=st.booleans(), chunk=st.integers(1, 16), decode_steps=st.integers(0, 3))
def test_chunked_prefill_then_decode_match(sg, data, small, chunk, decode_steps):
    """Requests of any length in one batch, prefilled in chunks, then decoded: every id equals ours."""
    if small:  # a small config with its own EOS, so EOS collides with ordinary token values
        vocab, eos, kw = 50, 7, dict(vocab=50, eos=7, base=100, seed=data.draw(st.integers(0, 2**32)),
                                      index=data.draw(st.integers(0, 3)))
    else:
        vocab, eos, kw = VOCAB, EOS, {}
    emb = embedding(sg, **kw)
    ours = ours_from(emb)
    prompts = data.draw(token_lists(vocab, eos))
    n = len(prompts)
    pool = Pool(sg, n + 1, eos)
    slots = torch.arange(1, n + 1)
    pos = [0] * n
    while any(p < len(t) for p, t in zip(pos, prompts, strict=False)):
        lens = [min(chunk, len(t) - p) for p, t in zip(pos, prompts, strict=False)]
        tokens = [x for t, p, k in zip(prompts, pos, lens, strict=False) for x in t[p:p + k]]
        got = step(sg, emb, pool, sg.Mode.EXTEND, tokens, slots, lens)
        a = 0
        for t, p, k in zip(prompts, pos, lens, strict=False):
            np.testing.assert_array_equal(got[a:a + k].reshape(-1), ours.chunk_ids(t, p, p + k))
            a += k
        pos = [p + k for p, k in zip(pos, lens, strict=False)]
    seqs = [list(t) for t in prompts]
    for _ in range(decode_steps):
        new = data.draw(st.lists(st.one_of(st.integers(0, vocab - 1), st.just(eos)), min_size=n, max_size=n))
        got = step(sg, emb, pool, sg.Mode.DECODE, new, slots)
        for i, x in enumerate(new):
            seqs[i].append(x)
            np.testing.assert_array_equal(got[i], ours.chunk_ids(seqs[i], len(seqs[i]) - 1, len(seqs[i])))


@settings(max_examples=12, **PROFILE)
@given(windows=st.lists(st.lists(st.one_of(st.integers(0, VOCAB - 1), st.just(EOS)), min_size=3, max_size=3),
                        min_size=1, max_size=40))
def test_fused_decode_kernel_matches(sg, windows):
    """sglang's fused decode hash (a Triton kernel; CUDA-only dispatch) run by the interpreter."""
    from sglang.kernels.ops.embeddings import qwen4_ngram as fused

    emb = embedding(sg)
    ctx = torch.tensor(windows, dtype=torch.long)
    out = torch.empty((len(windows), 16), dtype=torch.long)
    n = out.numel()
    fused._qwen4_ngram_hash_kernel[(-(-n // 256),)](
        ctx, emb.layer_multipliers, emb.ngram_heads_vocab_sizes, emb.ngram_heads_offsets, out, n, emb.eos_token_id,
        NGRAM_SIZE=3, HEADS_PER_NGRAM=8, NGRAM_HEADS=16, BLOCK_SIZE=256)
    ours = ours_from(emb)
    expect = np.stack([ours.ids(w[2:], w[:2])[0] for w in windows])
    np.testing.assert_array_equal(out.numpy(), expect)


@settings(max_examples=40, **PROFILE)
@given(windows=st.lists(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=3, max_size=3), min_size=1, max_size=30))
def test_out_of_vocabulary_tokens_wrap_like_the_torch_path(sg, windows):
    """Outside the vocabulary the products overflow int64: ours wraps exactly like sglang's torch hash
    (the fused kernel's C-style ``%`` then differs for negative mixes; no real token reaches that)."""
    emb = embedding(sg)
    sg.q.get_req_to_token_pool = lambda: types.SimpleNamespace(ple_window_cache=None)
    got = emb._hash_contexts(torch.tensor(windows, dtype=torch.long), decode_sized=False).numpy()
    ours = ours_from(emb)
    np.testing.assert_array_equal(got, np.stack([ours.ids(w[2:], w[:2])[0] for w in windows]))


def test_a_different_hash_is_detected(sg):
    """Not vacuous: a hasher of another PLE layer disagrees with the module on the same tokens."""
    emb = embedding(sg)
    other = NGramHash.from_config(unigram_vocab_size=VOCAB, eos_token_id=EOS, ple_layer_index=1)
    pool = Pool(sg, 2, EOS)
    tokens = list(range(100, 140))
    got = step(sg, emb, pool, sg.Mode.EXTEND, tokens, torch.tensor([1]), [len(tokens)])
    assert not np.array_equal(got.reshape(-1), other.chunk_ids(tokens, 0, len(tokens)))
    np.testing.assert_array_equal(got.reshape(-1), ours_from(emb).chunk_ids(tokens, 0, len(tokens)))
