"""A first start that is warm too (issue 27 item 2): a hot file built from a user's text corpus.

Each corpus file is one request (its history starts at EOS, as a new request's): tokenized by the model's own
tokenizer (transformers, the engine's), hashed into each PLE table's row ids by the engines' n-gram hash
(:mod:`.ngram`, proved bit-exact against both; the checkpoint's own hash buffers when it carries them), counted,
and the ``rows`` most frequent ids of each table (ties: the lower id) are written with their bytes, read from the
sidecar, to the hot file the serving process will look for (:mod:`.hot_file`). The sidecar must be the model's:
a hash whose row count is not the table's is refused.

A TP rank serves a different row range of each table (the tables differ in size). The split is the engine's own
vocab-parallel arithmetic, which this floor may not import: the adapters pass it in as a :data:`ShardRule`, and
every rank's ranges must tile each table with none empty (what the serving hooks' ``check_model_shape`` asks of a
rank), else the TP size is refused, never guessed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import BadKitData, EnvironmentProblem
from .format import SidecarManifest, check_model_shape
from .hot_file import changed_fields, hot_file_path, hottest, write_hot_file
from .ngram import DEFAULT_SEED, NGramHash

HASH_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")

# (table rows, TP rank, TP size, the model's text config) -> that rank's rows [lo, hi) of the table, computed by the
# engine's own code (the adapters' ``ple_rank_rows``).
ShardRule = Callable[[int, int, int, object], tuple[int, int]]


class ProfileRefused(BadKitData):
    """The model and the sidecar do not fit together, or the corpus gives nothing to profile."""


@dataclass(frozen=True)
class Profile:
    path: Path
    row_range: dict[int, tuple[int, int]]  # layer -> the rank's rows of each table (tables differ in size)
    tp_rank: int
    tp_size: int
    tokens: int
    rows: dict[int, int]  # layer -> rows written
    distinct: dict[int, int]  # layer -> distinct rows the corpus looks up in the range


def _text_config(model: Path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model), local_files_only=True)
    return getattr(config, "text_config", config)


def _checkpoint_buffers(model: Path, layer: int) -> dict[str, np.ndarray]:
    """The hash buffers the checkpoint carries for decoder ``layer`` (the engines load them over the derived
    ones), read with safetensors; empty when it carries none."""
    index = model / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
    else:
        weight_map = {k: "model.safetensors" for k in _keys(model / "model.safetensors")}
    out = {}
    for name, file in weight_map.items():
        parts = name.split(".")
        if parts[-1] in HASH_BUFFERS and f"layers.{layer}." in f"{name}." and ".mtp." not in f".{name}":
            from safetensors import safe_open

            with safe_open(str(model / file), "np") as f:  # this tensor only (int64; the file holds bf16 too)
                out[parts[-1]] = f.get_tensor(name)
    return out


def _keys(path: Path) -> list[str]:
    if not path.is_file():
        return []
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        return list(f.keys())


def model_hashes(model: str | os.PathLike, manifest: SidecarManifest, cfg=None) -> dict[int, NGramHash]:
    """Each sidecar table's n-gram hash as the engine builds it for ``model`` (its config through transformers,
    the checkpoint's hash buffers where it has them). Refuses a hash whose row count is not the table's."""
    model = Path(model)
    cfg = _text_config(model) if cfg is None else cfg
    ple_ids = sorted(set(int(x) for x in getattr(cfg, "ple_layer_ids", None) or []))
    out = {}
    for table in manifest.tables:
        if table.layer + 1 not in ple_ids:  # config.ple_layer_ids count decoder layers from 1 (sglang _has_ple)
            raise ProfileRefused(f"the sidecar's table for decoder layer {table.layer} is not a PLE layer of {model} "
                                 f"(ple_layer_ids {ple_ids}, counted from 1): another model's sidecar")
        h = NGramHash.from_config(
            unigram_vocab_size=int(cfg.vocab_size), eos_token_id=int(cfg.eos_token_id),
            ngram_size=int(cfg.ngram_size), heads_per_ngram=int(cfg.heads_per_ngram),
            ngram_vocab_size_base=int(cfg.ngram_vocab_size_base),
            make_ngram_vocab_size_divisible_by=int(getattr(cfg, "make_ngram_vocab_size_divisible_by", 128)),
            seed=int(getattr(cfg, "seed", DEFAULT_SEED)), ple_layer_index=ple_ids.index(table.layer + 1))
        buffers = _checkpoint_buffers(model, table.layer)
        if buffers:
            missing = [b for b in HASH_BUFFERS if b not in buffers]
            if missing:
                raise ProfileRefused(f"{model}: layer {table.layer} carries some n-gram hash buffers but not "
                                     f"{', '.join(missing)}")
            h = NGramHash.from_buffers(buffers["layer_multipliers"], buffers["ngram_heads_vocab_sizes"],
                                       buffers["ngram_heads_offsets"], heads_per_ngram=h.heads_per_ngram,
                                       eos_token_id=h.eos_token_id, rows=h.rows)
        if h.rows != table.rows:
            raise ProfileRefused(f"{model}'s n-gram hash addresses {h.rows} rows for layer {table.layer}; the "
                                 f"sidecar's table has {table.rows}: another model's sidecar")
        out[table.layer] = h
    return out


def _engine_split(rule: ShardRule, rows: int, size: int, cfg, layer: int) -> list[tuple[int, int]]:
    """Every rank's rows of one table by the engine's rule; refused unless they tile ``[0, rows)`` with no rank
    empty (a server whose rank gets no rows of a table refuses to start: ``check_model_shape``)."""
    try:
        split = [tuple(int(x) for x in rule(rows, rank, size, cfg)) for rank in range(size)]
    except (AssertionError, ValueError, ArithmeticError) as exc:  # the engine's own refusal (vLLM: not divisible)
        raise ProfileRefused(f"the engine does not split layer {layer}'s PLE table ({rows} rows) over TP {size}: "
                             f"{exc or type(exc).__name__}") from None
    except ImportError as exc:  # the split is the engine's code: profile a TP rank in the engine's runtime
        raise EnvironmentProblem(f"the engine's TP split of the PLE tables needs the engine in this runtime: "
                                 f"{exc}") from None
    empty = [rank for rank, (lo, hi) in enumerate(split) if lo >= hi]
    if empty:
        raise ProfileRefused(f"TP {size} leaves rank {empty[0]} no rows of layer {layer}'s PLE table ({rows} rows; "
                             f"the engine's split: {split}); a server of that size refuses to start")
    if split[0][0] != 0 or split[-1][1] != rows or any(split[r][1] != split[r + 1][0] for r in range(size - 1)):
        raise ProfileRefused(f"the engine's split of layer {layer}'s PLE table ({rows} rows) over TP {size} does "
                             f"not tile it: {split}")
    return split


def rank_ranges(manifest: SidecarManifest, hashes: dict[int, NGramHash], cfg, *, tp_rank: int, tp_size: int,
                shard_rule: ShardRule | None) -> dict[int, tuple[int, int]]:
    """This TP rank's rows of each table, as the engine splits them at serve time, checked as the serving hooks
    check them. TP 1 serves each whole table in both engines, so it needs no rule."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"TP rank {tp_rank} of TP size {tp_size}: expected 0 <= rank < size")
    if tp_size > 1 and shard_rule is None:
        raise ProfileRefused(f"this command does not know the engine's TP split of the PLE tables; profile TP "
                             f"{tp_size} with the engine's own CLI")
    out = {}
    for table in manifest.tables:
        rows = hashes[table.layer].rows  # the model's table size: what the engine's embedding is built with
        lo, hi = (0, rows) if tp_size == 1 else _engine_split(shard_rule, rows, tp_size, cfg, table.layer)[tp_rank]
        check_model_shape(table, dtype=table.dtype, columns=table.columns, rows=rows, row_range=(lo, hi))
        out[table.layer] = (lo, hi)
    return out


