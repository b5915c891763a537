"""The tiny qwen4_exp as vLLM 0.33 serves it: ``tests/e2e/models.py``'s writer plus one config field.

Used by the suite (``conftest.py``, in the vLLM venv's pytest) and by the probe
(``tests/e2e/vllm_cpu_standin/try_serve.py``, in a subprocess of that venv), so both serve the same files.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..e2e.models import make_qwen4_exp

PLE_SHARD = ".ngram_embedding.shard_"  # the checkpoint's PLE table shards (what a sidecar is built from)


def make_qwen4_exp_vllm(out: Path, *, negate_ple: bool = False) -> Path:
    """The sglang suite's tiny qwen4_exp, with ``text_config.output_gate_type`` written out.

    transformers reads ``output_gate_type: None`` as ``hidden_act`` ("silu"); vLLM 0.33's
    ``QwenGatedDeltaNetAttention`` asserts a string. Same meaning, so no numerics change.
    ``negate_ple``: every PLE shard negated, the same model with other PLE rows (a negative control)."""
    make_qwen4_exp(out)
    cfg = json.loads((out / "config.json").read_text())
    text = cfg["text_config"]
    text["output_gate_type"] = text.get("output_gate_type") or text["hidden_act"]
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    if negate_ple:
        negate_ple_shards(out)
    return out


def negate_ple_shards(model: Path) -> None:
    from safetensors.torch import load_file, save_file

    for f in model.glob("*.safetensors"):
        tensors = load_file(str(f))
        tensors = {k: (-v if PLE_SHARD in k else v) for k, v in tensors.items()}
        save_file(tensors, str(f), metadata={"format": "pt"})
