"""benchmarks/ple_metrics/gpu_overhead.py, the H200 measurement of the metrics' cost, run end to end on this CPU
(``--device cpu``) as the GPU machine will run it: prometheus_client packed here and imported from ``--site``, a
JSON with the command, the device, the versions and both sides' timings of real lookups through the staged gather,
an exit status that follows the bound; without prometheus_client it says so and measures nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ple_metrics" / "gpu_overhead.py"


def _run(*args, cwd=None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, cwd=cwd,
                          env=env)


def test_packed_and_run_on_this_cpu_as_on_the_gpu(tmp_path):
    site = tmp_path / "site"
    r = _run("--pack", str(site))
    assert r.returncode == 0 and (site / "prometheus_client" / "__init__.py").is_file(), r.stderr
    assert _run("--pack", str(site)).returncode == 2  # never over an existing one
    out = tmp_path / "o.json"
    r = _run("--device", "cpu", "--site", str(site), "--pairs", "24", "--commit", "abc1234", "--out", str(out))
    got = json.loads(out.read_text())
    assert r.returncode == (0 if got["within_bound"] else 1), (r.returncode, r.stderr[-2000:])
    assert got["command"].endswith(f"--pairs 24 --commit abc1234 --out {out}") and got["commit"] == "abc1234"
    assert got["device"]["kind"] == "cpu" and got["versions"]["prometheus_client_from"] == str(
        site / "prometheus_client")
    assert got["lookup"]["rows"] == 2048 * 16 and got["lookup"]["hit_rate"] == 1.0
    assert got["metrics_on"]["n"] == got["metrics_off"]["n"] == 24 and got["metrics_off"]["median_us"] > 0
    assert got["observer_calls_in_lookup"]["n"] == 24 and got["publish_one_layer"]["n"] == 24
    assert got["within_bound"] == (got["overhead_ratio"] < 0.01 and got["observer_share_of_lookup"] < 0.01)


def test_no_cuda_device_is_said_and_nothing_written(tmp_path):
    out = tmp_path / "o.json"
    hidden = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no device on any host, GPU or not
    r = _run("--device", "cuda", "--pairs", "24", "--out", str(out), env=hidden)
    assert r.returncode == 2 and "finds no CUDA device" in r.stderr and not out.exists()
