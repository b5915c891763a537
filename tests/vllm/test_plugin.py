"""The plugin inside the real vLLM 0.33.0 install (shared venv, never patched by these tests).

Each engine-side check module runs in a fresh venv subprocess (vLLM loads plugins once per
process); every test in it must pass, none may be skipped.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ..engine import outcomes_only
from .synthetic import random_table, write_sidecar

CHECKS = [
    "tests/vllm/checks/check_plugin_off.py",
    "tests/vllm/checks/check_plugin_streamed.py",
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


def test_vllm_serve_stops_on_bad_settings(vllm):
    r = serve_help(vllm, VLLM_PLE_CPU_OFFLOAD="1", VLLM_PLE_OFFLOAD_BACKEND="nvme")
    assert r.returncode != 0
    assert "vllm-ple-offload plugin: PleSettingsError: VLLM_PLE_OFFLOAD_BACKEND='nvme' is not a PLE backend" in r.stderr


def test_qsa_module_must_not_be_imported_first(vllm):
    """The hazard our checks work around: nvidia/qsa.py imports the model, which imports qsa."""
    def run(code):
        return subprocess.run([vllm.python, "-c", code], capture_output=True, text=True, env=vllm.env(), timeout=600)

    first = run("import vllm.models.qwen4_exp.nvidia.qsa")
    assert first.returncode != 0 and "circular import" in first.stderr
    ordered = run("import vllm.models.qwen4_exp.nvidia.model, vllm.models.qwen4_exp.nvidia.qsa as q; "
                  "print(q.Qwen4ExpQSAAttention.__name__)")
    assert ordered.returncode == 0 and ordered.stdout.strip().endswith("Qwen4ExpQSAAttention"), ordered.stderr[-2000:]
