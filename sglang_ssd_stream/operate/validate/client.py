"""One request = one ``Reply`` record, whatever happens: the suites never see an exception.

Uses the ``openai`` client with retries off and a per-request timeout, so a killed or frozen
server costs at most that timeout per request and the run always ends with a report.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field


@dataclass
class Reply:
    ok: bool
    error: str | None = None
    finish_reason: str | None = None
    content: str = ""
    reasoning: str = ""
    tool_calls: list = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    latency_s: float = 0.0
    ttft_s: float | None = None
    chunks: int = 0
    token_ids: list | None = None
    tokens: list | None = None
    logprobs: list | None = None
    status: int | None = None  # the HTTP status of a refused request (e.g. 400)

    def brief(self) -> dict:
        d = asdict(self)
        for k in ("token_ids", "tokens", "logprobs"):
            d.pop(k)
        d["content"] = self.content[:200]
        d["reasoning"] = self.reasoning[:200]
        return d


def _root(url: str) -> str:
    return re.sub(r"/v1/?$", "", url.rstrip("/"))


class Client:
    def __init__(self, url: str, model: str, *, api_key: str | None = None, timeout_s: float = 600.0):
        import httpx
        import openai

        self.url, self.model, self.timeout_s = url.rstrip("/"), model, timeout_s
        self._oa = openai.OpenAI(base_url=self.url, api_key=api_key or "EMPTY", timeout=timeout_s, max_retries=0)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=_root(url), timeout=min(timeout_s, 10.0), headers=headers)
        self._kv_source: str | None = None  # "loads" | "metrics" | "none", learned on first use

    def close(self) -> None:
        self._http.close()
        self._oa.close()

    def models(self) -> list[dict]:
        """``/v1/models`` entries; raises on failure (used to prove the server answers at all)."""
        r = self._http.get("/v1/models")
        r.raise_for_status()
        return r.json().get("data", [])

    def alive(self) -> bool:
        import httpx

        for path in ("/health", "/v1/models"):
            try:
                if self._http.get(path).status_code < 500:
                    return True
            except httpx.HTTPError:
                continue
        return False

    def kv_usage(self) -> dict | None:
        """Used/total KV tokens where the server exposes them: sglang ``/v1/loads``, vLLM ``/metrics``."""
        import httpx

        if self._kv_source == "none":
            return None
        try:
            if self._kv_source in (None, "loads"):
                r = self._http.get("/v1/loads")
                if r.status_code == 200 and r.json().get("loads"):
                    loads = r.json()["loads"]
                    self._kv_source = "loads"
                    return {"used_tokens": sum(x.get("num_used_tokens", 0) for x in loads),
                            "total_tokens": sum(x.get("max_total_num_tokens", 0) for x in loads),
                            "running": sum(x.get("num_running_reqs", 0) for x in loads)}
            if self._kv_source in (None, "metrics"):
                r = self._http.get("/metrics")
                m = (re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} ([0-9.eE+-]+)$", r.text, re.M)
                     if r.status_code == 200 else None)
                if m:
                    self._kv_source = "metrics"
                    run = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.eE+-]+)$", r.text, re.M)
                    return {"used_fraction": float(m.group(1)), "running": float(run.group(1)) if run else None}
        except (httpx.HTTPError, ValueError):
            return None  # transient: try the same source again next time
        if self._kv_source is None:
            self._kv_source = "none"
        return None

    def chat(self, messages: list[dict], *, max_tokens: int, stream: bool = False, tools: list | None = None,
             thinking: bool | None = None, logprobs: bool = False, temperature: float = 0.0,
             on_chunk=None) -> Reply:
        extra: dict = {}
        if thinking is not None:
            extra["chat_template_kwargs"] = {"enable_thinking": thinking}
        kwargs = dict(model=self.model, messages=messages, max_tokens=max_tokens, temperature=temperature,
                      extra_body=extra or None)
        if tools:
            kwargs["tools"] = tools
        if logprobs:
            kwargs["logprobs"] = True
        t0 = time.monotonic()
        try:
            if stream:
                return self._stream(kwargs, t0, on_chunk)
            resp = self._oa.chat.completions.create(**kwargs)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a Reply (see module docstring)
            return Reply(ok=False, error=f"{type(exc).__name__}: {exc}"[:500], latency_s=time.monotonic() - t0,
                         status=getattr(exc, "status_code", None))
        choice = resp.choices[0] if resp.choices else None
        if choice is None:
            return Reply(ok=False, error="no choices in response", latency_s=time.monotonic() - t0)
        msg = choice.message
        reply = Reply(ok=True, finish_reason=choice.finish_reason, content=msg.content or "",
                      reasoning=getattr(msg, "reasoning_content", None) or "",
                      tool_calls=[tc.model_dump() for tc in (msg.tool_calls or [])],
                      prompt_tokens=resp.usage.prompt_tokens if resp.usage else None,
                      completion_tokens=resp.usage.completion_tokens if resp.usage else None,
                      latency_s=time.monotonic() - t0)
        ids = getattr(choice, "token_ids", None) or (choice.model_extra or {}).get("token_ids")
        if ids is not None:
            reply.token_ids = list(ids)
        if choice.logprobs and choice.logprobs.content:
            reply.tokens = [c.token for c in choice.logprobs.content]
            reply.logprobs = [c.logprob for c in choice.logprobs.content]
        return reply

    def _stream(self, kwargs: dict, t0: float, on_chunk) -> Reply:
        reply = Reply(ok=False)
        parts, reasoning = [], []
        stream = self._oa.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
        try:
            for chunk in stream:
                reply.chunks += 1
                if chunk.usage:
                    reply.prompt_tokens = chunk.usage.prompt_tokens
                    reply.completion_tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    delta = choice.delta
                    if delta.content:
                        if reply.ttft_s is None:
                            reply.ttft_s = time.monotonic() - t0
                        parts.append(delta.content)
                    r = getattr(delta, "reasoning_content", None)
                    if r:
                        reasoning.append(r)
                    if delta.tool_calls:
                        reply.tool_calls.extend(tc.model_dump() for tc in delta.tool_calls)
                    if choice.finish_reason:
                        reply.finish_reason = choice.finish_reason
                if on_chunk is not None:
                    on_chunk(reply)
        except Exception as exc:  # noqa: BLE001
            reply.error = f"stream broke after {reply.chunks} chunks: {type(exc).__name__}: {exc}"[:500]
        finally:
            stream.close()
        reply.content, reply.reasoning = "".join(parts), "".join(reasoning)
        reply.latency_s = time.monotonic() - t0
        if reply.error is None and reply.finish_reason is None:
            reply.error = f"stream ended after {reply.chunks} chunks without a finish_reason"
        reply.ok = reply.error is None
        return reply


def tool_schema() -> list[dict]:
    """The write-up's probe tool (000 §10: ``shell_probe``), harmless by construction."""
    return [{"type": "function", "function": {
        "name": "shell_probe", "description": "Report a fact about the working directory.",
        "parameters": {"type": "object", "properties": {"question": {"type": "string"}}, "required": ["question"]}}}]


def dumps(obj) -> str:
    return json.dumps(obj, indent=2, default=str)
