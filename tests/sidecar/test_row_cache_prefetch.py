"""Prompt-ahead prefetch (sidecar/prefetch.py) into the row cache: which rows, in which order, how far ahead."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from sglang_ssd_stream.sidecar import SidecarReader
from sglang_ssd_stream.sidecar.format import SidecarTable
from sglang_ssd_stream.sidecar.ngram import NGramHash
from sglang_ssd_stream.sidecar.prefetch import PromptPrefetcher
from sglang_ssd_stream.sidecar.row_cache import RowCache, RowCacheConfig

EOS = 7
HASH = NGramHash.from_config(unigram_vocab_size=1000, eos_token_id=EOS, ngram_vocab_size_base=1000)
HASH1 = NGramHash.from_config(unigram_vocab_size=1000, eos_token_id=EOS, ngram_vocab_size_base=1000, ple_layer_index=1)
RB = 160
CHUNK = 256


@pytest.fixture
def table(tmp_path) -> SidecarTable:
    rows = max(HASH.rows, HASH1.rows)
    path = tmp_path / "t.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, rows * RB, dtype=np.uint8).tobytes())
    return SidecarTable(0, path.name, path, "0" * 64, "float8_e4m3fn", rows, 160, 0, rows * RB)


def cache(table, **kw) -> RowCache:
    return RowCache(SidecarReader(table, max_rows=CHUNK * 16), np.zeros((60_000, RB), np.uint8),
                    RowCacheConfig(workers=2, **{k.lstrip("_"): v for k, v in kw.items()}))


class Recorder:
    """A row source that records what it was asked to prefetch (and can be slowed or broken)."""

    def __init__(self, gate: threading.Event | None = None, fail_first: bool = False):
        self.calls, self.gate, self.fail_first = [], gate, fail_first

    def prefetch(self, ids):
        if self.gate is not None:
            self.gate.wait()
        if self.fail_first and not self.calls:
            self.calls.append(None)
            raise OSError("disk gone")
        self.calls.append(np.asarray(ids).copy())


def prompt(n: int, seed: int = 0) -> list[int]:
    t = np.random.default_rng(seed).integers(0, 1000, n)
    t[::97] = EOS
    return t.tolist()


def chunk(tokens, a, b, h=HASH):
    return h.chunk_ids(tokens, a, b)


def test_the_chunk_being_computed_and_the_window_after_it_are_fetched_nothing_more(table):
    tokens = prompt(4000)
    with cache(table) as c:
        p = PromptPrefetcher([(HASH, c)], chunk_tokens=CHUNK, window=2)
        p.scheduled("r", tokens, 0, CHUNK)
        assert p.drain(60)
        for k in range(3):
            assert c.contains(chunk(tokens, k * CHUNK, (k + 1) * CHUNK)).all()
        fetched = np.unique(np.concatenate([chunk(tokens, 0, 3 * CHUNK)]))
        later = chunk(tokens, 3 * CHUNK, 4000)
        np.testing.assert_array_equal(c.contains(later), np.isin(later, fetched))  # nothing beyond the window
        assert p.stats.chunks_fetched == 3 and not p.stats.errors
        p.close()


def test_the_lookup_after_prefetch_reads_nothing(table):
    tokens = prompt(1000, 1)
    with cache(table) as c:
        p = PromptPrefetcher([(HASH, c)], chunk_tokens=CHUNK, window=1)
        p.scheduled("r", tokens, 0, CHUNK)
        assert p.drain(60)
        before = c.stats
        ids = chunk(tokens, CHUNK, 2 * CHUNK)  # the next chunk, fetched ahead
        out = np.empty((ids.size, RB), np.uint8)
        c.read_rows(ids, out)
        after = c.stats
        p.close()
    assert after["rows_read"] == before["rows_read"] and after["hits"] - before["hits"] == ids.size
    assert after["prefetch_hits"] > 0


def test_scheduled_returns_while_the_disk_is_still_reading(table):
    """The scheduler's call only queues: it is back while the (slowed) read of the chunk is in flight."""
    tokens = prompt(600, 2)
    with cache(table, _debug_delay_us=400_000) as c:
        p = PromptPrefetcher([(HASH, c)], chunk_tokens=CHUNK, window=0)
        p.scheduled("r", tokens, 0, CHUNK)
        assert not c.contains(chunk(tokens, 0, CHUNK)).any()  # still being read
        assert p.drain(60)
        assert c.contains(chunk(tokens, 0, CHUNK)).all()
        p.close()


