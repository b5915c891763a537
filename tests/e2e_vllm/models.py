"""The tiny qwen4_exp as vLLM 0.33 serves it: ``tests/e2e/models.py``'s writer plus one config field.

Used by the suite (``conftest.py``, in the vLLM venv's pytest) and by the probe
(``tests/e2e/vllm_cpu_standin/try_serve.py``, in a subprocess of that venv), so both serve the same files.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..e2e.models import make_qwen4_exp

PLE_SHARD = ".ngram_embedding.shard_"  # the checkpoint's PLE table shards (what a sidecar is built from)


def make_qwen4_exp_vllm(out: Path, *, negate_ple: bool = False, mtp: bool = False) -> Path:
    """The sglang suite's tiny qwen4_exp, with ``text_config.output_gate_type`` written out.

    transformers reads ``output_gate_type: None`` as ``hidden_act`` ("silu"); vLLM 0.33's
    ``QwenGatedDeltaNetAttention`` asserts a string. Same meaning, so no numerics change.
    ``negate_ple``: every PLE shard negated, the same model with other PLE rows (a negative control).
    ``mtp``: the MTP draft's tensors added as :func:`add_mtp_weights` writes them (the target's are unchanged)."""
    make_qwen4_exp(out)
    cfg = json.loads((out / "config.json").read_text())
    text = cfg["text_config"]
    text["output_gate_type"] = text.get("output_gate_type") or text["hidden_act"]
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    if negate_ple:
        negate_ple_shards(out)
    if mtp:
        add_mtp_weights(out)
    return out


def negate_ple_shards(model: Path) -> None:
    from safetensors.torch import load_file, save_file

    for f in model.glob("*.safetensors"):
        tensors = load_file(str(f))
        tensors = {k: (-v if PLE_SHARD in k else v) for k, v in tensors.items()}
        save_file(tensors, str(f), metadata={"format": "pt"})


MTP_FILE = "model-mtp.safetensors"


def add_mtp_weights(model: Path, *, repeat_draft: bool = True) -> Path:
    """The MTP draft in the target checkpoint itself, where vLLM 0.33 loads it from: ``--speculative-config
    '{"method": "mtp", ...}'`` makes the draft model path the target's (``config/speculative.py``), rewrites the
    config to ``Qwen4ExpMTP`` with ``n_predict = text_config.mtp_num_hidden_layers`` (written here: 1), and
    ``Qwen4ExpMTP.load_weights`` keeps ``mtp.*`` (as ``model.*``) and the target's embedding from the same files,
    while the target's loader drops every ``mtp.`` name; the draft always shares the target's ``lm_head``
    (``spec_decode/eagle/utils.py:_should_share``: ``Qwen4ExpMTP`` declares no head of its own). The tensors are
    the sglang suite's draft (``tests/e2e/models.py:write_mtp_draft``: one QSA decoder layer shaped like the
    target's, the hyper-connection mixer and the ``fc_embedding``/``fc_hidden`` fusion, random, seed 1), written
    to one more shard, :data:`MTP_FILE`, and named in the index when the checkpoint has one. The draft layer is
    decoder layer ``num_hidden_layers`` (4), not a PLE layer, so no PLE tensor is written.

    ``repeat_draft``: the draft proposes the token the target has just emitted, so some drafts are accepted
    (``write_mtp_draft`` says how; measured here with a random draft: 0 of 10 accepted, the rollback to an
    accepted draft token untried)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from ..e2e.models import MTP_DIR, write_mtp_draft

    draft = write_mtp_draft(model, repeat_draft=repeat_draft)
    tensors = load_file(str(draft / "model.safetensors"))
    shutil.rmtree(draft)  # the sglang layout's own directory: vLLM reads the shards of the model directory
    assert not (model / MTP_DIR).exists()
    save_file(tensors, str(model / MTP_FILE), metadata={"format": "pt"})
    index = model / "model.safetensors.index.json"
    if index.exists():
        meta = json.loads(index.read_text())
        meta["weight_map"].update({name: MTP_FILE for name in tensors})
        index.write_text(json.dumps(meta, indent=1))
    cfg = json.loads((model / "config.json").read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    (model / "config.json").write_text(json.dumps(cfg, indent=1))
    return model
