"""Patch 0001 on the real sglang 0.5.23 install: RED on pristine, GREEN patched, then a byte-exact revert."""

from __future__ import annotations

from ..engine import assert_red_green

PATCH_ID = "0001-page-safe-truncation"
CHECK = "tests/sglang/checks/check_0001_page_safe_truncation.py"

# Each of these reproduces the bug on pristine sglang (assertion failures from the real code paths).
RED = {
    "test_seed_example_120_in_8_out",  # 90 + 0 instead of 82 + 8
    "test_worker_input_limit_page_aligned[64]",
    "test_worker_input_limit_page_aligned[512]",
    "test_tokenizer_truncation_keeps_output_budget",
    "test_scheduler_recomputes_budget_after_truncation",
    "test_scheduler_guard_finishes_zero_budget_under_mtp",
    "test_end_to_end_boundary_sweep",
    "test_truncation_log_names_the_limit",  # the warning names the limit the prompt did not fit
}
# Regression guards: behaviour the patch must not change.
GUARDS = {
    "test_worker_input_limit_page_aligned[1]",
    "test_scheduler_guard_keeps_explicit_zero_budget",
    "test_auto_truncate_off_unchanged",
    # issue 38 item 3: a prompt that fits is served whole, as pristine serves it (220 + 24 at context 256,
    # page 64; the patch's earlier page-aligned input limit cut it to 128)
    "test_a_prompt_that_fits_is_never_cut",
    # upstream's test doubles (issue 29 item 10): same on pristine and patched
    "test_worker_limits_with_a_schedule_without_page_size",
    "test_tokenizer_without_max_req_input_len_truncates_inside_the_context",
}


def test_red_on_pristine_green_when_patched(sglang_release):
    assert_red_green(sglang_release, CHECK, RED, GUARDS)


def test_apply_verify_revert_on_the_real_install(sglang_release):
    sglang = sglang_release
    sglang.ensure_pristine()
    pristine = {f["path"]: f["sha256"] for f in sglang.status()["files"]}
    assert pristine == {f["path"]: f["pristine"] for f in sglang.status()["files"]}

    applied = sglang.cli("apply")
    assert applied.returncode == 0, applied.stderr
    assert sglang.cli("verify").returncode == 0
    again = sglang.cli("apply")
    assert again.returncode == 0 and "already patched: nothing to do" in again.stdout

    reverted = sglang.cli("revert")
    assert reverted.returncode == 0, reverted.stderr
    after = sglang.status()
    assert {f["path"]: f["sha256"] for f in after["files"]} == pristine  # byte-exact, proven by hash
    assert sglang.cli("verify").returncode == 1


def test_every_manifest_release_is_tested():
    """A release with a manifest is supported only if its RED/GREEN run is part of this suite."""
    import os

    from sglang_ssd_stream.patching.engines import ENGINES
    from sglang_ssd_stream.patching.manifest import known_manifests

    tested = {ENGINES["sglang"].pinned} | {i.split("=")[0] for i in os.environ.get(
        "SSD_STREAM_SGLANG_RELEASES", "").split()}
    assert {m.release for m in known_manifests(ENGINES["sglang"])} <= tested
