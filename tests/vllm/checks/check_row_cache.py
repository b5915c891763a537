"""The row cache and prompt-ahead prefetch of the streamed backends, in the real vLLM 0.33.0 install.

Runs inside the vLLM venv (CPU platform), TP=1 on gloo, through vLLM's real plugin loader:

- the real embedding (vLLM's class selection, our ``StreamedPLEEmbedding``) with
  ``VLLM_PLE_ROW_CACHE_MB`` 0 and > 0 gives the same rows, the sidecar's; the cache is used
  (its counters), its budget is split over the sidecar's PLE layers, a share holding no row is
  refused, ``pread`` still refuses FULL graphs with it;
- the runner hook: vLLM's real V2 ``GPUModelRunner.update_requests`` as the plugin wrapped it,
  bound to a stand-in runner holding the request-state arrays it updates, driven by vLLM's own
  ``SchedulerOutput``/``NewRequestData``/``CachedRequestData``; the prefetcher it feeds is the
  real one over the real caches, its hashes built from the constructed module's buffers, and the
  rows it fetched are the ids vLLM's own ``compute_ngram_ids`` gives; a prefetch stuck on the disk
  does not hold the runner; vLLM's V1 runner refuses to start with a cache.
"""

from __future__ import annotations

import inspect
import logging
import threading
import types

import numpy as np
import pytest
import torch

from tests.vllm import harness
from tests.vllm.synthetic import random_table, write_sidecar
from vllm_ple_offload.errors import PleSettingsError

RUNNER_V2 = "vllm.v1.worker.gpu.model_runner"


@pytest.fixture(scope="module", autouse=True)
def tp1():
    with harness.distributed(1):
        yield


def settings(backend: str, manifest, cache_mb: str | None, **extra) -> dict[str, str]:
    out = {"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": backend, "VLLM_PLE_SIDECAR": str(manifest),
           "VLLM_PLE_ALLOW_UNPATCHED": "1", "VLLM_PLE_FETCH_WORKERS": "3", "VLLM_PLE_ROWS_PER_TASK": "5", **extra}
    if cache_mb is not None:
        out["VLLM_PLE_ROW_CACHE_MB"] = cache_mb
    return out


V2_WRAPPED = ("load_model", "update_requests", "sample_tokens", "execute_model")


@pytest.fixture
def runners(monkeypatch):
    """Whatever the plugin wraps on vLLM's runner classes is restored after the test."""
    import importlib

    for name, attrs in ((RUNNER_V2, V2_WRAPPED), ("vllm.v1.worker.gpu_model_runner",
                                                                         ("__init__",))):
        cls = importlib.import_module(name).GPUModelRunner
        for attr in attrs:
            monkeypatch.setattr(cls, attr, vars(cls)[attr])
    from vllm_ple_offload import embedding, prompt_prefetch

    monkeypatch.setattr(embedding, "_ROW_CACHES", [])
    monkeypatch.setattr(prompt_prefetch, "_hook", None)
    yield
    hook = prompt_prefetch.current()
    if hook is not None:
        hook.close()


def sidecar(tmp_path, cfg, layers=(harness.LAYER,), seed=0):
    lay = harness.layout(cfg)
    tables = {layer: ("bfloat16", random_table(lay.rows, lay.row_bytes, seed + i)) for i, layer in enumerate(layers)}
    return lay, tables[harness.LAYER][1], write_sidecar(tmp_path / f"sc-{seed}", tables)


def lookups(model, seeds=range(3)):
    out = []
    for seed in seeds:
        ids, qsl, ctx = harness.ngram_batch(seed)
        model.start_prefetch(ids, qsl, ctx)
        got = model(torch.empty(0), ids, qsl, ctx)
        out.append((got.contiguous().view(torch.uint8).numpy().copy(), model.compute_ngram_ids(ids, qsl, ctx)))
    return out


# ----------------------------------------------------------------------------- the cache in the embedding


