"""Issue 17's bar for the vLLM CLI where vLLM is installed (its venv, CPU platform): `plan`, `serve --dry-run`,
`service`, `doctor`, `validate --help` for every vLLM profile, in fresh processes, without a traceback."""

from __future__ import annotations

import subprocess

import pytest

from sglang_ssd_stream.operate.profiles import PROFILES_BY_ENGINE

from ..operate.conftest import write_model

PROFILES = list(PROFILES_BY_ENGINE["vllm"])


def _run(vllm, tmp_path, *args):
    r = subprocess.run([vllm.python, "-m", "vllm_ple_offload.cli", *args], capture_output=True, text=True,
                       env=vllm.env({"SGLANG_SSD_STREAM_HOME": str(tmp_path / "data")}), timeout=600)
    assert "Traceback" not in r.stdout + r.stderr, r.stderr[-3000:]
    return r


@pytest.mark.parametrize("profile", PROFILES)
def test_vllm_cli_on_a_cpu_box(vllm, tmp_path, profile):
    model = write_model(tmp_path / "model")
    r = _run(vllm, tmp_path, "plan", "--profile", profile, "--model", str(model), "--device-memory-gib", "122.86")
    assert r.returncode == 0 and "memory: " in r.stdout
    r = _run(vllm, tmp_path, "serve", "--profile", profile, "--model", str(model), "--dry-run")
    assert r.returncode == 0, r.stderr[-2000:]
    command, *report = r.stdout.splitlines()
    assert "/vllm serve " in command and report[-1].startswith("# ")
    assert any(line.startswith("# [error] ") for line in report)  # no CUDA platform here: reported, not raised
    r = _run(vllm, tmp_path, "service", "--profile", profile, "--model", str(model), "--image", "i", "--cache-dir",
             str(tmp_path))
    assert r.returncode == 0 and r.stdout.startswith("services:\n")


def test_vllm_doctor_and_help(vllm, tmp_path):
    r = _run(vllm, tmp_path, "doctor")
    assert r.returncode in (0, 2)
    for command in ("validate", "watch"):
        r = _run(vllm, tmp_path, command, "--help")
        assert r.returncode == 0 and r.stdout.startswith("usage: ")
