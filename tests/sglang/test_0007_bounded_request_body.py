"""Patch 0007 on the real sglang install of every release in the manifest: RED on pristine, GREEN patched."""

from __future__ import annotations

from ..engine import assert_red_green

PATCH_ID = "0007-bounded-request-body"
CHECK = "tests/sglang/checks/check_0007_bounded_request_body.py"

# Pristine sglang parses any body (no 413) and waits for a half-sent one for ever (no 408).
RED = {"test_declared_oversized_body_refused_413", "test_streamed_oversized_body_refused_413",
       "test_half_sent_body_answered_408"}
GUARDS = {"test_ordinary_body_reaches_the_route"}  # a valid body still reaches FastAPI whole


def test_red_on_pristine_green_when_patched(sglang_release):
    assert_red_green(sglang_release, CHECK, RED, GUARDS)
