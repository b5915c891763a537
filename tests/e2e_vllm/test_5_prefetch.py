"""Proof 5 (issue 26 item 4): prompt-ahead prefetch under vLLM's real scheduling, in the real worker.

The ``patched-chunked`` server prefills in chunks of :data:`~.conftest.CHUNK` tokens (``--max-num-batched-tokens``):
a 112-token prompt is sent first and its client goes away after :data:`~.conftest.ABORT_AFTER_S` seconds, while
vLLM is still prefilling it; three prompts of 40-56 tokens are sent at once right behind it (3-4 chunks each,
interleaved with the others' decode steps); then ``validate`` (proof 6) sends more. The worker's log then holds:

- for the aborted request, one line when it left the prefill unfinished: where the scheduler had got to, and how far
  the prefetcher had read it: exactly one window (one chunk) ahead, never beyond;
- the prefetcher's activity line, with that leave and then again (at most once a minute): chunks and tokens
  fetched, queued and dropped, prefills done / left unfinished / in flight with their tokens, chunks read for a
  request after it left (counted on the prompt the hook hands over: must stay 0), and the row caches' counters,
  whose lookups hit the rows fetched ahead.

The worker's ``VmRSS`` is sampled from ``/proc`` every half second from before the first request to the last: its
growth stays within the row cache budget (``VLLM_PLE_ROW_CACHE_MB``) plus :data:`RSS_SLACK_MIB`.
"""

from __future__ import annotations

import math
import re

from .conftest import ABORT_AFTER_S, ABORTED, CHUNK, CONCURRENT, ROW_CACHE_MB, UNFINISHED_LINE
from .test_1_plugin_live import _processes

WINDOW = 1  # VLLM_PLE_PREFETCH_CHUNKS: the default
# RSS the worker may gain while serving besides the row cache: the Triton interpreter's and torch's allocations
# for batches it has not run before, KV pages touched for the first time (measured: see docs/e2e-vllm-notes.md)
RSS_SLACK_MIB = 256

ACTIVITY = re.compile(
    r"PLE prompt-ahead prefetch: (?P<fetched>\d+) chunk\(s\) fetched \((?P<tokens>\d+) tokens\) of (?P<queued>\d+) "
    r"queued, (?P<dropped>\d+) dropped, (?P<calls>\d+) scheduled call\(s\), busy [\d.]+ s; prefills: (?P<done>\d+) "
    r"done \((?P<done_tokens>\d+) tokens\), (?P<unfinished>\d+) left unfinished \((?P<unfinished_tokens>\d+) tokens "
    r"fetched\), (?P<in_flight>\d+) in flight \((?P<in_flight_tokens>\d+) tokens fetched\), (?P<late>\d+) chunk\(s\) "
    r"read after their request left; row caches over (?P<layers>\d+) layer\(s\): (?P<prefetch_rows>\d+) rows "
    r"prefetched, (?P<hits>\d+) of (?P<lookups>\d+) lookups hit \([\d.]+%\), (?P<prefetch_hits>\d+) on prefetched "
    r"rows, (?P<rows_read>\d+) rows read from disk$")
UNFINISHED = re.compile(
    r"PLE prompt-ahead prefetch: request (?P<id>\S+) left \((?P<why>[\w-]+)\) with its prefill unfinished, scheduled "
    r"to token (?P<scheduled>\d+) of (?P<n>\d+) \(from (?P<start>\d+)\): (?P<chunks>\d+) chunk\(s\) of it fetched, "
    r"to token (?P<fetched_to>\d+)$")


def _worker_lines(sc) -> list[str]:
    return sc.lines_of(_processes(sc)["worker"])


def _unfinished(sc) -> tuple[int, dict]:
    """(index in the worker's lines, fields) of the one request that left its prefill unfinished."""
    lines = _worker_lines(sc)
    hits = [(i, UNFINISHED.search(line)) for i, line in enumerate(lines) if UNFINISHED_LINE.search(line)]
    assert len(hits) == 1 and hits[0][1], hits
    i, m = hits[0]
    return i, {k: (v if k in ("id", "why") else int(v)) for k, v in m.groupdict().items()}


def _activity(sc) -> list[tuple[int, dict]]:
    out = []
    for i, line in enumerate(_worker_lines(sc)):
        if "chunk(s) fetched (" in line:
            m = ACTIVITY.search(line)
            assert m, line  # every activity line has the documented form
            out.append((i, {k: int(v) for k, v in m.groupdict().items()}))
    return out


