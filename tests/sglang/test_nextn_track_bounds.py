"""NEXTN/Mamba track-index bounds: safe in sglang 0.5.23, so no patch; proved on the pristine install.

Every test must pass on pristine sglang. The upstream-form tests inside the check show the
property can fail (hypothesis finds the off-by-one of PR #35821's verbatim clamp).
"""

from __future__ import annotations

from ..engine import outcomes_only

CHECK = "tests/sglang/checks/check_nextn_track_bounds.py"
SITES = ("eager", "kda", "fused_commit", "verify_commit_outputs")
TESTS = {
    "test_real_sites_track_only_accepted_steps",
    "test_h200_script_grid_on_cpu",
    "test_oracle_distinguishes_the_boundary_step",
    *(f"test_upstream_form_is_off_by_one[{site}]" for site in SITES),
    "test_index_sites_get_accept_lens_from_eagle_sample",
    "test_pp_relay_forwards_the_last_rank_accept_lens",
    "test_eagle_sample_counts_the_bonus_token",
    *(f"test_triton_verify_counts_are_never_negative[{w}]" for w in (1, 2, 4, 6)),
    "test_simulated_acceptance_keeps_one_token",
    "test_cuda_verify_kernels_count_up_from_zero",
}


def test_track_bounds_hold_on_pristine(sglang):
    sglang.ensure_pristine()
    results = sglang.run_checks(CHECK)
    assert outcomes_only(results) == {t: "passed" for t in TESTS}, results["__output__"]
