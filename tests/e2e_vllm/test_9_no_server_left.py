"""Every server this session started is gone: each scenario checks its process group after stopping it."""

from __future__ import annotations


def test_no_server_outlives_its_scenario(stage):
    assert stage.scenarios, "no scenario ran"
    left = {sc.name: sc.after_stop for sc in stage.scenarios if sc.after_stop}
    assert not left, f"processes left after stop: {left}"
