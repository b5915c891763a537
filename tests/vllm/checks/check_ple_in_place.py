"""An in-place PLE sidecar (issue 41) through vLLM's real plugin loader and its real qwen4_exp embedding class.

Runs inside the vLLM venv (CPU platform), TP=1 on gloo, as ``check_plugin_streamed.py`` does. The checkpoint is
written here as safetensors shard files of vLLM's own table layout for a tiny config, and ``build_in_place``
writes its ``ssd-stream.json`` (regions of those files, no copy); the plugin streams the rows from them, the
uncached readers and the row cache alike, and they must be the table's bytes for vLLM's own n-gram ids.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.vllm import harness
from tests.vllm.checks.check_plugin_streamed import BACKENDS, DTYPES, settings, shards
from tests.vllm.synthetic import finite_fp8_table, random_table

PREFIX = f"model.language_model.layers.{harness.LAYER}.ple.ple_embedding."


@pytest.fixture(scope="module", autouse=True)
def tp1():
    with harness.distributed(1):
        yield


def in_place_checkpoint(root, cfg, dtype: str, table: np.ndarray):
    """``table`` as the checkpoint stores it (its shard tensors over two files, an index, a config), and its
    in-place manifest."""
    from safetensors.torch import save_file

    from sglang_ssd_stream.sidecar.in_place import build_in_place

    root.mkdir(parents=True)
    named = {PREFIX + name: t for name, t in shards(table, dtype, cfg.split_ngram_parts)}
    weight_map = {}
    for i, fname in enumerate(("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")):
        part = {n: named[n] for n in sorted(named)[i::2]}
        save_file(part, str(root / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps({"text_config": {"split_ngram_parts": cfg.split_ngram_parts}}))
    return build_in_place(root, progress=False).manifest


@pytest.mark.parametrize("cache_mb", ["0", "16"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_in_place_rows_are_the_checkpoint_rows(tmp_path, monkeypatch, backend, dtype, cache_mb):
    cfg = harness.text_config(dtype)
    lay = harness.layout(cfg, dtype)
    table = finite_fp8_table(lay.rows, lay.row_bytes, 3) if dtype == "float8_e4m3fn" else \
        random_table(lay.rows, lay.row_bytes, 3)
    manifest = in_place_checkpoint(tmp_path / "ckpt", cfg, dtype, table)
    assert manifest.tables[0].in_place and len(manifest.tables[0].files) == 2
    harness.load_plugins(monkeypatch, {**settings(backend, manifest.path), "VLLM_PLE_ROW_CACHE_MB": cache_mb})
    model = harness.build(cfg)
    emb = model.ngram_embedding
    assert emb.table.in_place and (emb.row_cache is None) == (cache_mb == "0")
    loaded = model.load_weights(shards(table, dtype, cfg.split_ngram_parts))
    assert "ngram_embedding.weight" in loaded and emb._checked_shards == len(shards(table, dtype, 5))
    for seed in range(3):
        ids, qsl, ctx = harness.ngram_batch(seed)
        model.start_prefetch(ids, qsl, ctx)
        got = model(torch.empty(0), ids, qsl, ctx)
        assert np.array_equal(got.contiguous().view(torch.uint8).numpy(),
                              harness.rows_of(table, model.compute_ngram_ids(ids, qsl, ctx)))
    if emb.row_cache is not None:
        assert emb.row_cache.stats["rows_read"] > 0  # misses read from the shards by the C cache


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tampered_region_is_refused_before_it_serves(tmp_path, monkeypatch, backend):
    cfg = harness.text_config("bfloat16")
    lay = harness.layout(cfg, "bfloat16")
    manifest = in_place_checkpoint(tmp_path / "ckpt", cfg, "bfloat16", random_table(lay.rows, lay.row_bytes, 4))
    region = manifest.tables[0].regions[1]
    with open(region.file, "r+b") as f:
        f.seek(region.offset + 5)
        b = f.read(1)
        f.seek(region.offset + 5)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(SystemExit, match=rf"sidecar_sha: PLE table {region.path} \(layer 3\) has SHA-256 .*"
                                         rf"tensor {region.tensor}: rows \[{region.row_start}, {region.row_end}\)"):
        harness.load_plugins(monkeypatch, settings(backend, manifest.path))  # the plugin's preflight hashes


@pytest.mark.parametrize("strategy", ["default", "eager"])
def test_vllms_weight_iterator_maps_a_ple_shard_unless_loaded_eagerly(tmp_path, strategy):
    """Serving the checkpoint itself (``--model`` and ``VLLM_PLE_SIDECAR`` the checkpoint): the default loader's
    iterator hands each PLE shard to the streamed embedding's ``weight_loader`` as a view of the file's mapping,
    of which it reads one row (the spot check): the table is not read into memory.
    ``--safetensors-load-strategy eager`` reads each shard file whole into anonymous memory instead."""
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    from tests.loader_residency import residency, write_ple_shard

    path = tmp_path / "model-00001-of-00001.safetensors"
    nbytes = write_ple_shard(path)
    chosen = LoadConfig().safetensors_load_strategy if strategy == "default" else strategy
    r = residency(safetensors_weights_iterator([str(path)], use_tqdm_on_load=False,
                                               safetensors_load_strategy=chosen), path)
    if chosen == "eager":
        assert r.mapped_file is None and r.anon_growth >= nbytes, r
    else:
        assert r.mapped_file == str(path) and r.anon_growth < nbytes // 8, r
