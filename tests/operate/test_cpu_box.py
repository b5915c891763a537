"""Issue 17's bar: on a CPU box (this one, the SGLang runtime), `plan`, `serve --dry-run`, `service`, `doctor`,
`validate --help` and `watch --help` run for every profile of both CLIs as a user runs them, in a fresh
process: no traceback, and every exit code one the README documents. vLLM is not installed in this venv,
so the vLLM CLI's engine checks must say so and exit 4 (tests/vllm/test_cpu_box_vllm.py runs the same
commands where vLLM is installed)."""

from __future__ import annotations

import getpass
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_ssd_stream.errors import EXIT_ENVIRONMENT, EXIT_OK, EXIT_REFUSED
from sglang_ssd_stream.operate.profiles import PROFILES_BY_ENGINE

from .conftest import write_model

REPO = Path(__file__).resolve().parents[2]
CLIS = {"sglang": "sglang_ssd_stream.cli", "vllm": "vllm_ple_offload.cli"}
NO_VLLM = "vLLM is not installed in this runtime"


def _run(tmp_path, engine, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home"),
           "SGLANG_SSD_STREAM_HOME": str(tmp_path / "data")}
    env.pop("SGLANG_SSD_STREAM_READ_WORKERS", None)
    return subprocess.run([sys.executable, "-m", CLIS[engine], *args], capture_output=True, text=True, env=env,
                          timeout=600)


def _ok(r, *codes):
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
    assert r.returncode in codes, (r.returncode, r.stdout[-1500:], r.stderr[-1500:])


CASES = [(engine, name) for engine, table in PROFILES_BY_ENGINE.items() for name in table]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("cpu-box") / "model")


@pytest.mark.parametrize("engine, profile", CASES)
def test_plan(tmp_path, model, engine, profile):
    r = _run(tmp_path, engine, "plan", "--profile", profile, "--model", str(model), "--device-memory-gib", "122.86")
    _ok(r, EXIT_OK)
    assert r.stdout.startswith("weights: model ") and "memory: " in r.stdout and "MTP" in r.stderr


@pytest.mark.parametrize("engine, profile", CASES)
def test_serve_dry_run(tmp_path, model, engine, profile):
    r = _run(tmp_path, engine, "serve", "--profile", profile, "--model", str(model), "--dry-run")
    if engine == "vllm":  # vLLM's own checks cannot run here: say so, name the fix, exit 4
        _ok(r, EXIT_ENVIRONMENT)
        assert NO_VLLM in r.stderr and "./install.sh --engine vllm" in r.stderr
        return
    _ok(r, EXIT_OK)
    command, *report = r.stdout.splitlines()
    assert "/sglang serve --model-path " in command
    assert "# [error] device: no CUDA device: torch sees no GPU here" in report
    assert report[-1].startswith("# a real serve would refuse here: ")


@pytest.mark.parametrize("engine, profile", CASES)
def test_service_and_watch_unit(tmp_path, model, engine, profile):
    extra = ["--user", getpass.getuser()] if engine == "sglang" else ["--image", "img", "--cache-dir", str(tmp_path)]
    r = _run(tmp_path, engine, "service", "--profile", profile, "--model", str(model), *extra)
    _ok(r, EXIT_OK)
    assert r.stdout.startswith("[Unit]\n" if engine == "sglang" else "services:\n")
    r = _run(tmp_path, engine, "service", "--profile", profile, "--model", str(model), *extra, "--watch-unit")
    _ok(r, EXIT_OK)
    assert " watch --url http://127.0.0.1:" in r.stdout


@pytest.mark.parametrize("engine", CLIS)
def test_doctor(tmp_path, engine):
    if engine == "vllm":
        r = _run(tmp_path, engine, "doctor")
        _ok(r, EXIT_ENVIRONMENT)
        assert NO_VLLM in r.stderr
        return
    for profile in PROFILES_BY_ENGINE[engine]:
        r = _run(tmp_path, engine, "doctor", "--profile", profile)
        _ok(r, EXIT_OK, EXIT_REFUSED)
        assert "[error] device: no CUDA device" in r.stdout and "refusal(s)" in r.stderr


@pytest.mark.parametrize("engine", CLIS)
@pytest.mark.parametrize("command", ["validate", "watch", "plan", "serve", "service"])
def test_help(tmp_path, engine, command):
    r = _run(tmp_path, engine, command, "--help")
    _ok(r, EXIT_OK)
    assert r.stdout.startswith("usage: ")
