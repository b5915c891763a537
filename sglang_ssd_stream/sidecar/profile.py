"""A first start that is warm too (issue 27 item 2): a hot file built from a user's text corpus.

Each corpus file is one request (its history starts at EOS, as a new request's): tokenized by the model's own
tokenizer (transformers, the engine's), hashed into each PLE table's row ids by the engines' n-gram hash
(:mod:`.ngram`, proved bit-exact against both; the checkpoint's own hash buffers when it carries them), counted,
and the ``rows`` most frequent ids of each table (ties: the lower id) are written with their bytes, read from the
sidecar, to the hot file the serving process will look for (:mod:`.hot_file`). The sidecar must be the model's:
a hash whose row count is not the table's is refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import BadKitData
from .format import SidecarManifest
from .hot_file import hot_file_path, hottest, write_hot_file
from .ngram import DEFAULT_SEED, NGramHash

HASH_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


class ProfileRefused(BadKitData):
    """The model and the sidecar do not fit together, or the corpus gives nothing to profile."""


@dataclass(frozen=True)
class Profile:
    path: Path
    row_range: dict[int, tuple[int, int]]  # layer -> the rows of each table (tables differ in size)
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


def model_hashes(model: str | os.PathLike, manifest: SidecarManifest) -> dict[int, NGramHash]:
    """Each sidecar table's n-gram hash as the engine builds it for ``model`` (its config through transformers,
    the checkpoint's hash buffers where it has them). Refuses a hash whose row count is not the table's."""
    model = Path(model)
    cfg = _text_config(model)
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
                  role: str, rows: int, row_range: tuple[int, int] | None = None,
                  path: str | os.PathLike | None = None) -> Profile:
    """Write the hot file of ``role`` and ``row_range`` (one range for every table; default: each whole table, one
    rank) from ``corpus``:
    each table's ``rows`` most looked-up rows, most first."""
    from . import SidecarReader

    if rows < 1:
        raise ValueError(f"rows per layer {rows}: expected >= 1")
    hashes = model_hashes(model, manifest)
    requests = corpus_tokens(model, corpus)
    tokens = int(sum(t.size for t in requests))
    if not tokens:
        raise ProfileRefused("the corpus has no text to profile")
    ranges = {t.layer: tuple(row_range) if row_range is not None else (t.row_start, t.row_start + t.rows)
              for t in manifest.tables}
    layers, written, distinct = {}, {}, {}
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
            for a in range(0, top.size, 1 << 16):
                reader.read_rows(top[a:a + (1 << 16)], data[a:a + (1 << 16)])
        finally:
            reader.close()
        layers[table.layer] = (top, data)
        written[table.layer] = int(top.size)
    if not layers:
        raise ProfileRefused("the corpus looks up no row of this range")
    target = Path(path) if path is not None else hot_file_path(manifest, ranges, role)
    write_hot_file(target, manifest, ranges, layers, role=role)
    return Profile(target, ranges, tokens, written, distinct)
