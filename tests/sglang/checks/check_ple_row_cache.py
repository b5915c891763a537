"""The PLE row cache and prompt-ahead prefetch inside the real sglang 0.5.23 (CPU, TRITON_INTERPRET=1).

Runs inside the sglang venv. The hooks are installed through sglang's real ``load_plugins()``; the
model pieces are those of ``check_ple_hook.py`` (the real ``Qwen4ExpNGramEmbedding``, filled by the real
``Qwen4ExpForConditionalGeneration.load_weights`` from real safetensors shards, ids from its own
``_hash_contexts``). The scheduler side is the real ``NgramEmbeddingManager.prepare_for_forward`` with
real ``Req`` and ``ScheduleBatch`` objects, and the real ``release_kv_cache`` as the scheduler calls it.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent
BUDGET = "SGLANG_SSD_STREAM_ROW_CACHE_MB"
WINDOW = "SGLANG_SSD_STREAM_PREFETCH_CHUNKS"


def _base():
    """check_ple_hook.py's model stand-ins and helpers (loaded, not collected: its tests run in their own file)."""
    spec = importlib.util.spec_from_file_location("_check_ple_hook_base", HERE / "check_ple_hook.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


B = _base()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import sglang.srt.models.qwen4_exp as q

    from sglang_ssd_stream.sidecar.build import build_sidecar

    ep = tmp_path_factory.mktemp("ep") / "ssd_stream_ple_check-0.0.dist-info"
    ep.mkdir()
    (ep / "METADATA").write_text("Metadata-Version: 2.1\nName: ssd-stream-ple-check\nVersion: 0.0\n")
    (ep / "entry_points.txt").write_text(B.EP_TEXT)
    sys.path.insert(0, str(ep.parent))
    from sglang.srt.plugins import load_plugins

    load_plugins()
    cf = B._conftest()
    root = tmp_path_factory.mktemp("ple")
    ck = cf.make_checkpoint(root / "ck", {B.LAYER: ("float8_e4m3fn", B.ROWS, B.COLS)}, parts=B.PARTS, files=2, seed=5)
    build_sidecar(ck.path, root / "sidecar", progress=False)
    return types.SimpleNamespace(q=q, root=root, ck=ck, sidecar=root / "sidecar")


@pytest.fixture(autouse=True)
def _small_staging(monkeypatch):
    """64-token lookups (1,024 rows): the per-call buffers the budget reserves stay ~8 MiB, so a few MiB of
    budget leaves a cache smaller than the table (evictions happen)."""
    monkeypatch.setenv("SGLANG_SSD_STREAM_PLE_MAX_TOKENS", "64")
    yield
    from sglang_ssd_stream.sglang import prefetch

    prefetch.clear()


def _load(env, monkeypatch, budget: str | None, tp=(0, 1)):
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setenv("SGLANG_SSD_STREAM_SIDECAR", str(env.sidecar))
    if budget is None:
        monkeypatch.delenv(BUDGET, raising=False)
    else:
        monkeypatch.setenv(BUDGET, budget)
    with get_context().override_server_args():
        get_context().set_server_args(ServerArgs(model_path=str(env.ck.path), chunked_prefill_size=32))
        m = B._Model(env.q, B._config("float8_e4m3fn"), tp)
        m.load(env.q, env.ck.path)
    return m


def _batches(q, ngram, n: int, seed: int) -> list[torch.Tensor]:
    """``n`` lookups of 60 tokens (960 row ids each) from the model's own hashing."""
    return [B._ids(q, ngram, 60, seed=seed + i) for i in range(n)]


# ----------------------------------------------------------------------------- the cache in the hooks


@pytest.mark.parametrize("budget", [None, "9"], ids=["default-budget", "9MiB-evicting"])
@pytest.mark.parametrize("tp", [(0, 1), (1, 2)])
def test_cached_rows_identical_to_uncached_and_the_cache_serves_them(env, monkeypatch, budget, tp):
    from sglang_ssd_stream.sidecar.row_cache import RowCache, captured_read

    plain = _load(env, monkeypatch, "0", tp)
    assert type(plain.ngram.ngram_embedding._ssd_stream.reader).__name__ == "MappedReader"  # budget 0: as before
    lookups = _batches(env.q, plain.ngram, 16, seed=tp[0] * 7 + 1)
    lookups.append(lookups[0].clone())  # a repeat: every row of it was read before
    expected = [B._gather(plain.ngram.ngram_embedding, ids) for ids in lookups]

    cached = _load(env, monkeypatch, budget, tp)
    gather = cached.ngram.ngram_embedding._ssd_stream
    cache = gather.reader
    assert isinstance(cache, RowCache) and gather._host_read is captured_read
    lo, hi = cached.ngram.ngram_embedding.shard_indices.org_vocab_start_index, \
        cached.ngram.ngram_embedding.shard_indices.org_vocab_end_index
    if budget is None:  # 1024 MiB: capped at what this rank's rows need (a small table is held whole)
        assert cache.capacity == hi - lo
    else:
        assert 0 < cache.capacity < hi - lo
        assert cache.working_set_bytes <= 9 << 20
    got = [B._gather(cached.ngram.ngram_embedding, ids) for ids in lookups]
    for g, e in zip(got, expected, strict=False):
        assert torch.equal(g.view(torch.int16), e.view(torch.int16))  # bit for bit, other ranks' rows zero
    st = cache.stats
    assert st["calls"] == len(lookups) and st["lookups"] > 0 and st["hits"] > 0, st
    flat = torch.cat([x.reshape(-1) for x in lookups[:-1]])
    distinct = flat[(flat >= lo) & (flat < hi)].unique().numel()
    if budget is None:
        assert st["evictions"] == 0
        assert st["rows_read"] == distinct  # each row of this rank read once, then hits
    else:
        assert distinct > cache.capacity and st["evictions"] > 0, (distinct, cache.capacity, st)

    # The captured read (a CUDA graph's host node) is the cache's native function: the same rows.
    ids = lookups[1].reshape(-1).numpy().astype(np.int64)
    out = np.zeros((ids.size, cache.row_bytes), np.uint8)
    node = gather._host_read(cache, ids, out, what="check")
    node.run()
    ref = np.zeros_like(out)
    plain.ngram.ngram_embedding._ssd_stream.reader.read_rows(ids, ref)
    assert node.calls == 1 and np.array_equal(out, ref)


def test_the_budget_is_split_over_the_bound_layers(env, monkeypatch):
    """The knob is MiB for all PLE layers of the process: with 2 layers bound each gets half."""
    from sglang_ssd_stream.sglang import hooks

    seen = []
    real = hooks.wrap_in_row_cache

    def spy(reader, **kw):
        seen.append(kw)
        return real(reader, **kw)

    monkeypatch.setattr(hooks, "wrap_in_row_cache", spy)
    m = _load(env, monkeypatch, "20")
    assert seen == [dict(layer=B.LAYER, share=20 << 20, layers=1, budget_mb=20, device=torch.device("cpu"))]
    assert m.ngram.ngram_embedding._ssd_stream.reader.working_set_bytes <= 20 << 20
    # two layers' share of the same budget: a cache of at most half of it
    cache = real(m.ngram.ngram_embedding._ssd_stream.reader.reader, layer=B.LAYER, share=(20 << 20) // 2, layers=2,
                 budget_mb=20, device=torch.device("cpu"))
    assert cache.working_set_bytes <= 10 << 20 < m.ngram.ngram_embedding._ssd_stream.reader.working_set_bytes


def test_a_budget_that_holds_no_row_is_refused_naming_the_knob(env, monkeypatch):
    from sglang_ssd_stream.sglang.hooks import SidecarHookError

    with pytest.raises(SidecarHookError, match=r"SGLANG_SSD_STREAM_ROW_CACHE_MB=1 MiB split over 1 PLE layer\(s\) "
                                               r"is 1\.0 MiB per layer, which holds no 160-byte row .* set at least "
                                               r"\d+ MiB, or 0 to serve without the row cache"):
        _load(env, monkeypatch, "1")


def test_a_cache_that_cannot_be_built_stops_the_load(env, monkeypatch, tmp_path):
    """Fatal on failure: no silent fallback to the uncached reader."""
    from sglang_ssd_stream.sglang.hooks import SidecarHookError
    from sglang_ssd_stream.sidecar import row_cache

    monkeypatch.setattr(row_cache, "_lib", None)
    monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(tmp_path / "kit"))
    monkeypatch.setenv("CC", "false")
    with pytest.raises(SidecarHookError, match=r"(?s)PLE layer 3: cannot build the row cache "
                                               r"\(SGLANG_SSD_STREAM_ROW_CACHE_MB=64 MiB over 1 layer\(s\)\): "
                                               r"NativeBuildError: .*compiling libssd_row_cache.so failed.*"
                                               r"set SGLANG_SSD_STREAM_ROW_CACHE_MB=0"):
        _load(env, monkeypatch, "64")


