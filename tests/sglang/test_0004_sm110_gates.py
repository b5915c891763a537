"""Patch 0004 (SM110 gates) on the real sglang 0.5.23 install: RED on pristine, GREEN patched."""

from __future__ import annotations

from ..engine import assert_red_green

PATCH_ID = "0004-sm110-gates"
CHECK = "tests/sglang/checks/check_0004_sm110_gates.py"
ARCHS = ("sm110", "sm121", "sm120", "sm100", "sm90")

# Pristine sglang routes SM110 to flashinfer attention and leaves DeepGEMM JIT on.
RED = {"test_resolved_attention_defaults[sm110]", "test_deep_gemm_jit[sm110]"}
# Everything else is the same before and after: other archs unchanged, kept refusals kept.
GUARDS = {
    "test_probes_see_sm110_as_blackwell_but_not_sm100",
    "test_explicit_trtllm_mha_refused_on_sm110",
    *(f"{test}[{arch}]" for arch in ARCHS for test in (
        "test_resolved_attention_defaults", "test_fp8_qsa_indexer_refused_off_sm90_sm100", "test_deep_gemm_jit",
        "test_fp8_gemm_auto_backend", "test_qsa_decode_routes")),
} - RED


def test_red_on_pristine_green_when_patched(sglang_release):
    assert_red_green(sglang_release, CHECK, RED, GUARDS)
