"""Proof 4: ``sglang-ssd-stream validate`` (the real CLI) against the real server (patched, Qwen3, 256-token
context, ``--allow-auto-truncate``), every suite, budgets scaled to the tiny context (16 tokens a reply).

Random weights recall no needle and write no sane text, so the honest verdicts are: truncation and soak
pass, needle and canary fail (and matrix fails its tools-on cells: no tool-call parser). The test asserts
those verdicts and the report's structure; a suite that passed everything would fail it.
"""

from __future__ import annotations

import json

from .conftest import MAX_TOKENS
from .server import CONTEXT

SUITES = ["needle", "truncation", "soak", "matrix", "canary"]


def _report(qwen3_patched) -> dict:
    v = qwen3_patched.results["validate"]
    assert v["rc"] == 1, f"validate exited {v['rc']} (1 = validation failed)\n{v['stdout']}\n{v['stderr'][-3000:]}"
    return json.loads((v["out"] / "report.json").read_text())


def test_verdicts(qwen3_patched):
    doc = _report(qwen3_patched)
    assert list(doc["suites"]) == SUITES
    verdicts = {name: r["status"] for name, r in doc["suites"].items()}
    assert verdicts == {"needle": "fail", "truncation": "pass", "soak": "pass", "matrix": "fail", "canary": "fail"}
    assert doc["status"] == "fail" and doc["aborted"] is None
    out = qwen3_patched.results["validate"]["stdout"]
    assert all(f"{name}: {status}" in out for name, status in verdicts.items()), out
    assert doc["settings"]["context_length"] == CONTEXT  # read from the server's /v1/models


def test_needle_runs_and_tracks_the_targets(qwen3_patched):
    doc = _report(qwen3_patched)
    needle = doc["suites"]["needle"]
    checks = needle["checks"]
    room = CONTEXT - MAX_TOKENS - 16
    # question + needles, measured on the server; with the chat template they are the shortest needle prompt
    assert needle["fixed_tokens"] > 0
    floor = doc["calibration"]["template_tokens"] + needle["fixed_tokens"]
    assert needle["floor_tokens"] == floor and floor < room // 2
    fractions = (1 / 8, 1 / 4, 1 / 2, 3 / 4, 15 / 16, 1)
    assert [c["target_tokens"] for c in checks] == [floor + int((room - floor) * f) for f in fractions]
    for c in checks:
        assert c["status"] == "fail" and c["error"] is None and c["finish_reason"] == "length", c
        assert not any(c["recalled"])
        # the prompt that went out is the length asked for (it was ~100 tokens for every target before)
        assert abs(c["prompt_tokens"] - c["target_tokens"]) <= max(6, c["target_tokens"] // 10), c
        assert c["ttft_s"] is not None and c["kv"] is not None


def test_truncation_passes_on_the_patched_server(qwen3_patched):
    t = _report(qwen3_patched)["suites"]["truncation"]
    assert {c["check"]: c["status"] for c in t["checks"]} == {
        "request finished": "pass", "finish_reason=length": "pass", "output budget kept": "pass",
        "fits the window": "pass", "KV returns to zero": "pass", "short request afterwards": "pass"}
    assert t["prompt_tokens"] < t["sent_tokens_estimate"]


def test_soak_budgets_scale_to_the_context(qwen3_patched):
    soak = _report(qwen3_patched)["suites"]["soak"]
    assert soak["completed"] == soak["planned"] == 4
    assert soak["continue_tokens"] == MAX_TOKENS and soak["compact_tokens"] == MAX_TOKENS
    assert soak["per_session_tokens"] == int(CONTEXT * 0.45)
    stages = [c for c in soak["checks"] if "stage" in c]
    assert len(stages) == 4 and all(c["completion_tokens"] <= MAX_TOKENS for c in stages)
    assert all(c["prompt_tokens"] + c["completion_tokens"] <= CONTEXT for c in stages)
    assert soak["checks"][-1]["check"] == "KV returns to zero" and soak["checks"][-1]["status"] == "pass"


def test_canary_and_matrix_fail_honestly(qwen3_patched):
    doc = _report(qwen3_patched)
    canary = doc["suites"]["canary"]["checks"]
    assert len(canary) == 3 and all(c["count"] == MAX_TOKENS and c["unit"] == "token" for c in canary)
    assert any(c["status"] == "fail" for c in canary)
    for c in canary:  # a verdict is fail exactly when a rule fired, and says which
        assert (c["status"] == "fail") == bool(c["problems"]), c
    assert any(p.startswith("degenerate repetition") for c in canary for p in c["problems"])
    cells = doc["suites"]["matrix"]["checks"]
    assert len(cells) == 8 and all(c["turns"] == 2 for c in cells)
    assert all(c["status"] == "fail" and "no structured tool_calls with tools on" in c["problems"]
               for c in cells if c["tools"])


def test_report_files(qwen3_patched):
    v = qwen3_patched.results["validate"]
    md = (v["out"] / "report.md").read_text()
    assert "| needle | fail | 0/6 checks passed |" in md and "| truncation | pass | 6/6 checks passed |" in md
    assert "Budgets: 115 prompt, 16 continue, 16 compress tokens per session; 4/4 stages completed" in md
    assert "session 0 cycle 0 continue: pass (prompt_tokens=" in md  # a stage prints its own fields
    assert (v["out"] / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