@pytest.mark.parametrize("name,value,message", [
    (BUDGET, "lots", "SGLANG_SSD_STREAM_ROW_CACHE_MB='lots' is not an integer number of MiB"),
    (BUDGET, "-1", "SGLANG_SSD_STREAM_ROW_CACHE_MB=-1 is out of range 0..1048576 MiB"),
    (WINDOW, "65", "SGLANG_SSD_STREAM_PREFETCH_CHUNKS=65 is out of range 0..64 chunks"),
    (WINDOW, "two", "SGLANG_SSD_STREAM_PREFETCH_CHUNKS='two' is not an integer number of prefill chunks ahead"),
])
def test_bad_row_cache_knobs_stop_the_plugin_at_start(monkeypatch, name, value, message):
    from sglang_ssd_stream.sglang import plugin

    monkeypatch.setenv(name, value)
    monkeypatch.setattr(plugin, "_registered", False)
    with pytest.raises(SystemExit, match=re.escape(message)):
        plugin.register()


def test_memory_line_states_cache_and_staging_bytes(env, monkeypatch, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="sglang_ssd_stream.sglang.hooks"):
        m = _load(env, monkeypatch, "9")
    gather = m.ngram.ngram_embedding._ssd_stream
    from sglang_ssd_stream.staging.host_memory import fmt_bytes

    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("PLE host memory:"))
    assert line == (f"PLE host memory: row cache {fmt_bytes(gather.reader.working_set_bytes)} "
                    f"({gather.reader.capacity} rows; SGLANG_SSD_STREAM_ROW_CACHE_MB=9 MiB for 1 layer(s)) + staging "
                    f"{fmt_bytes(gather.pinned_bytes)} = "
                    f"{fmt_bytes(gather.reader.working_set_bytes + gather.pinned_bytes)}")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sglang_ssd_stream.sglang.hooks"):
        _load(env, monkeypatch, "0")
    assert any(r.getMessage().startswith("PLE host memory: row cache off (SGLANG_SSD_STREAM_ROW_CACHE_MB=0), staging ")
               for r in caplog.records)


