"""Proof 2: page-safe auto-truncation (patch 0001), RED on the pristine engine and GREEN patched, through
the real server with ``--allow-auto-truncate``, at page size 1 (Qwen3) and 64 (qwen4_exp: QSA forces it).

The same two over-long prompts (token ids: 275 = 1.075 x the 256-token context, and 252, between the
scheduler's input limit and the context) each ask for 8 tokens. Pristine, the budget collapses (to 0
for the one over the context), as the Thor write-up describes; patched, the prompt is cut to whole pages
and the client's 8 tokens come back, inside the context.
"""

from __future__ import annotations

import re

import pytest

from .conftest import TRUNCATION_MAX_TOKENS
from .server import CONTEXT

CASES = {1: ("qwen3_patched", "qwen3_pristine"), 64: ("qwen4_ram", "qwen4_pristine")}


def _page_size(log: str) -> int:
    return int(re.search(r"'page_size': (\d+)", log).group(1))


def _usage(probe: dict) -> tuple[int, int, str]:
    assert probe["status"] == 200, probe
    body = probe["body"]
    return body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]


@pytest.mark.parametrize("page", sorted(CASES))
def test_patched_keeps_the_output_budget_inside_the_context(request, page):
    sc = request.getfixturevalue(CASES[page][0])
    assert _page_size(sc.log) == page
    for label, probe in sc.results["truncation"].items():
        prompt, completion, finish = _usage(probe)
        assert finish == "length", (label, probe)
        assert completion == TRUNCATION_MAX_TOKENS, (label, probe)  # the client's max_tokens honoured
        assert prompt + completion <= CONTEXT, (label, probe)
        assert prompt < probe["sent"] and prompt % page == 0, (label, probe)  # cut, to whole KV pages


@pytest.mark.parametrize("page", sorted(CASES))
def test_pristine_budget_collapses(request, page):
    sc = request.getfixturevalue(CASES[page][1])
    assert _page_size(sc.log) == page
    over, near = sc.results["truncation"]["over"], sc.results["truncation"]["near"]
    prompt, completion, _ = _usage(over)
    assert completion == 0, over  # the write-up's bug: truncated to the full window, nothing left to generate
    assert prompt + TRUNCATION_MAX_TOKENS > CONTEXT
    _, completion, _ = _usage(near)
    assert completion < TRUNCATION_MAX_TOKENS, near


@pytest.mark.parametrize("scenario", ["qwen3_patched", "qwen4_ram", "qwen4_mtp_ram", "qwen3_pristine",
                                      "qwen4_pristine"])
def test_a_prompt_that_fits_is_served_whole(request, scenario):
    """Issue 38 item 3: 220 ids + 24 new tokens fit the 256-token context; patched (page 1, page 64, page 64
    under MTP) serves all 220 as pristine does, never cut to the page-aligned limit an earlier patch 0001 used."""
    probe = request.getfixturevalue(scenario).results["fits"]
    prompt, completion, finish = _usage(probe)
    assert (prompt, completion, finish) == (probe["sent"], probe["max_tokens"], "length"), probe
