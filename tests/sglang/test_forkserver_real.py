"""The fork server on the real sglang venv: its zygote holds the engine's dependencies and no module of the
engine, the kit or the tests, and a check forked from it has the outcomes of a new process."""

from __future__ import annotations

import pytest

from .. import forkserver
from ..engine import outcomes_only

CHECK = "tests/sglang/checks/check_ngram_hash.py"


def test_forked_check_equals_a_new_process(sglang, monkeypatch):
    monkeypatch.delenv(forkserver.OFF_SWITCH, raising=False)
    monkeypatch.setattr(sglang, "zygote_wait", None)  # this test waits for the imports
    zygote = forkserver.known_zygote(sglang.python) or forkserver.zygote_for(sglang.python, "sglang", sglang.env())
    ready = zygote.wait_ready(None)
    assert ready is not None, zygote.failed
    assert not [m for m in ready["modules"] if m.split(".")[0] in forkserver.EXCLUDED]
    assert {"torch", "transformers", "triton", "flashinfer"} <= set(ready["modules"])
    assert "FLASHINFER_WORKSPACE_BASE" in ready["replayed"]  # sglang points it under $HOME before the import
    runs = zygote.runs
    forked = sglang.run_checks(CHECK)
    assert zygote.runs == runs + 1
    monkeypatch.setenv(forkserver.OFF_SWITCH, "0")
    fresh = sglang.run_checks(CHECK)
    assert zygote.runs == runs + 1
    assert outcomes_only(forked) == outcomes_only(fresh), forked["__output__"]
    assert set(outcomes_only(forked).values()) == {"passed"}, forked["__output__"]


@pytest.mark.parametrize("extra", [{"TRITON_INTERPRET": "0"}, {"CUDA_VISIBLE_DEVICES": ""}])
def test_a_check_with_another_interpreter_setting_runs_in_a_new_process(sglang, extra):
    zygote = forkserver.known_zygote(sglang.python) or forkserver.zygote_for(sglang.python, "sglang", sglang.env())
    ready = zygote.wait_ready(None)  # ready already when the test above ran first
    assert ready is not None, zygote.failed
    assert forkserver.differences(zygote.base_env, sglang.env(extra, home=str(zygote.home)), ready)