@pytest.mark.parametrize("backend", ["pread", "mmap"])
def test_cache_on_and_off_give_the_same_rows(tmp_path, monkeypatch, runners, backend):
    cfg = harness.text_config()
    lay, table, manifest = sidecar(tmp_path, cfg)
    results = {}
    for cache_mb in ("0", "64"):
        harness.load_plugins(monkeypatch, settings(backend, manifest, cache_mb))
        model = harness.build(cfg)
        emb = model.ngram_embedding
        results[cache_mb] = lookups(model) + lookups(model)  # the second pass: the same rows again
        if cache_mb == "0":
            assert emb.row_cache is None and emb._reader.io == backend and emb._gather._host_read is None
        else:
            stats = emb.row_cache.stats
            assert emb._reader is emb.row_cache and emb.row_cache.reader.io == backend
            assert stats["lookups"] == sum(ids.numel() for _, ids in results[cache_mb])
            assert stats["hits"] >= stats["lookups"] // 2  # the second pass: every row is cached (the table fits)
            assert emb.row_cache.capacity == lay.rows  # a whole-range cache: the share is capped at the table
    for (off, ids), (on, _) in zip(results["0"], results["64"], strict=False):
        assert np.array_equal(off, on) and np.array_equal(on, harness.rows_of(table, ids))


def test_the_default_is_a_cache_and_the_startup_log_accounts_it(tmp_path, monkeypatch, runners, caplog):
    cfg = harness.text_config()
    _, _, manifest = sidecar(tmp_path, cfg)
    harness.load_plugins(monkeypatch, settings("mmap", manifest, None))
    with caplog.at_level(logging.INFO, logger="vllm.ple_offload"):
        emb = harness.build(cfg).ngram_embedding
    assert emb.row_cache is not None and emb.settings.row_cache_mb == 1024
    text = caplog.text
    assert f"model.layers.{harness.LAYER}.ple.ple_embedding.ngram_embedding row cache" in text
    assert "VLLM_PLE_ROW_CACHE_MB=1024 over 1 layer(s)" in text and "plain host memory" in text
    assert "row cache " in text and "staging" in text and "working set" in text


def big_config():
    """A larger table (~800K rows), so a layer's share of the budget is smaller than its whole range."""
    cfg = harness.text_config()
    cfg.ngram_vocab_size_base = 200_000
    return cfg


