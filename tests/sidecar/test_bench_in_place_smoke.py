"""benchmarks/ple_in_place/bench.py keeps running end to end (a 4 MiB table, ~15 s; no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_in_place_smoke_writes_every_case(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, str(REPO / "benchmarks/ple_in_place/bench.py"), "--smoke", "--out", str(out),
           "--work", str(work), "--min-free-gib", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    res = json.loads((out / "results.json").read_text())
    for sub in ("tiny", "table"):
        b = res["builds"][sub]
        assert b["in_place"]["files"] == ["ssd-stream.json"] and b["copy"]["build_s"] > 0
        assert 0 < b["in_place"]["disk_bytes"] < b["copy"]["disk_bytes"]  # the copy holds every row again
        assert b["copy"]["disk_bytes"] >= b["rows"] * 160
    cases = {(c["path"], c["ids"], c["tokens"]) for c in res["lookups"]}
    assert cases == {(p, d, t) for p in ("mmap", "pread", "cache") for d in ("uniform", "zipf") for t in (1, 64)}
    for c in res["lookups"]:
        for phase in ("cold_s", "warm_s"):
            assert all(len(c[phase][k]) == 2 and min(c[phase][k]) > 0 for k in ("in_place", "copy"))
        assert c["cold_ratio"]["min"] <= c["cold_ratio"]["median"] <= c["cold_ratio"]["max"]
    assert "bench.py" in res["command"] and res["geometry"]["row_bytes"] == 160
    assert not (work / "table").exists() and not (work / "tiny").exists()  # the synthetic data is removed
