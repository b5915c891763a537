"""Synthetic Qwen3.8-style checkpoints with real safetensors PLE shards (written through torch)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

PREFIX = "model.language_model.layers.{layer}.ple.ple_embedding.ngram_embedding"


@dataclass
class Checkpoint:
    path: Path
    tables: dict[int, np.ndarray]  # layer -> uint8 [rows, row_bytes], the bytes we generated
    dtypes: dict[int, str]
    scales: dict[int, float]
    parts: int


def make_checkpoint(
    path: Path,
    layers: dict[int, tuple[str, int, int]],
    *,
    parts: int,
    files: int = 3,
    seed: int = 0,
    index: bool = True,
    scale: bool = True,
    drop_shards: dict[int, list[int]] | None = None,
    resize_shard: dict[int, tuple[int, int]] | None = None,
) -> Checkpoint:
    """Write ``{layer: (dtype, rows, columns)}`` as PLE shard tensors split into ``parts``."""
    import torch
    from safetensors.torch import save_file

    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    named: dict[str, torch.Tensor] = {}
    tables, dtypes, scales = {}, {}, {}
    for layer, (dtype, rows, cols) in layers.items():
        itemsize = 1 if dtype == "float8_e4m3fn" else 2
        raw = rng.integers(0, 256, size=(rows, cols * itemsize), dtype=np.uint8)
        tables[layer], dtypes[layer] = raw, dtype
        t = torch.from_numpy(raw.copy())
        t = t.view(torch.float8_e4m3fn) if dtype == "float8_e4m3fn" else t.view(torch.bfloat16)
        t = t.reshape(rows, cols)
        size = math.ceil(rows / parts)
        for k in range(parts):
            lo, hi = k * size, min((k + 1) * size, rows)
            if lo >= rows:
                break
            if k in (drop_shards or {}).get(layer, []):
                continue
            shard = t[lo:hi].clone()
            if resize_shard and layer in resize_shard and resize_shard[layer][0] == k:
                shard = shard[: resize_shard[layer][1]].clone()
            named[f"{PREFIX.format(layer=layer)}.shard_{k}.weight"] = shard
        if scale:
            value = 2.0 ** -(layer % 5 + 2)
            scales[layer] = value
            named[f"{PREFIX.format(layer=layer)}.weight_scale"] = torch.tensor([value], dtype=torch.bfloat16)
    # unrelated tensors, and an MTP PLE shard that must be ignored
    named["model.language_model.embed_tokens.weight"] = torch.zeros(4, 8, dtype=torch.bfloat16)
    named["mtp.layers.0.ple.ple_embedding.ngram_embedding.shard_0.weight"] = torch.zeros(2, 8, dtype=torch.bfloat16)
    names = sorted(named)
    weight_map = {}
    for i in range(files):
        fname = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        chunk = {n: named[n] for n in names[i::files]}
        if chunk:
            save_file(chunk, str(path / fname))
            weight_map.update({n: fname for n in chunk})
    if index:
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({"model_type": "qwen4_exp",
                                                  "text_config": {"split_ngram_parts": parts}}))
    return Checkpoint(path, tables, dtypes, scales, parts)


def shard_rows_via_safetensors(ckpt: Path, layer: int) -> np.ndarray:
    """The table as the engine would see it: every shard loaded by safetensors, concatenated."""
    import re

    import torch
    from safetensors.torch import load_file

    pat = re.compile(rf"layers\.{layer}\.ple\.ple_embedding\.ngram_embedding\.shard_(\d+)\.weight$")
    shards = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            m = pat.search(name)
            if m and "mtp" not in name:
                shards[int(m.group(1))] = t
    full = torch.cat([shards[k] for k in sorted(shards)])
    return full.view(torch.uint8).numpy().reshape(full.shape[0], -1)


FP8_LAYER, BF16_LAYER = 3, 7
FP8_ROWS, BF16_ROWS, COLS = 1_000_003, 40_009, 160


@pytest.fixture(scope="session")
def big(tmp_path_factory):
    """~1M-row fp8 table + 40k-row bf16 table, built once: (Checkpoint, manifest, reference rows)."""
    from sglang_ssd_stream.sidecar.build import build_sidecar

    root = tmp_path_factory.mktemp("big")
    ck = make_checkpoint(
        root / "ckpt",
        {FP8_LAYER: ("float8_e4m3fn", FP8_ROWS, COLS), BF16_LAYER: ("bfloat16", BF16_ROWS, COLS)},
        parts=64, files=3, seed=1,
    )
    result = build_sidecar(ck.path, root / "artifact", progress=False)
    ref = {n: shard_rows_via_safetensors(ck.path, n) for n in ck.tables}
    return ck, result, ref


@pytest.fixture
def small(tmp_path):
    """A fresh small artifact per test (safe to corrupt): (Checkpoint, artifact dir)."""
    from sglang_ssd_stream.sidecar.build import build_sidecar

    ck = make_checkpoint(tmp_path / "ckpt", {2: ("float8_e4m3fn", 5003, 160)}, parts=8, files=2, seed=2)
    build_sidecar(ck.path, tmp_path / "artifact", progress=False)
    return ck, tmp_path / "artifact"


@pytest.fixture
def table(small):
    """The small sidecar's one table."""
    from sglang_ssd_stream.sidecar import load_manifest

    _, art = small
    return load_manifest(art).tables[0]


@pytest.fixture
def ref(table):
    """That table's bytes, read directly."""
    return np.frombuffer(table.file.read_bytes(), np.uint8).reshape(table.rows, table.row_bytes)