def test_the_budget_is_split_over_the_sidecars_ple_layers(tmp_path, monkeypatch, runners):
    from sglang_ssd_stream.sidecar.row_cache import capacity_for_budget

    cfg = big_config()
    lay, table, manifest = sidecar(tmp_path, cfg, layers=(harness.LAYER, harness.LAYER + 1, harness.LAYER + 2))
    harness.load_plugins(monkeypatch, settings("pread", manifest, "27"))
    model = harness.build(cfg)
    cache = model.ngram_embedding.row_cache
    assert cache.capacity == capacity_for_budget((27 << 20) // 3, lay.row_bytes, max_rows=cache.max_rows)
    assert 0 < cache.capacity < lay.rows and cache.working_set_bytes <= (27 << 20) // 3
    for got, ids in lookups(model):
        assert np.array_equal(got, harness.rows_of(table, ids))


def test_a_share_that_holds_no_row_is_refused(tmp_path, monkeypatch, runners):
    cfg = big_config()
    _, _, manifest = sidecar(tmp_path, cfg, layers=(harness.LAYER, harness.LAYER + 1, harness.LAYER + 2))
    harness.load_plugins(monkeypatch, settings("pread", manifest, "8"))
    with pytest.raises(PleSettingsError, match=r"VLLM_PLE_ROW_CACHE_MB=8 split over the sidecar's 3 PLE layer\(s\) "
                                               r"leaves 2.7 MiB per layer, less than one row cache needs .*set "
                                               r"VLLM_PLE_ROW_CACHE_MB to at least 25, or to 0"):
        harness.build(cfg)


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"])
def test_pread_with_a_cache_still_refuses_full_graphs(tmp_path, monkeypatch, runners, mode):
    cfg = harness.text_config()
    _, _, manifest = sidecar(tmp_path, cfg)
    harness.load_plugins(monkeypatch, settings("pread", manifest, "64"))
    with pytest.raises(PleSettingsError, match=f"cudagraph_mode={mode}: pread PLE backend under FULL CUDA graphs"):
        harness.build(cfg, cudagraph_mode=mode)


# ----------------------------------------------------------------------------- the runner hook


def v2_runner_class():
    import importlib

    return importlib.import_module(RUNNER_V2).GPUModelRunner


def test_the_plugin_wraps_vllms_v2_runner_only_with_a_cache(tmp_path, monkeypatch, runners):
    from vllm_ple_offload import prompt_prefetch

    cfg = harness.text_config()
    _, _, manifest = sidecar(tmp_path, cfg)
    cls = v2_runner_class()
    originals = {n: vars(cls)[n] for n in V2_WRAPPED}
    harness.load_plugins(monkeypatch, settings("mmap", manifest, "0"))
    assert {n: vars(cls)[n] for n in originals} == originals
    harness.load_plugins(monkeypatch, settings("mmap", manifest, "64", VLLM_PLE_PREFETCH_CHUNKS="3"))
    for name, original in originals.items():
        wrapped = vars(cls)[name]
        assert getattr(wrapped, prompt_prefetch._MARK) and wrapped.__wrapped__ is original
        # vLLM's own decorators (inference_mode) kept under ours: the function beneath is vLLM's
        assert inspect.unwrap(original).__code__.co_filename.endswith("vllm/v1/worker/gpu/model_runner.py")
    from vllm_ple_offload import plugin

    plugin._registered = False
    plugin.register()  # again: already wrapped, nothing stacks
    assert all(vars(cls)[n].__wrapped__ is originals[n] for n in originals)


def test_vllms_v1_runner_refuses_to_start_with_a_cache(tmp_path, monkeypatch, runners):
    import importlib

    cfg = harness.text_config()
    _, _, manifest = sidecar(tmp_path, cfg)
    v1 = importlib.import_module("vllm.v1.worker.gpu_model_runner").GPUModelRunner
    harness.load_plugins(monkeypatch, settings("mmap", manifest, "64"))
    with pytest.raises(PleSettingsError, match="prompt-ahead prefetch runs in vLLM's V2 model runner, but this worker "
                                               "builds the V1 runner.*or set VLLM_PLE_ROW_CACHE_MB=0"):
        v1(harness.vllm_config(), torch.device("cpu"))


def stand_in_runner(max_reqs: int = 8):
    """What vLLM's ``update_requests`` touches on its runner: the request-state arrays, block tables, no
    fresh blocks to zero, no copy-on-write. The method itself is vLLM's."""
    states = types.SimpleNamespace(req_id_to_index={}, num_computed_tokens_np=np.zeros(max_reqs, np.int32),
                                   prefill_len=types.SimpleNamespace(np=np.zeros(max_reqs, np.int32)),
                                   num_computed_prefill_tokens=np.zeros(max_reqs, np.int32))
    appended = []
    return types.SimpleNamespace(req_states=states, kv_block_zeroer=None, kv_caches=None, appended=appended,
                                 block_tables=types.SimpleNamespace(
                                     append_block_ids=lambda *a, **k: appended.append(a)))


def new_request(runner, req_id: str, tokens: list[int], computed: int):
    """vLLM's NewRequestData; the stand-in's request states as ``add_requests`` would leave them."""
    from vllm.v1.core.sched.output import NewRequestData

    index = len(runner.req_states.req_id_to_index)
    runner.req_states.req_id_to_index[req_id] = index
    runner.req_states.prefill_len.np[index] = len(tokens)
    return NewRequestData(req_id=req_id, prompt_token_ids=list(tokens), mm_features=[], sampling_params=None,
                          pooling_params=None, block_ids=([0],), num_computed_tokens=computed, lora_request=None,
                          prefill_token_ids=list(tokens))


def scheduler_output(new=(), cached=(), scheduled=None, finished=(), preempted=None):
    """vLLM's SchedulerOutput: ``cached`` = (req_id, num_computed_tokens) of running requests."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    so = SchedulerOutput.make_empty()
    so.scheduled_new_reqs = list(new)
    so.scheduled_cached_reqs = CachedRequestData(
        req_ids=[r for r, _ in cached], resumed_req_ids=set(), new_token_ids=[], all_token_ids={},
        new_block_ids=[None] * len(cached), num_computed_tokens=[c for _, c in cached],
        num_output_tokens=[0] * len(cached))
    so.num_scheduled_tokens = dict(scheduled or {})
    so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
    so.finished_req_ids = set(finished)
    so.preempted_req_ids = preempted
    return so


@pytest.fixture
def hooked(tmp_path, monkeypatch, runners):
    """The plugin with a cache, the real model's PLE module, and the prefetch hook built from it as the
    wrapped ``load_model`` builds it; ``calls`` records what the hook asked of the prefetcher."""
    from vllm_ple_offload import prompt_prefetch

    cfg = harness.text_config()
    _, table, manifest = sidecar(tmp_path, cfg, seed=3)
    harness.load_plugins(monkeypatch, settings("pread", manifest, "64", VLLM_PLE_PREFETCH_CHUNKS="2"))
    cls = v2_runner_class()
    model = harness.build(cfg)
    emb = model.ngram_embedding
    hook = prompt_prefetch.build(torch.nn.ModuleList([model]), chunk_tokens=8, settings=emb.settings)
    calls = []
    pf = hook.prefetcher
    for name in ("scheduled", "finished"):
        real = getattr(pf, name)
        monkeypatch.setattr(pf, name, lambda *a, _real=real, _name=name: (calls.append((_name, *[
            x if not isinstance(x, list) else len(x) for x in a])), _real(*a))[1])
    return types.SimpleNamespace(model=model, emb=emb, hook=hook, calls=calls, table=table,
                                 update=cls.update_requests, runner=stand_in_runner())


def vllm_ids(model, tokens: list[int]) -> np.ndarray:
    """vLLM's own n-gram ids of a whole prompt (a fresh request: its history is EOS)."""
    ids = torch.tensor(tokens, dtype=torch.int64)
    qsl = torch.tensor([0, len(tokens)], dtype=torch.int32)
    ctx = torch.full((1, model.ngram_size - 1), model.eos_token_id, dtype=torch.int64)
    return model.compute_ngram_ids(ids, qsl, ctx).numpy()


def test_the_prefetcher_hashes_with_the_modules_buffers(hooked):
    from sglang_ssd_stream.sidecar.ngram import NGramHash

    (hasher, cache), = hooked.hook.prefetcher.layers
    m = hooked.model
    assert cache is hooked.emb.row_cache and hooked.hook.prefetcher.chunk_tokens == 8
    assert hasher == NGramHash.from_module(m, rows=hooked.emb.org_vocab_size)


def test_update_requests_schedules_each_prefill_chunk_and_forgets_finished_requests(hooked):
    h, run = hooked, hooked.runner
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 1000, 50).tolist(), rng.integers(0, 1000, 10).tolist()
    # step 1: A from the start (8 tokens), B after a 4-token prefix-cache hit (6 tokens)
    step = scheduler_output(new=[new_request(run, "A", a, 0), new_request(run, "B", b, 4)], scheduled={"A": 8, "B": 6})
    h.update(run, step)
    assert h.calls == [("scheduled", "A", 50, 0, 8), ("scheduled", "B", 10, 4, 10)]
    assert h.hook.prefetcher.drain(30)
    cache = h.emb.row_cache
    # A's chunk and 2 chunks ahead ([0, 24)), all of B's rest ([4, 10)): vLLM's own ids are in the cache
    assert cache.contains(vllm_ids(h.model, a)[:24].reshape(-1)).all()
    assert cache.contains(vllm_ids(h.model, b)[4:].reshape(-1)).all()
    assert h.hook.prefetcher.stats.tokens_fetched == 24 + 6
    # step 2: A's next chunk (vLLM's update_requests writes its computed count); B finished
    h.calls.clear()
    h.update(run, scheduler_output(cached=[("A", 8)], scheduled={"A": 8}, finished=["B"]))
    assert run.req_states.num_computed_tokens_np[0] == 8 and run.req_states.num_computed_prefill_tokens[0] == 8
    assert h.calls == [("finished", "B"), ("scheduled", "A", 50, 8, 16)]
    # step 3: A's last prefill tokens, then decode: its prefill is over, the hook forgets it
    h.calls.clear()
    h.update(run, scheduler_output(cached=[("A", 48)], scheduled={"A": 2}))  # (a jump: [32, 48) is never queued)
    assert h.hook.prefetcher.drain(30)
    h.update(run, scheduler_output(cached=[("A", 50)], scheduled={"A": 1}))
    assert h.calls == [("scheduled", "A", 50, 48, 50), ("finished", "A")] and h.hook.tracked == 0
    ids = vllm_ids(h.model, a)
    assert cache.contains(ids[:32].reshape(-1)).all() and cache.contains(ids[48:].reshape(-1)).all()
    assert h.hook.prefetcher.stats.tokens_fetched == 24 + 6 + 8 + 2
    # preempted: forgotten; resumed later as a new request, from its computed tokens
    h.calls.clear()
    c = rng.integers(0, 1000, 30).tolist()
    h.update(run, scheduler_output(new=[new_request(run, "C", c, 0)], scheduled={"C": 8}))
    h.update(run, scheduler_output(preempted={"C"}))
    h.update(run, scheduler_output(new=[new_request(run, "C", c, 8)], scheduled={"C": 8}))
    assert h.calls == [("scheduled", "C", 30, 0, 8), ("finished", "C"), ("scheduled", "C", 30, 8, 16)]


