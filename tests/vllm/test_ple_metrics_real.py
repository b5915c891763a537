"""The kit's series through the real vLLM 0.33.0 plugin and its /metrics route: check_ple_metrics.py in the venv,
in a process started with PROMETHEUS_MULTIPROC_DIR set (vLLM's multiprocess mode, which carries a worker's
values to the API server's endpoint)."""

from __future__ import annotations

from ..engine import outcomes_only

CHECK = "tests/vllm/checks/check_ple_metrics.py"


def test_ple_metrics_through_real_vllm(vllm, tmp_path):
    prom = tmp_path / "prom"
    prom.mkdir()
    r = vllm.run_checks(CHECK, extra_env={"PROMETHEUS_MULTIPROC_DIR": str(prom)})
    assert outcomes_only(r) == {"test_series_in_vllms_metrics_equal_the_row_caches_stats": "passed"}, \
        r["__output__"]
    assert any(prom.glob("counter_*.db"))  # the values went to the multiprocess directory, not to memory
