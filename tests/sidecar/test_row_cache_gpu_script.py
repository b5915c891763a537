"""scripts/gpu/ple_row_cache_h200.py: its CPU parts run here (tiny sizes, no GPU; no timing is asserted).

The GPU numbers are NOT YET RUN; this keeps the script's pipeline (SidecarGather over a RowCache,
the prompt-ahead prefetcher, sglang's own gather kernel as the reference under the Triton
interpreter, the memory and long-prompt accounting) working between GPU runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts/gpu/ple_row_cache_h200.py"


def _sglang_qwen4_exp() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed in this interpreter (the sglang venv runs this test)")
    return Path(next(iter(spec.submodule_search_locations))) / "srt/models/qwen4_exp.py"


def test_cpu_smoke_writes_every_section(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(SCRIPT), "--cpu-smoke", "--qwen4-exp", str(_sglang_qwen4_exp()),
           "--dir", str(tmp_path / "d"),
           "--table-gib", "0.01", "--bitexact-mib", "1", "--bitexact-rows", "64", "--budget-mib", "64",
           "--chunk-tokens", "16", "--chunks", "3", "--layers", "4", "--ple-layer", "2", "--layer-ms", "1",
           "--windows", "0", "1", "--memory-chunk-tokens", "64", "--memory-chunks", "2", "--reps", "2",
           "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and res["all_bitexact"] is True
    assert {(b["dtype"], b["rows"]) for b in res["bitexact"]} == {(d, n) for d in ("float8_e4m3fn", "bfloat16")
                                                                  for n in (1, 64)}
    assert all(b["eager_miss_bitexact"] and b["eager_hit_bitexact"] for b in res["bitexact"])
    configs = [c["config"] for c in res["cold_prefill"]]
    assert configs == ["none", "window0", "window1"]
    none, w0, w1 = res["cold_prefill"]
    assert none["prefetch_hits"] == 0 and w1["prefetch_hits"] > 0  # the prefetcher's rows served the lookups
    assert none["rows_read"] == w0["rows_read"] == w1["rows_read"]  # the same prompt: each row read once
    assert res["warm_prefill"]["rows_read_during_warm"] == 0  # warm: every lookup a hit
    one = res["warm_prefill_one_copy_thread"]
    assert one["workers"] == 1 and one["rows_read_during_warm"] == 0 and one["parallel_passes"] == 0
    assert one["host_read_ms"] > 0 and one["lookup_alone_ms"] > 0
    warm = res["warm_prefill"]  # the lookup beside the layer after the first (--ple-layer 2)
    assert warm["layers_before_lookup"] == 1 and warm["lookups"] == 2 and warm["forward_only_ms"] > 0
    mem = res["memory"]
    assert mem["within_limit"] and mem["table_page_cache_bytes"] == 0  # O_DIRECT misses: no page cache
    assert mem["cache_working_set_bytes"] <= mem["budget_bytes"]
    assert "decode_graphs" not in res and res["long_prompt"] is None  # GPU-only / needs fio


def test_long_prompt_estimate_from_the_trace_growth():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("ple_row_cache_h200", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    est = mod.long_prompt(str(REPO / "benchmarks/row_cache/trace.json"), iops=90_000.0, tok_s=1400.0)
    growth = json.loads((REPO / "benchmarks/row_cache/trace.json").read_text())["ids_curve"]["distinct_after_lookups"]
    lo = max(d for n, d in growth if n <= 262_144 * 16)
    hi = min(d for n, d in growth if n >= 262_144 * 16)
    assert lo <= est["distinct_rows"] <= hi
    assert est["disk_s_at_fio_iops"] == est["distinct_rows"] / 90_000.0
    assert est["compute_s"] == 262_144 / 1400.0
    assert est["added_with_prefetch_s"] == max(0.0, est["disk_s_at_fio_iops"] - est["compute_s"])