# ----------------------------------------------------------------------------- the scheduler hooks


def _req(rid: str, prompt: list[int], output: tuple = ()):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    r = Req(rid, "", list(prompt), SamplingParams())
    r.output_ids.extend(output)
    return r


def _batch(mode: str, reqs, prefix, extend):
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return ScheduleBatch(reqs=reqs, forward_mode=getattr(ForwardMode, mode), prefix_lens=list(prefix),
                         extend_lens=list(extend))


def _manager():
    from sglang.srt.model_executor.model_runner_components.ngram_embedding_manager import NgramEmbeddingManager

    return NgramEmbeddingManager(enabled=False, table=None, n=0)


def test_scheduler_hooks_land_on_the_real_targets(env):
    import sglang.srt.managers.scheduler as scheduler
    from sglang.srt.mem_cache import common
    from sglang.srt.model_executor.model_runner_components.ngram_embedding_manager import NgramEmbeddingManager

    from sglang_ssd_stream.sglang import hooks

    assert hooks._installed
    hooked = NgramEmbeddingManager.__dict__["prepare_for_forward"]
    assert hooked.__wrapped__.__code__ is not hooked.__code__  # the registry's AROUND wrapper around the original
    assert hooked.__wrapped__.__module__ == NgramEmbeddingManager.__module__
    assert scheduler.release_kv_cache is common.release_kv_cache  # the scheduler's `from … import` copy too
    arrive = scheduler.Scheduler.__dict__["_add_request_to_queue"]
    assert arrive.__wrapped__.__code__ is not arrive.__code__ and arrive.__wrapped__.__module__ == scheduler.__name__
    assert common.release_kv_cache.__wrapped__.__code__ is not common.release_kv_cache.__code__
    assert hooks._stale_bindings(common.release_kv_cache.__wrapped__) == []  # no module kept the original


