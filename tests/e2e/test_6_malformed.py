"""Proof 6 (issue 30 item 5): no single request takes the server down, over HTTP.

The same malformed requests (``probes.malformed_cases``: oversized ``n``, bad ``max_tokens``/``stop``/
``logprobs``/sampling values, empty and junk prompts, invalid UTF-8, non-JSON, wrong shapes, a 2 MB prompt, ids
outside the vocabulary on every path) against ours (patched, under MTP) and the pristine Qwen3 server. Ours must
answer each one (200 or 4xx), keep serving after each, and never put a traceback fragment or a file path in a
body. Pristine leaks its source paths in validation errors, and ``logprobs`` past the vocabulary ends it
(patch 0006); a token id past the vocabulary, or a negative one, ends it too (patch 0005, ``test_5_mtp``).
"""

from __future__ import annotations

from .conftest import PRISTINE_KILLER, PRISTINE_SKIP
from .probes import BODY_TIMEOUT_S

# What ours must refuse with 400, and a phrase of the message (patches 0005, 0006, and sglang's own checks)
REFUSED = {
    "n-oversized": "n must be an integer in [1, 128]",
    "logprobs-over-limit": "top_logprobs_num (logprobs) must be an integer in [0, 1000]",
    "ids-past-vocab": "outside the vocabulary",
    "ids-equal-vocab": "outside the vocabulary",
    "ids-negative": "outside the vocabulary",
    "ids-float": "Input should be a valid integer",  # sglang's own request schema (pristine too)
    "generate-ids-past-vocab": "outside the vocabulary",
    "batch-one-id-past-vocab": "outside the vocabulary",
    "max_tokens-negative": "max_tokens",
    "max_tokens-string": "max_tokens",
}
# Patch 0007: answered before the body is parsed
BODY = {"body-over-limit": (413, "SGLANG_MAX_REQUEST_BODY_MB")}


def _cases(sc):
    return sc.results["malformed"]["cases"]


def test_ours_answers_every_malformed_request_and_serves_on(qwen4_mtp_ram):
    m = qwen4_mtp_ram.results["malformed"]
    assert m["killed_by"] is None, m
    for name, case in m["cases"].items():
        assert case["status"] is not None and case["status"] < 500, (name, case)
        assert case["alive_after"], (name, case)


def test_ours_refuses_the_requests_that_end_or_stall_pristine(qwen4_mtp_ram):
    cases = _cases(qwen4_mtp_ram)
    for name, phrase in REFUSED.items():
        assert cases[name]["status"] == 400, (name, cases[name])
        assert phrase in cases[name]["body"], (name, cases[name])


def test_ours_error_bodies_carry_no_tracebacks_or_paths(qwen4_mtp_ram):
    leaking = {name: case["leaks"] for name, case in _cases(qwen4_mtp_ram).items() if case["leaks"]}
    assert not leaking, leaking


def test_pristine_leaks_source_paths_in_validation_errors(qwen3_pristine):
    case = _cases(qwen3_pristine)["max_tokens-negative"]
    assert case["status"] == 400 and "site-packages" in case["leaks"], case


def test_pristine_server_dies_of_logprobs_past_the_vocabulary(qwen3_pristine):
    res = qwen3_pristine.results
    assert res["malformed"]["killed_by"] is None, res["malformed"]  # the survey itself left it serving
    assert PRISTINE_KILLER not in res["malformed"]["cases"] and not set(PRISTINE_SKIP) & set(_cases(qwen3_pristine))
    assert res["killer"]["status"] != 200 and res["killer"]["death"]["exited"], res["killer"]
    assert "selected index k out of range" in qwen3_pristine.log


def test_ours_bounds_request_bodies(qwen4_mtp_ram, qwen3_pristine):
    """Patch 0007: a body over the limit is refused before it is parsed, and a client that sends half a request
    and goes silent is answered 408 and let go within the body timeout; pristine parses the body and holds the
    half-sent request for as long as the client waits."""
    ours, pristine = qwen4_mtp_ram.results["malformed"], qwen3_pristine.results["malformed"]
    for name, (status, phrase) in BODY.items():
        assert ours["cases"][name]["status"] == status and phrase in ours["cases"][name]["body"], ours["cases"][name]
        assert pristine["cases"][name]["status"] != status, pristine["cases"][name]
    half = ours["half_request"]
    assert half["dropped"] and half["after"] < BODY_TIMEOUT_S + 5 and " 408 " in half["answer"], half
    assert not pristine["half_request"]["dropped"], pristine["half_request"]

