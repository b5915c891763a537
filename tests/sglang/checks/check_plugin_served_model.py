"""Runs inside the sglang venv (patched engine): the PLE hooks follow the model sglang resolves.

Our plugin is loaded by the real ``load_plugins()``; the model is resolved by sglang's real
``get_model_architecture`` (the call every model load makes before it builds the model). Only the
``ModelConfig`` around it is a stand-in (what that function reads: the HF config's architectures).

- loading the plugin imports nothing of qwen4_exp (it did: a server of any other model died where
  qwen4_exp cannot be imported, e.g. sglang's CPU engine);
- resolving Qwen3 leaves the PLE targets untouched; resolving qwen4_exp installs the four hooks;
- a qwen4_exp whose hooks cannot land stops the load, while Qwen3 still resolves in that process;
- a qwen4_exp checkpoint that sglang would serve with another class is refused.
"""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[3]
QWEN4 = "Qwen4ExpForConditionalGeneration"


def _model_config(arch: str, model_type: str):
    from sglang.srt.configs.model_config import ModelImpl

    hf = SimpleNamespace(architectures=[arch], model_type=model_type)
    return SimpleNamespace(hf_config=hf, quantization=None, model_impl=ModelImpl.AUTO, model_path=f"/models/{arch}")


@pytest.fixture(scope="module")
def loaded():
    from sglang.srt.plugins import load_plugins

    import sglang_ssd_stream.sglang.plugin as plugin

    load_plugins()
    assert plugin._registered
    return plugin


def _ple_targets():
    from sglang_ssd_stream.sglang import hooks

    return {t: pkgutil.resolve_name(t) for t, _ in hooks._hooks()}


def test_loading_the_plugin_imports_no_qwen4_exp(loaded):
    assert "sglang.srt.models.qwen4_exp" not in sys.modules
    assert "sglang.srt.models.qwen4_exp_ple_table" not in sys.modules
    from sglang.srt.model_loader import utils

    assert getattr(utils.get_model_architecture, "__wrapped__", None) is not None  # the gate landed


def test_other_model_left_alone_then_qwen4_exp_hooked(loaded):
    from sglang.srt.model_loader.utils import get_model_architecture

    from sglang_ssd_stream.sglang import hooks

    before = _ple_targets()  # imports qwen4_exp now, for the comparison only
    cls, arch = get_model_architecture(_model_config("Qwen3ForCausalLM", "qwen3"))
    assert cls.__name__ == "Qwen3ForCausalLM" and arch == "Qwen3ForCausalLM"
    assert _ple_targets() == before and not hooks._installed

    cls, _ = get_model_architecture(_model_config(QWEN4, "qwen4_exp"))
    assert cls.__name__ == QWEN4 and hooks._installed
    after = _ple_targets()
    assert all(after[t] is not before[t] for t in before)  # all four hooks on the real classes
    import sglang.srt.models.qwen4_exp as q

    assert q.allocate_ple_host_table is after[hooks.ALLOCATE]  # the copy qwen4_exp calls


def test_qwen4_exp_checkpoint_served_by_another_class_is_refused(loaded):
    from sglang_ssd_stream.sglang import hooks

    class Elsewhere:
        __module__ = "sglang.srt.models.transformers"

    with pytest.raises(hooks.SidecarHookError, match=r"is a qwen4_exp checkpoint, but sglang resolved it to "
                                                     r"sglang\.srt\.models\.transformers\.Elsewhere"):
        hooks.around_get_model_architecture(lambda mc: (Elsewhere, "X"), _model_config(QWEN4, "qwen4_exp"))
    assert hooks.around_get_model_architecture(lambda mc: (Elsewhere, "X"),
                                               _model_config("LlamaForCausalLM", "llama"))[0] is Elsewhere


BROKEN = """
import sglang.srt.models.qwen4_exp as q
del q.Qwen4ExpPLELayer._consume_prefetched_embeddings  # as a renamed upstream target would be
from types import SimpleNamespace
from sglang.srt.configs.model_config import ModelImpl
from sglang.srt.plugins import load_plugins
from sglang.srt.model_loader.utils import get_model_architecture
load_plugins()

def mc(arch, kind):
    return SimpleNamespace(hf_config=SimpleNamespace(architectures=[arch], model_type=kind), quantization=None,
                           model_impl=ModelImpl.AUTO, model_path="/m")

print("QWEN3", get_model_architecture(mc("Qwen3ForCausalLM", "qwen3"))[0].__name__, flush=True)
get_model_architecture(mc("Qwen4ExpForConditionalGeneration", "qwen4_exp"))
print("QWEN4 SERVED")
"""


def test_qwen4_exp_whose_hooks_cannot_land_stops_the_load():
    r = subprocess.run([sys.executable, "-c", BROKEN], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "QWEN3 Qwen3ForCausalLM" in r.stdout, r.stderr[-3000:]  # the other model is left alone
    assert r.returncode != 0 and "QWEN4 SERVED" not in r.stdout
    assert "SidecarHookError" in r.stderr and "_consume_prefetched_embeddings is missing" in r.stderr, r.stderr[-3000:]
