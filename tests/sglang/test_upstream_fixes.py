"""Fixes already upstream in the pinned sglang (README seed-fix table, "upstream" rows).

They must hold on the pristine release and still hold with our patch series applied (0001
edits tokenizer_manager.py and scheduler.py, which carry two of these fixes).
"""

from __future__ import annotations

from ..engine import outcomes_only

CHECK = "tests/sglang/checks/check_upstream_fixes.py"
TESTS = {
    "test_ghost_nodes_zero_cache_len_inserts_nothing",
    "test_ghost_nodes_mamba_component_donates_nothing_without_a_checkpoint",
    "test_ghost_nodes_tree_core_refuses_empty_keys",
    "test_disconnect_aborts_dispatched_requests",
    "test_disconnect_abort_is_sent_once",
    "test_disconnect_dispatch_marks_state",
    "test_disconnect_handler_failure_releases_states",
    "test_idle_sleeper_empty_cache[0.001-False-True]",
    "test_idle_sleeper_empty_cache[0.001-True-False]",
    "test_idle_sleeper_empty_cache[-1-False-False]",
    "test_idle_sleeper_only_with_sleep_on_idle[False]",
    "test_idle_sleeper_only_with_sleep_on_idle[True]",
    "test_on_idle_sleeps_only_when_fully_idle[False]",
    "test_on_idle_sleeps_only_when_fully_idle[True]",
    "test_maybe_sleep_on_idle_is_only_called_from_on_idle",
    "test_qsa_fp8_reads_widen_to_query_dtype",
    "test_qsa_prefill_rows_are_tiled",
}


def test_upstream_fixes_present_pristine_and_patched(sglang):
    sglang.ensure_pristine()
    pristine = sglang.run_checks(CHECK)
    assert outcomes_only(pristine) == {t: "passed" for t in TESTS}, pristine["__output__"]

    sglang.ensure_patched()
    patched = sglang.run_checks(CHECK)
    assert outcomes_only(patched) == {t: "passed" for t in TESTS}, patched["__output__"]
    sglang.ensure_pristine()
