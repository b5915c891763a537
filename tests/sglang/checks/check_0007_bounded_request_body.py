"""Patch 0007 in the installed sglang: request bodies are bounded in size and time before the app reads them.

Drives the real FastAPI ``app`` of ``sglang.srt.entrypoints.http_server`` as an ASGI callable (its middleware
stack included, no engine behind it): a body over the limit is answered 413 before any route runs, a body that
stops arriving is answered 408 within the timeout, and an ordinary body reaches the route unchanged. The limits
are sglang's own settings (``envs``), set small here before the app builds its middleware stack.
"""

from __future__ import annotations

import asyncio
import json
import os

os.environ["SGLANG_MAX_REQUEST_BODY_MB"] = "1"
os.environ["SGLANG_REQUEST_BODY_TIMEOUT"] = "1"

from sglang.srt.entrypoints.http_server import app  # noqa: E402

BOUND = 5.0  # seconds (5x the 1 s timeout set above); pristine waits for the rest of the body for ever


def call(body_chunks, *, declared: int | None = None, path: str = "/v1/completions", stall: bool = False):
    """One POST through the app: the response status and body (None when it did not answer within BOUND)."""
    headers = [(b"content-type", b"application/json")]
    if declared is not None:
        headers.append((b"content-length", str(declared).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    pending = [{"type": "http.request", "body": c, "more_body": i + 1 < len(body_chunks) or stall}
               for i, c in enumerate(body_chunks)]
    sent = {"status": None, "body": b""}

    async def receive():
        if pending:
            return pending.pop(0)
        await asyncio.sleep(3600)  # a client that went silent

    async def send(message):
        if message["type"] == "http.response.start":
            sent["status"] = message["status"]
        elif message["type"] == "http.response.body":
            sent["body"] += message.get("body", b"")

    async def run():
        try:
            await asyncio.wait_for(app(scope, receive, send), BOUND)
        except asyncio.TimeoutError:
            pass
        except Exception:  # no engine behind the route: what matters is what was answered before
            pass

    asyncio.run(run())
    return sent["status"], sent["body"].decode(errors="replace")


def test_declared_oversized_body_refused_413():
    status, body = call([b"{}"], declared=(1 << 20) + 1)
    assert status == 413 and "SGLANG_MAX_REQUEST_BODY_MB" in body, (status, body)


def test_streamed_oversized_body_refused_413():
    chunk = b"x" * (256 << 10)
    status, body = call([chunk] * 5)  # 1.25 MiB, no Content-Length
    assert status == 413 and "SGLANG_MAX_REQUEST_BODY_MB" in body, (status, body)


def test_half_sent_body_answered_408():
    status, body = call([b'{"model": "m", "prom'], declared=200, stall=True)
    assert status == 408 and "SGLANG_REQUEST_BODY_TIMEOUT" in body, (status, body)


def test_ordinary_body_reaches_the_route():
    """A body within the limits, split in chunks, reaches FastAPI whole: its validation answers on the fields."""
    raw = json.dumps({"model": "m", "prompt": "hi", "max_tokens": -5}).encode()
    status, body = call([raw[:7], raw[7:]], declared=len(raw))
    assert status == 400 and "max_tokens" in body, (status, body)
