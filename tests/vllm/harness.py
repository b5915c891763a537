"""Engine-side helpers for the vLLM check modules (imported inside the vLLM venv only).

A tiny qwen4_exp PLE configuration, vLLM's own table layout for it, a distributed setup on
gloo, and a way to run vLLM's real ``load_general_plugins()`` again with other ``VLLM_PLE_*``
settings in the same process (vLLM runs plugins once per process; tests reset that flag, our
plugin's flag, our post-import hooks and the module globals the plugin rebinds).
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

NVIDIA = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
COMMON = "vllm.models.qwen4_exp.common.ngram_embedding"
LAYER = 3  # decoder layer of the PLE table under test (prefix model.layers.3.ple.ple_embedding)
EMBED_DIM = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def modules():
    importlib.import_module("vllm.models.qwen4_exp.nvidia.model")  # nvidia/qsa.py cannot be imported first
    return importlib.import_module(NVIDIA), importlib.import_module(COMMON)


def text_config(dtype: str = "bfloat16"):
    from transformers import Qwen4ExpTextConfig

    cfg = Qwen4ExpTextConfig(vocab_size=1000, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=50,
                             make_ngram_vocab_size_divisible_by=8, eos_token_id=7, split_ngram_parts=5)
    if dtype == "float8_e4m3fn":
        cfg.ple_embedding_dtype = "float8_e4m3fn"
    return cfg


@dataclass
class Layout:
    rows: int  # padded vocabulary (rows of the table)
    heads: int
    head_dim: int
    row_bytes: int
    dtype: str


def layout(cfg, dtype: str = "bfloat16", dense_id: int = 0) -> Layout:
    """vLLM's own arithmetic for the table shape of this config."""
    ne, _ = modules()
    heads = (cfg.ngram_size - 1) * cfg.heads_per_ngram
    _, _, total = ne.Qwen4ExpNGramEmbedding._make_vocab_layout(
        ngram_vocab_size_base=cfg.ngram_vocab_size_base, ngram_heads=heads, ple_dense_layer_id=dense_id)
    div = cfg.make_ngram_vocab_size_divisible_by
    rows = -(-total // div) * div
    head_dim = EMBED_DIM // heads
    return Layout(rows, heads, head_dim, head_dim * (1 if dtype == "float8_e4m3fn" else 2), dtype)


def vllm_config(*, cpu_offload: bool = True, cudagraph_mode: str = "NONE"):
    from vllm.config import VllmConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.config.engram import EngramConfig

    vc = VllmConfig()
    vc.engram_config = EngramConfig(cpu_offload=cpu_offload)
    vc.compilation_config.cudagraph_mode = CUDAGraphMode[cudagraph_mode]
    return vc


@contextmanager
def distributed(world_size: int = 1, rank: int = 0, port: int | None = None):
    """vLLM's distributed state on gloo (CPU), TP = ``world_size``."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    vc = vllm_config()
    vc.parallel_config.tensor_parallel_size = world_size  # vLLM sizes the ETP group from it
    with set_current_vllm_config(vc):
        ps.init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{port or free_port()}")
        ps.initialize_model_parallel(world_size)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


def build(cfg, *, cpu_offload: bool = True, cudagraph_mode: str = "NONE", max_tokens: int = 64):
    """The real ``Qwen4ExpNGramEmbedding`` of decoder layer ``LAYER`` (its class selection included)."""
    from vllm.config import set_current_vllm_config

    ne, _ = modules()
    dtype = torch.bfloat16
    with set_current_vllm_config(vllm_config(cpu_offload=cpu_offload, cudagraph_mode=cudagraph_mode)):
        return ne.Qwen4ExpNGramEmbedding(cfg, EMBED_DIM, 0, max_tokens, data_parallel_rank=0, params_dtype=dtype,
                                         prefix=f"model.layers.{LAYER}.ple.ple_embedding")


def load_plugins(monkeypatch, settings: dict[str, str], prepare=None) -> None:
    """Run vLLM's real plugin loader again with exactly these VLLM_PLE_* variables.

    ``prepare(nvidia_module)`` runs after the reset, right before the loader."""
    import vllm.plugins

    from vllm_ple_offload import plugin
    from vllm_ple_offload import post_import as hook

    for k in list(os.environ):
        if k.startswith("VLLM_PLE_"):
            monkeypatch.delenv(k)
    for k, v in settings.items():
        monkeypatch.setenv(k, v)
    ne, common = modules()
    monkeypatch.setattr(ne, "Qwen4ExpPLEPinnedHostEmbedding", common.Qwen4ExpPLEPinnedHostEmbedding)
    monkeypatch.setattr(ne, "Qwen4ExpPLEDeviceEmbedding", common.Qwen4ExpPLEDeviceEmbedding)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(hook, "_callbacks", {})
    if hook._finder is not None and hook._finder in sys.meta_path:
        monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if f is not hook._finder])
    monkeypatch.setattr(hook, "_finder", None)
    if prepare is not None:
        prepare(ne)
    vllm.plugins.load_general_plugins()


def ngram_batch(seed: int = 0):
    """input_ids, query_start_loc, ngram_context of three requests (one with an EOS inside)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (40,), generator=g)
    ids[11] = 7  # eos_token_id: older tokens are masked
    ids[12:14] = ids[3:5]  # repeated n-grams: duplicate row ids
    qsl = torch.tensor([0, 9, 30, 40], dtype=torch.int32)
    ctx = torch.randint(0, 1000, (3, 2), generator=g)
    return ids, qsl, ctx


