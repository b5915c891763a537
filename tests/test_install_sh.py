"""install.sh: refusals on unsupported platforms, dry-run, and a real install + verified no-op re-run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INSTALL = REPO / "install.sh"


def run(args, env_extra=None, path_prefix=None, timeout=120):
    env = {**os.environ, **(env_extra or {})}
    if path_prefix:
        env["PATH"] = f"{path_prefix}:{env['PATH']}"
    return subprocess.run(["sh", str(INSTALL), *args], capture_output=True, text=True, env=env, timeout=timeout)


def fake_command(bindir: Path, name: str, body: str) -> None:
    bindir.mkdir(exist_ok=True)
    p = bindir / name
    p.write_text(f"#!/bin/sh\n{body}\n")
    p.chmod(0o755)


@pytest.mark.parametrize("system,machine,expected", [
    ("Darwin", "arm64", "unsupported OS 'Darwin'"),
    ("Linux", "riscv64", "unsupported architecture 'riscv64'"),
])
def test_refuses_unsupported_platform(tmp_path, system, machine, expected):
    fake_command(tmp_path / "bin", "uname", f'[ "$1" = -s ] && echo {system} || echo {machine}')
    r = run(["--prefix", str(tmp_path / "rt"), "--bin-dir", str(tmp_path / "b")], path_prefix=tmp_path / "bin")
    assert r.returncode == 2 and expected in r.stderr
    assert not (tmp_path / "rt").exists()


def test_refuses_unsupported_python(tmp_path):
    fake_command(tmp_path / "bin", "python3.9", 'echo 3.9')
    r = run(["--python", str(tmp_path / "bin" / "python3.9"), "--prefix", str(tmp_path / "rt")])
    assert r.returncode == 2 and "Python 3.9 is unsupported" in r.stderr
    assert not (tmp_path / "rt").exists()


def test_refuses_missing_python(tmp_path):
    r = run(["--python", "/nonexistent/python", "--prefix", str(tmp_path / "rt")])
    assert r.returncode == 2 and "no Python interpreter" in r.stderr


@pytest.mark.parametrize("args", [["--engine", "tgi"], ["--frobnicate"], ["--prefix"]])
def test_usage_errors(args):
    assert run(args).returncode == 64


def test_dry_run_changes_nothing(tmp_path):
    r = run(["--dry-run", "--prefix", str(tmp_path / "rt"), "--bin-dir", str(tmp_path / "bin")])
    assert r.returncode == 0, r.stderr
    assert "would run:" in r.stdout and "sglang==0.5.23" in r.stdout
    assert not (tmp_path / "rt").exists() and not (tmp_path / "bin").exists()


def test_dry_run_vllm_engine(tmp_path):
    r = run(["--engine", "vllm", "--dry-run", "--prefix", str(tmp_path / "rt"), "--bin-dir", str(tmp_path / "bin")])
    assert r.returncode == 0, r.stderr
    assert "vllm==0.33.0" in r.stdout and "vllm-ple-offload patch apply" in r.stdout
    assert not (tmp_path / "rt").exists()


def test_check_on_missing_runtime_fails(tmp_path):
    r = run(["--check", "--prefix", str(tmp_path / "rt"), "--bin-dir", str(tmp_path / "bin")])
    assert r.returncode == 1 and "no sglang 0.5.23 venv" in r.stdout


@pytest.mark.sglang
def test_real_install_then_verified_noop_rerun(tmp_path):
    """A real runtime (cached between CI runs, so later runs prove the no-op path)."""
    cache = os.environ.get("SSD_STREAM_CACHE")
    if not cache:
        pytest.fail("SSD_STREAM_CACHE is not set: run the tests through scripts/test.sh")
    prefix = Path(cache) / "install-e2e"
    bindir = tmp_path / "bin"
    first = run(["--prefix", str(prefix), "--bin-dir", str(bindir)], timeout=1800)
    assert first.returncode == 0, first.stdout + first.stderr
    link = bindir / "sglang-ssd-stream"
    venv = prefix / "sglang-0.5.23" / "venv"
    assert os.readlink(link) == str(venv / "bin" / "sglang-ssd-stream")

    t0 = time.monotonic()
    again = run(["--prefix", str(prefix), "--bin-dir", str(bindir)], timeout=600)
    elapsed = time.monotonic() - t0
    assert again.returncode == 0, again.stdout + again.stderr
    for line in ("sglang 0.5.23 venv: present", "kit: current", "already patched: nothing to do",
                 "verified: every file is patched"):
        assert line in again.stdout, again.stdout
    print(f"re-run of install.sh took {elapsed:.1f}s (target < 30 s)")

    assert run(["--check", "--prefix", str(prefix), "--bin-dir", str(bindir)]).returncode == 0

    # The installed kit carries the native host-node source (package data) and compiles it.
    home = tmp_path / "kit-home"
    built = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "from sglang_ssd_stream.staging import native_read as n; n.load(); print(n.library_path())"],
                           env={**os.environ, "SGLANG_SSD_STREAM_HOME": str(home)}, cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    assert Path(built.stdout.strip()).is_file() and Path(built.stdout.strip()).is_relative_to(home)

    # A tampered engine file: --check fails, install refuses and changes nothing.
    site = next((venv / "lib").glob("python3.*/site-packages"))
    target = site / "sglang" / "srt" / "managers" / "tp_worker.py"
    original = target.read_bytes()
    try:
        target.write_bytes(original + b"# tampered\n")
        check = run(["--check", "--prefix", str(prefix), "--bin-dir", str(bindir)])
        assert check.returncode == 1
        refused = run(["--prefix", str(prefix), "--bin-dir", str(bindir)], timeout=600)
        assert refused.returncode == 2
        assert "Refusing to patch an unknown sglang source state: sglang/srt/managers/tp_worker.py" in refused.stderr
        assert target.read_bytes() == original + b"# tampered\n"
    finally:
        target.write_bytes(original)
    assert run(["--check", "--prefix", str(prefix), "--bin-dir", str(bindir)]).returncode == 0
