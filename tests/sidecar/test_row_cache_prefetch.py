"""Prompt-ahead prefetch (sidecar/prefetch.py) into the row cache: which rows, in which order, how far ahead."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from sglang_ssd_stream.sidecar import SidecarReader
from sglang_ssd_stream.sidecar.format import SidecarTable
from sglang_ssd_stream.sidecar.ngram import NGramHash
from sglang_ssd_stream.sidecar.prefetch import PromptPrefetcher, parse_window
from sglang_ssd_stream.sidecar.row_cache import RowCache

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
    return RowCache(SidecarReader(table, max_rows=CHUNK * 16), np.zeros((60_000, RB), np.uint8), workers=2, **kw)


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
    for got, w in zip(rec.calls, want):
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
    assert parse_window("X", None) == 1 and parse_window("X", " 0 ") == 0
    for raw, msg in (("two", "not an integer"), ("-1", "out of range"), ("65", "out of range")):
        with pytest.raises(ValueError, match=msg):
            parse_window("SGLANG_SSD_STREAM_PREFETCH_CHUNKS", raw)
    with pytest.raises(ValueError, match="at least one PLE layer"):
        PromptPrefetcher([], chunk_tokens=CHUNK)


# ----------------------------------------------------------------------------- the next batch, staged ahead


class Stager:
    """Records what it is asked to stage and the tickets (the gather's side of the protocol; the real
    gather is the last test's)."""

    def __init__(self, gate: threading.Event | None = None, fail: bool = False):
        self.calls, self.gate, self.fail = [], gate, fail
        self.announced, self.ended = 0, []

    def expect(self):
        self.announced += 1
        return self.announced

    def end_expected(self, ticket):
        self.ended.append(ticket)

    def stage_ahead(self, ids, ticket):
        try:
            if self.gate is not None:
                self.gate.wait()
            self.calls.append((np.asarray(ids).copy(), ticket))
            if self.fail:
                raise OSError("disk gone")
        finally:
            self.end_expected(ticket)


def test_the_expected_batch_is_staged_per_layer_in_forward_order():
    """Each stager gets its layer's ids of every part's tokens, concatenated in the batch's order (what
    the forward's lookup will bring)."""
    a, b = prompt(700, 1), prompt(300, 2)
    s0, s1 = Stager(), Stager()
    p = PromptPrefetcher([(HASH, Recorder(), s0), (HASH1, Recorder(), s1)], chunk_tokens=CHUNK, window=0)
    p.expected([("a", a, 256, 512), ("b", b, 0, 300)])
    assert p.drain(60)
    ((got0, t0),), ((got1, t1),) = s0.calls, s1.calls
    assert t0 == t1 == 1 and s0.ended == s1.ended == [1]
    np.testing.assert_array_equal(got0, np.concatenate([chunk(a, 256, 512), chunk(b, 0, 300)]))
    np.testing.assert_array_equal(got1, np.concatenate([chunk(a, 256, 512, HASH1), chunk(b, 0, 300, HASH1)]))
    assert p.stats.batches_staged == 1 and not p.stats.errors
    p.close()


def test_staging_never_waits_behind_chunk_fetches_and_only_the_latest_is_staged():
    """The staging thread is not the fetch thread: with a chunk fetch stuck on the disk, the expected
    batch is still staged. A batch superseded before its staging began has its ticket ended at once
    (a lookup never waits for a staging that will not happen)."""
    gate, sgate = threading.Event(), threading.Event()
    rec, st = Recorder(gate), Stager(sgate)
    tokens = prompt(2000, 3)
    p = PromptPrefetcher([(HASH, rec, st)], chunk_tokens=CHUNK, window=3)
    p.scheduled("r", tokens, 0, CHUNK)  # the fetch thread blocks in [0, 256); 3 chunks stay queued
    p.expected([("r", tokens, 0, 64)])  # the staging thread blocks in this one
    while not p._staging:
        pass
    p.expected([("r", tokens, 0, 100)])
    p.expected([("r", tokens, 0, CHUNK)])  # replaces the one before before it was staged
    assert st.ended == [2] and p.stats.batches_superseded == 1
    sgate.set()
    deadline = time.monotonic() + 30
    while len(st.calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [t for _, t in st.calls] == [1, 3] and rec.calls == []  # staged while the fetch is still stuck
    np.testing.assert_array_equal(st.calls[1][0], chunk(tokens, 0, CHUNK))
    gate.set()
    assert p.drain(60)
    assert len(rec.calls) == 4 and p.stats.chunks_fetched == 4 and sorted(st.ended) == [1, 2, 3]
    p.close()


def test_a_finished_request_drops_its_expected_batch_and_ends_its_ticket():
    sgate = threading.Event()
    st = Stager(sgate)
    p = PromptPrefetcher([(HASH, Recorder(), st)], chunk_tokens=CHUNK, window=0)
    p.expected([("a", prompt(50), 0, 50)])
    while not p._staging:
        pass
    p.expected([("b", prompt(60, 1), 0, 60)])
    p.finished("b")
    assert st.ended == [2] and p._expected is None
    sgate.set()
    assert p.drain(30) and [t for _, t in st.calls] == [1] and sorted(st.ended) == [1, 2]
    p.close()


def test_a_failing_staging_is_recorded_and_fetches_go_on():
    st, rec = Stager(fail=True), Recorder()
    tokens = prompt(600, 4)
    p = PromptPrefetcher([(HASH, rec, st)], chunk_tokens=CHUNK, window=1)
    p.expected([("r", tokens, 0, CHUNK)])
    assert p.drain(60)
    p.scheduled("r", tokens, 0, CHUNK)
    assert p.drain(60)
    assert p.stats.errors == ["OSError: disk gone"] and p.stats.batches_staged == 0 and p.stats.chunks_fetched == 2
    assert st.ended == [1]
    p.close()


def test_without_stagers_expected_does_nothing():
    rec = Recorder()
    p = PromptPrefetcher([(HASH, rec)], chunk_tokens=CHUNK)
    p.expected([("r", prompt(100), 0, 100)])
    assert p.drain(5) and rec.calls == [] and p.stats.batches_staged == 0
    p.close()


def test_staged_rows_are_what_the_gather_delivers_without_reading(table):
    """The whole path on CPU: the prefetcher hashes the batch, the real gather over a real row cache
    stages it; the lookup with the same ids delivers without a read and the rows are the table's."""
    import torch

    from sglang_ssd_stream.staging.gather import SidecarGather

    tokens = prompt(900, 5)
    data = np.fromfile(table.file, np.uint8).reshape(table.rows, RB)
    with cache(table) as c:
        g = SidecarGather(c, columns=160, is_fp8=True, capacity_rows=CHUNK * 16, device="cpu", mode="h2d",
                          output="raw")
        p = PromptPrefetcher([(HASH, c, g)], chunk_tokens=CHUNK, window=0)
        p.expected([("r", tokens, CHUNK, 2 * CHUNK)])
        assert p.drain(60) and g.stats.staged_ahead == 1
        calls = c.stats["calls"]
        ids = chunk(tokens, CHUNK, 2 * CHUNK)
        out = torch.zeros((ids.size, RB), dtype=torch.uint8)
        g.begin(torch.from_numpy(ids), out)
        assert g.stats.ahead_used == 1 and c.stats["calls"] == calls  # no read on the lookup's path
        assert np.array_equal(out.numpy(), data[ids])
        p.close()
        g.close()  # closes the cache too (again at the end of the block: a no-op)
