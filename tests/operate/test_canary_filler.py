"""Canary rules and the deterministic filler, on exact inputs."""

from __future__ import annotations

import math

from sglang_ssd_stream.operate.validate import canary
from sglang_ssd_stream.operate.validate.filler import Filler, needle_codes, with_needles


def test_token_id_zero_run_detected():
    r = canary.check(text="", token_ids=[5, 0, 0, 0, 0, 0, 0, 0, 0, 9])
    assert r.unit == "token_id" and r.zero_run == 8 and r.problems == ["token-id-0 run of 8 (token_id)",
                                                                        ]


def test_bang_run_is_token_zero_without_ids():
    r = canary.check(text="ok" + "!" * 8)
    assert r.problems == ["token-id-0 run of 8 (char)"]
    assert canary.check(text="ok!!!!!!!").ok  # 7 is below the limit


def test_nan_logprobs_detected():
    r = canary.check(text="a b", tokens=["a", " b"], logprobs=[-0.1, math.nan])
    assert r.problems == ["1 NaN/+Inf log-probabilities"]


def test_degenerate_repetition():
    r = canary.check(text="", tokens=["x"] * 32)
    assert r.problems == ["degenerate repetition: 'x' x 32 (token)"]
    assert canary.check(text="", tokens=["x"] * 31).ok


def test_tokens_without_visible_text():
    assert canary.check(text="\n\n", completion_tokens=40).problems == ["40 tokens produced no visible text"]
    assert canary.check(text="\n\n", completion_tokens=15).ok


def test_filler_is_deterministic_and_prefix_stable():
    a, b = Filler(3), Filler(3)
    assert a.text(5000) == b.text(5000)
    assert a.text(100) == b.text(5000)[:100]
    assert Filler(4).text(200) != a.text(200)


def test_needles_at_depths():
    body = Filler(1).text(10_000)
    codes = needle_codes(1)
    text = with_needles(body, (0.1, 0.5, 0.9), codes)
    for i, (code, depth) in enumerate(zip(codes, (0.1, 0.5, 0.9), strict=False), 1):
        pos = text.index(f"The secret code number {i} is {code}.")
        assert abs(pos / len(text) - depth) < 0.02
    assert len(set(codes)) == 3 and needle_codes(1) == codes


def test_latency_chart_without_matplotlib(tmp_path, monkeypatch):
    """The runtimes ship no matplotlib: the report then carries the curve as text instead of no plot."""
    import builtins
    import json as _json

    from sglang_ssd_stream.operate.validate import report

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    checks = [{"prompt_tokens": n, "target_tokens": n, "latency_s": s, "status": "pass", "recalled": [True]}
              for n, s in ((1000, 0.5), (4000, 2.0))]
    results = {"model": "m", "url": "http://127.0.0.1:1/v1", "status": "pass",
               "suites": {"needle": {"status": "pass", "checks": checks}}}
    files = report.write(results, tmp_path)
    assert files["plot"] is None and results["plot"].startswith("text chart")
    chart = (tmp_path / "latency.txt").read_text()
    assert "1,000 | " + "#" * 12 + " 0.50 s" in chart and "4,000 | " + "#" * 50 + " 2.00 s" in chart
    assert "4,000 | " in (tmp_path / "report.md").read_text()
    assert _json.loads((tmp_path / "report.json").read_text())["plot"].startswith("text chart")
