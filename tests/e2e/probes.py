"""What the MTP scenarios send (issue 30): the write-up §8 truncation probes, four requests at once, clients
that go away, malformed requests. Each returns plain data for the tests to assert on; nothing here asserts.

Every wait is bounded: a request that never answers is recorded as such (``status: None``), never waited on
for ever, so the pristine engine's real behaviour is observed whatever it is.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx

from .server import CONTEXT, POLL_S, SglangServer, shared_tls

BODY_LIMIT_MB = 4  # SGLANG_MAX_REQUEST_BODY_MB for the survey's servers (patch 0007; default 16)
BODY_TIMEOUT_S = 5  # SGLANG_REQUEST_BODY_TIMEOUT for them (default 30)
BOUND = 120.0  # seconds any one probe may take before it counts as never answering (write-up §8)
# Write-up §8 under MTP: over the 256-token context (275 = 1.075 x, as the write-up), client budgets of 8 and
# 1; and a prompt between the scheduler's input limit and the context, whose 8 tokens page rounding would eat.
MTP_TRUNCATION = {"over-8": (275, 8), "over-1": (275, 1), "near-8": (252, 8)}
LONG_DECODE = (24, 200)  # prompt ids, tokens: a request that decodes for many seconds on this CPU
# max_tokens far past the context is legal: the server clamps it to what the context leaves and decodes that
# much (a 1-token prompt: ~250 tokens, a minute or two under MTP here). This prompt leaves CONTEXT - 180 = 76,
# under every input limit of the suite's servers, so it is not cut (issue 37 item 5).
HUGE_MAX_TOKENS_PROMPT = 180


def token_ids(n: int, seed: int = 0) -> list[int]:
    """A deterministic prompt of ``n`` ordinary token ids (the tokenizer's specials are ids < 10)."""
    return [10 + (i * 37 + seed * 101) % 980 for i in range(n)]


LOAD_KEYS = ("timestamp", "num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_running_requests",
             "speculative")


def loads(server: SglangServer) -> dict:
    """The scheduler's live counters (``/v1/loads``; ``/metrics`` gauges lag until the next log interval)."""
    now = httpx.get(f"{server.url}/v1/loads", verify=shared_tls(), timeout=30).json()["loads"][0]
    return {k: now[k] for k in LOAD_KEYS if k in now}


def settle(server: SglangServer, timeout: float = 15.0) -> dict:
    """Until nothing runs, waits or holds KV tokens (or ``timeout``): seconds taken and the last counters. Only
    a snapshot the scheduler took after this call counts (sglang publishes ``/v1/loads`` at each prefill, when idle
    and every 15 decode steps: its ``load_snapshot_publish_interval``)."""
    t0, since = time.monotonic(), time.time()
    while True:
        now = loads(server)
        idle = (now["timestamp"] > since and now["num_running_reqs"] == 0 and now["num_waiting_reqs"] == 0
                and now["num_used_tokens"] == 0)
        if idle or time.monotonic() - t0 > timeout:
            return {"idle": idle, "seconds": time.monotonic() - t0, "loads": now}
        time.sleep(0.25)


def completion(server: SglangServer, prompt, max_tokens: int, timeout: float = BOUND, **extra) -> dict:
    """One ``/v1/completions`` call: status, JSON body (or text), seconds; a timeout is ``status: None``."""
    t0 = time.monotonic()
    body = {"model": str(server.model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    try:
        r = server.post("/v1/completions", body, timeout=timeout)
        try:
            out = r.json()
        except ValueError:
            out = {"text": r.text}
        return {"status": r.status_code, "body": out, "seconds": time.monotonic() - t0}
    except httpx.HTTPError as exc:
        return {"status": None, "error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - t0}


def truncation(server: SglangServer) -> dict:
    """The §8 probes one after another, each bounded; the scheduler's counters after each."""
    out = {}
    for label, (n, max_tokens) in MTP_TRUNCATION.items():
        probe = completion(server, token_ids(n), max_tokens)
        probe.update(sent=n, max_tokens=max_tokens, after=settle(server))
        out[label] = probe
    return out


def _together(server: SglangServer, cases: dict) -> dict:
    """Sends ``cases`` (label -> (prompt, max_tokens)) at once, ignoring EOS: each one's outcome with its start
    and end (seconds from the common start), the most requests the scheduler reported running at once (sampled
    from /v1/loads), and the counters once all are done."""
    results: dict = {}
    peak = {"running": 0}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            try:
                peak["running"] = max(peak["running"], loads(server)["num_running_reqs"])
            except httpx.HTTPError:
                pass
            time.sleep(0.1)

    t0 = time.monotonic()

    def send(label, prompt, max_tokens):
        start = time.monotonic() - t0
        results[label] = {**completion(server, prompt, max_tokens, ignore_eos=True), "start": start,
                          "end": time.monotonic() - t0}

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    threads = [threading.Thread(target=send, args=(label, *args)) for label, args in cases.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND + 10)
    stop.set()
    watcher.join(5)
    return {"requests": results, "peak_running": peak["running"], "after": settle(server)}


def four_at_once(server: SglangServer) -> dict:
    """The profile's concurrency: one over-long request and three ordinary ones sent together."""
    return _together(server, {"over": (token_ids(275), 8),
                              **{f"ordinary-{i}": (token_ids(30 + 20 * i, i + 1), 16) for i in range(3)}})


def concurrency(server: SglangServer, n: int, max_tokens: int = 48) -> dict:
    """``n`` ordinary requests sent together, long enough that a snapshot of the scheduler (every 15 decode
    steps) sees every one it runs at once."""
    return _together(server, {i: (token_ids(20, i + 7), max_tokens) for i in range(n)})


def disconnects(server: SglangServer) -> dict:
    """Write-up 000 §10: a client that goes away mid-decode. A streaming client closes its connection after a
    few chunks, a non-streaming one closes its socket; each leaves once a fresh snapshot shows its request
    running. For each: how long until the scheduler runs nothing and holds no KV (bounded); and, to compare,
    how long the same request takes uninterrupted."""
    n, max_tokens = LONG_DECODE
    out = {}
    body = {"model": str(server.model), "prompt": token_ids(n, 5), "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}
    # streaming: two chunks, then close
    with httpx.Client(timeout=BOUND, verify=shared_tls()) as client:
        with client.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as r:
            chunks, busy, since = 0, 0, time.time()
            for line in r.iter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    chunks += 1
                    now = loads(server)
                    # leave once a fresh snapshot shows the request decoding (published every 15 decode steps)
                    if chunks >= 2 and now["timestamp"] > since and now["num_running_reqs"] >= 1:
                        busy = now["num_running_reqs"]
                        break
    gone = time.monotonic()
    out["stream"] = {"chunks_read": chunks, "busy_when_left": busy, "after": settle(server, timeout=30.0)}
    out["stream"]["after"]["since_close"] = time.monotonic() - gone
    # non-streaming: the client gives up (closes its socket) once a fresh snapshot shows the request running
    # (a fixed client timeout can fire before a loaded box has even scheduled it)
    payload = json.dumps(body).encode()
    t0, since = time.monotonic(), time.time()
    with socket.create_connection(("127.0.0.1", server.port), timeout=BOUND) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        busy = 0
        while time.monotonic() - t0 < BOUND:
            now = loads(server)
            if now["timestamp"] > since and now["num_running_reqs"] >= 1:
                busy = now["num_running_reqs"]
                break
            time.sleep(0.2)
    out["timeout"] = {"busy_when_left": busy, "waited": time.monotonic() - t0,
                      "after": settle(server, timeout=30.0)}
    # and what an uninterrupted request of the same size costs here, to compare
    full = completion(server, token_ids(n, 5), max_tokens, ignore_eos=True)
    out["full_request_seconds"] = full["seconds"]
    out["full_request_tokens"] = (full.get("body") or {}).get("usage", {}).get("completion_tokens")
    return out


def alive(server: SglangServer) -> bool:
    """The server still serves: /health answers and an ordinary request completes."""
    try:
        if httpx.get(f"{server.url}/health", verify=shared_tls(), timeout=30).status_code != 200:
            return False
        return completion(server, token_ids(8, 3), 2, timeout=60)["status"] == 200
    except httpx.HTTPError:
        return False


def _raw(server: SglangServer, payload: bytes, *, content_type: str = "application/json", path="/v1/completions",
         timeout: float = 60.0):
    return httpx.post(f"{server.url}{path}", verify=shared_tls(), content=payload,
                      headers={"content-type": content_type}, timeout=timeout)


def _half_request(server: SglangServer, wait: float = 30.0) -> dict:
    """Headers and half the body, then silence: does the server drop the connection within ``wait`` s?"""
    body = json.dumps({"model": str(server.model), "prompt": "hello", "max_tokens": 2}).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=wait + 5)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[: len(body) // 2])
        t0 = time.monotonic()
        s.settimeout(wait)
        try:
            data = s.recv(4096)
            return {"dropped": True, "after": time.monotonic() - t0, "answer": data[:200].decode(errors="replace")}
        except TimeoutError:
            return {"dropped": False, "after": time.monotonic() - t0}
    finally:
        s.close()


# Issue 38 item 3: a prompt that fits the context with its budget (220 + 24 <= 256) but lies past the page-aligned
# input limit patch 0001 once used (192 at page 64) is served whole, as pristine serves it.
FITS = (220, 24)


def fits(server: SglangServer) -> dict:
    """The prompt that fits, greedy, ``max_tokens`` honoured: its status and usage."""
    n, max_tokens = FITS
    return {**completion(server, token_ids(n, 6), max_tokens, ignore_eos=True), "sent": n, "max_tokens": max_tokens}


def seconds_per_token(server: SglangServer, tokens: int = 8) -> float:
    """This server's decode time per token, measured now (prefill included: an over-estimate, as a bound wants)."""
    t0 = time.monotonic()
    r = completion(server, token_ids(8, 3), tokens, ignore_eos=True)
    if r["status"] != 200:
        raise AssertionError(f"the decode-rate probe was not served: {r}")
    return (time.monotonic() - t0) / tokens


def huge_max_tokens_timeout(s_per_token: float) -> float:
    """The wait for ``max_tokens-huge``: three times what its clamped decode takes at the measured rate."""
    return max(60.0, 3 * (CONTEXT - HUGE_MAX_TOKENS_PROMPT) * s_per_token + 30)


def malformed_cases(server: SglangServer, vocab: int, s_per_token: float = 1.0) -> dict:
    """Name -> a thunk sending one malformed request (issue 30 item 5). Token ids out of the vocabulary come
    last in :func:`malformed` (pristine, one of them ends the server). ``s_per_token``: the server's measured
    decode rate, which bounds the one request that legally decodes to the end of the context."""
    m = str(server.model)
    ok = {"model": m, "prompt": "hello", "max_tokens": 2, "temperature": 0.0}

    def comp(**kw):
        return lambda: server.post("/v1/completions", {**ok, **kw}, timeout=60)

    return {
        "n-oversized": comp(n=100000),
        "max_tokens-negative": comp(max_tokens=-5),
        "max_tokens-huge": lambda: server.post("/v1/completions", {
            **ok, "prompt": token_ids(HUGE_MAX_TOKENS_PROMPT, 4), "max_tokens": 10**12},
            timeout=huge_max_tokens_timeout(s_per_token)),
        "max_tokens-string": comp(max_tokens="many"),
        "stop-not-string": comp(stop=[1, 2]),
        "stop-huge-list": comp(stop=["x"] * 10000),
        "logprobs-over-limit": comp(logprobs=1000000),
        "temperature-negative": comp(temperature=-1.0),
        "top_p-out-of-range": comp(temperature=1.0, top_p=7.0),
        "empty-prompt-string": comp(prompt=""),
        "empty-prompt-ids": comp(prompt=[]),
        "prompt-null": comp(prompt=None),
        "prompt-nested-junk": comp(prompt=[[1, "a"], {"x": 1}]),
        "invalid-utf8-body": lambda: _raw(server, b'{"model": "m", "prompt": "\xff\xfe bad", "max_tokens": 2}'),
        "not-json": lambda: _raw(server, b"{this is not json"),
        "json-array-body": lambda: _raw(server, b"[1, 2, 3]"),
        # 2 MB of text is served (cut to the context); over the body limit is refused before it is parsed (the
        # scenarios lower it to BODY_LIMIT_MB; a 50 MB prompt grew the pristine server past 15 GB)
        "body-2mb": lambda: _raw(server, json.dumps({**ok, "prompt": "a " * (1024 * 1024)}).encode(), timeout=BOUND),
        "body-over-limit": lambda: _raw(server, json.dumps({**ok, "prompt": "a " * ((BODY_LIMIT_MB << 20) // 2 + 1)}
                                                            ).encode(), timeout=BOUND),
        "chat-messages-wrong-type": lambda: server.post("/v1/chat/completions",
                                                        {"model": m, "messages": "hi", "max_tokens": 2}, timeout=60),
        "chat-unknown-role": lambda: server.post("/v1/chat/completions", {
            "model": m, "messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2}, timeout=60),
        "generate-sampling-params-junk": lambda: server.post("/generate", {
            "text": "hello", "sampling_params": {"max_new_tokens": "x", "temperature": "hot"}}, timeout=60),
        "generate-no-input": lambda: server.post("/generate", {"sampling_params": {"max_new_tokens": 2}}, timeout=60),
        # token ids outside [0, vocab) or not integers: what patch 0005 refuses at intake
        "ids-equal-vocab": comp(prompt=[11, 12, vocab]),
        "ids-negative": comp(prompt=[11, 12, -1]),
        "ids-float": comp(prompt=[11, 12.5, 13]),
        "generate-ids-past-vocab": lambda: server.post("/generate", {
            "input_ids": [11, 12, 10**6], "sampling_params": {"max_new_tokens": 2}}, timeout=60),
        "batch-one-id-past-vocab": comp(prompt=[[11, 12, 13], [11, 12, 10**6]]),
        "ids-past-vocab": comp(prompt=[11, 12, 10**6]),
    }


LEAK_MARKERS = ("Traceback", 'File "', "site-packages", ".py\", line", "/sglang/srt/")


def malformed(server: SglangServer, vocab: int, *, stop_at_death: bool = True, skip=()) -> dict:
    """Each malformed request: its status, a bounded excerpt of the body, whether the body leaks traceback
    fragments or file paths, and whether the server still serves afterwards. Stops at the first request after
    which the server no longer serves (recorded as ``killed_by``); a half-sent request is sent first and waits
    beside the first cases."""
    # the half-sent request is an idle socket waiting on the server's clock: it waits beside the first cases
    # (the decode-rate probe, the small ones), not before them; it is over before a big body is sent (parsing
    # one could delay the server's answer to it)
    half: dict = {}

    def half_request():
        try:
            half.update(_half_request(server, wait=BODY_TIMEOUT_S + 10))
        except Exception as exc:  # raised in the caller's thread below
            half["raised"] = exc

    waiter = threading.Thread(target=half_request)
    waiter.start()
    out = {"cases": {}, "killed_by": None, "s_per_token": seconds_per_token(server)}
    for name, send in malformed_cases(server, vocab, out["s_per_token"]).items():
        if name in skip:
            continue
        if name.startswith("body-"):
            waiter.join(BODY_TIMEOUT_S + 20)
        t0 = time.monotonic()
        try:
            r = send()
            text = r.text
            case = {"status": r.status_code, "body": text[:600],
                    "leaks": [m for m in LEAK_MARKERS if m in text]}
        except httpx.HTTPError as exc:
            case = {"status": None, "error": f"{type(exc).__name__}: {exc}"[:300], "leaks": []}
        case["seconds"] = time.monotonic() - t0
        case["alive_after"] = alive(server) if server.proc.poll() is None else False
        out["cases"][name] = case
        if not case["alive_after"]:
            out["killed_by"] = name
            if stop_at_death:
                break
    waiter.join(BODY_TIMEOUT_S + 20)
    if "raised" in half:
        raise half["raised"]
    out["half_request"] = half
    return out


def wait_dead(server: SglangServer, timeout: float = BOUND) -> dict:
    """After a request that may have killed the server: does its launcher exit within ``timeout``?"""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if server.proc.poll() is not None:
            return {"exited": True, "code": server.proc.returncode, "seconds": time.monotonic() - t0}
        time.sleep(POLL_S)
    return {"exited": False, "seconds": time.monotonic() - t0}
