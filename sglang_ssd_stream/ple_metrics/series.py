"""The kit's Prometheus series (``ssd_stream_*``): names, kinds, labels, buckets; one table for both engines.

Both adapters publish these through :mod:`.publish`, inside the engine's own ``/metrics`` (prometheus_client's
multiprocess mode, which sglang and vLLM use across their processes); the dashboard, ``watch`` and the docs read
the names from here. Stdlib only.

Where a kit object already counts, a series mirrors that count (``stat``: the :class:`~..sidecar.row_cache.RowCache`
statistic, :data:`..sidecar.row_cache.STAT_NAMES`) and is published as the count's increase since the last
publish, so a series equals the cache's own count at each publish by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "ssd_stream_"
LAYER_LABELS = ("engine", "layer", "tp_rank", "pp_rank")  # one PLE table of one rank
PROCESS_LABELS = ("engine", "tp_rank", "pp_rank")  # a serving process (its hot file covers all its layers)
ENGINES = ("sglang", "vllm")

# Seconds; a warm lookup of a 2,048-token chunk reads 32,768 rows from memory in about a millisecond, a cold one
# from NVMe takes tens, a hot-file write seconds.
LOOKUP_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)
WRITE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# What ``ssd_stream_refusals_total`` counts, by the error a serving process met (never free text: a label's
# values must stay few). A refusal at start (a table whose hash or shape differs) stops the process before its
# endpoint serves, so it is in the log, not here.
REFUSAL_REASONS = {
    "SidecarChanged": "table_changed",  # the table file was written while served
    "SidecarTruncated": "table_truncated",
    "SidecarRowOutOfRange": "row_out_of_range",  # an id outside the table (the lookup is refused, the server goes on)
    "SidecarIOError": "io_error",
    "SidecarReaderUnusable": "reader_unusable",  # a lookup after an earlier fatal failure
}
HOT_FILE_IGNORED = "hot_file_ignored"  # a hot file that failed a check at start (the cache starts cold)
REASONS = (*REFUSAL_REASONS.values(), HOT_FILE_IGNORED)


@dataclass(frozen=True)
class Series:
    name: str
    kind: str  # "counter" or "histogram"
    doc: str
    labels: tuple[str, ...] = LAYER_LABELS
    stat: str | None = None  # the RowCache statistic it mirrors
    buckets: tuple[float, ...] | None = None

    @property
    def sample(self) -> str:
        """The sample name a scrape shows (a counter's ``_total``; a histogram's ``_count``)."""
        return self.name + ("_total" if self.kind == "counter" else "_count")


def _c(short: str, doc: str, stat: str | None = None, labels: tuple[str, ...] = LAYER_LABELS) -> Series:
    return Series(PREFIX + short, "counter", doc, labels, stat)


def _h(short: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = LAYER_LABELS) -> Series:
    return Series(PREFIX + short, "histogram", doc, labels, None, buckets)


# Row-cache counters: each the increase of one RowCache statistic (rows_read - prefetch_rows for on-demand rows).
LOOKUPS = _c("lookups", "PLE rows looked up by forwards (this rank's rows; hits + misses)", "lookups")
HITS = _c("row_cache_hits", "PLE row lookups served from the row cache (a row being filled counts once it is)", "hits")
MISSES = _c("row_cache_misses", "PLE row lookups the row cache had to read from the table", "miss_lookups")
ROWS_READ = _c("disk_rows_read", "PLE rows read from the table file (on demand and ahead)", "rows_read")
PAGES_READ = _c("disk_pages_read", "4 KiB pages read from the table file", "pages_read")
READS = _c("disk_reads", "read calls on the table file (coalesced runs of pages: the disk's IOPS)", "reads")
BYTES_READ = _c("disk_read_bytes", "bytes read from the table file (pages x 4,096)", "bytes_read")
AHEAD = _c("rows_fetched_ahead", "PLE rows read by the prefetch before a forward asked (prompt chunks, MTP drafts)",
           "prefetch_rows")
ON_DEMAND = _c("rows_fetched_on_demand", "PLE rows a forward had to read itself (rows read - rows fetched ahead)")
AHEAD_USED = _c("rows_fetched_ahead_used", "rows fetched ahead that a forward then looked up", "prefetch_hits")
EVICTIONS = _c("row_cache_evictions", "rows the row cache evicted", "evictions")
# Per eager lookup (a captured CUDA-graph replay runs no Python: its rows are in the counters above, not here).
READ_SECONDS = _h("read_seconds", "seconds one PLE lookup took to read its rows (cache and disk)", LOOKUP_BUCKETS)
EXPOSED_SECONDS = _h("exposed_seconds", "seconds a forward waited on one PLE layer's rows (the exposed time; on a "
                                        "CPU-only process the whole read)", LOOKUP_BUCKETS)
# The hot file (issue 27) and refusals, per process.
HOT_LOADED = _c("hot_rows_loaded", "rows placed into the row caches from the hot file at start", None, PROCESS_LABELS)
HOT_WRITTEN = _c("hot_rows_written", "rows written to the hot file (a file kept as it was writes none)", None,
                 PROCESS_LABELS)
HOT_WRITE_SECONDS = _h("hot_write_seconds", "seconds each write of the hot file took (ranking, writing, syncing)",
                       WRITE_BUCKETS, PROCESS_LABELS)
REFUSALS = _c("refusals", "sidecar refusals while serving, by reason", None, (*PROCESS_LABELS, "reason"))

ROW_CACHE_SERIES = (LOOKUPS, HITS, MISSES, ROWS_READ, PAGES_READ, READS, BYTES_READ, AHEAD, ON_DEMAND, AHEAD_USED,
                    EVICTIONS)
ALL = (*ROW_CACHE_SERIES, READ_SECONDS, EXPOSED_SECONDS, HOT_LOADED, HOT_WRITTEN, HOT_WRITE_SECONDS, REFUSALS)


def refusal_reason(exc: BaseException) -> str | None:
    """The ``reason`` label of a sidecar error (None: not a sidecar refusal), by class name along its MRO."""
    for cls in type(exc).__mro__:
        reason = REFUSAL_REASONS.get(cls.__name__)
        if reason is not None:
            return reason
    return None
