"""Prompt-ahead prefetch: the rows of a prefill's next chunks, read into the row caches before the forward.

The PLE ids are a pure function of the tokens (:mod:`.ngram`), and the whole prompt is known when a
request is scheduled. So while chunk k computes, the rows of chunks k+1 … k+W can be read from disk
into the :class:`~.row_cache.RowCache` of every PLE layer; when the forward looks them up they are
hits (or rows still being filled, which the lookup waits for instead of reading them again).

The engine's scheduler calls :meth:`PromptPrefetcher.scheduled` when it is about to run tokens
``[start, end)`` of a request (SGLang: ``NgramEmbeddingManager.prepare_for_forward``, which
``Scheduler.get_next_batch_to_run`` calls with the batch it will launch; vLLM: the worker's
``GPUModelRunner.execute_model`` after ``update_requests``). That call only records the request and
wakes a background thread: it never reads, hashes or waits. The thread, in the order chunks were
scheduled, hashes each chunk's tokens for every PLE layer (numpy) and calls that layer's
``RowCache.prefetch`` (C, GIL released while reading). At most ``window`` chunks beyond the chunk
being computed are fetched per request, so the window bounds both the disk work queued ahead and
the rows it pins in the cache.

A request's first chunk can be fetched before it is scheduled: :meth:`PromptPrefetcher.arrived`, when the
request enters the engine's waiting queue, queues that chunk (only while the queue holds no more than
``window`` chunks, so a burst of arrivals never delays chunks already scheduled). Without it the first
chunk of every prompt is read while it is being computed.

Decode rows ahead (issue 27 item 3): with MTP, the tokens a verify forward computes (each request's last
committed token, then its draft tokens) exist once the draft has run, before the verify forward looks their
rows up. :meth:`PromptPrefetcher.drafted` hands the thread a callable that returns them (it may first wait for
the device to have produced them); the thread hashes and fetches them before any prompt chunk, since a decode
step waits for its rows now. Only the newest step's tokens are kept: an older step still queued has been
verified already.

Imports only the standard library and numpy (no engine, no torch).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..knobs import PREFETCH_DEFAULT_CHUNKS as DEFAULT_WINDOW
from ..knobs import PREFETCH_MAX_CHUNKS as MAX_WINDOW
from .ngram import NGramHash

log = logging.getLogger(__name__)

MAX_REQUESTS = 4096  # requests remembered; the oldest is forgotten (an engine that never calls finished())


@dataclass
class _Request:
    tokens: Sequence[int]  # the prompt (a list or array the engine keeps; read, never written)
    fetched_to: int = 0  # tokens [.., fetched_to) are queued or fetched


@dataclass
class PrefetchStats:
    scheduled_calls: int = 0
    chunks_queued: int = 0
    chunks_fetched: int = 0
    chunks_dropped: int = 0  # the request finished before its chunk was fetched
    tokens_fetched: int = 0
    arrivals: int = 0  # requests whose first chunk was queued when they entered the waiting queue
    draft_steps: int = 0  # verify steps whose tokens were fetched ahead (drafted())
    draft_tokens: int = 0  # their tokens (per request: the last committed one and the drafts)
    draft_steps_dropped: int = 0  # superseded by a newer step before the thread got to them
    draft_rows_read: int = 0  # rows those fetches placed, counted on the CPU path only (drafted(wait=True))
    seconds_busy: float = 0.0
    errors: list = field(default_factory=list)


def _verify_sequence(pairs, ctx: int, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """``[history_0 (ctx tokens, EOS-padded on the left), tokens_0, history_1, tokens_1, ...]`` and the mask of its
    token positions: one hash call over it gives every row's ids."""
    pieces, mask = [], []
    for hist, t in pairs:
        hist = hist[max(0, hist.size - ctx):]
        pieces += [np.full(ctx - hist.size, eos, np.int64), hist, t]
        mask += [np.zeros(ctx, bool), np.ones(t.size, bool)]
    return np.concatenate(pieces), np.concatenate(mask)


