"""Our SGLang plugin, loaded by the real load_plugins(), refuses to run on an engine it cannot vouch for."""

from __future__ import annotations

from ..engine import outcomes_only

CHECK = "tests/sglang/checks/check_plugin_guard.py"
BASE = {"SGLANG_PLUGINS": "ssd_stream"}


def _run(sglang, **env):
    result = sglang.run_checks(CHECK, extra_env={**BASE, **env})
    assert outcomes_only(result) == {"test_guard": "passed"}, result["__output__"]


def test_pristine_engine_is_refused(sglang):
    sglang.ensure_pristine()
    _run(sglang, EXPECT="refuse", EXPECT_MESSAGE="sglang 0.5.23 is not patched")


def test_pristine_engine_allowed_explicitly(sglang):
    sglang.ensure_pristine()
    _run(sglang, EXPECT="start", EXPECT_BUDGET_MB="128", SGLANG_SSD_STREAM_ALLOW_UNPATCHED="1")


def test_patched_engine_starts_with_knob(sglang):
    sglang.ensure_patched()
    _run(sglang, EXPECT="start", EXPECT_BUDGET_MB="32", SGLANG_QSA_PREFILL_LOGITS_BUDGET_MB="32")


def test_bad_knob_stops_the_process(sglang):
    sglang.ensure_patched()
    _run(sglang, EXPECT="refuse", EXPECT_MESSAGE="is not an integer number of MiB",
         SGLANG_QSA_PREFILL_LOGITS_BUDGET_MB="32MB")


def test_failing_hook_installation_stops_the_process(sglang):
    sglang.ensure_patched()
    _run(sglang, EXPECT="refuse", EXPECT_MESSAGE="get_model_architecture is missing", FAIL_PLE_HOOKS="1")


SERVED_MODEL = "tests/sglang/checks/check_plugin_served_model.py"


def test_ple_hooks_follow_the_served_model(sglang):
    """Loading the plugin imports no qwen4_exp; resolving another model leaves the PLE targets alone,
    resolving qwen4_exp installs the hooks, and one whose hooks cannot land stops the load."""
    sglang.ensure_patched()
    result = sglang.run_checks(SERVED_MODEL, extra_env=BASE)
    assert outcomes_only(result) == {
        "test_loading_the_plugin_imports_no_qwen4_exp": "passed",
        "test_other_model_left_alone_then_qwen4_exp_hooked": "passed",
        "test_qwen4_exp_checkpoint_served_by_another_class_is_refused": "passed",
        "test_qwen4_exp_whose_hooks_cannot_land_stops_the_load": "passed",
    }, result["__output__"]
