"""Prompt-ahead prefetch in sglang's scheduler: the rows of a prefill's next chunks, read before its forward.

Where: sglang 0.5.23's scheduler runs the model in its own process (one scheduler per TP rank builds its
``TpModelWorker``, whose ``ModelRunner`` loads the model there: the e2e suite sees our ``load_weights``
hook log from the ``sglang::scheduler`` process). So ``load_weights`` (``hooks.around_load_weights``)
:func:`register`\\ s one :class:`~..sidecar.prefetch.PromptPrefetcher` per model in this module, and two
AROUND hooks of the same process use it:

- ``NgramEmbeddingManager.prepare_for_forward(batch, chunked_req=)``: ``Scheduler.get_next_batch_to_run``
  (and the disaggregation loops) call it with every batch they are about to launch. For an EXTEND or
  MIXED batch it announces, per request, the prompt tokens this step computes:
  ``scheduled(rid, origin_input_ids, prefix_len, prefix_len + extend_len)``. The prefetcher only records
  them and wakes its thread (hashing and disk reads happen there): the scheduler never waits on a read.
- ``managers.scheduler.Scheduler._add_request_to_queue(req, is_retracted=False)``: when a new request is
  now the last of the waiting queue (not retracted, not aborted by the call; the queue of a scheduler
  without disaggregation), ``arrived(rid, origin_input_ids)`` queues its first chunk while it waits to be
  scheduled.
- ``mem_cache.common.release_kv_cache(req, ...)``: every finished, aborted or retracted request gives its
  KV row back through it; ``finished(rid)`` drops the chunks still queued for it. (A retracted request
  that comes back is announced again from where it restarts.) The prefetcher also forgets the oldest of
  more than ``MAX_REQUESTS`` requests, should a path ever skip this call.

With MTP (``EAGLEWorkerV2``, which serves qwen4_exp's NEXTN), two more AROUND hooks read a verify step's decode
rows ahead (issue 27 item 3; off unless ``SGLANG_SSD_STREAM_PREFETCH_DRAFTS=1``, as the thor profile sets it, read
once per model load: on the H200 it lowered a verify step's exposure only at Thor-class step times,
docs/hot-file-measured.md):

- ``speculative.eagle_worker_v2.EagleDraftWorker.draft(batch)``: its result holds the verify input, whose
  ``draft_token`` row per request is the last committed token, then the drafts (qwen4_exp's PLE refuses
  ``topk`` > 1, so a row is a chain). Right after it, on the stream that produced them, the tokens and each
  request's n-gram history (``get_ngram_context`` of its Mamba slot, the ``ngram_size - 1`` tokens before the
  row, committed by the previous verify) are copied to pinned host memory and an event is recorded: the
  scheduler does not wait. :meth:`~..sidecar.prefetch.PromptPrefetcher.drafted` hands the prefetch thread a
  source that waits for that event, then hashes and fetches the rows, ahead of any prompt chunk, while the
  verify forward runs up to the PLE layers. On a CPU (tests) there is no device to overlap with, so the rows
  are fetched before ``draft`` returns.
- ``EAGLEWorkerV2.verify``: on a CPU, where the verify forward's lookups run inside the call, the lookups that
  still read their rows from disk are counted (``verify_misses``; the activity line says them). On a GPU the
  lookups run after the call returns, so nothing is counted there.

Not covered: the multi-layer EAGLE and frozen-KV MTP workers (their own ``draft``), steps an adaptive policy runs
with no draft, and under DP attention the rows other ranks' requests need from this rank's table slice.

All these hooks are advisory: an error in them is logged once and never reaches the scheduler (a real read
error surfaces in the forward's own lookup, which is fatal there).
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)

PREPARE = ("sglang.srt.model_executor.model_runner_components.ngram_embedding_manager."
           "NgramEmbeddingManager.prepare_for_forward")
RELEASE = "sglang.srt.mem_cache.common.release_kv_cache"
ARRIVE = "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue"
DRAFT = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.draft"
VERIFY = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.verify"
PREFILL_MODES = ("EXTEND", "MIXED")  # ForwardMode names of scheduler batches that compute prompt tokens
REPORT_EVERY_S = 60.0  # the activity line's period in the log
REPORT_FIRST = 8  # the first requests after a start each get an activity line (a cold or hot start shows there)

_lock = threading.Lock()
_prefetchers: dict[int, object] = {}  # id(model) -> PromptPrefetcher of that model's PLE layers
_warned: set[str] = set()  # what this process said once (a failure, the first announcement)
_last_report = [0.0]
_reports = [0]
_verify = {"steps": 0, "misses": 0}  # CPU only: verify forwards, and their lookups that read the disk
_drafts = [False]  # SGLANG_SSD_STREAM_PREFETCH_DRAFTS, read when a model registers its prefetcher


def register(model, prefetcher) -> None:
    """The prefetcher of ``model`` (a reload replaces, and closes, the previous one)."""
    from . import settings

    with _lock:
        _drafts[0] = settings.current().prefetch_drafts  # once per load, not per decode step
        old = _prefetchers.pop(id(model), None)
        _prefetchers[id(model)] = prefetcher
    if old is not None:
        old.close()


def active() -> list:
    with _lock:
        return list(_prefetchers.values())


def clear() -> None:
    """Close and forget every prefetcher (tests)."""
    with _lock:
        olds = list(_prefetchers.values())
        _prefetchers.clear()
    for p in olds:
        p.close()


def _warn_once(what: str, exc: BaseException) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning("PLE prompt-ahead prefetch: %s failed (%s: %s); serving continues, rows are read on demand",
                    what, type(exc).__name__, exc)


def announce(batch, prefetchers) -> int:
    """Tell ``prefetchers`` which prompt tokens ``batch`` computes; returns the requests announced."""
    mode = getattr(getattr(batch, "forward_mode", None), "name", None)
    if mode not in PREFILL_MODES:
        return 0
    n = 0
    for req, start, extend in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, strict=True):
        prompt = req.origin_input_ids
        if start >= len(prompt):  # a decode request of a MIXED batch: no prompt tokens left
            continue
        for p in prefetchers:
            p.scheduled(req.rid, prompt, start, start + extend)
        n += 1
    return n


def around_prepare_for_forward(original, self, batch, *args, **kwargs):
    prefetchers = active()
    if prefetchers and batch is not None:
        try:
            if announce(batch, prefetchers) and "announce" not in _warned:
                _warned.add("announce")  # said once per process, as the PLE hooks say they ran
                log.info("PLE sidecar hook prefetch ran: prompt tokens of %d request(s) announced to the prompt-ahead "
                         "prefetch (window %d chunk(s) of %d tokens)", len(batch.reqs), prefetchers[0].window,
                         prefetchers[0].chunk_tokens)
        except Exception as exc:  # noqa: BLE001 - advisory, see the module docstring
            _warn_once("announcing a batch", exc)
    return original(self, batch, *args, **kwargs)


def around_add_request_to_queue(original, self, req, *args, **kwargs):
    result = original(self, req, *args, **kwargs)
    prefetchers = active()
    if prefetchers:
        try:
            retracted = kwargs.get("is_retracted", args[0] if args else False)
            queue = getattr(self, "waiting_queue", None)
            if not retracted and queue and queue[-1] is req:  # queued (not aborted, not disaggregated)
                for p in prefetchers:
                    p.arrived(req.rid, req.origin_input_ids)
        except Exception as exc:  # noqa: BLE001 - advisory
            _warn_once("announcing an arriving request", exc)
    return result


def around_release_kv_cache(original, req, *args, **kwargs):
    result = original(req, *args, **kwargs)
    prefetchers = active()
    if prefetchers:
        try:
            for p in prefetchers:
                p.finished(req.rid)
            _maybe_report(prefetchers)
        except Exception as exc:  # noqa: BLE001 - advisory
            _warn_once("forgetting a finished request", exc)
    return result


def draft_source(worker, batch, verify_input):
    """The verify step's rows (``draft_token``, one chain per request) and each request's n-gram history (its
    Mamba slot's ``get_ngram_context``, as ``qwen4_exp._prepare_ple_batch`` reads it), off the device without
    waiting (:func:`..staging.verify_rows.verify_rows_source`)."""
    from ..staging.verify_rows import verify_rows_source

    pool = worker.target_worker.model_runner.req_to_token_pool
    history = pool.get_ngram_context(pool.get_mamba_indices(batch.req_pool_indices).long())
    tokens = verify_input.draft_token.reshape(history.shape[0], int(verify_input.draft_token_num))
    return verify_rows_source(tokens, history)


def around_draft(original, self, batch, *args, **kwargs):
    result = original(self, batch, *args, **kwargs)
    prefetchers = active()
    if prefetchers and _drafts[0] and batch is not None and not batch.forward_mode.is_idle():
        try:
            verify_input = result[0] if isinstance(result, tuple) else result
            source, on_device = draft_source(self, batch, verify_input)
            for p in prefetchers:
                p.drafted(source, wait=not on_device)
            if "draft" not in _warned:
                _warned.add("draft")
                log.info("PLE sidecar hook draft ran: the rows of a verify step (%d request(s), %d tokens each) "
                         "fetched ahead of its forward", len(batch.reqs), int(verify_input.draft_token_num))
        except Exception as exc:  # noqa: BLE001 - advisory
            _warn_once("fetching a verify step's rows ahead", exc)
    return result


def _misses(prefetchers) -> int:
    return sum(c.stats["miss_lookups"] for p in prefetchers for _, c in p.layers)


def around_verify(original, self, batch, *args, **kwargs):
    prefetchers = active()
    counted = False
    if prefetchers:
        try:
            import torch

            counted = not torch.cuda.is_available()  # a CPU forward looks its rows up inside the call
            before = _misses(prefetchers) if counted else 0
        except Exception as exc:  # noqa: BLE001 - advisory
            _warn_once("counting a verify step's lookups", exc)
            counted = False
    result = original(self, batch, *args, **kwargs)
    if counted:
        try:
            with _lock:
                _verify["steps"] += 1
                _verify["misses"] += _misses(prefetchers) - before
        except Exception as exc:  # noqa: BLE001 - advisory
            _warn_once("counting a verify step's lookups", exc)
    return result


def activity_line(prefetcher) -> str:
    """What the prefetcher did and what its caches saw, for the log."""
    s = prefetcher.stats
    caches = [c for _, c in prefetcher.layers]
    totals: dict[str, int] = {}
    for c in caches:
        for k, v in c.stats.items():
            totals[k] = totals.get(k, 0) + v
    lookups = max(totals.get("lookups", 0), 1)
    return (f"PLE prompt-ahead prefetch: {s.chunks_fetched} chunk(s) fetched ({s.tokens_fetched} tokens; "
            f"{s.arrivals} first chunk(s) queued on arrival), "
            f"{s.chunks_dropped} dropped, {s.scheduled_calls} scheduled call(s), busy {s.seconds_busy:.3f} s; "
            f"row caches over {len(caches)} layer(s): {totals.get('prefetch_rows', 0)} rows prefetched, "
            f"{totals.get('hits', 0)} of {totals.get('lookups', 0)} lookups hit "
            f"({totals.get('hits', 0) / lookups:.1%}), {totals.get('prefetch_hits', 0)} on prefetched rows, "
            f"{totals.get('rows_read', 0)} rows read from disk"
            + (f"; {s.draft_steps} verify step(s) fetched ahead ({s.draft_tokens} tokens, {s.draft_steps_dropped} "
               f"superseded" + (f", {s.draft_rows_read} rows placed" if s.draft_rows_read else "") + ")"
               if s.draft_steps or s.draft_steps_dropped else "")
            + (f"; verify forwards on this CPU: {_verify['steps']}, their lookups that read the disk: "
               f"{_verify['misses']}" if _verify["steps"] else "")
            + (f"; errors: {s.errors}" if s.errors else ""))


def _maybe_report(prefetchers) -> None:
    now = time.monotonic()
    with _lock:
        if _reports[0] >= REPORT_FIRST and now - _last_report[0] < REPORT_EVERY_S:
            return
        _last_report[0] = now
        _reports[0] += 1
    for p in prefetchers:
        log.info("%s", activity_line(p))