def test_a_prefetch_stuck_on_the_disk_does_not_hold_the_runner(hooked, monkeypatch):
    h, run = hooked, hooked.runner
    cache = h.emb.row_cache
    entered, release = threading.Event(), threading.Event()
    real = cache.prefetch

    def stuck(ids):  # the disk does not answer until the test says so
        entered.set()
        release.wait(60)
        return real(ids)

    monkeypatch.setattr(cache, "prefetch", stuck)
    tokens = list(range(100, 164))
    h.update(run, scheduler_output(new=[new_request(run, "A", tokens, 0)], scheduled={"A": 8}))
    assert entered.wait(30)  # the prefetch thread is inside the read, stuck
    for computed in (8, 16, 24):  # the runner goes on stepping while it is stuck
        h.update(run, scheduler_output(cached=[("A", computed)], scheduled={"A": 8}))
    assert not release.is_set() and h.hook.prefetcher.pending_chunks > 0
    assert run.req_states.num_computed_tokens_np[0] == 24
    release.set()
    assert h.hook.prefetcher.drain(60)
    assert cache.contains(vllm_ids(h.model, tokens)[:48].reshape(-1)).all()  # 3 steps of 8 + 2 chunks ahead


def test_a_worker_whose_model_lacks_its_caches_is_refused(hooked):
    from vllm_ple_offload import prompt_prefetch

    with pytest.raises(PleSettingsError, match=r"built 1 PLE row cache\(s\), but the model vLLM's runner loaded "
                                               r"holds none of them"):
        prompt_prefetch.build(torch.nn.Linear(2, 2), chunk_tokens=8, settings=hooked.emb.settings)


