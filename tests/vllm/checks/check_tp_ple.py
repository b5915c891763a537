"""Issue 7 on CPU: TP ranks over gloo assemble the TP=1 rows, bit for bit.

1. ``tests/vllm/tp_ple.py`` with vLLM's own vocab-range function (the engine-neutral driver; the
   SGLang venv runs it with ``--engine sglang``), FP8 and BF16, TP=2 and TP=4.
2. vLLM's real qwen4_exp embedding at TP=2 with our streamed backends: each rank's class, its
   range (vLLM's ``shard_indices``), our zero-filled rows and vLLM's own ETP all-reduce (CPU
   communicator on gloo); the assembled rows must be the sidecar's rows of vLLM's n-gram ids.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.vllm import harness, tp_ple
from tests.vllm.synthetic import finite_fp8_table, random_table, write_sidecar


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bfloat16"])
def test_vllm_ranges_assemble_tp1_rows(tmp_path, dtype, world):
    rc = tp_ple.main(["--engine", "vllm", "--world", str(world), "--dtype", dtype, "--out", str(tmp_path)])
    report = json.loads((tmp_path / "report.json").read_text())
    assert rc == 0 and report["ok"], report
    assert set(report["cases"]) == {"random", "boundaries", "duplicates", "mixed"}


@pytest.mark.parametrize("backend,dtype", [("pread", "float8_e4m3fn"), ("mmap", "bfloat16")])
def test_vllm_streamed_backend_at_tp2(tmp_path, backend, dtype):
    import torch.multiprocessing as mp

    cfg = harness.text_config(dtype)
    lay = harness.layout(cfg, dtype)
    table = (finite_fp8_table if dtype == "float8_e4m3fn" else random_table)(lay.rows, lay.row_bytes, 11)
    if dtype == "bfloat16":  # vLLM reduces BF16 rows in BF16: -0.0 + 0.0 = +0.0, NaN payloads change
        table[:, 1::2] = np.minimum(table[:, 1::2] & 0x7F, 0x7E)
    manifest = write_sidecar(tmp_path / "sc", {harness.LAYER: (dtype, table)})
    mp.start_processes(harness.streamed_tp_rank, nprocs=2, start_method="spawn",
                       args=(2, str(manifest), backend, dtype, harness.free_port(), str(tmp_path)))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["class"] for r in ranks] == ["StreamedPLEEmbedding"] * 2
    expected_ranges = [list(tp_ple.engine_range("vllm", lay.rows, cfg.make_ngram_vocab_size_divisible_by, r, 2))
                       for r in range(2)]
    assert [r["range"] for r in ranks] == expected_ranges
    assert expected_ranges[0][1] == expected_ranges[1][0] and expected_ranges[1][1] == lay.rows
    per_rank = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    for seed in range(3):
        ngram = per_rank[0][f"ngram{seed}"]
        want = harness.rows_of(table, __import__("torch").from_numpy(ngram))
        lo, hi = expected_ranges[0]
        assert ((ngram >= lo) & (ngram < hi)).any() and ((ngram < lo) | (ngram >= hi)).any()  # both ranks used
        for r in range(2):
            assert np.array_equal(per_rank[r][f"rows{seed}"], want), (r, seed)