def test_prepare_for_forward_announces_the_chunk_and_the_window_and_prefetches(env, monkeypatch):
    """A prompt of 100 tokens in chunks of 32 (the server's chunked_prefill_size), window 2: the first
    chunk's call queues [0, 96); the second [96, 100). The prefetched rows are the ones the forward reads:
    its lookup of chunk 2 is all hits."""
    from sglang_ssd_stream.sglang import prefetch

    monkeypatch.setenv(WINDOW, "2")
    m = _load(env, monkeypatch, None)
    (pf,) = prefetch.active()
    assert (pf.chunk_tokens, pf.window) == (32, 2)
    calls = []
    real = pf.scheduled
    monkeypatch.setattr(pf, "scheduled", lambda *a: (calls.append(a[:1] + a[2:]), real(*a))[1])
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(10, 1000, 100)]
    req = _req("req-a", prompt)
    mgr = _manager()
    for start in (0, 32, 64, 96):
        n = min(32, 100 - start)
        batch = _batch("EXTEND", [req], [start], [n])
        assert mgr.prepare_for_forward(batch, chunked_req=req if start + n < 100 else None) is batch
    assert calls == [("req-a", 0, 32), ("req-a", 32, 64), ("req-a", 64, 96), ("req-a", 96, 100)]
    assert pf.drain(60)
    assert pf.stats.chunks_fetched == 4 and pf.stats.tokens_fetched == 100  # [0,32) [32,64) [64,96) [96,100)
    cache = m.ngram.ngram_embedding._ssd_stream.reader
    before = cache.stats
    assert before["prefetch_rows"] > 0 and before["lookups"] == 0
    # the forward's lookup of chunk 2, hashed by sglang itself: every row is already there
    from sglang_ssd_stream.sidecar.ngram import NGramHash

    emb = m.ngram
    h = NGramHash.from_module(emb, rows=emb.ngram_embedding.org_vocab_size)
    ids = torch.from_numpy(h.chunk_ids(prompt, 32, 64).reshape(32, 16))
    windows = torch.tensor([[prompt[i - 2] if i >= 2 else B.EOS, prompt[i - 1] if i >= 1 else B.EOS, prompt[i]]
                            for i in range(32, 64)])
    env.q.get_req_to_token_pool = lambda: types.SimpleNamespace(ple_window_cache=None)
    assert torch.equal(emb._hash_contexts(windows, decode_sized=False), ids)  # our prefetch ids == sglang's
    B._gather(emb.ngram_embedding, ids)
    after = cache.stats
    assert after["lookups"] - before["lookups"] == 32 * 16
    assert after["hits"] - before["hits"] == 32 * 16 and after["rows_read"] == before["rows_read"]


def test_mixed_and_decode_batches_announce_only_prompt_tokens(env, monkeypatch):
    from sglang_ssd_stream.sglang import prefetch

    _load(env, monkeypatch, "64")
    (pf,) = prefetch.active()
    calls = []
    monkeypatch.setattr(pf, "scheduled", lambda *a: calls.append(a[:1] + a[2:]))
    new, old = _req("new", list(range(10, 60))), _req("old", list(range(10, 30)), output=(5, 6, 7))
    mgr = _manager()
    mgr.prepare_for_forward(_batch("DECODE", [old], [22], [1]), chunked_req=None)
    assert calls == []
    mgr.prepare_for_forward(_batch("MIXED", [new, old], [8, 22], [42, 1]), chunked_req=None)
    assert calls == [("new", 8, 50)]  # a prefix-cache hit of 8 tokens: fetched from there; "old" decodes
    assert mgr.prepare_for_forward(None, chunked_req=None) is None