def test_chunks_are_fetched_once_each_in_the_order_scheduled():
    rec = Recorder()
    p = PromptPrefetcher([(HASH, rec)], chunk_tokens=CHUNK, window=1)
    a, b = prompt(3 * CHUNK, 3), prompt(2 * CHUNK + 10, 4)
    p.scheduled("a", a, 0, CHUNK)  # a: chunks 0, 1
    p.scheduled("b", b, 0, CHUNK)  # b: chunks 0, 1
    p.scheduled("a", a, CHUNK, 2 * CHUNK)  # a advances: chunk 2 only
    p.scheduled("a", a, CHUNK, 2 * CHUNK)  # the same step again: nothing new
    p.scheduled("b", b, CHUNK, 2 * CHUNK)  # b: its 10-token tail
    assert p.drain(60)
    want = [chunk(a, 0, CHUNK), chunk(a, CHUNK, 2 * CHUNK), chunk(b, 0, CHUNK), chunk(b, CHUNK, 2 * CHUNK),
            chunk(a, 2 * CHUNK, 3 * CHUNK), chunk(b, 2 * CHUNK, 2 * CHUNK + 10)]
    assert len(rec.calls) == len(want)
    for got, w in zip(rec.calls, want, strict=False):
        np.testing.assert_array_equal(got, w)
    p.close()


def test_a_prefix_cache_hit_starts_fetching_at_the_first_computed_token():
    rec = Recorder()
    p = PromptPrefetcher([(HASH, rec)], chunk_tokens=CHUNK, window=0)
    tokens = prompt(4 * CHUNK, 5)
    p.scheduled("r", tokens, 2 * CHUNK + 5, 3 * CHUNK + 5)
    assert p.drain(60)
    np.testing.assert_array_equal(rec.calls[0], chunk(tokens, 2 * CHUNK + 5, 3 * CHUNK + 5))  # history: the 2 before
    assert len(rec.calls) == 1
    p.close()


def test_a_finished_request_drops_its_queued_chunks():
    gate = threading.Event()
    rec = Recorder(gate)
    p = PromptPrefetcher([(HASH, rec)], chunk_tokens=CHUNK, window=3)
    done, live = prompt(4 * CHUNK, 6), prompt(CHUNK, 7)
    p.scheduled("done", done, 0, CHUNK)  # 4 chunks queued; the thread blocks on the first
    p.scheduled("live", live, 0, CHUNK)
    p.finished("done")
    gate.set()
    assert p.drain(60)
    assert p.stats.chunks_dropped >= 3
    fetched = [c for c in rec.calls]
    assert not any(np.array_equal(f, chunk(done, k * CHUNK, (k + 1) * CHUNK)) for f in fetched for k in (1, 2, 3))
    np.testing.assert_array_equal(fetched[-1], chunk(live, 0, CHUNK))
    p.close()


def test_requests_never_finished_are_forgotten_oldest_first(monkeypatch):
    from sglang_ssd_stream.sidecar import prefetch

    monkeypatch.setattr(prefetch, "MAX_REQUESTS", 3)
    gate = threading.Event()
    rec = Recorder(gate)
    p = PromptPrefetcher([(HASH, rec)], chunk_tokens=CHUNK, window=0)
    tokens = [prompt(CHUNK, s) for s in range(5)]
    for k, t in enumerate(tokens):
        p.scheduled(k, t, 0, CHUNK)
    assert list(p._reqs) == [2, 3, 4]
    gate.set()
    assert p.drain(60)
    # requests 0 and 1 are forgotten: their chunks are dropped, unless the thread already held one
    assert p.stats.chunks_dropped in (1, 2) and p.stats.chunks_fetched + p.stats.chunks_dropped == 5
    for t in tokens[2:]:
        assert any(np.array_equal(c, chunk(t, 0, CHUNK)) for c in rec.calls)
    assert not any(np.array_equal(c, chunk(tokens[1], 0, CHUNK)) for c in rec.calls)
    p.close()