def test_the_wrapped_load_model_builds_the_hook_from_the_loaded_model(tmp_path, monkeypatch, runners):
    """The plugin's wrapper, installed on a class shaped like vLLM's runner (whose real ``load_model`` needs a
    GPU): after the original loads the model, the hook is built from it with the runner's token budget."""
    from vllm_ple_offload import prompt_prefetch

    cfg = harness.text_config()
    _, _, manifest = sidecar(tmp_path, cfg)
    harness.load_plugins(monkeypatch, settings("mmap", manifest, "64", VLLM_PLE_PREFETCH_CHUNKS="5"))
    model = harness.build(cfg)

    class GPUModelRunner:
        max_num_tokens = 24

        def load_model(self, load_dummy_weights=False, *args, model=None, **kwargs):
            self.model = model

        def get_model(self):
            return self.model

        def update_requests(self, scheduler_output):
            pass

        @torch.inference_mode()  # vLLM's are decorated; the plugin expects that
        def sample_tokens(self, grammar_output):
            pass

        @torch.inference_mode()
        def execute_model(self, scheduler_output):
            pass

    prompt_prefetch.install_v2(model.ngram_embedding.settings)(types.SimpleNamespace(GPUModelRunner=GPUModelRunner))
    assert prompt_prefetch.current() is None
    GPUModelRunner().load_model(model=torch.nn.ModuleList([model]))
    hook = prompt_prefetch.current()
    assert hook is not None and (hook.prefetcher.chunk_tokens, hook.prefetcher.window) == (24, 5)
    assert [c for _, c in hook.prefetcher.layers] == [model.ngram_embedding.row_cache]
    GPUModelRunner().load_model(model=torch.nn.ModuleList([model]))  # a reload replaces (and closes) the old one
    assert prompt_prefetch.current() is not hook and hook.prefetcher._closed


