"""PLE sidecar hooks on the real sglang 0.5.23 install (CPU): check_ple_hook.py in the venv."""

from __future__ import annotations

from ..engine import outcomes_only

CHECK = "tests/sglang/checks/check_ple_hook.py"
EXPECTED = {
    "test_hooks_land_on_real_classes_after_load_plugins",
    *(f"test_lookup_bit_identical_to_sglang_offload_path[tp{t}-{d}-{io}]"
      for t in range(3) for d in ("float8_e4m3fn", "bfloat16") for io in ("mmap", "pread")),
    "test_refuses_without_ple_offload",
    "test_refuses_dtype_mismatch_with_model_config",
    "test_refuses_a_checkpoint_scale_that_disagrees_with_the_sidecar",
    "test_refuses_a_sidecar_with_a_wrong_sha256",
    "test_gather_on_an_unbound_sidecar_table_refuses",
    *(f"test_every_overlapping_checkpoint_shard_is_spot_checked[tp{i}-{n}]" for i, n in enumerate((8, 4, 4))),
    *(f"test_a_self_consistent_sidecar_of_another_checkpoint_is_refused_at_load[tp{i}]" for i in range(2)),
    "test_read_error_after_bind_fails_closed[pread-SidecarTruncated-truncated: it has 4096 bytes]",
    "test_read_error_after_bind_fails_closed[mmap-SidecarTruncated-truncated: it has 4096 bytes]",
    *(f"test_read_error_after_bind_fails_closed[{io}-SidecarChanged-written while it is served]"
      for io in ("pread", "mmap", "pread-nocache", "mmap-nocache")),
    ("test_bad_knob_values_stop_the_plugin_at_start[SGLANG_SSD_STREAM_IO-aio-"
     "SGLANG_SSD_STREAM_IO='aio': expected one of mmap, pread]"),
    ("test_bad_knob_values_stop_the_plugin_at_start[SGLANG_SSD_STREAM_PLE_GATHER-zero-copy-"
     "SGLANG_SSD_STREAM_PLE_GATHER='zero-copy': expected one of h2d, uva]"),
    ("test_bad_knob_values_stop_the_plugin_at_start[SGLANG_SSD_STREAM_READ_WORKERS-0-"
     "SGLANG_SSD_STREAM_READ_WORKERS=0 is out of range 1..256]"),
    ("test_bad_knob_values_stop_the_plugin_at_start[SGLANG_SSD_STREAM_READ_WORKERS-100000-"
     "SGLANG_SSD_STREAM_READ_WORKERS=100000 is out of range 1..256]"),
    (f"test_bad_knob_values_stop_the_plugin_at_start[SGLANG_SSD_STREAM_PLE_MAX_TOKENS-{10**30}-"
     f"SGLANG_SSD_STREAM_PLE_MAX_TOKENS={10**30} is out of range 1..1048576]"),
    "test_bad_knob_values_stop_the_plugin_at_start[retired-switch-interval]",
    *(f"test_binding_for_cuda_graphs_needs_the_native_host_node_library[{cc}-{io}]"
      for cc in ("working", "broken") for io in ("mmap", "pread")),
    "test_gather_inside_graph_capture_is_captured_not_refused",
    "test_conversion_kernel_matches_sglang_kernel_for_every_byte",
    "test_install_raises_when_a_hook_cannot_land[apply_fails]",
    "test_install_raises_when_a_hook_cannot_land[missing_target]",
}


def test_ple_sidecar_hooks_on_real_sglang(sglang):
    sglang.ensure_pristine()  # the PLE hooks need no source patch
    r = sglang.run_checks(CHECK, extra_env={"SGLANG_SSD_STREAM_ALLOW_UNPATCHED": "1"})
    assert outcomes_only(r) == {t: "passed" for t in EXPECTED}, r["__output__"]