def test_every_layer_gets_its_own_hash():
    r0, r1 = Recorder(), Recorder()
    p = PromptPrefetcher([(HASH, r0), (HASH1, r1)], chunk_tokens=CHUNK, window=0)
    tokens = prompt(CHUNK, 8)
    p.scheduled("r", tokens, 0, CHUNK)
    assert p.drain(60)
    np.testing.assert_array_equal(r0.calls[0], chunk(tokens, 0, CHUNK, HASH))
    np.testing.assert_array_equal(r1.calls[0], chunk(tokens, 0, CHUNK, HASH1))
    assert not np.array_equal(r0.calls[0], r1.calls[0])
    p.close()


def test_a_failing_prefetch_is_recorded_and_later_chunks_still_go():
    rec = Recorder(fail_first=True)
    p = PromptPrefetcher([(HASH, rec)], chunk_tokens=CHUNK, window=1)
    tokens = prompt(2 * CHUNK, 9)
    p.scheduled("r", tokens, 0, CHUNK)  # does not raise
    assert p.drain(60)
    assert p.stats.errors == ["OSError: disk gone"] and p.stats.chunks_fetched == 1
    np.testing.assert_array_equal(rec.calls[-1], chunk(tokens, CHUNK, 2 * CHUNK))
    p.close()


def test_window_knob():
    from sglang_ssd_stream.knobs import knob

    k = knob("sglang", "PREFETCH_CHUNKS")
    assert k.parse(None) == 1 and k.parse("0") == 0
    with pytest.raises(ValueError, match="not an integer"):  # one rule for every knob: ASCII digits only
        k.parse(" 0 ")
    for raw, msg in (("two", "not an integer"), ("-1", "out of range"), ("65", "out of range")):
        with pytest.raises(ValueError, match=msg):
            k.parse(raw)
    with pytest.raises(ValueError, match="window"):  # the prefetcher's own bound is the knob's
        PromptPrefetcher([(None, None)], chunk_tokens=CHUNK, window=k.hi + 1)
    with pytest.raises(ValueError, match="at least one PLE layer"):
        PromptPrefetcher([], chunk_tokens=CHUNK)


# ----------------------------------------------------------------------------- a request's arrival


def test_arrival_queues_the_first_chunk_and_scheduling_continues_after_it():
    gate = threading.Event()
    rec = Recorder(gate)
    tokens = prompt(1000, 6)
    p = PromptPrefetcher([(HASH, rec)], chunk_tokens=CHUNK, window=1)
    assert p.arrived("r", tokens)
    assert not p.arrived("r", tokens)  # known already: nothing queued twice
    p.scheduled("r", tokens, 0, CHUNK)  # the first chunk was queued on arrival: only the window follows
    gate.set()
    assert p.drain(60)
    got = [c for c in rec.calls]
    np.testing.assert_array_equal(got[0], chunk(tokens, 0, CHUNK))
    np.testing.assert_array_equal(got[1], chunk(tokens, CHUNK, 2 * CHUNK))
    assert len(got) == 2 and p.stats.arrivals == 1 and p.stats.chunks_queued == 2
    p.close()


