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
           "--io-uring", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert set(res["ratios"]) == {"pread", "mmap"}
    for io in ("pread", "mmap"):
        assert set(res["ratios"][io]) == {"cold_pages_per_s_vs_fio_iops", "warm_rows_per_s_vs_pooled_10us_per_row",
                                          "working_set_vs_64MiB"}
        r = res["readers"][io]
        assert r["cold"]["rows"] == 512 and 1 <= r["cold"]["pages"] <= 2 * 512 and r["warm"]["rows"] == 1024
        assert r["memory"]["rows"] == 64 * 16 and r["memory"]["working_set_bytes"] > 0
    assert res["readers"]["pread"]["cold"]["pages"] == res["readers"]["mmap"]["cold"]["pages"]  # same ids
    assert res["fio_io_uring"]["iops"] > 0 and "--ioengine=io_uring" in res["fio_io_uring"]["command"]
    assert res["io_uring_iops_vs_psync_iops"] == res["fio_io_uring"]["iops"] / res["fio"]["iops"]
    assert res["fio"]["iops"] > 0 and res["fio"]["version"].startswith("fio-")
    assert "bench_sidecar_cpu.py" in res["command"] and not (tmp_path / "d" / "ple-bench-table.bin").exists()