def test_a_slow_prefetch_never_delays_the_scheduler(env, monkeypatch):
    """The cache's prefetch blocks for 2 s per call: prepare_for_forward still returns at once, and a finished
    request's queued chunks are dropped (release_kv_cache, as the scheduler calls it on finish/abort)."""
    from sglang.srt.mem_cache import common

    from sglang_ssd_stream.sglang import prefetch

    monkeypatch.setenv(WINDOW, "3")
    m = _load(env, monkeypatch, "64")
    cache = m.ngram.ngram_embedding._ssd_stream.reader
    started, release = threading.Event(), threading.Event()

    def slow(ids):
        started.set()
        release.wait(2.0)

    monkeypatch.setattr(cache, "prefetch", slow)
    (pf,) = prefetch.active()
    req = _req("slow", list(range(10, 138)))  # 4 chunks of 32
    mgr = _manager()
    t = time.perf_counter()
    batch = _batch("EXTEND", [req], [0], [32])
    assert mgr.prepare_for_forward(batch, chunked_req=req) is batch
    assert started.wait(10)  # the background thread is inside the slow read now
    for start in (32, 64):
        mgr.prepare_for_forward(_batch("EXTEND", [req], [start], [32]), chunked_req=req)
    took = time.perf_counter() - t
    assert took < 1.0, took  # never waited for the 2 s read
    assert pf.pending_chunks == 3  # [32,64) [64,96) [96,128) queued behind the one being read

    class _Tree:  # release_kv_cache's tree: the request holds no KV and no Mamba slot (the early-return path)
        def supports_mamba(self):
            return True

    assert not req.kv.holds_kv and not req.kv.holds_mamba and req.kv.is_kv_released  # a fresh Req
    common.release_kv_cache(req, _Tree(), checkpoint=False)  # the real function, through our AROUND hook
    assert pf.pending_chunks == 0 and pf.stats.chunks_dropped == 3
    release.set()
    assert pf.drain(10) and pf.stats.chunks_fetched == 1