def test_a_burst_of_arrivals_never_pushes_scheduled_chunks_back():
    """Arrivals queue only while the queue holds at most `window` chunks."""
    gate = threading.Event()
    rec = Recorder(gate)
    p = PromptPrefetcher([(HASH, rec)], chunk_tokens=CHUNK, window=1)
    p.scheduled("s", prompt(1000, 7), 0, CHUNK)  # the thread takes [0, 256) and blocks; [256, 512) waits
    while p.pending_chunks != 1:
        time.sleep(0.001)
    assert p.arrived("a", prompt(300, 8))  # 1 queued <= window: queued
    assert not p.arrived("b", prompt(300, 9))  # 2 queued > window: left to its scheduling
    assert p.pending_chunks == 2 and p.stats.arrivals == 1
    gate.set()
    assert p.drain(60) and len(rec.calls) == 3
    assert not p.arrived("c", [])  # an empty prompt has no chunk
    p.close()


def test_an_arrived_request_that_finishes_unscheduled_drops_its_chunk():
    gate = threading.Event()
    rec = Recorder(gate)
    p = PromptPrefetcher([(HASH, rec)], chunk_tokens=CHUNK, window=0)
    p.scheduled("s", prompt(300, 1), 0, 44)
    while p.pending_chunks:
        time.sleep(0.001)  # the thread holds [0, 44) of "s"
    p.arrived("a", prompt(500, 2))
    p.finished("a")  # aborted while waiting
    gate.set()
    assert p.drain(60) and len(rec.calls) == 1 and p.stats.chunks_dropped == 1
    p.close()


# ----------------------------------------------------------------------------- decode rows ahead (issue 27 item 3)


def _verify_ids(h, sequence, start, n):
    """The ids a verify forward looks up for ``sequence[start:start + n]``: the whole sequence's hash, sliced
    (what the engine's forward computes, its n-gram context being the tokens before)."""
    return h.chunk_ids(sequence, start, start + n)


def test_drafted_tokens_are_fetched_with_their_history_and_the_verify_lookup_reads_nothing(table):
    """Two requests' verify steps (last committed token + 3 drafts each): the rows fetched are exactly those
    the verify forward looks up (hashing the tokens after their n-gram history), so that lookup is all hits.
    One request's history has an EOS in it (the hash's reset), the other is 1 token into its sequence (EOS
    pads the history as the engines' start of a request)."""
    a = prompt(300, 11)
    a[297] = EOS
    b = prompt(1, 12)
    with cache(table) as c0, cache(table) as c1:
        p = PromptPrefetcher([(HASH, c0), (HASH1, c1)], chunk_tokens=CHUNK, window=0)
        drafts_a, drafts_b = [5, 6, 7, 8], [9, 10, 11, 12]
        seq_a, seq_b = a + drafts_a, b + drafts_b
        p.drafted(lambda: [(a[-2:], drafts_a), (b[-2:], drafts_b)])
        assert p.drain(60)
        for h, c in ((HASH, c0), (HASH1, c1)):
            want = np.concatenate([_verify_ids(h, seq_a, 300, 4).reshape(-1), _verify_ids(h, seq_b, 1, 4).reshape(-1)])
            assert c.contains(want).all()
            before = c.stats
            c.read_rows(want, np.empty((want.size, RB), np.uint8))
            assert c.stats["rows_read"] == before["rows_read"]  # the verify's lookup: no disk read
        assert p.stats.draft_steps == 1 and p.stats.draft_tokens == 8 and not p.stats.errors
        p.close()


def test_a_verify_step_goes_before_queued_prompt_chunks_and_a_superseded_one_is_dropped():
    gate = threading.Event()
    rec = Recorder(gate)
    p = PromptPrefetcher([(HASH, rec)], chunk_tokens=CHUNK, window=3)
    tokens = prompt(4 * CHUNK, 13)
    p.scheduled("r", tokens, 0, CHUNK)  # 4 chunks queued; the thread blocks in the first
    deadline = time.monotonic() + 10
    while p.pending_chunks > 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    calls = []
    p.drafted(lambda: calls.append("old") or [([1, 2], [3])])  # verified before the thread gets to it
    p.drafted(lambda: calls.append("new") or [([1, 2], [4, 5])])
    gate.set()
    assert p.drain(60)
    assert calls == ["new"] and p.stats.draft_steps_dropped == 1 and p.stats.draft_steps == 1
    np.testing.assert_array_equal(rec.calls[1], HASH.ids([4, 5], [1, 2]).reshape(-1))  # right after chunk 0
    assert len(rec.calls) == 5
    p.close()


