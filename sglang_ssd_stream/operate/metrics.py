"""What an engine's metrics endpoint says about KV usage and MTP acceptance, read through the names each
adapter hands in (:class:`MetricNames` on :class:`~.side.EngineSide`); parsed with ``prometheus_client``.

Gauges are read as they are (SGLang reports accept length and rate over its last logging interval);
counters are turned into rates between two samples (vLLM counts drafts, draft tokens and accepted
tokens; acceptance over the interval is accepted / draft tokens and the accept length is
1 + accepted / drafts, the verify step's bonus token included, as SGLang's gauge counts it).
Neither sglang 0.5.23 nor vLLM 0.33.0 exports the PyTorch allocator's reserved bytes, so ``watch``
reads memory from the host instead (``/proc``, NVML on discrete GPUs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MetricNames:
    """Sample names on the engine's ``/metrics`` (None: the engine does not export it)."""

    kv_usage: str | None = None  # gauge, fraction 0..1 of the KV pool in use
    kv_used_tokens: str | None = None  # gauge
    kv_total_tokens: str | None = None  # gauge
    running: str | None = None  # gauge
    waiting: str | None = None  # gauge
    accept_length: str | None = None  # gauge: accepted tokens per verify step (bonus included)
    accept_rate: str | None = None  # gauge: accepted / proposed drafts
    drafts_total: str | None = None  # counter (verify steps)
    draft_tokens_total: str | None = None  # counter
    accepted_total: str | None = None  # counter
    generation_tokens_total: str | None = None  # counter
    gen_throughput: str | None = None  # gauge, tokens/s
    enable_hint: str = ""  # how to turn the endpoint on, when it needs a flag
    # When /metrics answers without these names: a second source, fetch(path) -> parsed JSON -> partial sample.
    fallback: Callable[[Callable[[str], Any]], dict] | None = None


SUMMED = ("_total", "_tokens", "_sum", "_count")  # counters, token counts, histograms' sums and counts


def parse(text: str) -> dict[str, float]:
    """Sample name -> value; samples of one name with several label sets (ranks, PLE layers) are summed for
    counters, token counts and histograms' sums and counts, and the largest is kept for fractions and rates (the
    worst rank)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(float(s.value))
    return {k: (sum(v) if k.endswith(SUMMED) else max(v)) for k, v in out.items()}


def _ple_totals() -> dict[str, str]:
    """The kit's own series ``watch`` reads (:mod:`..ple_metrics.series`): key -> sample name."""
    from ..ple_metrics import series as S

    return {"lookups": S.LOOKUPS.sample, "hits": S.HITS.sample, "rows_read": S.ROWS_READ.sample,
            "rows_ahead": S.AHEAD.sample, "reads": S.READS.sample, "bytes_read": S.BYTES_READ.sample,
            "exposed_s": S.EXPOSED_SECONDS.name + "_sum", "exposed_lookups": S.EXPOSED_SECONDS.name + "_count",
            "hot_rows_loaded": S.HOT_LOADED.sample, "hot_rows_written": S.HOT_WRITTEN.sample,
            "refusals": S.REFUSALS.sample}


def ple_sample(values: dict[str, float], previous: dict | None, dt: float | None) -> dict | None:
    """The PLE part of one ``watch`` sample from the kit's ``ssd_stream_*`` series (all layers and ranks summed):
    the totals, and over the interval since ``previous`` the hit rate, disk MiB/s and reads/s, the part of the
    rows read that the prefetch read, exposed ms per layer lookup and new refusals. None: no such series."""
    totals = {k: values[n] for k, n in _ple_totals().items() if n in values}
    if "lookups" not in totals:
        return None
    out: dict = {"totals": totals}
    prev = (previous or {}).get("totals") or {}
    if not prev or not dt or dt <= 0 or any(totals.get(k, 0) < v for k, v in prev.items()):
        return out  # no interval yet, or the server restarted (its counters fell)
    d = {k: totals.get(k, 0) - prev.get(k, 0) for k in totals}
    out.update(lookups_per_s=d["lookups"] / dt,
               hit_rate=d["hits"] / d["lookups"] if d["lookups"] else None,
               disk_mib_per_s=d.get("bytes_read", 0) / dt / 2**20, disk_reads_per_s=d.get("reads", 0) / dt,
               ahead_share=d.get("rows_ahead", 0) / d["rows_read"] if d.get("rows_read") else None,
               exposed_ms_per_lookup=(1e3 * d["exposed_s"] / d["exposed_lookups"] if d.get("exposed_lookups")
                                      else None),
               new_refusals=d.get("refusals", 0))
    return out


def engine_sample(names: MetricNames, values: dict[str, float], previous: dict | None, dt: float | None) -> dict:
    """The engine part of one ``watch`` sample (None where the engine exported nothing)."""

    def get(name):
        return values.get(name) if name else None

    s = {"kv_usage": get(names.kv_usage), "kv_used_tokens": get(names.kv_used_tokens),
         "kv_total_tokens": get(names.kv_total_tokens), "running": get(names.running),
         "waiting": get(names.waiting), "accept_length": get(names.accept_length),
         "accept_rate": get(names.accept_rate), "gen_tokens_per_s": get(names.gen_throughput),
         "counters": {k: values[n] for k, n in (("drafts", names.drafts_total),
                                                 ("draft_tokens", names.draft_tokens_total),
                                                 ("accepted", names.accepted_total),
                                                 ("generated", names.generation_tokens_total)) if n and n in values}}
    if s["kv_usage"] is None and s["kv_used_tokens"] is not None and s["kv_total_tokens"]:
        s["kv_usage"] = s["kv_used_tokens"] / s["kv_total_tokens"]
    prev = (previous or {}).get("counters") or {}
    c = s["counters"]
    if prev and dt and dt > 0:
        def delta(k):
            return c[k] - prev[k] if k in c and k in prev and c[k] >= prev[k] else None  # a restart resets counters

        drafts, tokens = delta("drafts"), delta("draft_tokens")
        accepted, generated = delta("accepted"), delta("generated")
        if s["accept_rate"] is None and tokens and accepted is not None:
            s["accept_rate"] = accepted / tokens
        if s["accept_length"] is None and drafts and accepted is not None:
            s["accept_length"] = 1 + accepted / drafts
        if s["gen_tokens_per_s"] is None and generated is not None:
            s["gen_tokens_per_s"] = generated / dt
    return s