def corpus_tokens(model: str | os.PathLike, files: Sequence[str | os.PathLike]) -> list[np.ndarray]:
    """Each file's token ids by the model's own tokenizer (one request each)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    out = []
    for f in files:
        text = Path(f).read_text(encoding="utf-8", errors="replace")
        out.append(np.asarray(tok(text, add_special_tokens=False)["input_ids"], np.int64))
    return out


def _counts(hasher: NGramHash, requests: Iterable[np.ndarray], lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    ids = [hasher.ids(t).reshape(-1) for t in requests if t.size]
    flat = np.concatenate(ids) if ids else np.empty(0, np.int64)
    flat = flat[(flat >= lo) & (flat < hi)]
    return np.unique(flat, return_counts=True)


def build_profile(manifest: SidecarManifest, model: str | os.PathLike, corpus: Sequence[str | os.PathLike], *,
                  role: str, rows: int, tp_rank: int = 0, tp_size: int = 1, shard_rule: ShardRule | None = None,
                  path: str | os.PathLike | None = None) -> Profile:
    """Write the hot file of ``role`` and TP rank ``tp_rank`` of ``tp_size`` (its rows of each table by
    ``shard_rule``, the engine's split; TP 1: each whole table) from ``corpus``: each table's ``rows`` most
    looked-up rows, most first."""
    from . import SidecarReader

    if rows < 1:
        raise ValueError(f"rows per layer {rows}: expected >= 1")
    cfg = _text_config(Path(model))
    hashes = model_hashes(model, manifest, cfg)
    ranges = rank_ranges(manifest, hashes, cfg, tp_rank=tp_rank, tp_size=tp_size, shard_rule=shard_rule)
    requests = corpus_tokens(model, corpus)
    tokens = int(sum(t.size for t in requests))
    if not tokens:
        raise ProfileRefused("the corpus has no text to profile")
    layers, written, distinct, opened = {}, {}, {}, {}
    for table in manifest.tables:
        lo, hi = ranges[table.layer]
        ids, counts = _counts(hashes[table.layer], requests, lo, hi)
        distinct[table.layer] = int(ids.size)
        top = hottest(ids, counts, min(rows, ids.size))
        if not top.size:
            continue
        data = np.empty((top.size, table.row_bytes), np.uint8)
        reader = SidecarReader(table, vocab_start=lo, vocab_end=hi, max_rows=max(1, min(top.size, 1 << 16)))
        try:
            # the file is bound to the table its rows were read from (the descriptor's identity, not the path's
            # when writing), and a table written meanwhile (ctime moves even when mtime is put back) is refused
            fds = reader.table_files.fds  # every file of the table (an in-place table's shards)
            opened[table.layer] = tuple(os.fstat(fd) for fd in fds)
            for a in range(0, top.size, 1 << 16):
                reader.read_rows(top[a:a + (1 << 16)], data[a:a + (1 << 16)])
            why = "; ".join(w for w in map(changed_fields, opened[table.layer], (os.fstat(fd) for fd in fds)) if w)
        finally:
            reader.close()
        if why:
            raise ProfileRefused(f"PLE table {table.file} (layer {table.layer}) changed while it was profiled "
                                 f"({why}); no hot file written: profile again once the table stays as it is")
        layers[table.layer] = (top, data)
        written[table.layer] = int(top.size)
    if not layers:
        raise ProfileRefused("the corpus looks up no row of this range")
    target = Path(path) if path is not None else hot_file_path(manifest, ranges, role)
    write_hot_file(target, manifest, ranges, layers, role=role, table_stats=opened)
    return Profile(target, ranges, tp_rank, tp_size, tokens, written, distinct)