def _scheduler(waiting: list, *, accept: bool = True):
    """What the real ``Scheduler._add_request_to_queue`` reads of its scheduler: no disaggregation, no queue
    limit, no hierarchical cache; ``accept`` False: the priority check refuses the request (an abort)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return types.SimpleNamespace(_set_or_validate_priority=lambda req: accept,
                                 _release_aborted_request=lambda req: None,
                                 disaggregation_mode=DisaggregationMode.NULL, _abort_on_queued_limit=lambda req: False,
                                 _prefetch_kvcache=lambda req: None, waiting_queue=waiting, processed_tokens_counter=0)


def test_an_arriving_request_has_its_first_chunk_fetched_before_it_is_scheduled(env, monkeypatch):
    """The real Scheduler._add_request_to_queue, through our AROUND hook: a new request's first chunk (32
    tokens here) is fetched while it waits; a retracted request or one the call aborts is not announced."""
    from sglang.srt.managers.scheduler import Scheduler

    from sglang_ssd_stream.sglang import prefetch
    from sglang_ssd_stream.sidecar.ngram import NGramHash

    m = _load(env, monkeypatch, None)
    (pf,) = prefetch.active()
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(10, 1000, 100)]
    waiting: list = []
    req = _req("early", prompt)
    Scheduler._add_request_to_queue(_scheduler(waiting), req)
    assert waiting == [req]  # sglang's own work done
    assert pf.drain(60) and pf.stats.arrivals == 1 and pf.stats.chunks_fetched == 1 and pf.stats.tokens_fetched == 32
    emb = m.ngram
    h = NGramHash.from_module(emb, rows=emb.ngram_embedding.org_vocab_size)
    cache = emb.ngram_embedding._ssd_stream.reader
    assert cache.contains(h.chunk_ids(prompt, 0, 32)).all()  # in the cache before any scheduling
    later = h.chunk_ids(prompt, 32, 100)
    assert not cache.contains(later).all()
    Scheduler._add_request_to_queue(_scheduler(waiting), _req("back", prompt[::-1]), is_retracted=True)
    refused: list = []
    Scheduler._add_request_to_queue(_scheduler(refused, accept=False), _req("refused", prompt[1:]))
    assert refused == [] and len(waiting) == 2
    assert pf.drain(60) and pf.stats.arrivals == 1 and pf.stats.chunks_fetched == 1
    assert "1 first chunk(s) queued on arrival" in prefetch.activity_line(pf)


def test_a_failing_prefetcher_never_reaches_the_scheduler(env, monkeypatch, caplog):
    """The scheduler hooks are advisory: a prefetcher that raises leaves the real sglang functions' work done and
    their results returned, and says so once per kind of call (a real read error surfaces in the forward)."""
    from sglang.srt.managers.scheduler import Scheduler

    from sglang_ssd_stream.sglang import prefetch

    _load(env, monkeypatch, None)
    (pf,) = prefetch.active()

    def broken(*a, **k):
        raise RuntimeError("prefetcher broken")

    monkeypatch.setattr(pf, "arrived", broken)
    monkeypatch.setattr(pf, "scheduled", broken)
    monkeypatch.setattr(prefetch, "_warned", set())
    waiting: list = []
    with caplog.at_level("WARNING", logger=prefetch.__name__):
        for rid in ("x", "y"):
            req = _req(rid, list(range(10, 50)))
            Scheduler._add_request_to_queue(_scheduler(waiting), req)
            batch = _batch("EXTEND", [req], [0], [40])
            assert _manager().prepare_for_forward(batch, chunked_req=None) is batch
    assert [r.rid for r in waiting] == ["x", "y"]
    said = [r.getMessage() for r in caplog.records if r.name == prefetch.__name__]
    assert len(said) == 2, said  # once per kind of call, not per request
    assert any("announcing an arriving request failed (RuntimeError: prefetcher broken)" in m for m in said)
    assert any("announcing a batch failed (RuntimeError: prefetcher broken)" in m for m in said)


def test_prefetch_off_with_the_cache_off(env, monkeypatch):
    from sglang_ssd_stream.sglang import prefetch

    _load(env, monkeypatch, "0")
    assert prefetch.active() == []
    batch = _batch("EXTEND", [_req("x", list(range(10, 40)))], [0], [30])
    assert _manager().prepare_for_forward(batch, chunked_req=None) is batch


# ----------------------------------------------------------------------------- the hot file across a restart


def test_a_restart_gets_the_hot_rows_back_before_any_lookup(env, monkeypatch, tmp_path, caplog):
    """SGLANG_SSD_STREAM_HOT_SHARE_PCT: a clean shutdown writes the hottest rows; the next load of the model
    (the next start) reads them into the row cache before any lookup, and they serve bit for bit."""
    import logging

    from sglang_ssd_stream.sidecar.hot_file import read_hot_file

    monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(tmp_path / "kit"))
    monkeypatch.setenv("SGLANG_SSD_STREAM_HOT_SHARE_PCT", "50")
    monkeypatch.setenv("SGLANG_SSD_STREAM_HOT_INTERVAL_S", "0")
    plain = _load(env, monkeypatch, "0")
    lookups = _batches(env.q, plain.ngram, 4, seed=11)
    expected = [B._gather(plain.ngram.ngram_embedding, ids) for ids in lookups]
    with caplog.at_level(logging.WARNING, logger="sglang_ssd_stream.sidecar.hot_file"):
        first = _load(env, monkeypatch, "9")
    hot = first._ssd_stream_hot
    assert hot is not None and hot.loaded_rows == 0 and hot.path.parent == tmp_path / "kit" / "hot"
    lines = [r.getMessage() for r in caplog.records if r.name == "sglang_ssd_stream.sidecar.hot_file"]
    assert len(lines) == 1 and "missing" in lines[0], lines  # the first start: no file, one line
    for ids in lookups:
        B._gather(first.ngram.ngram_embedding, ids)
    hot.close()  # a clean shutdown
    cap = first.ngram.ngram_embedding._ssd_stream.reader.capacity
    assert 0 < hot.written <= cap // 2 and hot.path.is_file()
    on_disk = read_hot_file(hot.path, hot.manifest, hot.row_range, 1 << 30)
    (hot_ids, _), = on_disk.layers.values()

    second = _load(env, monkeypatch, "9")
    cache = second.ngram.ngram_embedding._ssd_stream.reader
    assert second._ssd_stream_hot.loaded_rows == hot_ids.size
    assert cache.contains(hot_ids).all() and cache.stats["rows_read"] == 0  # in the cache, nothing read yet
    got = [B._gather(second.ngram.ngram_embedding, ids) for ids in lookups]
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g.view(torch.int16), e.view(torch.int16))
    assert cache.stats["hits"] > 0
    second._ssd_stream_hot.close()


def test_the_hot_file_is_on_by_default_and_off_at_0_or_without_a_row_cache(env, monkeypatch):
    monkeypatch.delenv("SGLANG_SSD_STREAM_HOT_SHARE_PCT", raising=False)
    hot = _load(env, monkeypatch, "9")._ssd_stream_hot
    assert hot is not None and hot.share == 1.0  # the default: the whole cache (docs/hot-file-measured.md)
    hot.close()
    monkeypatch.setenv("SGLANG_SSD_STREAM_HOT_SHARE_PCT", "0")
    assert _load(env, monkeypatch, "9")._ssd_stream_hot is None
    monkeypatch.setenv("SGLANG_SSD_STREAM_HOT_SHARE_PCT", "50")
    assert _load(env, monkeypatch, "0")._ssd_stream_hot is None
