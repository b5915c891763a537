"""QSA prefill logits budget knob (SGLANG_QSA_PREFILL_LOGITS_BUDGET_MB), applied by our plugin.

No source patch: the check runs on the pristine install, with SGLANG_SSD_STREAM_ALLOW_UNPATCHED=1
set inside its probe processes so the plugin guard lets sglang start.
"""

from __future__ import annotations

from ..engine import outcomes_only

CHECK = "tests/sglang/checks/check_qsa_budget_knob.py"
TESTS = {
    "test_budget_32_gives_smaller_chunks_than_default",
    "test_unset_keeps_the_upstream_default",
    *(f"test_bad_values_stop_the_process[{v}]" for v in ("abc", "empty", "0", "-1", "65537", "1e30")),
    "test_tiling_keeps_topk_selection_identical",
}


def test_budget_knob_in_real_sglang_processes(sglang):
    sglang.ensure_pristine()
    results = sglang.run_checks(CHECK)
    assert outcomes_only(results) == {t: "passed" for t in TESTS}, results["__output__"]
