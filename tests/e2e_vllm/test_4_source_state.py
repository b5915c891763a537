"""Proof 4 (issue 26 item 2, the rest): the plugin's source guard judges the engine the real server runs.

Both scenarios run a private copy of the shared venv made of hard links (``cp -al``, about a second; the kit's
patcher and the suite write by rename, so the shared venv stays pristine: ``test_9``):

- ``unknown-source``: the copy's one patch target (``vllm/models/qwen4_exp/nvidia/ops/qsa.py``) has a line
  appended after install, a state the kit has no hash for. With the escape hatch set (``VLLM_PLE_ALLOW_UNPATCHED=1``
  covers a pristine engine only) the plugin refuses in the API server's ``register()``, naming the file, its state
  and the release, before vLLM starts the engine; nothing is served.
- ``patched-chunked``: the copy patched with the kit's own ``vllm-ple-offload patch apply`` serves **without**
  ``VLLM_PLE_ALLOW_UNPATCHED``; every vLLM process ran the plugin's guard and checks, and none says UNPATCHED.
"""

from __future__ import annotations

import re

from .conftest import PATCH_TARGET
from .test_1_plugin_live import _processes
from .test_3_refusals import _refused

RELEASE = "0.33.0"


def test_unknown_source_state_refuses_to_start(unknown_source):
    sc = unknown_source
    _refused(sc)
    assert sc.env["VLLM_PLE_ALLOW_UNPATCHED"] == "1"  # the escape hatch does not cover an unknown state
    assert sc.results["copy_seconds"] < 60  # hard links: no file copied
    # the kit's own status of that copy: the file, the hash found, and the hashes it knows for the release
    status = sc.results["status"]
    assert status["state"] == "unknown" and status["sha256"] == sc.results["sha256"], status
    assert sc.results["sha256"] not in (status["pristine"], status["patched"])
    # the server's refusal, in the API server (the launcher), before vLLM started the engine core
    refusal = sc.grep(r"^vllm-ple-offload plugin: PreflightFailed: PLE preflight failed:$")
    # the file, the hash found, what the release expects and the releases the kit knows
    verdict = sc.grep(rf"^\[error\] source: vllm {re.escape(RELEASE)} files match no state this kit knows "
                      rf"\({re.escape(PATCH_TARGET)}=unknown \(SHA-256 {sc.results['sha256']}; {RELEASE} expects "
                      rf"pristine {status['pristine']} or patched {status['patched']}\); releases this kit knows: "
                      rf"{re.escape(RELEASE)}\)$")
    fix = sc.grep(rf"fix: reinstall the engine as released \(pip install --force-reinstall --no-deps "
                  rf"vllm=={re.escape(RELEASE)}\), then vllm-ple-offload patch apply")
    assert refusal and verdict and fix, sc.log[-4000:]
    assert "(EngineCore" not in sc.log and "StreamedPLEEmbedding" not in sc.log
    assert sc.ready_seconds < 120


def test_patched_copy_serves_without_the_escape_hatch(patched_chunked):
    sc = patched_chunked
    facts = sc.results["venv"]
    assert facts["states"] == {"patched"} and facts["target"]["state"] == "patched", facts
    assert facts["target"]["sha256"] == facts["target"]["patched"] != facts["target"]["pristine"]
    assert facts["copy_seconds"] < 60
    # what the plugin's register() decides first, run in the copy: the patched OK verdict
    assert f"[ok] source: vllm {RELEASE}: 1 file(s) patched" in facts["guard"], facts["guard"]
    assert not any(k == "VLLM_PLE_ALLOW_UNPATCHED" for k in sc.env)
    pids = _processes(sc)
    venv_python = facts["python"]
    assert sc.pids[sc.leader].startswith(f"{venv_python} -m vllm.entrypoints.openai.api_server"), sc.pids
    for role, pid in pids.items():
        # each process ran the plugin's guard, then its checks (whose warnings it logs), and was not refused
        assert sc.grep(r"vllm-ple-offload: \[warning\] uva: ", pid), f"{role} (pid {pid})\n{sc.log[-3000:]}"
        # and says, with its pid, the guard's patched verdict
        assert f"vllm-ple-offload plugin: pid {pid}: [ok] source: vllm {RELEASE}: 1 file(s) patched" in sc.log, role
    assert "UNPATCHED" not in sc.log and "VLLM_PLE_ALLOW_UNPATCHED" not in sc.log
    assert "RefusedSourceState" not in sc.log
    for role in ("api_server", "worker"):  # the runtime guard passed where the model module is imported
        assert sc.grep(r"qwen4_exp PLE tables use StreamedPLEEmbedding \(backend=mmap ", pids[role])
    # it served: the concurrent requests of proof 5 came back whole
    assert all(r["status"] == 200 for r in sc.results["concurrent"].values()), sc.results["concurrent"]
