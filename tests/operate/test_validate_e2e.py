"""The validation suite against a REAL OpenAI-compatible server (``transformers serve``, CPU, loopback).

The model has random weights, so the expected verdicts are the honest ones for such a server:
no recall, no structured tool calls, no truncation (transformers serve does not truncate),
whitespace-only output. What is proven: streaming and non-streaming requests, finish_reason
``length``, usage accounting, the report files, and that a killed or frozen server ends the
run with a report instead of a hang.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from sglang_ssd_stream.operate.errors import ServerUnreachable
from sglang_ssd_stream.operate.validate.runner import run_validation
from sglang_ssd_stream.operate.validate.suites import Settings

from .conftest import SIDES
from .server import Server, free_port, make_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def server(tiny_model, tmp_path):
    s = Server(tiny_model, tmp_path)
    try:
        s.wait_ready()
        yield s
    finally:
        s.close()


def _settings(**kw):
    base = dict(context_length=600, answer_tokens=8, cycles=1, soak_tokens=64, continue_tokens=8, compact_tokens=8,
                turns=8, turn_tokens=8, canary_tokens=40, kv_zero_wait_s=2, progress=False)
    base.update(kw)
    return Settings(**base)


def test_full_run_against_real_server(server, tmp_path):
    events = []
    r = run_validation(server.url, server.model, _settings(), out_dir=str(tmp_path / "out"), timeout_s=60,
                       on_event=lambda name, data: events.append((name, data)))
    suites = r["suites"]
    assert list(suites) == ["needle", "truncation", "soak", "matrix", "canary"]
    # needle: streamed, prompts grow to the context limit, nothing recalled by random weights
    needle = suites["needle"]["checks"]
    # from the shortest needle prompt (template + question + needles, measured) to 600 - 8 - 16
    floor = r["calibration"]["template_tokens"] + suites["needle"]["fixed_tokens"]
    assert suites["needle"]["floor_tokens"] == floor and 0 < floor < 200
    assert [c["target_tokens"] for c in needle] == [floor + int((576 - floor) * f)
                                                    for f in (1 / 8, 1 / 4, 1 / 2, 3 / 4, 15 / 16, 1)]
    sizes = [c["prompt_tokens"] for c in needle]
    assert sizes == sorted(sizes) and sizes[-1] <= 600 - 8 and sizes[-1] > 450
    # the prompts that went out track the targets (question and needles are costed on the server)
    assert all(abs(c["prompt_tokens"] - c["target_tokens"]) <= max(6, c["target_tokens"] // 10) for c in needle), sizes
    assert all(c["finish_reason"] == "length" and c["ttft_s"] is not None for c in needle)
    assert suites["needle"]["status"] == "fail" and not any(any(c["recalled"]) for c in needle)
    # truncation: finish_reason=length with the 8-token budget kept, but transformers serve does not truncate
    t = {c["check"]: c for c in suites["truncation"]["checks"]}
    assert t["finish_reason=length"]["status"] == "pass"
    assert t["output budget kept"]["status"] == "pass"
    assert t["fits the window"]["status"] == "fail" and "vs context 600" in t["fits the window"]["detail"]
    assert t["KV returns to zero"]["status"] == "unknown"
    assert t["short request afterwards"]["status"] == "pass"
    # soak: 2 sessions x 1 cycle x (continue, compress)
    soak = suites["soak"]
    assert soak["completed"] == soak["planned"] == 4 and soak["status"] == "pass"
    assert (soak["per_session_tokens"], soak["continue_tokens"], soak["compact_tokens"]) == (64, 8, 8)
    # matrix: 8 cells x 8 agent turns; tools-on cells fail without structured tool calls
    cells = suites["matrix"]["checks"]
    assert len(cells) == 8 and all(c["turns"] == 8 for c in cells)
    assert {(c["tools"], c["status"]) for c in cells} == {(True, "fail"), (False, "pass")}
    assert all("no structured tool_calls with tools on" in c["problems"] for c in cells if c["tools"])
    assert all(c["prompt_tokens"] == sorted(c["prompt_tokens"]) for c in cells)  # history grows each turn
    # canary: 40 generated tokens of whitespace is flagged
    assert all("40 tokens produced no visible text" in c["problems"] for c in suites["canary"]["checks"])
    assert r["status"] == "fail" and r["aborted"] is None
    # report files
    doc = json.loads((tmp_path / "out" / "report.json").read_text())
    assert doc["status"] == "fail" and doc["plot"] == "written"
    assert (tmp_path / "out" / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| needle | fail | 0/6 checks passed |" in md and "## Reasoning x tools" in md
    assert sum(1 for name, _ in events if name == "reply") >= 6 + 2 + 4 + 64 + 3


def test_server_killed_mid_stream_reports_and_ends(server, tmp_path):
    """SIGKILL the server when the first needle stream chunk arrives: the run finishes with a report."""
    killed = threading.Event()

    def on_event(name, data):
        if name == "reply" and not killed.is_set():
            server.kill()
            killed.set()

    t0 = time.monotonic()
    r = run_validation(server.url, server.model, _settings(), suites=("needle", "truncation", "matrix"),
                       out_dir=str(tmp_path / "out"), timeout_s=30, on_event=on_event)
    assert time.monotonic() - t0 < 60
    assert killed.is_set() and r["aborted"].startswith("server stopped answering")
    needle = r["suites"]["needle"]["checks"]
    assert needle[1]["error"] is not None and "Connection" in needle[1]["error"]
    assert all(c["status"] == "skipped" for c in needle[2:])
    assert r["suites"]["needle"]["status"] in ("fail", "incomplete")
    assert r["suites"]["matrix"]["status"] == "incomplete"
    assert r["status"] == "fail"
    assert "Aborted: server stopped answering" in (tmp_path / "out" / "report.md").read_text()


def test_frozen_server_times_out_instead_of_hanging(server, tmp_path):
    """SIGSTOP: connections are accepted by the kernel but never answered; the per-request timeout ends it."""
    frozen = threading.Event()

    def on_event(name, data):
        if name == "reply" and not frozen.is_set():
            server.freeze()
            frozen.set()

    t0 = time.monotonic()
    r = run_validation(server.url, server.model, _settings(), suites=("needle", "canary"),
                       out_dir=str(tmp_path / "out"), timeout_s=3, on_event=on_event)
    took = time.monotonic() - t0
    assert took < 45, took
    assert r["aborted"] and "Timeout" in r["aborted"]
    assert r["suites"]["canary"]["status"] == "incomplete"


def test_no_server_is_unreachable(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(ServerUnreachable, match="did not answer a 1-token request"):
        run_validation(url, "m", _settings(), out_dir=str(tmp_path / "out"), timeout_s=5)


def test_validate_command_exit_codes(server, tmp_path, capsys):
    import argparse

    from sglang_ssd_stream.operate import add_operate_commands
    from sglang_ssd_stream.operate.errors import ValidationFailed

    p = argparse.ArgumentParser()
    add_operate_commands(p.add_subparsers(dest="command", required=True), SIDES["sglang"])
    args = p.parse_args(["validate", "--url", server.url, "--model", server.model, "--suite", "soak",
                         "--context-length", "600", "--soak-tokens", "64", "--cycles", "1", "--continue-tokens", "4",
                         "--compact-tokens", "4", "--kv-wait", "1", "--out", str(tmp_path / "o"), "-q"])
    assert args.func(args) == 0
    assert "soak: pass" in capsys.readouterr().out
    args = p.parse_args(["validate", "--url", server.url, "--model", server.model, "--suite", "canary",
                         "--context-length", "600", "--canary-tokens", "40", "--out", str(tmp_path / "o2"), "-q"])
    with pytest.raises(ValidationFailed) as exc:
        args.func(args)
    assert exc.value.exit_code == 1
    args = p.parse_args(["validate", "--url", server.url, "--model", server.model, "--suite", "bogus",
                         "--context-length", "600"])
    assert args.func(args) == 64
    # /v1/models of transformers serve has no max_model_len: the context must then be given
    args = p.parse_args(["validate", "--url", server.url, "--model", server.model, "--suite", "canary"])
    with pytest.raises(ServerUnreachable, match="pass --context-length"):
        args.func(args)
