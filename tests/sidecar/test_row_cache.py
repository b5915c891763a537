"""The PLE row cache (sidecar/row_cache.{py,c}): the readers' contract, never another id's row, bounded memory.

Every table here is self-describing: row ``r`` starts with ``r`` as 8 little-endian bytes and the rest
is a function of ``r``, so a returned row proves which id it belongs to.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_ssd_stream.sidecar import MappedReader, SidecarReader
from sglang_ssd_stream.sidecar.errors import (
    SidecarIOError,
    SidecarReaderUnusable,
    SidecarRowOutOfRange,
    SidecarShapeMismatch,
    SidecarTruncated,
)
from sglang_ssd_stream.sidecar.format import SidecarTable
from sglang_ssd_stream.sidecar.row_cache import (
    POLICIES,
    CacheSimulator,
    RowCache,
    RowCacheConfig,
    capacity_for_budget,
    captured_read,
    fixed_bytes,
    load,
    metadata_bytes,
)

REPO = Path(__file__).resolve().parents[2]
ROWS, RB = 20_000, 160


def content(ids, rb: int = RB) -> np.ndarray:
    ids = np.asarray(ids, np.int64)
    out = ((ids[:, None] * 2654435761 + np.arange(rb)[None, :] * 40503) % 251).astype(np.uint8)
    out[:, :8] = ids.astype("<i8").view(np.uint8).reshape(-1, 8)
    return out


def make_table(path: Path, rows: int = ROWS, rb: int = RB, row_start: int = 0) -> SidecarTable:
    path.write_bytes(content(np.arange(row_start, row_start + rows), rb).tobytes())
    dtype = "float8_e4m3fn" if rb == 160 else "bfloat16"
    return SidecarTable(0, path.name, path, "0" * 64, dtype, rows, 160, row_start, rows * rb)


def expect(ids, lo: int, hi: int, rb: int = RB) -> np.ndarray:
    ids = np.asarray(ids, np.int64)
    want = content(ids, rb)
    want[(ids < lo) | (ids >= hi)] = 0
    return want


def cache_of(table, capacity, *, lo=None, hi=None, reader="pread", **kw) -> RowCache:
    cls = SidecarReader if reader == "pread" else MappedReader
    r = cls(table, vocab_start=lo, vocab_end=hi, max_rows=4096, workers=2)
    config = RowCacheConfig(workers=kw.pop("workers", 4), **{k.lstrip("_"): v for k, v in kw.items()})
    return RowCache(r, np.zeros((capacity, table.row_bytes), np.uint8), config)


def read(cache: RowCache, ids) -> np.ndarray:
    out = np.full((len(ids), cache.row_bytes), 0xAB, np.uint8)
    cache.read_rows(np.asarray(ids, np.int64), out)
    return out


@pytest.fixture
def table(tmp_path):
    return make_table(tmp_path / "t.bin")


# ----------------------------------------------------------------------------- the readers' contract


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("waves", [(1024, 64), (2, 1), (3, 2)])  # bounce buffer and run size: spills across both
def test_rows_are_the_tables_rows(table, policy, direct, waves):
    rng = np.random.default_rng(0)
    with cache_of(table, 700, lo=1000, hi=15000, policy=policy, direct=direct, wave_pages=waves[0],
                  max_read_pages=waves[1]) as c:
        for _ in range(30):
            ids = rng.integers(0, ROWS, rng.integers(0, 900))
            ids[::7] = ids[0] if ids.size else 0  # duplicates in one lookup
            np.testing.assert_array_equal(read(c, ids), expect(ids, 1000, 15000))
        st = c.stats
        assert st["hits"] > 0 and st["evictions"] > 0 and c.occupancy()[0] <= 700


@pytest.mark.parametrize("rb,row_start", [(320, 0), (160, 5000)])
def test_bf16_rows_and_a_table_that_starts_later(tmp_path, rb, row_start):
    t = make_table(tmp_path / "t.bin", rows=3000, rb=rb, row_start=row_start)
    ids = np.random.default_rng(1).integers(row_start, row_start + 3000, 2000)
    with cache_of(t, 500) as c:
        np.testing.assert_array_equal(read(c, ids), expect(ids, row_start, row_start + 3000, rb))
        np.testing.assert_array_equal(read(c, ids[::-1]), expect(ids[::-1], row_start, row_start + 3000, rb))


def test_everything_that_fits_is_read_once(table):
    ids = np.random.default_rng(2).integers(0, ROWS, 3000)
    with cache_of(table, 4000) as c:
        read(c, ids)
        first = c.stats
        np.testing.assert_array_equal(read(c, ids), expect(ids, 0, ROWS))
        st = c.stats
    assert first["rows_read"] == np.unique(ids).size
    assert st["rows_read"] == first["rows_read"] and st["hits"] - first["hits"] == ids.size


def test_out_of_range_ids_are_refused_before_anything_is_written(table):
    with cache_of(table, 100) as c:
        out = np.full((3, RB), 0xAB, np.uint8)
        for bad in ([1, ROWS, 2], [1, -1, 2]):
            with pytest.raises(SidecarRowOutOfRange):
                c.read_rows(np.array(bad), out)
            assert (out == 0xAB).all()
        np.testing.assert_array_equal(read(c, [5]), expect([5], 0, ROWS))  # still usable


def test_bad_storage_policy_and_shapes_are_refused(table):
    r = SidecarReader(table, max_rows=8)
    for rows in (np.zeros((10, RB + 1), np.uint8), np.zeros((10, RB), np.int8), np.zeros((0, RB), np.uint8),
                 np.zeros((10, 2 * RB), np.uint8)[:, ::2], np.zeros((10, RB), np.uint8).T.copy().T):
        with pytest.raises(SidecarShapeMismatch):
            RowCache(r, rows)
    with pytest.raises(ValueError, match="expected one of lru, clock, s3fifo"):
        RowCache(r, np.zeros((10, RB), np.uint8), RowCacheConfig(policy="arc"))
    with cache_of(table, 10) as c:
        with pytest.raises(SidecarShapeMismatch):
            c.read_rows(np.array([1, 2]), np.zeros((3, RB), np.uint8))
        with pytest.raises(SidecarShapeMismatch):
            c.read_rows(np.array([[1, 2]]), np.zeros((2, RB), np.uint8))


def test_a_rank_range_beyond_32_bit_row_keys_is_refused(tmp_path):
    """Slots keep a row as its 32-bit offset in the rank's range: a larger range is refused, not wrapped."""
    rows = (1 << 32) + 10
    path = tmp_path / "huge.bin"
    with open(path, "wb") as f:
        f.truncate(rows * RB)  # sparse
    t = SidecarTable(0, path.name, path, "0" * 64, "float8_e4m3fn", rows, 160, 0, rows * RB)
    with pytest.raises(SidecarShapeMismatch, match=r"at most 2\^32 - 1 per rank"):
        RowCache(SidecarReader(t, max_rows=8), np.zeros((10, RB), np.uint8))
    with RowCache(SidecarReader(t, vocab_start=5, vocab_end=5 + (1 << 32) - 1, max_rows=8),
                  np.zeros((10, RB), np.uint8)) as c:  # the largest range that fits
        np.testing.assert_array_equal(read(c, [5, (1 << 32) + 3, 4]), np.zeros((3, RB), np.uint8))


