"""The kit's ``ssd_stream_*`` series from this worker (:mod:`sglang_ssd_stream.ple_metrics`), in vLLM's ``/metrics``.

vLLM 0.33.0 serves ``/metrics`` from its API server process, while the PLE lookups run in the worker (the engine
core's process, or one per TP rank). Their values meet only in prometheus_client's multiprocess mode, which vLLM
turns on itself with ``--api-server-count`` > 1 (``v1/metrics/prometheus.py``: ``setup_multiprocess_prometheus``
before it starts the engine), or when ``PROMETHEUS_MULTIPROC_DIR`` names an empty directory before ``vllm serve``
starts (its registry reads that directory at each scrape). Otherwise the series are not exported: one log line
says so, and nothing of prometheus_client is imported on their account.
"""

from __future__ import annotations


def _ranks() -> tuple[int | None, int | None]:
    """This worker's TP and PP ranks (None: no distributed groups, as in tests)."""
    try:
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
    except (AssertionError, ImportError, RuntimeError, AttributeError):
        return None, None


def process_metrics():
    """This process's :class:`~sglang_ssd_stream.ple_metrics.publish.PleMetrics` (its periodic publish started),
    or None when vLLM's metrics cannot carry them."""
    from sglang_ssd_stream.ple_metrics.publish import for_process

    tp, pp = _ranks()
    metrics = for_process("vllm", tp_rank=tp, pp_rank=pp)
    if metrics is not None:
        metrics.start()  # once: a started publish is left as it is
    return metrics


def watch_layer(layer: int, cache, gather) -> None:
    """Publish one streamed PLE layer: its row cache's counts (``cache``: None without one) and the gather's
    per-lookup times."""
    metrics = process_metrics()
    if metrics is not None:
        metrics.layer(layer, cache, gather)


def watch_hot(hot) -> None:
    """After the hot file's load: its rows (or an ignored file), then each write."""
    metrics = process_metrics()
    if metrics is not None:
        metrics.hot_loaded(hot)