# ----------------------------------------------------------------------------- the hot file across a restart


def test_a_restarted_worker_gets_its_hot_rows_back(tmp_path, monkeypatch, runners, caplog):
    """VLLM_PLE_HOT_SHARE_PCT: the hook's build (as the wrapped load_model runs it) reads the hot file into the
    model's row caches; a clean shutdown writes it; the next worker's caches hold those rows before any lookup
    and serve them bit for bit."""
    import logging

    from vllm_ple_offload import embedding, prompt_prefetch

    monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(tmp_path / "kit"))
    cfg = harness.text_config()
    _, _, manifest = sidecar(tmp_path, cfg, seed=5)
    knobs = settings("pread", manifest, "64", VLLM_PLE_HOT_SHARE_PCT="50", VLLM_PLE_HOT_INTERVAL_S="0")
    harness.load_plugins(monkeypatch, knobs)
    first = harness.build(cfg)
    with caplog.at_level(logging.WARNING, logger="sglang_ssd_stream.sidecar.hot_file"):
        prompt_prefetch.build(torch.nn.ModuleList([first]), chunk_tokens=8, settings=first.ngram_embedding.settings)
    hot = prompt_prefetch._hot
    assert hot is not None and hot.loaded_rows == 0 and "missing" in caplog.records[-1].getMessage()
    expected = lookups(first)
    hot.close()
    assert hot.written and hot.path.is_file()

    monkeypatch.setattr(embedding, "_ROW_CACHES", [])
    second = harness.build(cfg)
    prompt_prefetch.build(torch.nn.ModuleList([second]), chunk_tokens=8, settings=second.ngram_embedding.settings)
    again = prompt_prefetch._hot
    cache = second.ngram_embedding.row_cache
    assert again is not hot and again.loaded_rows == hot.written and cache.stats["rows_read"] == 0
    got = lookups(second)
    for (g, _), (e, _) in zip(got, expected, strict=True):
        np.testing.assert_array_equal(g, e)
    assert cache.stats["hits"] > 0
    again.close()