def test_the_worker_prefetches_chunks_of_the_scheduler(patched_chunked):
    sc = patched_chunked
    worker = _processes(sc)["worker"]
    line = sc.grep(rf"PLE prompt-ahead prefetch: 2 layer\(s\), chunks of {CHUNK} tokens \(vLLM's "
                   rf"max_num_batched_tokens\), {WINDOW} chunk\(s\) ahead", worker)
    assert len(line) == 1, sc.log[-4000:]
    cache = re.search(r"into row caches of ([\d.]+) (KiB|MiB) in all$", line[0])
    assert cache, line
    assert float(cache[1]) * (1 if cache[2] == "MiB" else 1 / 1024) <= ROW_CACHE_MB  # within the budget
    assert sc.grep(rf"row_cache={ROW_CACHE_MB} MiB prefetch_chunks={WINDOW}\) in pid {worker}$", worker)


def test_concurrent_chunked_prompts_complete(patched_chunked):
    results = patched_chunked.results["concurrent"]
    assert set(results) == set(CONCURRENT)
    for label, (prompt, max_tokens) in CONCURRENT.items():
        r = results[label]
        assert r["status"] == 200 and r["finish_reason"] == "length", (label, r)
        assert len(r["token_ids"]) == max_tokens and r["prompt_token_ids"] == prompt, (label, r)
        assert len(prompt) > 2 * CHUNK  # three or more chunks each


def test_the_aborted_request_left_mid_prefill_one_window_fetched_ahead(patched_chunked):
    sc = patched_chunked
    aborted = sc.results["aborted"]
    assert aborted["answered_before_close"] == "" and aborted["closed_after_s"] >= ABORT_AFTER_S, aborted
    _, a = _unfinished(sc)
    n = len(ABORTED[0])
    assert a["why"] == "finished" and a["n"] == n and a["start"] == 0, a  # vLLM aborts it: a finished request
    assert 0 < a["scheduled"] < n and a["scheduled"] % CHUNK == 0, a  # alone, it had every chunk of each step
    # the prefetcher had read it exactly one window ahead of the scheduler, and no further
    assert a["fetched_to"] == min(n, a["scheduled"] + WINDOW * CHUNK), a
    assert a["chunks"] == math.ceil(a["fetched_to"] / CHUNK), a


def test_activity_line_counts_the_chunks_fetched_ahead(patched_chunked):
    sc = patched_chunked
    at, a = _unfinished(sc)
    lines = _activity(sc)
    after = [(i, f) for i, f in lines if i > at]
    assert len(after) >= 2, "no activity line after the one the abort wrote"  # the next: >= a minute later
    _, last = lines[-1]
    assert last["layers"] == 2 and last["fetched"] > 0
    # every prompt token the scheduler computed was fetched once, none twice, none past an aborted request's window
    assert last["tokens"] == last["done_tokens"] + last["unfinished_tokens"] + last["in_flight_tokens"], last
    assert last["unfinished"] == 1 and last["unfinished_tokens"] == a["fetched_to"] - a["start"], (last, a)
    # consistent with the number of chunks: none longer than a chunk, each queued one fetched or dropped
    assert math.ceil(last["tokens"] / CHUNK) <= last["fetched"] <= last["queued"], last
    assert last["fetched"] + last["dropped"] <= last["queued"], last
    # the three long prompts and the aborted one alone need this many chunks
    assert last["fetched"] >= sum(math.ceil(len(p) / CHUNK) for p, _ in CONCURRENT.values()) + a["chunks"]
    assert last["done"] >= len(CONCURRENT) and last["calls"] >= last["done"]
    # the forward's lookups were served by rows fetched ahead
    assert last["prefetch_rows"] > 0 and last["prefetch_hits"] > 0, last
    assert last["hits"] >= 0.9 * last["lookups"] > 0, last


def test_nothing_fetched_for_the_aborted_request_after_its_abort(patched_chunked):
    sc = patched_chunked
    at, a = _unfinished(sc)
    lines = _activity(sc)
    assert all(f["late"] == 0 for _, f in lines), lines  # not a chunk read for any request after it left
    after = [f for i, f in lines if i > at]  # the one written at the abort, then at least one a minute or more later
    assert len(after) >= 2 and all(f["unfinished_tokens"] == a["fetched_to"] for f in after), (a, after)


def test_worker_rss_stays_within_the_row_cache_budget(patched_chunked):
    sc = patched_chunked
    rss = sc.results["rss"]
    assert rss["pid"] == _processes(sc)["worker"]
    assert rss["samples"] >= 20 and rss["seconds"] >= 0.8 * sc.results["seconds"] - 5, rss
    growth_mib = (rss["peak_kib"] - rss["baseline_kib"]) / 1024
    assert growth_mib <= ROW_CACHE_MB + RSS_SLACK_MIB, (growth_mib, rss)
