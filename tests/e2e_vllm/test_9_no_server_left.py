"""Every server this session started is gone (each scenario checks its process group after stopping it), and the
shared venv the private copies were made from is still pristine."""

from __future__ import annotations


def test_no_server_outlives_its_scenario(stage):
    assert stage.scenarios, "no scenario ran"
    left = {sc.name: sc.after_stop for sc in stage.scenarios if sc.after_stop}
    assert not left, f"processes left after stop: {left}"


def test_the_shared_venv_is_still_pristine(engine):
    """The private copies (hard links) were patched and edited by rename: the shared venv's files are untouched."""
    assert engine.states() == {"pristine"}
