"""The Grafana dashboard (scripts/grafana/ssd-stream-ple.json): every query names series that exist, with labels
they carry. The kit's names come from its series table; the engines' from the names ``watch`` reads, which
tests/operate/test_watch.py and tests/vllm/test_watch_metrics.py take from sglang's and vLLM's own collectors."""

from __future__ import annotations

import json
import re
from pathlib import Path

from sglang_ssd_stream.ple_metrics import series as S
from sglang_ssd_stream.sglang.side import METRICS as SGLANG
from vllm_ple_offload.metrics import METRICS as VLLM

DASHBOARD = Path(__file__).resolve().parents[2] / "scripts" / "grafana" / "ssd-stream-ple.json"
NAME = re.compile(r"\b(ssd_stream_\w+|sglang:\w+|vllm:\w+)")
# An engine's series as the dashboard names it: either spelling, since prometheus_client 0.26 escapes ':' to '_'
# when Prometheus 2 negotiates OpenMetrics (what Prometheus stores then is sglang_token_usage)
ENGINE_NAME = re.compile(r'\{__name__=~\\?"(sglang|vllm)\[:_\](\w+)\\?"\}')


def _names(expr: str) -> list[str]:
    """The series ``expr`` reads, an engine's under its own name (``sglang:token_usage``)."""
    return NAME.findall(ENGINE_NAME.sub("", expr)) + [f"{e}:{n}" for e, n in ENGINE_NAME.findall(expr)]


def _exprs() -> list[tuple[str, str]]:
    d = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in d["panels"] for t in p["targets"]]


def _kit_samples() -> dict[str, tuple[str, ...]]:
    out = {}
    for s in S.ALL:
        if s.kind == "counter":
            out[s.sample] = s.labels
        else:
            out.update({s.name + "_sum": s.labels, s.name + "_count": s.labels, s.name + "_bucket": (*s.labels, "le")})
    return out


def _engine_names() -> set[str]:
    fields = ("kv_usage", "kv_used_tokens", "kv_total_tokens", "running", "waiting", "accept_length", "accept_rate",
              "drafts_total", "draft_tokens_total", "accepted_total", "generation_tokens_total", "gen_throughput")
    return {getattr(m, f) for m in (SGLANG, VLLM) for f in fields if getattr(m, f)}


def test_every_query_names_an_exported_series_and_its_labels():
    kit, engines = _kit_samples(), _engine_names()
    for title, expr in _exprs():
        # a bare sglang:/vllm: name misses what Prometheus 2 stores
        assert not re.search(r"\b(sglang|vllm):", ENGINE_NAME.sub("", expr)), (title, expr)
        names = _names(expr)
        assert names or "vector($" in expr, (title, expr)
        for name in names:
            assert name in kit or name in engines, (title, name)
            if name in kit:
                used = {lab for group in re.findall(r"by \(([^)]*)\)", expr) for lab in re.split(r"\s*,\s*", group)}
                used |= set(re.findall(r"[{,]\s*(\w+)\s*=~?", expr))
                assert used <= set(kit[name]), (title, name, used - set(kit[name]))


def test_the_issues_panels_are_there_and_their_variables_defined():
    exprs = " ".join(e + " " + " ".join(_names(e)) for _, e in _exprs())
    for needed in (S.HITS.sample, S.LOOKUPS.sample, S.BYTES_READ.sample, "$disk_mib_s", S.READS.sample,
                   "$disk_iops", S.EXPOSED_SECONDS.name + "_sum", S.HOT_LOADED.sample, S.HOT_WRITTEN.sample,
                   S.REFUSALS.sample, SGLANG.kv_usage, VLLM.kv_usage, SGLANG.accept_rate, VLLM.accepted_total,
                   VLLM.draft_tokens_total):
        assert needed in exprs, needed
    d = json.loads(DASHBOARD.read_text())
    defined = {v["name"] for v in d["templating"]["list"]}
    used = set(re.findall(r"\$(\w+)", json.dumps(d))) - {"__rate_interval", "__range", "__all"}
    assert used <= defined, used - defined
