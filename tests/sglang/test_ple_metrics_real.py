"""The kit's series through the real sglang 0.5.23 hooks and its /metrics route: check_ple_metrics.py in the venv,
in a process started with PROMETHEUS_MULTIPROC_DIR set (as sglang's launcher sets it with --enable-metrics)."""

from __future__ import annotations

from ..engine import outcomes_only

CHECK = "tests/sglang/checks/check_ple_metrics.py"


def test_ple_metrics_through_real_sglang(sglang, tmp_path):
    sglang.ensure_pristine()  # the PLE hooks need no source patch
    prom = tmp_path / "prom"
    prom.mkdir()
    r = sglang.run_checks(CHECK, extra_env={"SGLANG_SSD_STREAM_ALLOW_UNPATCHED": "1",
                                            "PROMETHEUS_MULTIPROC_DIR": str(prom)})
    assert outcomes_only(r) == {"test_series_in_sglangs_metrics_equal_the_row_caches_stats": "passed"}, \
        r["__output__"]
    assert any(prom.glob("counter_*.db"))  # the values went to the multiprocess directory, not to memory
