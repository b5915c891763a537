"""What the ``patched-chunked`` scenario sends and measures (issue 26 items 4 and 5); nothing here asserts.

- :func:`abort_mid_prefill` with :func:`together`: one long prompt sent first on a raw socket and closed (the
  client goes away) while vLLM is still prefilling it chunk by chunk, and three more long prompts at once;
- :class:`RssSampler`: the worker's ``VmRSS`` from ``/proc`` every half second, from before the first request;
- :func:`start_watch` / :func:`run_validate`: the kit's own ``vllm-ple-offload watch`` and ``validate``, the real
  CLIs, in the vLLM venv, against the running server.

Every wait is bounded; a request that never answers is recorded as such.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx

from ..e2e.probes import token_ids
from ..e2e.server import shared_tls
from .server import SERVED_NAME, VllmServer

BOUND = 300.0  # seconds any one request may take here (a 56-token prefill is ~15 s on 2 busy cores)


def worker_pid(server: VllmServer) -> int | None:
    """The model worker of the server's group (vLLM titles it ``VLLM::Worker``)."""
    for pid, cmd in server.group_pids().items():
        if cmd.startswith("VLLM::Worker"):
            return pid
    return None


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class RssSampler(threading.Thread):
    """``VmRSS`` of one process every ``period`` seconds until :meth:`stop`; ``samples`` are (seconds, KiB)."""

    def __init__(self, pid: int, period: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.period = pid, period
        self.samples: list[tuple[float, int]] = []
        self._halt = threading.Event()
        self._t0 = time.monotonic()
        first = rss_kib(pid)  # the baseline: taken before the thread (and any request) starts
        if first is not None:
            self.samples.append((0.0, first))

    def run(self) -> None:
        while not self._halt.wait(self.period):
            kib = rss_kib(self.pid)
            if kib is None:
                return
            self.samples.append((time.monotonic() - self._t0, kib))

    def stop(self) -> dict:
        self._halt.set()
        self.join(5)
        kib = [k for _, k in self.samples]
        return {"pid": self.pid, "samples": len(kib), "baseline_kib": kib[0] if kib else None,
                "peak_kib": max(kib) if kib else None, "last_kib": kib[-1] if kib else None,
                "seconds": self.samples[-1][0] if self.samples else 0.0}


def completion(server: VllmServer, prompt, max_tokens: int, timeout: float = BOUND) -> dict:
    """One greedy ``/v1/completions``: status, the answer's fields the tests read, seconds."""
    t0 = time.monotonic()
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True}
    try:
        r = httpx.post(f"{server.url}/v1/completions", verify=shared_tls(), json=body, timeout=timeout)
        out = {"status": r.status_code, "seconds": time.monotonic() - t0}
        if r.status_code == 200:
            choice = r.json()["choices"][0]
            out.update(finish_reason=choice["finish_reason"], token_ids=choice.get("token_ids"),
                       prompt_token_ids=choice.get("prompt_token_ids"))
        else:
            out["text"] = r.text[:500]
        return out
    except httpx.HTTPError as exc:
        return {"status": None, "error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - t0}


class abort_mid_prefill:  # noqa: N801 - used as a context manager, reads like a phrase
    """Sends ``prompt`` (token ids) on a raw socket on entry and closes the socket ``after`` seconds later on
    exit (or at once if that time has passed): the client goes away while vLLM prefills it (chunks of
    ``--max-num-batched-tokens``, one step each, seconds apiece here). What came back before the close is kept."""

    def __init__(self, server: VllmServer, prompt: list[int], max_tokens: int, after: float):
        self.server, self.prompt, self.max_tokens, self.after = server, prompt, max_tokens, after
        self.result: dict = {}

    def __enter__(self):
        body = json.dumps({"model": SERVED_NAME, "prompt": self.prompt, "max_tokens": self.max_tokens,
                           "temperature": 0.0}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{self.server.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        self.sock = socket.create_connection(("127.0.0.1", self.server.port), timeout=10)
        self.sock.sendall(head + body)
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc):
        time.sleep(max(0.0, self.after - (time.monotonic() - self.t0)))
        self.sock.setblocking(False)
        try:
            answered = self.sock.recv(65536)
        except (BlockingIOError, OSError):
            answered = b""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.result = {"closed_after_s": time.monotonic() - self.t0, "answered_before_close": answered.decode(
            errors="replace")[:300]}
        return False


def together(server: VllmServer, cases: dict) -> dict:
    """``cases`` (label -> (prompt ids, max_tokens)) sent at once; each one's outcome."""
    results: dict = {}

    def send(label, prompt, max_tokens):
        results[label] = completion(server, prompt, max_tokens)

    threads = [threading.Thread(target=send, args=(label, *args)) for label, args in cases.items()]
    for t in threads:
        t.start()
    return {"threads": threads, "results": results}


def join(sent: dict) -> dict:
    for t in sent["threads"]:
        t.join(BOUND + 10)
    return sent["results"]


def kit_cli(python: str, env: dict, *args: str) -> list[str]:
    return [python, "-m", "vllm_ple_offload.cli", *args]


def start_watch(python: str, env: dict, url: str, sidecar: Path, out: Path, interval: float,
                samples: int) -> tuple[subprocess.Popen, float]:
    """``vllm-ple-offload watch`` in the background (it stops by itself after ``samples``)."""
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(kit_cli(python, env, "watch", "--url", f"{url}/v1", "--model", str(sidecar), "--out",
                                    str(out), "--interval", str(interval), "--samples", str(samples)),
                            stdout=open(out / "stdout.txt", "w"), stderr=open(out / "stderr.txt", "w"), env=env)
    return proc, time.monotonic()


def finish_watch(proc: subprocess.Popen, out: Path, t0: float, timeout: float) -> dict:
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait(10)
    lines = (out / "watch.jsonl").read_text().splitlines() if (out / "watch.jsonl").exists() else []
    return {"rc": rc, "seconds": time.monotonic() - t0, "stderr": (out / "stderr.txt").read_text(),
            "stdout": (out / "stdout.txt").read_text(), "samples": [json.loads(line) for line in lines]}


def run_validate(python: str, env: dict, url: str, out: Path, *args: str) -> dict:
    t0 = time.monotonic()
    r = subprocess.run(kit_cli(python, env, "validate", "--url", f"{url}/v1", "--model", SERVED_NAME, "--out",
                               str(out), "-q", *args), capture_output=True, text=True, env=env, timeout=900)
    return {"rc": r.returncode, "stdout": r.stdout, "stderr": r.stderr, "out": out,
            "seconds": time.monotonic() - t0}


__all__ = ["RssSampler", "abort_mid_prefill", "completion", "finish_watch", "join", "run_validate", "start_watch",
           "together", "token_ids", "worker_pid"]
