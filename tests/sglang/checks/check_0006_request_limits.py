"""Patch 0006 in the installed sglang: the requests that ended or stalled the server are refused at intake, and
validation errors carry no source paths.

Real code throughout: ``GenerateReqInput.normalize_batch_and_arguments`` (n), the real
``TokenizerManager._validate_one_request`` on a bare instance with the attributes it reads (top_logprobs_num),
and the real FastAPI app of ``sglang.srt.entrypoints.http_server`` with its own exception handler, called through
Starlette's test client on a route that validates a body (no engine behind it: validation fails first).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.runtime_context import get_context

VOCAB = 1000


def normalized(n):
    obj = GenerateReqInput(text="hello", sampling_params={"max_new_tokens": 2, "n": n})
    obj.normalize_batch_and_arguments()
    return obj


@pytest.mark.parametrize("n", [100000, 129, 0, -3, 2.5, True], ids=["1e5", "129", "0", "neg", "float",
                                                                       "bool"])
def test_bad_n_refused(n):
    with pytest.raises(ValueError, match=r"n must be an integer in \[1, 128\]"):
        normalized(n)


@pytest.mark.parametrize("n", [1, 2, 128])
def test_good_n_passes(n):
    assert normalized(n).parallel_sample_num == n


def validate(top_logprobs_num, return_logprob=True):
    tm = object.__new__(TokenizerManager)
    tm.model_config = SimpleNamespace(vocab_size=VOCAB, hidden_size=64)
    tm.context_len, tm.max_req_input_len, tm.num_reserved_tokens = 256, 250, 0
    tm.allow_auto_truncate, tm.validate_total_tokens, tm.is_generation = False, True, True
    tm._validate_joint_schema_request = lambda obj, ids: None
    obj = GenerateReqInput(input_ids=[11, 12, 13], sampling_params={"max_new_tokens": 2},
                           return_logprob=return_logprob, top_logprobs_num=top_logprobs_num)
    obj.normalize_batch_and_arguments()
    with get_context().override_server_args():  # sglang's own test hook: publishes default server args
        tm._validate_one_request(obj, list(obj.input_ids))


@pytest.mark.parametrize("k", [VOCAB + 1, 10**6, -1], ids=["vocab+1", "1e6", "neg"])
def test_top_logprobs_past_the_vocabulary_refused(k):
    with pytest.raises(ValueError, match=rf"top_logprobs_num \(logprobs\) must be an integer in \[0, {VOCAB}\]"):
        validate(k)


@pytest.mark.parametrize("k", [0, 5, VOCAB])
def test_top_logprobs_within_the_vocabulary_pass(k):
    validate(k)


def test_validation_error_body_has_no_source_paths():
    from fastapi.testclient import TestClient
    from sglang.srt.entrypoints.http_server import app

    r = TestClient(app, raise_server_exceptions=False).post(
        "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": -5})
    assert r.status_code == 400, r.text
    body = r.text
    assert "max_tokens" in body  # still names the field
    for leak in ('File "', "site-packages", "http_server.py", "line "):
        assert leak not in body, body
