"""The plugin inside the real vLLM 0.33.0 install (shared venv, never patched by these tests).

Each engine-side check module runs in a fresh venv subprocess (vLLM loads plugins once per
process); every test in it must pass, none may be skipped.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ..engine import outcomes_only
from .synthetic import random_table, write_sidecar

CHECKS = [
    "tests/vllm/checks/check_plugin_off.py",
    "tests/vllm/checks/check_plugin_streamed.py",
    "tests/vllm/checks/check_row_cache.py",
    "tests/vllm/checks/check_plugin_bad_input.py",
    "tests/vllm/checks/check_pinned_backend.py",
    "tests/vllm/checks/check_doctor_launch.py",
]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: Path(c).stem)
def test_engine_checks(vllm, check):
    result = vllm.run_checks(check)
    outcomes = outcomes_only(result)
    assert outcomes and set(outcomes.values()) == {"passed"}, f"{outcomes}\n{result['__output__']}"


def serve_help(vllm, **extra_env) -> subprocess.CompletedProcess:
    exe = Path(vllm.python).parent / "vllm"
    env = vllm.env({"VLLM_TARGET_DEVICE": "cpu", **extra_env})
    return subprocess.run([str(exe), "serve", "--help=all"], capture_output=True, text=True, env=env, timeout=600)


def test_vllm_serve_help_with_the_plugin_installed(vllm):
    r = serve_help(vllm)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--engram-config" in r.stdout


def test_vllm_serve_help_with_a_streaming_backend(vllm, tmp_path):
    manifest = write_sidecar(tmp_path, {3: ("bfloat16", random_table(64, 8, 0))})
    r = serve_help(vllm, VLLM_PLE_CPU_OFFLOAD="1", VLLM_PLE_OFFLOAD_BACKEND="mmap", VLLM_PLE_SIDECAR=str(manifest),
                   VLLM_PLE_ALLOW_UNPATCHED="1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--engram-config" in r.stdout


REFUSAL = "vllm-ple-offload plugin: PleSettingsError: VLLM_PLE_OFFLOAD_BACKEND='nvme' is not a PLE backend"


def test_vllm_serve_stops_on_bad_settings_and_says_it_once(vllm):
    """The CLI/API server process: the interpreter prints the SystemExit text; the plugin prints nothing itself."""
    r = serve_help(vllm, VLLM_PLE_CPU_OFFLOAD="1", VLLM_PLE_OFFLOAD_BACKEND="nvme")
    assert r.returncode != 0
    assert (r.stdout + r.stderr).count(REFUSAL) == 1, r.stderr[-3000:]


WORKER = """
import sys
from vllm.config import VllmConfig
from vllm.utils.system_utils import get_mp_context
from vllm.v1.executor.multiproc_executor import WorkerProc

if __name__ == "__main__":  # one worker started as vLLM's multiproc executor starts it
    ctx = get_mp_context()
    lock = ctx.Lock()
    handle = WorkerProc.make_worker_process(vllm_config=VllmConfig(), local_rank=0, rank=0,
                                           distributed_init_method="tcp://127.0.0.1:9", input_shm_handle=None,
                                           shared_worker_lock=lock, is_driver_worker=True)
    handle.proc.join(600)
    print("worker exit code", handle.proc.exitcode, flush=True)
"""


def test_a_worker_process_refusal_is_printed_once(vllm, tmp_path):
    """A vLLM worker (WorkerProc.worker_main -> init_worker -> load_general_plugins): vLLM logs "WorkerProc
    was terminated" (on stdout, vLLM's log stream) and re-raises; multiprocessing's bootstrap prints the
    SystemExit text, once. The engine-core process re-raises SystemExit the same way (run_engine_core)
    under the same bootstrap. (spawn: vLLM forces it here as soon as it has imported torch's CUDA bits.)"""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    r = subprocess.run([vllm.python, str(script)], capture_output=True, text=True, timeout=900,
                       env=vllm.env({"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": "nvme",
                                     "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}))
    both = r.stdout + r.stderr
    assert "worker exit code 1" in r.stdout, both[-3000:]
    assert "WorkerProc was terminated" in both  # vLLM's own worker path ran
    assert both.count(REFUSAL) == 1, both[-3000:]
