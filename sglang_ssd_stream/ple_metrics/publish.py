"""Publishing the kit's series (:mod:`.series`) from a serving process, into the engine's own ``/metrics``.

sglang (``--enable-metrics``) and vLLM (with ``PROMETHEUS_MULTIPROC_DIR`` set) run prometheus_client in
multiprocess mode: every process writes its values to files in ``$PROMETHEUS_MULTIPROC_DIR`` and the engine's
HTTP server merges them at each scrape (``MultiProcessCollector``). The PLE path runs in the model's process
(sglang's scheduler, vLLM's worker), so it publishes exactly when that mode is on in its process
(:func:`unavailable`), and never serves HTTP itself. prometheus_client is imported only then.

The row caches count in C (:attr:`~..sidecar.row_cache.RowCache.stats`); :class:`LayerPublisher` adds each
statistic's increase since its last publish to the series, every :data:`PUBLISH_INTERVAL_S` from a daemon thread
(and when :meth:`PleMetrics.publish` is called), so a series equals its cache's statistic as of the last publish.
A lookup itself only appends its two durations to a queue that the publish turns into histogram observations:
measured on the CPU box, observing and publishing inside the lookup cost 1.8 % of a warm 2,048-token lookup
(about 200 us: the lookup's 5 MiB copy leaves prometheus_client's code cold), the two appends about 4 us, under
0.5 % in all (``benchmarks/ple_metrics/``).
"""

from __future__ import annotations

import collections
import logging
import os
import threading

from . import series as S

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
PUBLISH_INTERVAL_S = 1.0  # the periodic publish; Prometheus scrapes every 15 s by default
QUEUED_MAX = 1 << 16  # durations held between two publishes (a lookup takes >= 50 us: 20,000 a second at most)

_families: dict[str, object] = {}
_families_lock = threading.Lock()


def unavailable() -> str | None:
    """Why this process cannot publish into the engine's endpoint (None: it can)."""
    where = os.environ.get(MULTIPROC_ENV)
    if not where:
        return f"{MULTIPROC_ENV} is not set in this process (the engine's metrics are not in multiprocess mode)"
    try:
        from prometheus_client import values
    except ImportError as exc:
        return f"prometheus_client cannot be imported ({exc})"
    if not getattr(values.ValueClass, "_multiprocess", False):
        return (f"prometheus_client was imported before {MULTIPROC_ENV} was set, so this process keeps its values in "
                f"memory, where the engine's endpoint cannot see them")
    if not os.path.isdir(where):
        return f"{MULTIPROC_ENV}={where} is not a directory"
    return None


def families() -> dict[str, object]:
    """The prometheus_client metric of every series, made once per process. Registered nowhere: in multiprocess
    mode a value lives in this process's files, which the engine's collector reads (and a second registration of
    one name in the default registry would raise)."""
    with _families_lock:
        if not _families:
            from prometheus_client import Counter, Histogram

            for s in S.ALL:
                if s.kind == "counter":
                    _families[s.name] = Counter(s.name, s.doc, s.labels, registry=None)
                else:
                    _families[s.name] = Histogram(s.name, s.doc, s.labels, registry=None, buckets=s.buckets)
        return _families


