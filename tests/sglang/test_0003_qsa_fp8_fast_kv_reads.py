"""Patch 0003 (FP8 QSA K/V through an f16 tensor-core path) on the real sglang 0.5.23 install:
the sm_90 build of the FP8 chunk kernel loses its per-value slow converts (RED on pristine,
GREEN patched), BF16 outputs stay byte-identical, and FP8 error against float64 does not grow.
The speed itself is measured on an H200: benchmarks/qsa_fp8/README.md."""

from __future__ import annotations

import json

from ..engine import assert_red_green

CHECK = "tests/sglang/checks/check_0003_qsa_fp8_fast_kv_reads.py"

RED = {f"test_fp8_chunk_kernel_runs_f16_dots_without_per_value_converts[{c}]"
       for c in ("16-512", "64-512", "128-2048", "256-512", "2048-512")}
GUARDS = {
    "test_interpreter_fix_matches_torch",
    *(f"test_fp8_kv_close_to_float64_reference[{p}]" for p in ("chunk", "paged", "decode")),
    *(f"test_fp8_kv_queries_of_extreme_magnitude[{m}]" for m in ("1e-06", "30.0", "1000000.0")),
    *(f"test_bf16_outputs_for_comparison[{p}]" for p in ("chunk", "paged", "decode")),
}


def test_red_on_pristine_green_when_patched(sglang, tmp_path):
    assert_red_green(sglang, CHECK, RED, GUARDS, outputs=tmp_path)
    for path in ("chunk", "paged", "decode"):
        before, after = ((tmp_path / s / f"{path}-bf16.bin").read_bytes() for s in ("pristine", "patched"))
        assert before and before == after, f"{path}: BF16 output differs from pristine"
    errors = {s: json.loads((tmp_path / s / "errors.json").read_text()) for s in ("pristine", "patched")}
    assert errors["pristine"].keys() == errors["patched"].keys() and len(errors["patched"]) == 6
    for case, err in errors["patched"].items():
        assert err <= errors["pristine"][case], (case, err, errors["pristine"][case])
