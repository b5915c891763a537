"""scripts/bench_sidecar_cpu.py keeps running (tiny sizes; no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_script_writes_its_ratios(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(REPO / "scripts/bench_sidecar_cpu.py"), "--dir", str(tmp_path / "d"),
           "--table-gib", "0.02", "--rows-per-call", "512", "--cold-calls", "1", "--warm-calls", "2",
           "--warm-gib", "0.01", "--chunk-tokens", "64", "--fio-seconds", "1", "--qd", "4", "--install-fio",
           "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert set(res["ratios"]) == {"cold_pages_per_s_vs_fio_iops", "warm_rows_per_s_vs_pooled_10us_per_row",
                                  "working_set_vs_64MiB"}
    assert res["fio"]["iops"] > 0 and res["fio"]["version"].startswith("fio-")
    assert res["cold"]["rows"] == 512 and res["cold"]["pages"] >= 1 and res["warm"]["rows"] == 1024
    assert res["memory"]["rows"] == 64 * 16 and res["memory"]["working_set_bytes"] > 0
    assert "bench_sidecar_cpu.py" in res["command"] and not (tmp_path / "d" / "ple-bench-table.bin").exists()