class PromptPrefetcher:
    """Reads the rows of upcoming prefill chunks into the row caches, in order, in the background.

    Args:
        layers: ``(hash, cache)`` per PLE layer, in forward order: the layer's :class:`NGramHash`
            (``NGramHash.from_buffers`` of the loaded module) and its row source with a
            ``prefetch(ids)`` method (a :class:`~.row_cache.RowCache`).
        chunk_tokens: the prefill chunk size (sglang ``--chunked-prefill-size``, vLLM
            ``--max-num-batched-tokens``).
        window: chunks fetched beyond the chunk being computed (0: only the chunk being scheduled).
    """

    def __init__(self, layers: Sequence[tuple[NGramHash, object]], *, chunk_tokens: int, window: int = DEFAULT_WINDOW):
        if not layers:
            raise ValueError("prompt-ahead prefetch needs at least one PLE layer")
        if chunk_tokens < 1 or not 0 <= window <= MAX_WINDOW:
            raise ValueError(f"chunk_tokens ({chunk_tokens}) must be >= 1 and window ({window}) in 0..{MAX_WINDOW}")
        self.layers, self.chunk_tokens, self.window = list(layers), int(chunk_tokens), int(window)
        self._context = max(h.ngram_size - 1 for h, _ in self.layers)
        self._reqs: OrderedDict[Hashable, _Request] = OrderedDict()
        self._queue: deque[tuple[Hashable, _Request, int, int]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False
        self._draft = None  # the newest verify step's token source, waiting for the thread
        self._last_was_draft = False
        self.stats = PrefetchStats()
        self._thread = threading.Thread(target=self._run, name="ple-prompt-prefetch", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ called by the scheduler

    def scheduled(self, key: Hashable, tokens: Sequence[int], start: int, end: int) -> None:
        """The engine is about to compute tokens ``[start, end)`` of request ``key`` (``tokens``: its
        prompt, at least ``end`` long). Queues what is not queued yet of ``[start, end + window ×
        chunk_tokens)`` clipped to the prompt, one chunk per entry, and returns at once."""
        n = len(tokens)
        end = min(int(end), n)
        start = max(0, int(start))
        with self._cond:
            if self._closed:
                return
            self.stats.scheduled_calls += 1
            self._queue_up_to(key, tokens, start, min(n, end + self.window * self.chunk_tokens))

    def arrived(self, key: Hashable, tokens: Sequence[int]) -> bool:
        """Request ``key`` entered the engine's waiting queue with prompt ``tokens``: queue its first chunk
        while it waits, unless it is known already or more than ``window`` chunks are queued (a prefix-cache
        hit found at scheduling may make part of it unneeded). Returns whether the chunk was queued;
        returns at once either way."""
        with self._cond:
            if self._closed or not len(tokens) or key in self._reqs or len(self._queue) > self.window:
                return False
            self.stats.arrivals += 1
            self._queue_up_to(key, tokens, 0, min(len(tokens), self.chunk_tokens))
        return True

    def _queue_up_to(self, key: Hashable, tokens: Sequence[int], start: int, horizon: int) -> None:
        """Under the lock: remember request ``key`` (most recent last) and queue its tokens not queued yet
        from ``start`` to ``horizon``, a chunk per entry, then wake the thread."""
        req = self._reqs.get(key)
        if req is None:
            req = self._reqs[key] = _Request(tokens, fetched_to=start)
            while len(self._reqs) > MAX_REQUESTS:  # forgotten: its queued chunks are dropped when popped
                self._reqs.popitem(last=False)
        self._reqs.move_to_end(key)
        req.tokens = tokens  # the same prompt, possibly a new list object holding it
        # a prefix-cache hit or a retraction may move the start: never fetch what will not be computed
        req.fetched_to = max(req.fetched_to, start)
        while req.fetched_to < horizon:
            a = req.fetched_to
            b = min(horizon, a + self.chunk_tokens)
            self._queue.append((key, req, a, b))
            self.stats.chunks_queued += 1
            req.fetched_to = b
        self._cond.notify()

    def drafted(self, source, *, wait: bool = False) -> None:
        """A verify forward is about to run: ``source()`` returns, per request, ``(history, tokens)``: the tokens
        the forward computes for it (its last committed token, then its draft tokens, as integer arrays) and the
        ``ngram_size - 1`` tokens before them (oldest first). The thread calls ``source`` (which may wait for the
        device) and fetches their rows before any queued prompt chunk; returns at once. A step not yet fetched
        when the next one comes is dropped (verified already). ``wait``: fetch in the caller instead and return
        when the rows are in the caches (a CPU forward, which nothing could overlap)."""
        if wait:
            with self._cond:
                if self._closed:
                    return
            self._run_drafted(source, count=True)
            return
        with self._cond:
            if self._closed:
                return
            if self._draft is not None:
                self.stats.draft_steps_dropped += 1
            self._draft = source
            self._cond.notify()

    def _fetch_drafted(self, source, *, count: bool = False) -> int:
        """The thread: hash every request's verify tokens per layer in one call over all of them (a verify step
        can hold hundreds of requests: no Python loop per request and layer), one prefetch per layer; returns the
        tokens. ``count``: add the rows the caches placed meanwhile to ``stats.draft_rows_read`` (the CPU path, which
        fetches in the caller; a prompt chunk fetched at the same moment would count too)."""
        pairs = [(np.asarray(h, np.int64).reshape(-1), np.asarray(t, np.int64).reshape(-1)) for h, t in source()]
        pairs = [(h, t) for h, t in pairs if t.size]
        if not pairs:
            return 0
        before = self._placed() if count else 0
        by_ctx: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for h, cache in self.layers:
            ctx = h.ngram_size - 1
            if ctx not in by_ctx:
                by_ctx[ctx] = _verify_sequence(pairs, ctx, h.eos_token_id)
            seq, mine = by_ctx[ctx]
            # each row's tokens follow its own ctx-token history in seq, so every window stays inside its row
            cache.prefetch(h.ids(seq[ctx:], seq[:ctx])[mine[ctx:]].reshape(-1))
        if count:
            placed = self._placed() - before
            with self._cond:
                self.stats.draft_rows_read += placed
        return sum(t.size for _, t in pairs)

    def _placed(self) -> int:
        """Rows the caches placed by prefetch so far (a row source without counters counts none)."""
        return sum(getattr(c, "stats", {}).get("prefetch_rows", 0) for _, c in self.layers)

    def finished(self, key: Hashable) -> None:
        """Request ``key`` is done (or aborted): its queued chunks are dropped."""
        with self._cond:
            self._reqs.pop(key, None)
            kept = deque(item for item in self._queue if item[0] != key)
            self.stats.chunks_dropped += len(self._queue) - len(kept)
            self._queue = kept

    # ------------------------------------------------------------------ the background thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and self._draft is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                # a verify step's tokens first (that decode step waits for them now), but never two in a row while
                # prompt chunks wait: a fetch slower than a step would otherwise starve every prefill
                draft = None
                if self._draft is not None and not (self._last_was_draft and self._queue):
                    draft, self._draft = self._draft, None
                self._last_was_draft = draft is not None
                if draft is None:
                    key, req, a, b = self._queue.popleft()
                    if self._reqs.get(key) is not req:  # finished (or replaced) since it was queued
                        self.stats.chunks_dropped += 1
                        continue
                self._busy = True
            if draft is not None:
                try:
                    self._run_drafted(draft)
                finally:
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()
                continue
            t = time.perf_counter()
            try:
                lo = max(0, a - self._context)
                seg = np.asarray(req.tokens[lo:b], dtype=np.int64)  # a chunk's slice: the GIL for ~chunk ints
                for h, cache in self.layers:
                    ctx = h.ngram_size - 1
                    before = seg[max(0, a - lo - ctx):a - lo]  # the predecessors of token a; EOS before the start
                    hist = np.concatenate([np.full(ctx - before.size, h.eos_token_id, np.int64), before])
                    cache.prefetch(h.ids(seg[a - lo:], hist).reshape(-1))
                with self._cond:
                    self.stats.chunks_fetched += 1
                    self.stats.tokens_fetched += b - a
            except Exception as exc:  # noqa: BLE001 - prefetch is advisory: the lookup itself raises for real
                with self._cond:
                    if len(self.stats.errors) < 8:
                        self.stats.errors.append(f"{type(exc).__name__}: {exc}")
                log.warning("PLE prompt-ahead prefetch of tokens [%d, %d) failed: %s", a, b, exc)
            finally:
                with self._cond:
                    self.stats.seconds_busy += time.perf_counter() - t
                    self._busy = False
                    self._cond.notify_all()

    def _run_drafted(self, source, *, count: bool = False) -> None:
        t = time.perf_counter()
        try:
            n = self._fetch_drafted(source, count=count)
            with self._cond:
                self.stats.draft_steps += 1
                self.stats.draft_tokens += n
        except Exception as exc:  # noqa: BLE001 - advisory, as a prompt chunk's
            with self._cond:
                if len(self.stats.errors) < 8:
                    self.stats.errors.append(f"{type(exc).__name__}: {exc}")
            log.warning("PLE decode rows ahead of a verify step failed: %s", exc)
        finally:
            with self._cond:
                self.stats.seconds_busy += time.perf_counter() - t

    # ------------------------------------------------------------------ lifecycle

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued chunk is fetched (tests, benchmarks); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._draft is not None or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    @property
    def pending_chunks(self) -> int:
        with self._cond:
            return len(self._queue)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._draft = None
            self._cond.notify_all()
        self._thread.join()


__all__ = ["PromptPrefetcher", "PrefetchStats", "DEFAULT_WINDOW", "MAX_WINDOW"]
