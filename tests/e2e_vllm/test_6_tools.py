"""Proof 6 (issue 26 item 5): the kit's own ``vllm-ple-offload validate`` and ``watch``, the real CLIs run from
the vLLM venv, against the real ``patched-chunked`` server (proof 5's traffic running at the same time).

``validate`` runs the needle, truncation, soak and canary suites with budgets scaled to the tiny server (128-token
context, 2-8 tokens a reply; the matrix suite needs a tool-call parser the tiny model has not got). What random
weights on vLLM 0.33.0 honestly give, asserted exactly:

- needle: **fail** (no code recalled);
- truncation: **pass**: vLLM has no ``--allow-auto-truncate``, so the vLLM side's validate expects what a healthy
  vLLM does with a prompt over ``--max-model-len``: a clean HTTP 400 naming the window (never a hang); the KV
  cache returns to zero and a short request afterwards is served;
- soak: **pass** (two sessions, continue then compress, KV back to zero);
- canary: **pass**: greedy replies of 8 tokens hold no token-id-0 run, no NaN log-probability and no run of 8
  identical tokens; each verdict is fail exactly when one of its rules fired.

``watch`` samples every 5 s for about a minute while the requests run: the server's process tree and RSS, the
sidecar's page-cache residency, and vLLM's ``/metrics`` (KV use, running requests, generated tokens).
"""

from __future__ import annotations

import json

from .conftest import CONTEXT, VALIDATE_SUITES, WATCH_INTERVAL_S, WATCH_SAMPLES
from .server import SERVED_NAME

GIB = 1 << 30


def _report(sc) -> dict:
    v = sc.results["validate"]
    assert v["rc"] == 1, f"validate exited {v['rc']} (1 = validation failed)\n{v['stdout']}\n{v['stderr'][-3000:]}"
    return json.loads((v["out"] / "report.json").read_text())


def test_validate_verdicts(patched_chunked):
    sc = patched_chunked
    doc = _report(sc)
    assert list(doc["suites"]) == VALIDATE_SUITES.split(",")
    verdicts = {name: r["status"] for name, r in doc["suites"].items()}
    assert verdicts == {"needle": "fail", "truncation": "pass", "soak": "pass", "canary": "pass"}, verdicts
    assert doc["status"] == "fail" and doc["aborted"] is None and doc["model"] == SERVED_NAME
    assert doc["settings"]["context_length"] == CONTEXT  # read from the server's /v1/models
    out = sc.results["validate"]["stdout"]
    assert all(f"{name}: {status}" in out for name, status in verdicts.items()), out


def test_needle_fails_honestly(patched_chunked):
    needle = _report(patched_chunked)["suites"]["needle"]
    (check,) = needle["checks"]
    assert check["status"] == "fail" and check["error"] is None and check["finish_reason"] == "length", check
    assert not any(check["recalled"])
    # the shortest needle prompt: the chat template, the question and the three needles, measured on the server
    assert needle["fixed_tokens"] > 0 and abs(check["prompt_tokens"] - needle["floor_tokens"]) <= 8, needle


def test_truncation_is_refused_by_vllm_then_kv_drains(patched_chunked):
    t = _report(patched_chunked)["suites"]["truncation"]
    checks = {c["check"]: c for c in t["checks"]}
    assert {k: c["status"] for k, c in checks.items()} == {
        "refused with HTTP 400": "pass", "the refusal names the window": "pass", "KV returns to zero": "pass",
        "short request afterwards": "pass"}
    assert "Error code: 400" in checks["refused with HTTP 400"]["detail"]
    assert f"maximum context length is {CONTEXT} tokens" in checks["the refusal names the window"]["detail"]
    assert t["prompt_tokens"] is None and t["sent_tokens_estimate"] > CONTEXT


def test_soak_passes(patched_chunked):
    soak = _report(patched_chunked)["suites"]["soak"]
    assert soak["completed"] == soak["planned"] == 4
    stages = [c for c in soak["checks"] if "stage" in c]
    assert len(stages) == 4 and all(c["status"] == "pass" and c["finish_reason"] == "length" for c in stages)
    assert all(c["prompt_tokens"] + c["completion_tokens"] <= CONTEXT for c in stages)
    assert soak["checks"][-1]["check"] == "KV returns to zero" and soak["checks"][-1]["status"] == "pass"


def test_canary_rules_hold_on_the_streamed_path(patched_chunked):
    canary = _report(patched_chunked)["suites"]["canary"]["checks"]
    assert len(canary) == 3
    for c in canary:
        assert c["error"] is None and c["unit"] == "token" and c["count"] == 8, c
        assert (c["status"] == "fail") == bool(c["problems"]), c  # fail exactly when a rule fired
        assert c["nan_logprobs"] == 0 and c["zero_run"] < 8 and c["longest_run"] < 8, c
        assert c["status"] == "pass"


def test_watch_reads_the_server(patched_chunked):
    sc = patched_chunked
    w = sc.results["watch"]
    assert w["rc"] == 0, w["stderr"][-3000:]
    assert "watch: http://127.0.0.1:" in w["stderr"] and "Traceback" not in w["stderr"], w["stderr"][-3000:]
    samples = w["samples"]
    assert len(samples) == WATCH_SAMPLES, len(samples)
    span = samples[-1]["t"] - samples[0]["t"]
    assert (WATCH_SAMPLES - 1) * WATCH_INTERVAL_S - 1 <= span <= (WATCH_SAMPLES - 1) * WATCH_INTERVAL_S + 30, span
    for s in samples:
        assert s["answering"] is True and not [a for a in s["alerts"] if a["check"] == "server"], s
        server = s["server"]
        assert server["pid"] == sc.leader and server["processes"] >= 3, server  # API server, engine core, worker
        assert 1.0 < server["rss_gib"] < 20.0, server
        eng = s["engine"]
        assert eng["source"] == "/metrics" and 0.0 <= eng["kv_usage"] <= 1.0, eng
        assert 0 <= eng["running"] <= 4 and eng["waiting"] >= 0, eng
        side = s["sidecar"]
        assert 0 < side["size_gib"] < 1e-3 and 0 <= side["page_cache_gib"] <= side["size_gib"], side
        assert 0 < s["mem"]["available_gib"] <= s["mem"]["total_gib"]
    # it saw the traffic: requests running, tokens generated, the counter never going back
    assert any(s["engine"]["running"] >= 1 for s in samples)
    generated = [s["engine"]["counters"]["generated"] for s in samples]
    assert generated == sorted(generated) and generated[-1] > generated[0], generated
    assert any((s["engine"]["gen_tokens_per_s"] or 0) > 0 for s in samples)