def rows_of(table: np.ndarray, ngram_ids: torch.Tensor, lo: int = 0, hi: int | None = None) -> np.ndarray:
    """The table rows of ``ngram_ids`` ([tokens, heads]) with other ranks' rows zero, as [tokens, heads*row_bytes]."""
    flat = ngram_ids.reshape(-1).numpy()
    hi = table.shape[0] if hi is None else hi
    out = table[flat].copy()
    out[(flat < lo) | (flat >= hi)] = 0
    return out.reshape(ngram_ids.shape[0], -1)


def streamed_tp_rank(rank: int, world: int, manifest: str, backend: str, dtype: str, port: int, out: str) -> None:
    """One TP rank: vLLM's distributed state, our plugin, the real embedding class, a lookup.

    Spawned by ``check_tp_streamed.py``; rank 0 writes the assembled rows of each batch.
    """
    import pytest

    os.environ.update({"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": backend, "VLLM_PLE_SIDECAR": manifest,
                       "VLLM_PLE_ALLOW_UNPATCHED": "1", "VLLM_PLE_FETCH_WORKERS": "2", "VLLM_PLE_ROWS_PER_TASK": "9"})
    mp = pytest.MonkeyPatch()
    with distributed(world, rank, port):
        load_plugins(mp, dict((k, v) for k, v in os.environ.items() if k.startswith("VLLM_PLE_")))
        cfg = text_config(dtype)
        model = build(cfg)
        emb = model.ngram_embedding
        idx = emb.shard_indices
        result = {"range": [idx.org_vocab_start_index, idx.org_vocab_end_index], "class": type(emb).__name__}
        arrays = {}
        for seed in range(3):
            ids, qsl, ctx = ngram_batch(seed)
            model.start_prefetch(ids, qsl, ctx)
            got = model(torch.empty(0), ids, qsl, ctx)
            arrays[f"rows{seed}"] = got.contiguous().view(torch.uint8).numpy().copy()
            arrays[f"ngram{seed}"] = model.compute_ngram_ids(ids, qsl, ctx).numpy()
        result["stats"] = emb._gather.stats.line()
    mp.undo()
    np.savez(f"{out}/rank{rank}.npz", **arrays)
    with open(f"{out}/rank{rank}.json", "w") as f:
        import json

        json.dump(result, f)
