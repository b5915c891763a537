"""Shared fixtures: the write-ups' model geometry, model directories with real sidecars."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from sglang_ssd_stream.sglang.side import SIDE as SGLANG_SIDE
from vllm_ple_offload.side import SIDE as VLLM_SIDE

SIDES = {"sglang": SGLANG_SIDE, "vllm": VLLM_SIDE}  # what each CLI hands to the operate commands

# Geometry of write-up 000 §3: 48 layers, every 4th full attention (12), 2 KV heads x 256, one MTP
# layer. The QSA index head (128, ratio 4) is the one that gives the measured 192 MiB at 262,144
# tokens (12 layers x 128 x 2 B / 4); the GDN sizes are Qwen3-Next's (not in the write-ups).
WRITEUP_TEXT_CONFIG = {
    "num_hidden_layers": 48, "full_attention_interval": 4, "num_key_value_heads": 2, "head_dim": 256,
    "mtp_num_hidden_layers": 1, "indexer_n_heads": 16, "indexer_kv_heads": 1, "indexer_head_dim": 128,
    "indexer_budget": 2048, "indexer_compress_ratio": 4, "linear_num_value_heads": 32, "linear_num_key_heads": 16,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    # Half of the 256-dim heads rotate (128 = the QSA index head): transformers' Qwen4ExpConfig refuses a
    # config whose RoPE dimensions do not fit the index head (issue 28 item 6). theta: any valid value.
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
}


def write_model(root: Path, *, sidecar: bool = True, draft: bool = True, shards: dict[str, int] | None = None) -> Path:
    """A model directory: config.json, an index with real shard files, optionally ssd-stream.json + ple/ and mtp/."""
    root.mkdir(parents=True, exist_ok=True)
    config = json.dumps({"model_type": "qwen4_exp", "text_config": WRITEUP_TEXT_CONFIG})
    (root / "config.json").write_text(config)
    shards = shards or {"model-00001.safetensors": 1000, "model-00002.safetensors": 3000}
    for name, size in shards.items():
        (root / name).write_bytes(b"\0" * size)
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {f"w{i}": name for i, name in enumerate(shards)}}))
    if sidecar:
        rows, cols = 64, 16
        data = bytes((i * 7) % 251 for i in range(rows * cols))
        (root / "ple").mkdir(exist_ok=True)
        (root / "ple" / "layer-3.bin").write_bytes(data)
        (root / "ssd-stream.json").write_text(json.dumps({"format": "sglang-ssd-stream", "version": 1, "tables": [
            {"layer": 3, "path": "ple/layer-3.bin", "sha256": hashlib.sha256(data).hexdigest(),
             "dtype": "float8_e4m3fn", "rows": rows, "columns": cols, "bytes": rows * cols}]}))
    if draft:
        (root / "mtp").mkdir(exist_ok=True)
        (root / "mtp" / "config.json").write_text(config)  # the real draft carries the target's config
        (root / "mtp" / "mtp.safetensors").write_bytes(b"\0" * 500)
        (root / "mtp" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"m": "mtp.safetensors"}}))
    return root


PLE_ROWS, PLE_COLS = 4096, 256  # one fp8 PLE table of layer 3 in two shards: 1 MiB


def add_ple_shards(model: Path) -> int:
    """Give ``write_model``'s model a real safetensors file of PLE shard tensors, mapped by its index (as the
    checkpoint itself maps them; ``split_ngram_parts`` 2); returns the table's bytes."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model / "config.json").read_text())
    cfg["text_config"]["split_ngram_parts"] = 2
    (model / "config.json").write_text(json.dumps(cfg))
    prefix = "model.language_model.layers.3.ple.ple_embedding.ngram_embedding"
    ple = {f"{prefix}.shard_{k}.weight": torch.full((PLE_ROWS // 2, PLE_COLS), k + 1, dtype=torch.uint8).view(
        torch.float8_e4m3fn) for k in range(2)}
    save_file(ple, str(model / "model-ple.safetensors"))
    index = json.loads((model / "model.safetensors.index.json").read_text())
    index["weight_map"].update({n: "model-ple.safetensors" for n in ple})
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    return PLE_ROWS * PLE_COLS


@pytest.fixture
def model_dir(tmp_path) -> Path:
    return write_model(tmp_path / "model")


@pytest.fixture
def writeup_config(tmp_path) -> Path:
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"text_config": WRITEUP_TEXT_CONFIG}))
    return p


@pytest.fixture(autouse=True)
def host_passes_doctor(request, monkeypatch):
    """`serve` runs the real doctor, which refuses this CPU-only box (no CUDA, pristine engine).
    Serve tests are about the launch line, so they stand in a doctor that passes and records what
    it saw; tests marked `real_doctor` keep the real one."""
    if request.node.get_closest_marker("real_doctor"):
        return None
    from sglang_ssd_stream.sglang import doctor as sglang_doctor
    from vllm_ple_offload import doctor as vllm_doctor

    seen = []
    for doctor in (sglang_doctor, vllm_doctor):
        monkeypatch.setattr(doctor, "preflight", lambda **kw: seen.append(kw) or [])
    return seen
