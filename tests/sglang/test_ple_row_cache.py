"""PLE row cache and prompt-ahead prefetch in the real sglang 0.5.23 (CPU): check_ple_row_cache.py in the venv."""

from __future__ import annotations

from ..engine import outcomes_only

CHECK = "tests/sglang/checks/check_ple_row_cache.py"
EXPECTED = {
    *(f"test_cached_rows_identical_to_uncached_and_the_cache_serves_them[tp{t}-{b}]"
      for t in ("0", "1") for b in ("default-budget", "9MiB-evicting")),
    "test_the_budget_is_split_over_the_bound_layers",
    "test_a_budget_that_holds_no_row_is_refused_naming_the_knob",
    "test_a_cache_that_cannot_be_built_stops_the_load",
    ("test_bad_row_cache_knobs_stop_the_plugin_at_start[SGLANG_SSD_STREAM_ROW_CACHE_MB-lots-"
     "SGLANG_SSD_STREAM_ROW_CACHE_MB='lots' is not an integer number of MiB]"),
    ("test_bad_row_cache_knobs_stop_the_plugin_at_start[SGLANG_SSD_STREAM_ROW_CACHE_MB--1-"
     "SGLANG_SSD_STREAM_ROW_CACHE_MB=-1 is out of range 0..1048576 MiB]"),
    ("test_bad_row_cache_knobs_stop_the_plugin_at_start[SGLANG_SSD_STREAM_PREFETCH_CHUNKS-65-"
     "SGLANG_SSD_STREAM_PREFETCH_CHUNKS=65 is out of range 0..64 chunks]"),
    ("test_bad_row_cache_knobs_stop_the_plugin_at_start[SGLANG_SSD_STREAM_PREFETCH_CHUNKS-two-"
     "SGLANG_SSD_STREAM_PREFETCH_CHUNKS='two' is not an integer number of prefill chunks ahead]"),
    "test_memory_line_states_cache_and_staging_bytes",
    "test_scheduler_hooks_land_on_the_real_targets",
    "test_prepare_for_forward_announces_the_chunk_and_the_window_and_prefetches",
    "test_mixed_and_decode_batches_announce_only_prompt_tokens",
    "test_a_slow_prefetch_never_delays_the_scheduler",
    "test_prefetch_off_with_the_cache_off",
    "test_an_arriving_request_has_its_first_chunk_fetched_before_it_is_scheduled",
    "test_a_failing_prefetcher_never_reaches_the_scheduler",
    "test_a_restart_gets_the_hot_rows_back_before_any_lookup",
    "test_the_hot_file_is_on_by_default_and_off_at_0_or_without_a_row_cache",
}


def test_ple_row_cache_and_prefetch_on_real_sglang(sglang):
    sglang.ensure_pristine()  # the PLE hooks need no source patch
    r = sglang.run_checks(CHECK, extra_env={"SGLANG_SSD_STREAM_ALLOW_UNPATCHED": "1"})
    assert outcomes_only(r) == {t: "passed" for t in EXPECTED}, r["__output__"]
