"""Patch 0002 (per-layer FP8 KV descales in QSA) on the real sglang 0.5.23 install: RED on
pristine, GREEN patched, and the outputs that must not change are byte-identical across both."""

from __future__ import annotations

from ..engine import assert_red_green

CHECK = "tests/sglang/checks/check_0002_qsa_fp8_kv_descales.py"

# Pristine has no descales: the launchers reject the scale arguments, the backend stores K
# unscaled (E4M3 overflow, subnormal V), and TRT-LLM gets bmm1 = scaling, bmm2 = 1.
RED = {
    "test_chunk_kernel_launchers_apply_descales[chunk]",
    "test_chunk_kernel_launchers_apply_descales[paged]",
    "test_chunk_kernel_launchers_apply_descales[decode]",
    "test_pack_descales_exactly",
    "test_compact_descales_exactly",
    "test_same_dtype_copy_refuses_a_descale",
    "test_invalid_descales_are_refused[0.0]",
    "test_invalid_descales_are_refused[-1.0]",
    "test_invalid_descales_are_refused[nan]",
    "test_invalid_descales_are_refused[inf]",
    "test_backend_prefill_and_decode_apply_checkpoint_scales",
    "test_trtllm_decode_gets_the_bmm_descales",
}
# Behaviour the patch must keep.
GUARDS = {
    "test_unit_scale_and_bf16_outputs_for_comparison",
    "test_backend_write_leaves_the_callers_kv_untouched",
    "test_backend_bf16_pool_ignores_checkpoint_scales",
    "test_backend_layer_without_scales_means_one[None]",
    "test_backend_layer_without_scales_means_one[-1.0]",
}
# BF16 K/V everywhere, and the FP8 gathers at unit scale (0003 changes only the FP8 chunk kernel).
SAME_BYTES = ["chunk-bf16", "paged-bf16", "decode-bf16", "compact-bf16", "pack-bf16", "compact-fp8", "pack-fp8"]


def test_red_on_pristine_green_when_patched(sglang, tmp_path):
    assert_red_green(sglang, CHECK, RED, GUARDS, outputs=tmp_path)
    for name in SAME_BYTES:
        before, after = ((tmp_path / s / f"{name}.bin").read_bytes() for s in ("pristine", "patched"))
        assert before and before == after, f"{name}: patched output differs from pristine"