class LayerPublisher:
    """One PLE layer's series: its row cache's counts (``cache``: a RowCache, None without one) and the gather's
    per-lookup times (it is the gather's ``observer``: :meth:`read`, :meth:`waited`, :meth:`refused`)."""

    def __init__(self, metrics: PleMetrics, layer: int, cache=None):
        fam, labels = families(), {**metrics.labels, "layer": str(layer)}
        self.metrics, self.layer, self.cache = metrics, int(layer), cache
        self._stat_children = [(s.stat, fam[s.name].labels(**labels)) for s in S.ROW_CACHE_SERIES if s.stat]
        self._on_demand = fam[S.ON_DEMAND.name].labels(**labels)
        self._read = fam[S.READ_SECONDS.name].labels(**labels)
        self._exposed = fam[S.EXPOSED_SECONDS.name].labels(**labels)
        self._last: dict | None = None  # the statistics as last published (None: nothing yet, all zero)
        self._lock = threading.Lock()
        self._reads: collections.deque = collections.deque(maxlen=QUEUED_MAX)
        self._waits: collections.deque = collections.deque(maxlen=QUEUED_MAX)

    def publish(self) -> None:
        """Observe the queued durations and add the cache's increases since the last publish; a publish already
        under way elsewhere makes this one a no-op (that one carries the counts)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            for queue, child in ((self._reads, self._read), (self._waits, self._exposed)):
                while queue:
                    child.observe(queue.popleft())
            if self.cache is None:
                return
            now = self.cache.stats
            last = self._last or dict.fromkeys(now, 0)
            for stat, child in self._stat_children:
                d = now[stat] - last[stat]
                if d:
                    child.inc(d)
            d = (now["rows_read"] - now["prefetch_rows"]) - (last["rows_read"] - last["prefetch_rows"])
            if d:
                self._on_demand.inc(d)
            self._last = now
        finally:
            self._lock.release()

    # the gather's observer: called inside each lookup, so it only queues
    def read(self, seconds: float) -> None:
        self._reads.append(seconds)

    def waited(self, seconds: float) -> None:
        self._waits.append(seconds)

    def refused(self, exc: BaseException) -> None:
        self.metrics.refused(exc)


class PleMetrics:
    """This process's publishers: one per PLE layer, the hot file's, the refusals, and the periodic publish."""

    def __init__(self, engine: str, *, tp_rank: int | None, pp_rank: int | None):
        if engine not in S.ENGINES:
            raise ValueError(f"engine {engine!r}: expected one of {S.ENGINES}")
        self.labels = {"engine": engine, "tp_rank": "" if tp_rank is None else str(tp_rank),
                       "pp_rank": "" if pp_rank is None else str(pp_rank)}
        self.layers: dict[int, LayerPublisher] = {}
        fam = families()
        self._hot_loaded = fam[S.HOT_LOADED.name].labels(**self.labels)
        self._hot_written = fam[S.HOT_WRITTEN.name].labels(**self.labels)
        self._hot_seconds = fam[S.HOT_WRITE_SECONDS.name].labels(**self.labels)
        self._refusals = {r: fam[S.REFUSALS.name].labels(**self.labels, reason=r) for r in S.REASONS}
        self._hot_writes: collections.deque = collections.deque()  # (rows, seconds), published by publish()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def layer(self, layer: int, cache=None, gather=None) -> LayerPublisher:
        """The publisher of ``layer`` (its row cache's counts); made the ``gather``'s observer when given."""
        old = self.layers.get(layer)
        if old is not None:  # the model loaded again in this process: what the old cache counted stays in
            old.publish()
        pub = self.layers[layer] = LayerPublisher(self, layer, cache)
        if gather is not None:
            gather.observer = pub
        return pub

    def publish(self) -> None:
        for pub in list(self.layers.values()):
            pub.publish()
        while self._hot_writes:
            rows, seconds = self._hot_writes.popleft()
            self._hot_written.inc(rows)
            self._hot_seconds.observe(seconds)

    def refused(self, exc: BaseException) -> None:
        reason = S.refusal_reason(exc)
        if reason is not None:
            self._refusals[reason].inc()

    def hot_loaded(self, hot) -> None:
        """After :meth:`~..sidecar.hot_rows.HotRows.load`: its rows, or one ``hot_file_ignored`` refusal when a
        file was there and gave none (its reason is the warning line the load logged); and count each write."""
        if hot.loaded_rows:
            self._hot_loaded.inc(hot.loaded_rows)
        elif os.path.lexists(hot.path):
            self._refusals[S.HOT_FILE_IGNORED].inc()
        hot.on_write = self.hot_written

    def hot_written(self, rows: int, seconds: float) -> None:
        # Queued, not counted here: the last write runs in a SIGTERM handler, which may have interrupted this very
        # thread inside prometheus_client's (non-reentrant) value lock.
        self._hot_writes.append((rows, seconds))

    def start(self, interval_s: float = PUBLISH_INTERVAL_S) -> None:
        """Publish every ``interval_s`` on a daemon thread (for what no eager lookup publishes), and at exit."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(interval_s,), name="ple-metrics", daemon=True)
            self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.publish()
            except Exception as exc:  # noqa: BLE001 - a closed cache after a failure: its counts stay as they were
                log.debug("PLE metrics publish: %s: %s", type(exc).__name__, exc)

    def close(self) -> None:
        self._stop.set()


_process: tuple[int, PleMetrics | None] | None = None  # (pid, this process's metrics): decided once per process
_process_lock = threading.Lock()


def for_process(engine: str, *, tp_rank: int | None, pp_rank: int | None) -> PleMetrics | None:
    """This process's :class:`PleMetrics` (the same one at every call), or None (one log line why, once) when the
    engine's metrics cannot carry them."""
    global _process
    with _process_lock:
        if _process is not None and _process[0] == os.getpid():
            return _process[1]
        why = unavailable()
        metrics = None if why is not None else PleMetrics(engine, tp_rank=tp_rank, pp_rank=pp_rank)
        _process = (os.getpid(), metrics)
    if why is not None:
        log.info("PLE metrics (ssd_stream_*) not exported: %s", why)
    else:
        log.info("PLE metrics (ssd_stream_*) exported through the engine's /metrics (%s=%s)", MULTIPROC_ENV,
                 os.environ[MULTIPROC_ENV])
    return metrics
