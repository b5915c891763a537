"""The streamed backends through vLLM's real plugin loader and its real qwen4_exp embedding class.

Runs inside the vLLM venv (CPU platform, ``VLLM_TARGET_DEVICE=cpu``), TP=1 on gloo. The sidecar
is built here from vLLM's own table layout for a tiny config; ids come from vLLM's own n-gram
hash (``compute_ngram_ids``); rows come back through ``start_prefetch``/``forward`` and must be
the sidecar's bytes. The vLLM install is pristine, so ``VLLM_PLE_ALLOW_UNPATCHED=1`` is set.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from sglang_ssd_stream.sidecar.errors import SidecarChecksumMismatch, SidecarRowOutOfRange, SidecarShapeMismatch
from tests.vllm import harness
from tests.vllm.synthetic import finite_fp8_table, random_table, write_sidecar
from vllm_ple_offload.errors import PleSettingsError

DTYPES = ["bfloat16", "float8_e4m3fn"]
BACKENDS = ["pread", "mmap"]


@pytest.fixture(scope="module", autouse=True)
def tp1():
    with harness.distributed(1):
        yield


def make_sidecar(tmp_path, dtype: str, *, columns_off: int = 0, rows_off: int = 0, seed: int = 0):
    cfg = harness.text_config(dtype)
    lay = harness.layout(cfg, dtype)
    rows, row_bytes = lay.rows + rows_off, lay.row_bytes + columns_off * (1 if dtype == "float8_e4m3fn" else 2)
    table = finite_fp8_table(rows, row_bytes, seed) if dtype == "float8_e4m3fn" else random_table(rows, row_bytes, seed)
    return cfg, lay, table, write_sidecar(tmp_path / f"sc-{seed}", {harness.LAYER: (dtype, table)})


def settings(backend: str, manifest) -> dict[str, str]:
    return {"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": backend, "VLLM_PLE_SIDECAR": str(manifest),
            "VLLM_PLE_ALLOW_UNPATCHED": "1", "VLLM_PLE_FETCH_WORKERS": "3", "VLLM_PLE_ROWS_PER_TASK": "5"}


def shards(table: np.ndarray, dtype: str, parts: int):
    """The checkpoint's view of the same table: ngram_embedding.shard_<k>.weight tensors."""
    size = -(-table.shape[0] // parts)
    t = torch.from_numpy(table.copy())
    t = t.view(torch.float8_e4m3fn) if dtype == "float8_e4m3fn" else t.view(torch.bfloat16)
    return [(f"ngram_embedding.shard_{k}.weight", t[k * size:(k + 1) * size].clone()) for k in range(parts)
            if k * size < table.shape[0]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_real_selection_streams_the_sidecar_rows(tmp_path, monkeypatch, backend, dtype):
    from vllm_ple_offload.embedding import StreamedPLEEmbedding

    cfg, lay, table, manifest = make_sidecar(tmp_path, dtype)
    harness.load_plugins(monkeypatch, settings(backend, manifest))
    ne, _ = harness.modules()
    assert ne.Qwen4ExpPLEPinnedHostEmbedding is StreamedPLEEmbedding
    model = harness.build(cfg)
    emb = model.ngram_embedding
    assert type(emb) is StreamedPLEEmbedding and emb.weight.numel() == 0 and emb.table.dtype == dtype

    weights = shards(table, dtype, cfg.split_ngram_parts)
    if dtype == "float8_e4m3fn":
        weights.append(("ngram_embedding.weight_scale", torch.tensor([0.25], dtype=torch.float32)))
    loaded = model.load_weights(weights)
    assert "ngram_embedding.weight" in loaded and emb._checked_shards == len(weights) - (dtype != "bfloat16")

    for seed in range(3):
        ids, qsl, ctx = harness.ngram_batch(seed)
        model.start_prefetch(ids, qsl, ctx)
        got = model(torch.empty(0), ids, qsl, ctx)
        ngram_ids = model.compute_ngram_ids(ids, qsl, ctx)
        assert got.shape == (ids.numel(), harness.EMBED_DIM)
        assert np.array_equal(got.contiguous().view(torch.uint8).numpy(), harness.rows_of(table, ngram_ids))
    if dtype == "float8_e4m3fn":
        assert torch.equal(emb.dequantize(got, torch.bfloat16), got.to(torch.bfloat16) * 0.25)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sidecar_from_another_checkpoint_is_refused(tmp_path, monkeypatch, backend):
    cfg, lay, table, manifest = make_sidecar(tmp_path, "bfloat16", seed=0)
    other = random_table(lay.rows, lay.row_bytes, seed=99)
    harness.load_plugins(monkeypatch, settings(backend, manifest))
    model = harness.build(cfg)
    with pytest.raises(SidecarChecksumMismatch, match="differs from the checkpoint shard starting at row 0"):
        model.load_weights(shards(other, "bfloat16", cfg.split_ngram_parts))


@pytest.mark.parametrize("columns_off,rows_off,match", [
    (1, 0, "has 5 columns, but the model expects 4"),
    (0, 8, r"holds rows \[0, \d+\), but the model expects \[0, \d+\)"),
])
def test_sidecar_of_another_shape_is_refused(tmp_path, monkeypatch, columns_off, rows_off, match):
    cfg, _, _, manifest = make_sidecar(tmp_path, "bfloat16", columns_off=columns_off, rows_off=rows_off)
    harness.load_plugins(monkeypatch, settings("pread", manifest))
    with pytest.raises(SidecarShapeMismatch, match=match):
        harness.build(cfg)


def test_sidecar_of_another_dtype_is_refused(tmp_path, monkeypatch):
    _, _, _, manifest = make_sidecar(tmp_path, "float8_e4m3fn")
    harness.load_plugins(monkeypatch, settings("pread", manifest))
    with pytest.raises(SidecarShapeMismatch, match="is float8_e4m3fn, but the model expects bfloat16"):
        harness.build(harness.text_config("bfloat16"))


def test_sidecar_without_this_layer_is_refused(tmp_path, monkeypatch):
    cfg = harness.text_config()
    lay = harness.layout(cfg)
    manifest = write_sidecar(tmp_path, {harness.LAYER + 1: ("bfloat16", random_table(lay.rows, lay.row_bytes, 0))})
    harness.load_plugins(monkeypatch, settings("mmap", manifest))
    with pytest.raises(SidecarShapeMismatch, match=f"no PLE table for layer {harness.LAYER}"):
        harness.build(cfg)


FULL_MODES = ["FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "FULL"]


@pytest.mark.parametrize("mode", FULL_MODES)
def test_pread_refuses_full_cuda_graphs(tmp_path, monkeypatch, mode):
    cfg, _, _, manifest = make_sidecar(tmp_path, "bfloat16")
    harness.load_plugins(monkeypatch, settings("pread", manifest))
    with pytest.raises(PleSettingsError,
                       match=f"cudagraph_mode={mode}: pread PLE backend under FULL CUDA graphs: "
                             r".*not hidden.*VLLM_PLE_OFFLOAD_BACKEND=mmap.*PIECEWISE.*--enforce-eager"):
        harness.build(cfg, cudagraph_mode=mode)


@pytest.mark.parametrize("backend,mode", [("pread", "PIECEWISE"), ("pread", "NONE"), *[("mmap", m) for m in
                                          ["PIECEWISE", "NONE", *FULL_MODES]]])
def test_graph_modes_a_backend_accepts(tmp_path, monkeypatch, backend, mode):
    """mmap: every mode, vLLM's default FULL_AND_PIECEWISE included (a graph slot for the captured read);
    pread: breakable PIECEWISE graphs or eager."""
    cfg, _, _, manifest = make_sidecar(tmp_path, "bfloat16")
    harness.load_plugins(monkeypatch, settings(backend, manifest))
    emb = harness.build(cfg, cudagraph_mode=mode).ngram_embedding
    full = mode.startswith("FULL")
    assert emb.supports_prefetch and emb._gather.graph_rows == (64 * emb._num_ngram_heads if full else 0)


def _lookup(emb, ngram_ids: torch.Tensor) -> torch.Tensor:
    emb.start_prefetch(ngram_ids)
    return emb.finalize_prefetch(total_tokens=ngram_ids.shape[0])


def _crafted_ids(rows: int, heads: int, seed: int) -> dict[str, torch.Tensor]:
    """[tokens, heads] int64 ids of the table: random, the table's edges, duplicates, a single token."""
    rng = np.random.default_rng(seed)
    edges = np.array([0, 1, rows // 2 - 1, rows // 2, rows - 2, rows - 1])
    return {"random": rng.integers(0, rows, (40, heads)), "boundaries": np.resize(edges, (9, heads)),
            "duplicates": rng.choice(rng.integers(0, rows, 3), (23, heads)),
            "one_token": rng.integers(0, rows, (1, heads))}


@pytest.fixture
def streamed(tmp_path, monkeypatch, request):
    """The real embedding (plugin-selected) of an FP8 sidecar, its checkpoint scale loaded."""
    backend, mode, *cache = request.param
    cfg, lay, table, manifest = make_sidecar(tmp_path, "float8_e4m3fn", seed=5)
    harness.load_plugins(monkeypatch, {**settings(backend, manifest),
                                       **({"VLLM_PLE_ROW_CACHE_MB": cache[0]} if cache else {})})
    model = harness.build(cfg, cudagraph_mode=mode)
    model.load_weights([("ngram_embedding.weight_scale", torch.tensor([0.5], dtype=torch.float32))])
    return model.ngram_embedding, lay, table


@pytest.mark.parametrize("streamed", [("pread", "NONE"), ("mmap", "FULL_AND_PIECEWISE")], indirect=True,
                         ids=["pread", "mmap"])
def test_crafted_ids_through_the_embedding_are_the_table_rows(streamed):
    emb, lay, table = streamed
    for name, ids in _crafted_ids(lay.rows, lay.heads, 1).items():
        got = _lookup(emb, torch.from_numpy(ids))
        assert np.array_equal(got.view(torch.uint8).numpy(), harness.rows_of(table, torch.from_numpy(ids))), name
    assert emb._gather.stats.lookups == 4 and emb._gather.stats.captured == 0  # eager: no capture on a CPU box


@pytest.mark.parametrize("streamed", [("pread", "NONE"), ("mmap", "FULL_AND_PIECEWISE")], indirect=True,
                         ids=["pread", "mmap"])
@pytest.mark.parametrize("bad,error,match", [
    ("float", TypeError, "PLE n-gram ids must be int64, got torch.float32 "
                         "\\(floating-point ids are refused, not truncated\\)"),
    ("int32", TypeError, "PLE n-gram ids must be int64, got torch.int32$"),
    ("too_large", SidecarRowOutOfRange, "row id {rows} .*outside table"),
    ("negative", SidecarRowOutOfRange, "row id -1 .*outside table"),
])
def test_refused_ids_leave_the_prefetch_buffer_untouched(streamed, bad, error, match):
    emb, lay, table = streamed
    good = torch.from_numpy(_crafted_ids(lay.rows, lay.heads, 2)["random"])
    first = _lookup(emb, good).clone()  # a good lookup fills the buffer
    before = emb._prefetch_buffer.clone()
    ids = {"float": good.float() + 0.7, "int32": good.int(), "too_large": good.clone().fill_(lay.rows),
           "negative": good.clone().index_fill_(1, torch.tensor([3]), -1)}[bad]
    with pytest.raises(error, match=match.format(rows=lay.rows)):
        _lookup(emb, ids)  # refused at start_prefetch on CPU; a GPU raises at finalize, before any row moves
    assert torch.equal(emb._prefetch_buffer.view(torch.uint8), before.view(torch.uint8))
    assert torch.equal(_lookup(emb, good).view(torch.uint8), first.view(torch.uint8))  # and the next lookup works


@pytest.mark.parametrize("streamed", [("pread", "NONE", "0"), ("mmap", "NONE", "0"), ("pread", "NONE"),
                                      ("mmap", "FULL_AND_PIECEWISE")], indirect=True,
                         ids=["pread", "mmap", "pread-cache", "mmap-cache"])
def test_a_table_rewritten_while_served_is_refused_through_the_embedding(streamed, tmp_path):
    """Issue 29 item 6 through vLLM's own embedding (the plugin-selected StreamedPLEEmbedding), row cache on and
    off: a table rewritten in place (same inode and size: `cp other/… a/…`) is refused at the next lookup, never
    served as other rows; the lookups after it stay refused."""
    import time

    from sglang_ssd_stream.sidecar.errors import SidecarChanged, SidecarReaderUnusable

    emb, lay, table = streamed
    ids = torch.from_numpy(_crafted_ids(lay.rows, lay.heads, 3)["random"])
    assert np.array_equal(_lookup(emb, ids).view(torch.uint8).numpy(), harness.rows_of(table, ids))
    (path,) = tmp_path.glob("sc-5/ple/layer-*.bin")
    time.sleep(0.05)  # past the filesystem's timestamp granularity, as a served table's last write is
    with open(path, "r+b") as f:
        f.write(bytes(b ^ 0x5A for b in path.read_bytes()))
    with pytest.raises((SidecarChanged, SidecarReaderUnusable), match="written while it is served|unusable"):
        _lookup(emb, ids)
    with pytest.raises((SidecarChanged, SidecarReaderUnusable)):
        _lookup(emb, ids[:1])


@pytest.fixture
def simulated_capture(monkeypatch):
    """A CPU box cannot capture: say the stream is capturing and run each host node at once (what a
    replay does), counting them. Everything else is the real code: vLLM's decorator, our embedding,
    the gather's capture path, the native host-node read."""
    from sglang_ssd_stream.staging import gather, hostfunc

    nodes = []
    monkeypatch.setattr(gather, "_capturing", lambda device: True)
    monkeypatch.setattr(hostfunc, "launch_native_host_func", lambda stream, node: (nodes.append(node), node.run()))
    monkeypatch.setattr(gather.SidecarGather, "begin", lambda *a, **k: pytest.fail("eager read inside a capture"))
    return nodes


@pytest.mark.parametrize("streamed", [("mmap", "FULL_AND_PIECEWISE", "0"), ("mmap", "FULL_DECODE_ONLY", "0"),
                                      ("mmap", "FULL_AND_PIECEWISE", "64")], indirect=True,
                         ids=["FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE-row-cache"])
def test_a_full_graph_captures_the_native_host_read(streamed, simulated_capture, tmp_path, monkeypatch):
    """Without a row cache the reader's native read; with one the cache's native host read (hits from memory)."""
    from sglang_ssd_stream.sidecar.row_cache import HostRead
    from sglang_ssd_stream.staging.native_read import NativeRead

    monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(tmp_path / "kit-home"))  # the library is compiled here
    emb, lay, table = streamed
    for name, ids in _crafted_ids(lay.rows, lay.heads, 3).items():
        got = _lookup(emb, torch.from_numpy(ids))
        assert np.array_equal(got.view(torch.uint8).numpy(), harness.rows_of(table, torch.from_numpy(ids))), name
    if emb.row_cache is None:
        assert len(simulated_capture) == 4 and all(isinstance(n, NativeRead) and n.io == "mmap"
                                                   for n in simulated_capture)
    else:
        assert len(simulated_capture) == 4 and all(isinstance(n, HostRead) and n.cache is emb.row_cache
                                                   for n in simulated_capture)
        assert [n.calls for n in simulated_capture] == [1, 1, 1, 1] and emb.row_cache.stats["lookups"] > 0
    assert emb._gather.stats.captured == 4 and emb._gather.stats.lookups == 0


def test_a_capture_larger_than_the_graph_slot_is_refused(tmp_path, monkeypatch, simulated_capture):
    from sglang_ssd_stream.staging.gather import StagingCapacityError

    cfg, lay, _, manifest = make_sidecar(tmp_path, "bfloat16")
    harness.load_plugins(monkeypatch, settings("mmap", manifest))
    emb = harness.build(cfg, cudagraph_mode="FULL_AND_PIECEWISE", max_tokens=64).ngram_embedding
    _lookup(emb, torch.zeros((1, lay.heads), dtype=torch.int64))  # allocates the prefetch buffer, as vLLM's warm-up
    emb._gather.graph_rows = 8 * lay.heads  # as if vLLM captured at most 8 tokens
    with pytest.raises(StagingCapacityError,
                       match=rf"captured PLE lookup needs {9 * lay.heads} rows but the graph slot "
                             rf"holds {8 * lay.heads} .*max_cudagraph_capture_size"):
        emb.start_prefetch(torch.zeros((9, lay.heads), dtype=torch.int64))


@pytest.mark.parametrize("runtime_mode", ["FULL", "PIECEWISE"])
def test_vllm_runs_the_lookup_inside_full_captures_and_eagerly_between_piecewise_segments(
        tmp_path, monkeypatch, runtime_mode):
    """What vLLM 0.33's ``eager_break_during_capture`` does with our two methods while its breakable graph
    capture is active (the real decorator and forward context; the capture object stands in for CUDA):
    FULL runtime mode runs them inside the capture (our captured path records the host read), PIECEWISE
    ends the segment, runs them eagerly and replays them eagerly."""
    from vllm.compilation import breakable_cudagraph as bc
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import create_forward_context, override_forward_context

    cfg, lay, table, manifest = make_sidecar(tmp_path, "bfloat16", seed=8)
    harness.load_plugins(monkeypatch, settings("mmap", manifest))
    emb = harness.build(cfg, cudagraph_mode="FULL_AND_PIECEWISE").ngram_embedding
    ids = torch.from_numpy(_crafted_ids(lay.rows, lay.heads, 4)["random"])
    want = harness.rows_of(table, ids)
    _lookup(emb, ids)  # vLLM's warm-up runs before any capture (allocates the buffer)

    class Capture:  # what BreakableCUDAGraphCapture does around an eager break, without CUDA
        _capturing = True

        def __init__(self):
            self.segments = []

        def add_eager(self, fn):
            self.segments.append(fn)
            return fn()

    cap = Capture()
    monkeypatch.setattr(bc.BreakableCUDAGraphCapture, "current", classmethod(lambda cls: cap))
    # vLLM's weak reference is a compiled op (absent from a CPU install): an alias of the same storage.
    monkeypatch.setattr(bc, "weak_ref_tensor", lambda t: t.detach() if isinstance(t, torch.Tensor) else t)
    captured = []
    monkeypatch.setattr(emb._gather, "capture",
                        lambda i, o, s: (captured.append(i.numel()), emb._gather.begin(i, o, s)))
    from sglang_ssd_stream.staging import gather

    monkeypatch.setattr(gather, "_capturing", lambda device: runtime_mode == "FULL")  # the stream state each mode has
    ctx = create_forward_context(None, harness.vllm_config(cudagraph_mode="FULL_AND_PIECEWISE"),
                                 cudagraph_runtime_mode=CUDAGraphMode[runtime_mode])
    with override_forward_context(ctx):
        got = _lookup(emb, ids)
    assert np.array_equal(got.view(torch.uint8).numpy(), want)
    if runtime_mode == "FULL":
        assert cap.segments == [] and captured == [ids.numel()]  # inside the capture: the captured path
    else:
        assert len(cap.segments) == 2 and captured == []  # start_prefetch and _finalize_prefetch: eager breaks
        emb._prefetch_buffer.zero_()
        for segment in cap.segments:  # a replay runs them again, eagerly
            segment()
        assert np.array_equal(emb._prefetch_buffer[: ids.shape[0]].view(torch.uint8).reshape(ids.shape[0], -1).numpy(),
                              want)


def test_nvfp4_table_is_refused(tmp_path, monkeypatch):
    cfg, _, _, manifest = make_sidecar(tmp_path, "bfloat16")
    cfg.ple_embedding_dtype = "nvfp4"
    harness.load_plugins(monkeypatch, settings("pread", manifest))
    with pytest.raises(SidecarShapeMismatch, match="NVFP4.*use VLLM_PLE_OFFLOAD_BACKEND=pinned"):
        harness.build(cfg)


def test_engram_cpu_offload_false_contradicts_the_switch(tmp_path, monkeypatch):
    cfg, _, _, manifest = make_sidecar(tmp_path, "bfloat16")
    harness.load_plugins(monkeypatch, settings("pread", manifest))
    with pytest.raises(PleSettingsError, match="--engram-config cpu_offload=false"):
        harness.build(cfg, cpu_offload=False)


def test_register_is_idempotent(tmp_path, monkeypatch):
    from vllm_ple_offload import plugin
    from vllm_ple_offload import post_import as hook

    _, _, _, manifest = make_sidecar(tmp_path, "bfloat16")
    harness.load_plugins(monkeypatch, settings("mmap", manifest))
    before = hook.registered(harness.NVIDIA)
    plugin.register()
    plugin.register()
    assert before >= 1 and hook.registered(harness.NVIDIA) == before  # registering again adds no callback


def test_missing_sidecar_stops_the_process(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="sidecar manifest not found"):
        harness.load_plugins(monkeypatch, settings("pread", tmp_path / "missing" / "ssd-stream.json"))
    ne, common = harness.modules()
    assert ne.Qwen4ExpPLEPinnedHostEmbedding is common.Qwen4ExpPLEPinnedHostEmbedding  # nothing was swapped


def test_streamed_lookup_is_eager_break_wrapped():
    """Under breakable CUDA graphs the host gather must run eagerly between graph segments."""
    from vllm_ple_offload.embedding import StreamedPLEEmbedding

    for name in ("start_prefetch", "_finalize_prefetch"):
        fn = getattr(StreamedPLEEmbedding, name)
        assert fn.__wrapped__ is not fn and fn.__module__ == "vllm_ple_offload.embedding"
        assert importlib.import_module("vllm.compilation.breakable_cudagraph").eager_break_during_capture.__name__ \
            in fn.__code__.co_qualname


def test_class_replaced_by_someone_else_is_refused(tmp_path, monkeypatch):
    _, _, _, manifest = make_sidecar(tmp_path, "bfloat16")
    foreign = type("ForeignPLE", (), {})
    with pytest.raises(SystemExit, match="another plugin replaced it, refusing to stack on top"):
        harness.load_plugins(monkeypatch, settings("pread", manifest),
                             prepare=lambda ne: monkeypatch.setattr(ne, "Qwen4ExpPLEPinnedHostEmbedding", foreign))
    ne, _ = harness.modules()
    assert ne.Qwen4ExpPLEPinnedHostEmbedding is foreign  # left as found