def test_a_failing_token_source_is_recorded_and_prefetch_goes_on():
    rec = Recorder()
    p = PromptPrefetcher([(HASH, rec)], chunk_tokens=CHUNK, window=0)

    def broken():
        raise RuntimeError("device lost")

    p.drafted(broken)  # does not raise
    tokens = prompt(CHUNK, 14)
    p.scheduled("r", tokens, 0, CHUNK)
    assert p.drain(60)
    assert p.stats.errors == ["RuntimeError: device lost"] and p.stats.chunks_fetched == 1
    p.close()


def test_wait_fetches_in_the_caller_while_the_thread_is_busy():
    """``wait=True`` (a CPU forward): the rows are fetched when the call returns, even while the thread is held
    by a slow prompt chunk."""
    gate = threading.Event()
    rec = Recorder()
    slow = Recorder(gate)
    p = PromptPrefetcher([(HASH, rec)], chunk_tokens=CHUNK, window=0)
    p.drafted(lambda: [([1, 2], [3, 4])], wait=True)
    assert len(rec.calls) == 1 and p.stats.draft_steps == 1
    np.testing.assert_array_equal(rec.calls[0], HASH.ids([3, 4], [1, 2]).reshape(-1))
    q = PromptPrefetcher([(HASH, slow)], chunk_tokens=CHUNK, window=0)
    q.scheduled("r", prompt(CHUNK, 15), 0, CHUNK)  # the thread blocks on the gate
    done = threading.Event()
    threading.Thread(target=lambda: (q.drafted(lambda: [([1, 2], [3])], wait=True), done.set())).start()
    assert not done.wait(0.3)  # the one row source is gated: it waits as the forward's lookup would
    gate.set()
    assert done.wait(10) and q.drain(10) and q.stats.draft_steps == 1
    p.close()
    q.close()


def test_two_verify_steps_in_a_row_let_a_waiting_prompt_chunk_go_between():
    """A verify step's fetch goes first, but not twice in a row while prompt chunks wait: a fetch slower than a
    step would starve every prefill."""
    gate = threading.Event()
    order = []

    class Source:
        def prefetch(self, ids):
            gate.wait()
            order.append(ids.size)

    p = PromptPrefetcher([(HASH, Source())], chunk_tokens=4, window=2)
    p.drafted(lambda: [([1, 2], [3])])  # 1 token (the thread takes it and blocks on the gate)
    deadline = time.monotonic() + 10
    while p._draft is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    p.scheduled("r", prompt(12, 16), 0, 4)  # 3 chunks of 4 tokens
    p.drafted(lambda: [([1, 2], [3, 4])])  # 2 tokens
    gate.set()
    assert p.drain(30)
    heads = HASH.ngram_heads
    assert order == [heads, 4 * heads, 2 * heads, 4 * heads, 4 * heads]  # draft, a chunk, the next draft, the rest
    p.close()


def test_many_requests_are_hashed_in_one_call_per_layer_exactly_as_one_by_one():
    rng = np.random.default_rng(17)
    pairs = []
    for i in range(300):
        hist = rng.integers(0, 1000, 2)
        if i % 7 == 0:
            hist[1] = EOS  # an EOS in the history: the hash's reset
        pairs.append((hist.tolist(), rng.integers(0, 1000, 1 + i % 4).tolist()))
    rec0, rec1 = Recorder(), Recorder()
    p = PromptPrefetcher([(HASH, rec0), (HASH1, rec1)], chunk_tokens=CHUNK, window=0)
    p.drafted(lambda: pairs, wait=True)
    for h, rec in ((HASH, rec0), (HASH1, rec1)):
        want = np.concatenate([h.ids(t, hh).reshape(-1) for hh, t in pairs])
        np.testing.assert_array_equal(rec.calls[0], want)
    p.close()
