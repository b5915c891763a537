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

from sglang_ssd_stream.sidecar.errors import SidecarChecksumMismatch, SidecarShapeMismatch
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


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "FULL"])
def test_full_cuda_graphs_are_refused(tmp_path, monkeypatch, mode):
    cfg, _, _, manifest = make_sidecar(tmp_path, "bfloat16")
    harness.load_plugins(monkeypatch, settings("pread", manifest))
    with pytest.raises(PleSettingsError, match=f"cudagraph_mode={mode}: .*PIECEWISE.*--enforce-eager"):
        harness.build(cfg, cudagraph_mode=mode)


def test_piecewise_cuda_graphs_are_accepted(tmp_path, monkeypatch):
    cfg, _, _, manifest = make_sidecar(tmp_path, "bfloat16")
    harness.load_plugins(monkeypatch, settings("pread", manifest))
    assert harness.build(cfg, cudagraph_mode="PIECEWISE").ngram_embedding.supports_prefetch


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
    from vllm_ple_offload import plugin, post_import as hook

    _, _, _, manifest = make_sidecar(tmp_path, "bfloat16")
    harness.load_plugins(monkeypatch, settings("mmap", manifest))
    before = hook.registered(harness.NVIDIA)
    plugin.register()
    plugin.register()
    assert before == 1 and hook.registered(harness.NVIDIA) == 1


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