# ----------------------------------------------------------------------------- never another id's row


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_id_colliding_still_returns_each_ids_row(table, policy):
    """debug hash 2: every id has the same home bucket (one probe chain through the whole index)."""
    rng = np.random.default_rng(3)
    with cache_of(table, 64, policy=policy, _debug_hash=2) as c:
        for _ in range(40):
            ids = rng.integers(0, 400, 150)
            np.testing.assert_array_equal(read(c, ids), expect(ids, 0, ROWS))


def test_crafted_collisions_with_evictions_in_the_chain(table):
    """debug hash 1 (id mod index size): ids that share a home bucket, deleted and reinserted in any order."""
    cap = 50
    index_cap = cap + cap // 2 + 1  # row_cache.c: load factor 2/3
    rng = np.random.default_rng(4)
    colliding = np.array([7 + k * index_cap for k in range(ROWS // index_cap)])
    with cache_of(table, cap, _debug_hash=1) as c:
        for _ in range(60):
            ids = np.concatenate([rng.choice(colliding, 40), rng.integers(0, ROWS, 20)])
            rng.shuffle(ids)
            np.testing.assert_array_equal(read(c, ids), expect(ids, 0, ROWS))


@st.composite
def operations(draw):
    return draw(st.lists(st.tuples(st.sampled_from(["read", "prefetch"]),
                                   st.lists(st.integers(0, 299), max_size=80)), min_size=1, max_size=25))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=operations(), policy=st.sampled_from(sorted(POLICIES)), capacity=st.integers(1, 120),
       debug_hash=st.sampled_from([0, 1, 2]))
def test_any_sequence_of_lookups_and_prefetches(table, ops, policy, capacity, debug_hash):
    """Against a model: every row right, the capacity never exceeded, counters consistent."""
    with cache_of(table, capacity, lo=50, hi=250, policy=policy, _debug_hash=debug_hash) as c:
        looked = 0
        for kind, ids in ops:
            if kind == "read":
                np.testing.assert_array_equal(read(c, ids), expect(ids, 50, 250))
                looked += sum(50 <= i < 250 for i in ids)
            else:
                c.prefetch(np.asarray(ids, np.int64))
            valid, filling = c.occupancy()
            assert valid <= capacity and filling == 0
        st = c.stats
        assert st["lookups"] == looked == st["hits"] + st["miss_lookups"]
        assert st["inserts"] - st["evictions"] == c.occupancy()[0]


def test_concurrent_lookups_and_prefetches_get_their_own_rows(table):
    """Threads (the GIL is released in C) on a tiny cache: evictions, fills and waits interleave."""
    errors = []

    def worker(seed, kind):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(150):
                ids = rng.integers(0, 600, rng.integers(1, 200))
                if kind == "prefetch":
                    c.prefetch(ids)
                else:
                    got = read(c, ids)
                    if not np.array_equal(got, expect(ids, 100, 500)):
                        errors.append(f"thread {seed}: wrong rows")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    for debug_hash in (0, 2):
        with cache_of(table, 40, lo=100, hi=500, _debug_hash=debug_hash, workers=3) as c:
            threads = [threading.Thread(target=worker, args=(s, "read" if s % 3 else "prefetch")) for s in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors, errors[:5]
            assert c.occupancy() [1] == 0


def test_a_row_being_filled_is_waited_for_not_read_twice(table):
    ids = np.arange(1000, 1300)
    with cache_of(table, 1000, _debug_delay_us=300_000) as c:
        t = threading.Thread(target=c.prefetch, args=(ids,))
        t.start()
        time.sleep(0.1)  # the prefetch has reserved the rows and sleeps in its read
        np.testing.assert_array_equal(read(c, ids), expect(ids, 0, ROWS))
        t.join()
        st = c.stats
    assert st["rows_read"] == 300 and st["waits"] == 300 and st["prefetch_hits"] == 300 and st["hits"] == 300


# ----------------------------------------------------------------------------- failure


def test_a_truncated_table_fails_closed(table):
    c = cache_of(table, 100)
    read(c, [1, 2, 3])
    with open(table.file, "r+b") as f:
        f.truncate(4096)
    with pytest.raises(SidecarTruncated, match="truncated: it has 4096 bytes"):
        read(c, [1, 5000])
    with pytest.raises(SidecarReaderUnusable, match="unusable after an earlier I/O failure"):
        read(c, [1])  # even a row it holds
    assert not c.usable
    c.close()


def test_a_read_that_fails_mid_fill_fails_its_waiters_too(table):
    """The filling call hits a short read (the file is cut while it sleeps in its read); a call that
    was waiting for those rows must get an error, never the bytes of a half-filled slot."""
    ids = np.arange(15000, 15100)
    c = cache_of(table, 1000, _debug_delay_us=400_000)
    results = {}

    def call(name, fn):
        try:
            fn()
            results[name] = "returned"
        except Exception as exc:  # noqa: BLE001 - checked below
            results[name] = exc

    filler = threading.Thread(target=call, args=("filler", lambda: c.prefetch(ids)))
    waiter = threading.Thread(target=call, args=("waiter", lambda: read(c, ids)))
    filler.start()
    time.sleep(0.1)  # the filler reserved the rows and sleeps in its read
    waiter.start()
    time.sleep(0.1)  # the waiter found them being filled and waits
    with open(table.file, "r+b") as f:
        f.truncate(ROWS * RB // 2)
    filler.join()
    waiter.join()
    assert isinstance(results["filler"], SidecarTruncated) and "short read" in str(results["filler"]), results
    assert isinstance(results["waiter"], (SidecarIOError, SidecarTruncated)), results  # the cause, not zeros
    assert c.stats["waits"] >= 1  # it did wait for the failed fill
    with pytest.raises(SidecarReaderUnusable):
        read(c, [1])
    c.close()


def test_close_waits_for_calls_in_flight_then_refuses(table):
    c = cache_of(table, 100, _debug_delay_us=200_000)
    t = threading.Thread(target=read, args=(c, [1, 2, 3]))
    t.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    c.close()
    assert time.perf_counter() - t0 > 0.05  # it waited for the read
    t.join()
    with pytest.raises(SidecarReaderUnusable, match="closed"):
        read(c, [1])
    with pytest.raises(SidecarReaderUnusable):
        c.reader.read_rows(np.array([1]), np.zeros((1, RB), np.uint8))  # the reader went with it


# ----------------------------------------------------------------------------- the page cache stays clean


def _resident_pages(path: Path) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    vec = np.zeros((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE, np.uint8)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
        view = np.frombuffer(m, np.uint8)
        assert libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size),
                            ctypes.c_void_p(vec.ctypes.data)) == 0
        del view
    return int((vec & 1).sum())


@pytest.mark.parametrize("direct", [True, False])
def test_misses_leave_no_table_pages_in_the_page_cache(table, direct):
    fd = os.open(table.file, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    assert _resident_pages(table.file) == 0
    ids = np.random.default_rng(5).integers(0, ROWS, 2000)
    with cache_of(table, 3000, direct=direct) as c:
        np.testing.assert_array_equal(read(c, ids), expect(ids, 0, ROWS))
        assert c.stats["pages_read"] > 500
        assert _resident_pages(table.file) == 0


# ----------------------------------------------------------------------------- policy, budget, simulation


def test_s3fifo_keeps_a_hot_set_through_scans_that_evict_it_from_lru(table):
    """Each batch: 300 hot rows looked up twice, then 2,000 rows seen once. LRU (1,000 rows) loses the
    hot set to every scan; S3-FIFO promotes it (a second lookup while new) and serves it from its main
    queue while the scans pass through the small one."""
    hot = np.arange(300)
    rates = {}
    for policy in ("lru", "s3fifo"):
        with cache_of(table, 1000, policy=policy) as c:
            for b in range(8):
                before = c.stats["hits"]
                read(c, hot)
                rate = (c.stats["hits"] - before) / hot.size
                read(c, hot)
                read(c, 1000 + b * 2000 + np.arange(2000))
            rates[policy] = rate
    assert rates["lru"] == 0.0 and rates["s3fifo"] == 1.0, rates


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_simulator_counts_exactly_what_a_real_cache_does(table, policy):
    rng = np.random.default_rng(6)
    calls = [(k % 5 == 4, rng.integers(0, ROWS // 4, rng.integers(1, 3000))) for k in range(40)]
    real = cache_of(table, 2000, policy=policy, _seed=1)  # the seed places the ghost's Bloom bits
    sim = CacheSimulator(2000, total_rows=ROWS, row_bytes=RB, policy=policy, seed=1)
    for prefetch, ids in calls:
        if prefetch:
            real.prefetch(ids)
            sim.prefetch(ids)
        else:
            read(real, ids)
            sim.access(ids)
    a, b = real.stats, sim.stats
    real.close()
    a.pop("bytes_read")
    b.pop("bytes_read")
    assert a == b and a["evictions"] > 1000


def test_the_simulator_ranks_and_admits_as_a_real_cache_does(table):
    """The hot file's two calls (``hottest``, ``admit``) on the simulator give a real cache's answers (the hot-file
    benchmark replays traces with them)."""
    rng = np.random.default_rng(8)
    real = cache_of(table, 1500, lo=500, hi=ROWS, _seed=3)
    sim = CacheSimulator(1500, total_rows=ROWS, row_bytes=RB, seed=3, vocab_start=500, vocab_end=ROWS)
    for _ in range(20):
        ids = rng.integers(0, ROWS // 3, rng.integers(1, 800))
        read(real, ids)
        sim.access(ids)
    ids, rows, counts = real.hottest(700)
    sim_ids, sim_counts = sim.hottest(700)
    np.testing.assert_array_equal(sim_ids, ids)
    np.testing.assert_array_equal(sim_counts, counts)
    assert ids.size == 700 and ids.min() >= 500
    np.testing.assert_array_equal(rows, expect(ids, 500, ROWS))
    new = np.arange(ROWS - 900, ROWS)  # rows neither has: placed in order until no slot is free
    assert sim.admit(new) == real.admit(new, expect(new, 500, ROWS), np.ones(new.size, np.uint16)) > 0
    a, b = real.stats, sim.stats
    real.close()
    a.pop("bytes_read")
    b.pop("bytes_read")
    assert a == b
    with pytest.raises(ValueError, match="counts"):
        sim.admit(new, np.ones(3, np.uint16))


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("debug_hash", [0, 1])
def test_large_lookups_copy_on_several_threads_with_the_serial_decisions(table, policy, debug_hash):
    """A prefill-sized lookup (>= 8,192 rows in this rank) probes and copies its hits on several
    threads; every row stays right and every decision and counter equals the serial simulation's."""
    rng = np.random.default_rng(7)
    calls = [(k % 4 == 3, rng.integers(0, ROWS // 2, rng.integers(9000, 14000))) for k in range(16)]
    real = cache_of(table, 3000, lo=500, hi=ROWS, policy=policy, _seed=2, _debug_hash=debug_hash)
    sim = CacheSimulator(3000, total_rows=ROWS, row_bytes=RB, policy=policy, seed=2, vocab_start=500, vocab_end=ROWS,
                         _debug_hash=debug_hash)
    for prefetch, ids in calls:
        if prefetch:
            real.prefetch(ids)
            sim.prefetch(ids)
        else:
            np.testing.assert_array_equal(read(real, ids), expect(ids, 500, ROWS))
            sim.access(ids)
    a, b = real.stats, sim.stats
    real.close()
    assert a.pop("parallel_passes") == sum(not p for p, _ in calls) and b.pop("parallel_passes") == 0
    a.pop("bytes_read")
    b.pop("bytes_read")
    assert a == b and a["hits"] > 10_000


def test_large_lookups_race_prefetches_and_evictions(table):
    """Large (parallel) lookups beside small lookups and prefetches on a cache far smaller than the
    ids: hits copied on helper threads while other calls wait for the lock, fills and evictions."""
    errors = []

    def worker(seed, kind):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(25):
                n = rng.integers(8192, 12000) if kind == "large" else rng.integers(1, 300)
                ids = rng.integers(0, 1500, n)
                if kind == "prefetch":
                    c.prefetch(ids)
                elif not np.array_equal(read(c, ids), expect(ids, 100, 1200)):
                    errors.append(f"thread {seed} ({kind}): wrong rows")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    with cache_of(table, 600, lo=100, hi=1200, workers=4) as c:
        kinds = ["large", "large", "small", "prefetch", "prefetch"]
        threads = [threading.Thread(target=worker, args=(s, k)) for s, k in enumerate(kinds)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[:5]
        assert c.occupancy()[1] == 0 and c.stats["parallel_passes"] > 0


@pytest.mark.parametrize("budget", [1 << 20, 64 << 20, 1 << 30])
def test_the_budget_is_a_hard_bound(budget):
    for policy in POLICIES:
        cap = capacity_for_budget(budget, RB, policy=policy, max_rows=32768)
        used = cap * RB + metadata_bytes(cap, policy) + fixed_bytes(max_rows=32768)
        over = (cap + 1) * RB + metadata_bytes(cap + 1, policy) + fixed_bytes(max_rows=32768)
        assert used <= budget < over or cap == 0


def test_working_set_counts_rows_metadata_and_buffers(table):
    budget = 32 << 20
    cap = capacity_for_budget(budget, RB, max_rows=4096)
    assert cap > 100_000
    with cache_of(table, cap) as c:
        assert c.working_set_bytes <= budget
        assert c.working_set_bytes == cap * RB + c.metadata_bytes + fixed_bytes(max_rows=4096)


def test_for_budget_sizes_and_allocates_through_the_caller(table):
    got = []

    def allocate(nbytes):
        got.append(nbytes)
        return np.zeros(nbytes, np.uint8)

    budget = 40 << 20
    c = RowCache.for_budget(SidecarReader(table, max_rows=4096), budget, allocate=allocate)
    assert got == [c.capacity * RB] and c.working_set_bytes <= budget
    np.testing.assert_array_equal(read(c, [3, 4]), expect([3, 4], 0, ROWS))
    c.close()
    assert RowCache.for_budget(SidecarReader(table, max_rows=4096), 0) is None  # 0: off


@pytest.mark.parametrize("raw,msg", [("1.5", "not an integer"), ("-1", "out of range"), ("2000000", "out of range"),
                                     ("lots", "not an integer"), (" 0 ", "not an integer")])
def test_budget_knob_refuses_bad_values(raw, msg):
    from sglang_ssd_stream.knobs import knob

    for engine in ("sglang", "vllm"):
        k = knob(engine, "ROW_CACHE_MB")
        with pytest.raises(ValueError, match=f"{k.name}.*{msg}"):
            k.parse(raw)
        assert k.parse(None) == 1024 and k.parse("0") == 0  # unset: the default; 0: off


# ----------------------------------------------------------------------------- as a host node


def test_host_read_runs_on_a_native_thread(table):
    lib = load()
    ids = np.array([4, 19999, 4, 7000], np.int64)
    out = np.zeros((4, RB), np.uint8)
    with cache_of(table, 10) as c:
        node = c.host_read(ids, out, what="PLE layer 0 row cache read")
        for _ in range(2):
            out[:] = 0
            handle = lib.rc_test_start(node.function, node.argument)
            assert handle and lib.rc_test_join(handle) == 0
            np.testing.assert_array_equal(out, expect(ids, 0, ROWS))
        assert node.calls == 2
        assert captured_read(c, ids, out, what="x").function == node.function  # the gather's host_read seam


@pytest.mark.parametrize("closing,message", [
    ("c.close()", "the PLE row cache is closed"),
    ("node.close()", "the PLE row cache read was closed while a graph that replays it can still run")])
def test_host_read_after_close_ends_the_process_with_a_message(tmp_path, closing, message):
    script = textwrap.dedent(f"""
        import numpy as np, sys
        sys.path.insert(0, {str(REPO)!r})
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_row_cache import make_table, cache_of
        from sglang_ssd_stream.sidecar.row_cache import load
        from pathlib import Path
        c = cache_of(make_table(Path({str(tmp_path)!r}) / "t.bin"), 10)
        ids, out = np.array([1], np.int64), np.zeros((1, 160), np.uint8)
        node = c.host_read(ids, out, what="PLE layer 3 row cache read")
        {closing}
        lib = load()
        lib.rc_test_join(lib.rc_test_start(node.function, node.argument))
        print("not reached")
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 70, p.stderr
    assert f"PLE layer 3 row cache read failed inside a CUDA stream/graph: {message}" in p.stderr
    assert "not reached" not in p.stdout


# ----------------------------------------------------------------------------- the configuration object


def test_a_library_whose_config_layout_differs_is_refused(monkeypatch):
    """``rc_create`` takes one ``rc_config_t``; Python's mirror must match it field for field, else the library
    is refused before any cache is built (a shifted field would silently misconfigure every cache)."""
    import ctypes

    from sglang_ssd_stream.sidecar import row_cache
    from sglang_ssd_stream.sidecar.native import NativeBuildError

    class Shifted(ctypes.Structure):
        _fields_ = [*row_cache._Config._fields_[1:], row_cache._Config._fields_[0]]  # capacity moved last

    monkeypatch.setattr(row_cache, "_lib", None)
    monkeypatch.setattr(row_cache, "_Config", Shifted)
    with pytest.raises(NativeBuildError, match=rf"config \[\d+(, \d+)+\]; expected ABI {row_cache.ABI}"):
        row_cache.load()


def test_the_config_object_reaches_the_c_cache(table):
    """Each field of RowCacheConfig acts: the policy, the workers, the seed and the test-only hash."""
    with cache_of(table, 64, policy="lru", workers=3, _seed=5, _debug_hash=2) as c:
        assert (c.policy, c.workers, c.config.seed, c.config.debug_hash) == ("lru", 3, 5, 2)
        np.testing.assert_array_equal(read(c, [1, 2]), expect([1, 2], 0, ROWS))
        np.testing.assert_array_equal(read(c, [1]), expect([1], 0, ROWS))
        assert c.stats["hits"] == 1  # the second lookup, served from the cache
    with pytest.raises(ValueError, match="row cache policy 'arc'"):
        RowCacheConfig(policy="arc")


# ----------------------------------------------------------------------------- the hot set (issue 27 item 1)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_hottest_ranks_rows_by_lookups_then_id(table, policy):
    """Bounded per-row lookup counts: the rows looked up most, most first, ties by the lower id; rows only
    prefetched and never looked up are not hot."""
    with cache_of(table, 100, policy=policy) as c:
        for ids in ([5, 7, 9, 20, 10], [5, 7], [5]):
            read(c, ids)
        c.prefetch(np.array([11, 12], np.int64))
        ids, rows, counts = c.hottest(10)
        assert ids.tolist() == [5, 7, 9, 10, 20] and counts.tolist() == [3, 2, 1, 1, 1]
        np.testing.assert_array_equal(rows, expect(ids, 0, ROWS))
        assert c.hottest(2)[0].tolist() == [5, 7] and c.hottest(0)[0].size == 0
        c.hottest(10, age=True)  # halves every count: recent lookups outrank old ones afterwards
        read(c, [20])
        ids, _, counts = c.hottest(10)
        assert ids.tolist() == [5, 7, 20] and counts.tolist() == [1, 1, 1]


def test_hot_counts_saturate(table):
    with cache_of(table, 8) as c:
        out = np.empty((1, RB), np.uint8)
        for _ in range(65_600):
            c.read_rows(np.array([3], np.int64), out)
        assert c.hottest(1)[2].tolist() == [65_535]


def test_admit_places_verified_rows_without_reading_the_disk(table):
    with cache_of(table, 100) as hot:
        for ids in ([5, 7, 9], [5, 7], [5]):
            read(hot, ids)
        ids, rows, counts = hot.hottest(100)
    with cache_of(table, 100, lo=0, hi=8) as c:  # a rank holding rows [0, 8): row 9 is another rank's
        assert c.admit(ids, rows, counts) == 2
        assert c.contains(np.array([5, 7, 9], np.int64)).tolist() == [True, True, False]
        assert c.stats["rows_read"] == 0
        np.testing.assert_array_equal(read(c, [5, 7]), expect([5, 7], 0, 8))
        assert c.stats["rows_read"] == 0 and c.stats["hits"] == 2
        got_ids, _, got_counts = c.hottest(10)
        assert got_ids.tolist() == [5, 7] and got_counts.tolist() == [4, 3]  # the file's counts, then this lookup
        assert c.admit(ids[:1], rows[:1]) == 0  # already cached: left alone
    with cache_of(table, 2) as small:  # placed as a prefetch places rows: a full cache evicts as it would
        assert small.admit(np.arange(3, dtype=np.int64), expect(np.arange(3), 0, ROWS)) == 3
        assert small.contains(np.arange(3, dtype=np.int64)).sum() == 2


def test_admit_refuses_bad_shapes_and_a_closed_cache(table):
    c = cache_of(table, 10)
    with pytest.raises(ValueError):
        c.admit(np.array([1, 2], np.int64), np.zeros((1, RB), np.uint8))
    with pytest.raises(ValueError, match="counts"):
        c.admit(np.array([1], np.int64), np.zeros((1, RB), np.uint8), np.zeros(2, np.uint16))
    c.close()
    with pytest.raises(SidecarReaderUnusable):
        c.admit(np.array([1], np.int64), np.zeros((1, RB), np.uint8))
