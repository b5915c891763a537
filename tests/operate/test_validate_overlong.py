"""The truncation suite judges what the engine does with a prompt over the window: SGLang (the kit's profiles
pass --allow-auto-truncate) must finish it with the client's budget; vLLM 0.33 has no auto-truncate and must
refuse it with a clean HTTP 400 naming the window. The real servers: tests/e2e and tests/e2e_vllm."""

from __future__ import annotations

from sglang_ssd_stream.operate.validate.client import Reply
from sglang_ssd_stream.operate.validate.suites import Settings, truncation


class _Run:
    def __init__(self, overlong: str, first: Reply):
        self.settings = Settings(context_length=128, overlong=overlong)
        self.replies = [first, Reply(ok=True, finish_reason="stop")]

    def chars_for(self, tokens: int) -> int:
        return tokens * 4

    def request(self, messages, **kw) -> Reply:
        return self.replies.pop(0)

    def wait_kv_zero(self) -> dict:
        return {"status": "pass", "detail": "0 tokens"}


REFUSED = Reply(ok=False, status=400, error="BadRequestError: Error code: 400 - This model's maximum context length "
                "is 128 tokens. However, your request has 190 input tokens.")
TRUNCATED = Reply(ok=True, finish_reason="length", prompt_tokens=120, completion_tokens=8)


def _verdict(overlong, first):
    r = truncation(_Run(overlong, first))
    return r["status"], {c["check"]: c["status"] for c in r["checks"]}


def test_vllm_passes_on_a_clean_400_naming_the_window():
    assert _verdict("refuse", REFUSED)[0] == "pass"


def test_vllm_fails_when_it_accepts_or_refuses_otherwise():
    status, checks = _verdict("refuse", TRUNCATED)
    assert status == "fail" and checks["refused with HTTP 400"] == "fail"
    status, checks = _verdict("refuse", Reply(ok=False, status=400, error="Error code: 400 - bad json"))
    assert status == "fail" and checks["the refusal names the window"] == "fail"
    assert _verdict("refuse", Reply(ok=False, error="ReadTimeout: timed out"))[0] == "fail"  # a hang is never ok


def test_sglang_must_finish_it_and_a_400_fails():
    assert _verdict("truncate", TRUNCATED)[0] == "pass"
    status, checks = _verdict("truncate", REFUSED)
    assert status == "fail" and checks["request finished"] == "fail"
