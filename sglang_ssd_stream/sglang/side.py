"""The SGLang row of the shared operate commands (:class:`~sglang_ssd_stream.operate.side.EngineSide`)."""

from __future__ import annotations

from ..operate.metrics import MetricNames
from ..operate.side import EngineSide, console_script
from .settings import READ_WORKERS, ROW_CACHE_MB


def _preflight(**launch) -> list:
    from . import doctor  # looked up at call time: tests stand in a doctor by patching doctor.preflight

    return doctor.preflight(**launch)


def _loads(fetch) -> dict:
    """``/v1/loads`` (always served by sglang 0.5.23, without --enable-metrics): KV and running requests; its
    speculative accept length and rate are averages since the server started, so a decay shows late."""
    loads = fetch("/v1/loads?include=core,spec")["loads"]
    spec = [x.get("speculative") or {} for x in loads]
    used, total = sum(x.get("num_used_tokens", 0) for x in loads), sum(x.get("max_total_num_tokens", 0) for x in loads)
    return {"kv_usage": used / total if total else None, "kv_used_tokens": used, "kv_total_tokens": total,
            "running": sum(x.get("num_running_reqs", 0) for x in loads),
            "waiting": sum(x.get("num_waiting_reqs", 0) for x in loads),
            "accept_length": max((s["accept_length"] for s in spec if s.get("accept_length")), default=None),
            "accept_rate": max((s["accept_rate"] for s in spec if s.get("accept_rate") is not None), default=None),
            "gen_tokens_per_s": sum(x.get("gen_throughput", 0.0) for x in loads),
            "source": "/v1/loads (averages since start: pass --enable-metrics for the recent interval)"}


# sglang 0.5.23 observability/metrics_collector.py; served at /metrics with --enable-metrics.
METRICS = MetricNames(
    kv_usage="sglang:token_usage", kv_used_tokens="sglang:kv_used_tokens",
    kv_total_tokens="sglang:max_total_num_tokens", running="sglang:num_running_reqs", waiting="sglang:num_queue_reqs",
    accept_length="sglang:spec_accept_length", accept_rate="sglang:spec_accept_rate",
    generation_tokens_total="sglang:generation_tokens_total", gen_throughput="sglang:gen_throughput",
    enable_hint="start sglang with --enable-metrics (the kit's SGLang profiles do)", fallback=_loads)

SIDE = EngineSide(
    name="sglang",
    display="SGLang",
    tool="sglang-ssd-stream",
    # sglang 0.5.23 warns that `python -m sglang.launch_server` is deprecated for `sglang serve` (same
    # arguments; it loads the plugins too, sglang/cli/serve.py).
    launcher=console_script("sglang", "serve"),
    preflight=_preflight,
    service="systemd",
    max_served_names=1,
    draft_option=True,
    update_model=True,
    install_hint="./install.sh --engine sglang",
    thread_knobs=((READ_WORKERS.name, READ_WORKERS.default),),  # the PLE sidecar's reader pool (mmap and pread)
    shown_env=("SGLANG_SSD_STREAM_", "SGLANG_PLUGINS", "SGLANG_QSA_", "SGLANG_EMPTY_CACHE_INTERVAL",
               "SGLANG_SANITIZE_NAN_LOGITS"),  # the kit's knobs and the variables the profiles set
    metrics=METRICS,
    row_cache_knob=(ROW_CACHE_MB.name, ROW_CACHE_MB.default),  # PLE rows in registered host memory, all layers
)
