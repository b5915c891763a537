"""scripts/gpu/ple_row_cache_h200.py: its CPU parts run here (tiny sizes, no GPU; no timing is asserted).

This keeps the script's pipeline (SidecarGather over a RowCache, the prompt-ahead prefetcher, sglang's own
gather kernel as the reference under the Triton interpreter, the memory and long-prompt accounting; the hot
file's restart and the decode rows fetched ahead of a verify step, issue 27 item 5, NOT YET RUN on a GPU)
working between GPU runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
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


def test_cpu_smoke_hot_chunk_and_decode_draft(tmp_path):
    """The two issue-27 sections end to end on the CPU: sglang's kernel is the reference where sglang is installed,
    else the kit's conversion of the table's bytes; fio (sequential reads beside the hot file) where installed."""
    out = tmp_path / "r.json"
    spec = importlib.util.find_spec("sglang")
    ref = ["--qwen4-exp", str(_sglang_qwen4_exp())] if spec is not None else []
    fio = shutil.which("fio")
    cmd = [sys.executable, str(SCRIPT), "--cpu-smoke", "--sections", "hot_chunk", "decode_draft", *ref,
           "--dir", str(tmp_path / "d"), "--table-gib", "0.01", "--chunk-tokens", "16", "--layers", "4",
           "--ple-layer", "2", "--repeats", "2",
           "--hot-budget-mib", "10", "--hot-learn-tokens", "512", "--hot-gap-tokens", "64", "--hot-chunks", "2",
           "--hot-layer-ms", "1", "--hot-shares", "50", "100", "--hot-windows", "1",
           "--decode-rows", "16", "128", "--decode-steps", "2", "--decode-budget-mib", "10",
           "--draft-step-ms", "0.5", "--decode-layer-ms", "0.5",
           *(["--fio", fio, "--fio-seconds", "0.5"] if fio else []), "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["sections"] == ["hot_chunk", "decode_draft"] and res["command"].endswith(str(out))
    assert res["all_bitexact"] is True and res["drafted_checks_ok"] is True
    assert ("sglang" in res["reference"]) == bool(ref)
    assert "bitexact" not in res and "cold_prefill" not in res and "memory" not in res

    hot = res["hot_chunk"]
    learned, files = hot["learned"], hot["hot_files"]
    assert learned["tokens"] == 512 and learned["lookups"] == 512 * 16 and learned["rows_read"] > 0
    for share in ("50", "100"):  # the hottest rows of the learning cache, at most the share of a cache
        assert 0 < files[share]["rows"] <= int(learned["capacity_rows"] * int(share) / 100)
        if fio:
            assert {"direct", "buffered"} <= set(files[share]["fio_seq"])
    assert [(c["hot_share_pct"], c["window"]) for c in hot["configurations"]] == [
        (0, None), (0, 1), (50, None), (50, 1), (100, None), (100, 1)]
    assert len(hot["runs"]) == 2 * 6 and all(r["bitexact"] for r in hot["runs"])
    for run in hot["runs"]:
        assert len(run["chunk_ms"]) == len(run["exposed_vs_compute"]) == len(run["pages_read"]) == 2
        if run["hot_share_pct"]:
            # the real HotRows.load put the file's rows into the fresh cache; the chunk reads only what it lacks
            assert run["hot_rows_loaded"] == files[str(run["hot_share_pct"])]["rows"] and run["load_mib_s"] > 0
            assert run["hot_covers_chunk_rows"][0] > 0
        else:
            assert "hot_rows_loaded" not in run and run["hot_covers_chunk_rows"] == [0.0, 0.0]
        if run["window"] is None:  # no prefetcher: the first chunk reads exactly its rows the cache lacks
            missing = round(run["distinct_rows"][0] * (1 - run["hot_covers_chunk_rows"][0]))
            assert run["rows_read"][0] == missing
    first = {(c["hot_share_pct"], c["window"]): c for c in hot["configurations"]}
    assert first[(100, None)]["first_chunk_pages_read"]["median"] < first[(0, None)]["first_chunk_pages_read"]["median"]
    assert len(first[(0, None)]["first_chunk_exposed_vs_compute"]["values"]) == 2
    assert set(res["goals"]["cold_chunk_exposed_le_10pct_of_compute"]) == {
        f"share{p}_window{w}" for p in (0, 50, 100) for w in (None, 1)}

    dec = res["decode_draft"]
    assert [(d["rows"], d["requests"], d["tokens_per_request"]) for d in dec] == [(16, 1, 1), (128, 2, 4)]
    for d in dec:
        chk = d["drafted_check"]  # drafted()'s ids are the lookup's; cached once it finished; the verify read nothing
        assert chk["drafted_ids_equal_lookup_ids"] and chk["lookup_rows_cached_after_drafted"]
        assert chk["verify_rows_read_after_drafted"] == 0 and chk["ok"]
        assert d["bitexact"] and len(d["repeats"]) == 2
        for rep in d["repeats"]:
            assert rep["all_cached"]["pages_read"] == [0, 0] and rep["all_cached"]["cold_rows"] == [0, 0]
            assert rep["on_demand"]["cold_rows"] == rep["drafted"]["cold_rows"]  # the same steps, the same misses
            assert all(c > 0 for c in rep["on_demand"]["cold_rows"])
            assert rep["drafted"]["draft_steps"] == 1 + 2 and not rep["drafted"]["errors"]  # warm-up + the steps
            assert len(rep["drafted"]["delta_ms"]) == 2
        for config in ("on_demand", "drafted"):
            assert len(d[config]["exposed_vs_step"]["values"]) == 2
    assert set(res["goals"]["decode_exposed_le_3pct_at_256_rows"]) == set()  # no 256-row step in this run
