"""The ``pinned`` backend through vLLM's real plugin loader and class selection, on a CPU box.

A CPU platform has neither UVA nor ``cudaHostRegister``, so three things are simulated: the
preflight's platform fact (UVA available), the CUDA host API (registration succeeds and reports
pinned memory) and vLLM's UVA view (identity). Everything else is real: the class selection, our
page-aligned allocation, vLLM's checkpoint shard copy into it, and the memlock refusal.
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from tests.vllm import harness
from tests.vllm.synthetic import random_table
from vllm_ple_offload.errors import PreflightFailed

SETTINGS = {"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": "pinned", "VLLM_PLE_ALLOW_UNPATCHED": "1"}


@pytest.fixture(scope="module", autouse=True)
def tp1():
    with harness.distributed(1):
        yield


@pytest.fixture
def simulated_cuda(monkeypatch):
    from sglang_ssd_stream.staging import host_memory
    from vllm_ple_offload import doctor as preflight

    registered = []
    monkeypatch.setattr(preflight, "_platform", lambda: (True, "CudaPlatform (simulated)"))
    monkeypatch.setattr(host_memory.CudaHost, "register", lambda self, p, n: registered.append((p, n)) or 0)
    monkeypatch.setattr(host_memory.CudaHost, "unregister", lambda self, p: 0)
    monkeypatch.setattr(host_memory.CudaHost, "is_pinned", lambda self, t: True)
    _, common = harness.modules()
    monkeypatch.setattr(common, "get_accelerator_view_from_cpu_tensor", lambda t: t)
    return registered


def test_selection_allocates_registered_page_aligned_memory(monkeypatch, simulated_cuda):
    from vllm_ple_offload.embedding import RegisteredPinnedPLEEmbedding

    harness.load_plugins(monkeypatch, SETTINGS)
    ne, _ = harness.modules()
    assert ne.Qwen4ExpPLEPinnedHostEmbedding is RegisteredPinnedPLEEmbedding
    cfg = harness.text_config()
    lay = harness.layout(cfg)
    model = harness.build(cfg)
    emb = model.ngram_embedding
    assert type(emb) is RegisteredPinnedPLEEmbedding
    nbytes = lay.rows * lay.row_bytes
    [(ptr, size)] = simulated_cuda
    assert ptr == emb.weight.data_ptr() and ptr % mmap.PAGESIZE == 0
    assert size == -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE  # exact, page-rounded: no power of two
    assert emb.weight.shape == (lay.rows, lay.head_dim) and emb.weight.dtype == torch.bfloat16


def test_checkpoint_shards_land_in_the_registered_table(monkeypatch, simulated_cuda):
    harness.load_plugins(monkeypatch, SETTINGS)
    cfg = harness.text_config()
    lay = harness.layout(cfg)
    table = random_table(lay.rows, lay.row_bytes, 5)
    model = harness.build(cfg)
    t = torch.from_numpy(table.copy()).view(torch.bfloat16)
    size = -(-lay.rows // cfg.split_ngram_parts)
    model.load_weights([(f"ngram_embedding.shard_{k}.weight", t[k * size:(k + 1) * size].clone())
                        for k in range(cfg.split_ngram_parts)])
    assert np.array_equal(model.ngram_embedding.weight.view(torch.uint8).numpy(), table)


def test_memlock_too_low_is_refused_at_allocation(monkeypatch, simulated_cuda):
    from sglang_ssd_stream.checks import memory

    harness.load_plugins(monkeypatch, SETTINGS)
    monkeypatch.setattr(memory.resource, "getrlimit", lambda which: (4096, 4096))  # the floor's check at allocation
    monkeypatch.setattr(memory, "status_fields", lambda *a: {"CapEff": "0"})
    with pytest.raises(PreflightFailed, match=r"(?s)locked-memory limit is 4 KiB, but the PLE table .* needs .*"
                                              r"--ulimit memlock=-1"):
        harness.build(harness.text_config())
    assert simulated_cuda == []  # refused before anything was registered
