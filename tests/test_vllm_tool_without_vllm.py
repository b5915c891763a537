"""``vllm-ple-offload`` installed in a runtime without vLLM (issue 17 item 2): the SGLang runtime's venv,
which is the interpreter this (sglang) suite runs in. ``doctor`` and ``serve`` (dry run or not) say
so, name the fix and exit 4; no traceback, and no command naming a ``vllm`` that is not there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def tool(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "VLLM_"))}
    env.update({"HOME": str(tmp_path), "PYTHONPATH": str(REPO)})
    return subprocess.run([sys.executable, "-m", "vllm_ple_offload.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.fixture
def model(tmp_path):
    m = tmp_path / "model"
    m.mkdir()
    (m / "config.json").write_text(json.dumps({"architectures": ["Qwen4ExpForConditionalGeneration"]}))
    return m


def test_this_runtime_has_no_vllm():
    assert importlib.util.find_spec("vllm") is None, (
        "run this test in the SGLang runtime's venv (scripts/test.sh sglang)")


@pytest.mark.parametrize("args", [
    ["doctor"],
    ["doctor", "--backend", "mmap", "--json"],
    ["serve", "--profile", "a100x4", "--model", "{model}"],
    ["serve", "--profile", "a100x4", "--model", "{model}", "--dry-run"],
])
def test_doctor_and_serve_say_vllm_is_missing(tmp_path, model, args):
    r = tool(tmp_path, *[a.replace("{model}", str(model)) for a in args])
    assert r.returncode == 4, (r.stdout, r.stderr)
    assert "vLLM is not installed in this runtime" in r.stderr and "./install.sh --engine vllm" in r.stderr
    assert "Traceback" not in r.stderr and "/bin/vllm" not in r.stdout


def test_commands_that_need_no_vllm_still_work(tmp_path):
    r = tool(tmp_path, "--help")
    assert r.returncode == 0 and "doctor" in r.stdout
