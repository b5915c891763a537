"""QSA prefill logits budget knob (SGLANG_QSA_PREFILL_LOGITS_BUDGET_MB), applied by our plugin.

No source patch: the check runs on the pristine install, with SGLANG_SSD_STREAM_ALLOW_UNPATCHED=1
set inside its probe processes so the plugin guard lets sglang start.
"""

from __future__ import annotations

import json

from ..engine import REPO, outcomes_only

CHECK = "tests/sglang/checks/check_qsa_budget_knob.py"
TESTS = {
    "test_budget_32_gives_smaller_chunks_than_default",
    "test_unset_keeps_the_upstream_default",
    *(f"test_bad_values_stop_the_process[{v}]" for v in ("abc", "empty", "0", "-1", "65537", "1e30")),
    "test_tiling_keeps_topk_selection_identical",
}


def _check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_qsa_budget_knob", REPO / CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # its top level imports only the standard library and pytest
    return module


def test_budget_knob_in_real_sglang_processes(sglang, tmp_path):
    sglang.ensure_pristine()
    check = _check_module()
    for name, (mode, budget) in check.PROBES.items():  # one process each: load_plugins() runs once per process
        proc = sglang.run_script(CHECK, "probe", mode, str(tmp_path / f"{name}.json"),
                                 extra_env={check.BUDGET_ENV: None, **check.probe_env(budget)})
        (tmp_path / f"{name}.proc.json").write_text(json.dumps(
            {"args": [str(a) for a in proc.args], "returncode": proc.returncode, "stdout": proc.stdout,
             "stderr": proc.stderr}))
    results = sglang.run_checks(CHECK, extra_env={"QSA_CHECK_OUT": str(tmp_path)})
    assert outcomes_only(results) == {t: "passed" for t in TESTS}, results["__output__"]
