"""Patch 0001 under the Triton interpreter: the real launch path runs with the fitted (halved) FP8 tile.

Runs inside the vLLM venv with ``TRITON_INTERPRET=1`` (the outer test sets it): the real QSA
split-K kernel is executed on the CPU. The interpreter compiles nothing (the kernel's
``run(..., warmup=True)`` returns None, which the patch takes as "nothing to measure"), so the
device is replaced where the patch reads it: its limit by a small number, and the compile-only
calls of the kernel answer a compiled kernel whose shared memory grows with ``BLOCK_N``
(``check_0001_qsa_smem_guard.py`` measures the real footprints by compiling for sm_110). The
batch has more than 2,048 programs so the table picks one split: the interpreter cannot run the
split-K merge kernel (a NumPy ``bitwise_and`` on a scalar mask).

Numerics are not checked here: Triton 3.8's interpreter miscomputes this kernel even for a
pristine BF16 cache (a one-row case returns ~1e8 where the attention is ~0.1), so the output
comparison against a float32 reference runs on the H200 (``scripts/gpu/vllm_qsa_smem_guard.py``).

RED on pristine 0.33.0: the launch keeps the table's tile. GREEN patched: it is halved.
Guard (both): with the interpreter's own compile-only call (nothing compiled) the table's tile
stays and the limit is never read.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

ROWS, HEADS, HEAD_DIM, PAGE, BLOCKS, WIDTH = 2049, 16, 32, 16, 8, 40
K_SCALE, V_SCALE = 0.5, 2.0  # host-side dequant scales


@pytest.fixture(scope="module")
def qsa():
    importlib.import_module("vllm.models.qwen4_exp.nvidia.model")  # qsa.py cannot be imported first
    return importlib.import_module("vllm.models.qwen4_exp.nvidia.ops.qsa")


def recorded_launches(qsa, monkeypatch, *, bytes_per_column: int | None) -> list[dict]:
    """Record the split-K launches; with bytes_per_column, compile-only calls answer a "compiled"
    kernel of that many bytes of shared memory per BLOCK_N column, else the interpreter's None."""
    monkeypatch.setattr(qsa, "_qsa_fitted_tiles", {}, raising=False)
    launched = []
    kernel = qsa._qsa_sparse_paged_gqa_splitk_kernel
    run = kernel.run

    def recording_run(*args, **kwargs):
        if kwargs["warmup"] and bytes_per_column is not None:
            return SimpleNamespace(metadata=SimpleNamespace(shared=bytes_per_column * kwargs["BLOCK_N"]))
        if not kwargs["warmup"]:
            launched.append(kwargs)
        return run(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", recording_run)
    return launched


@pytest.fixture
def small_device(qsa, monkeypatch):
    monkeypatch.setattr(qsa, "_qsa_shared_memory_limit", lambda: 2000, raising=False)
    return recorded_launches(qsa, monkeypatch, bytes_per_column=100)


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(ROWS, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    k = (torch.randn(BLOCKS, PAGE, 1, HEAD_DIM, generator=g) * 0.5).to(torch.float8_e4m3fn)
    v = (torch.randn(BLOCKS, PAGE, 1, HEAD_DIM, generator=g) * 0.5).to(torch.float8_e4m3fn)
    table = torch.randperm(BLOCKS, generator=g).to(torch.int32).reshape(1, BLOCKS)
    idx = torch.full((ROWS, WIDTH + 1), -1, dtype=torch.int32)
    idx[:, WIDTH] = 0
    for r in range(0, ROWS, 41):  # rows without selections cost the interpreter nothing
        n = WIDTH - r % 9
        idx[r, :n] = torch.randperm(BLOCKS * PAGE, generator=g)[:n].to(torch.int32)
        idx[r, WIDTH] = n
    gate = torch.randn(ROWS, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    return q, k, v, table, idx, gate


def run(qsa, batch):
    q, k, v, table, idx, gate = batch
    return qsa.qsa_sparse_paged_attention(q, k, v, idx, table, torch.zeros(ROWS, dtype=torch.int32), True,
                                          k_scale=K_SCALE, v_scale=V_SCALE, output_gate=gate)


def test_interpreted_launch_uses_fitted_tiles(qsa, small_device, batch):
    run(qsa, batch)
    table_block_n = qsa._select_config(ROWS, 1, True, WIDTH, True)[0]  # the table alone, no device check
    assert small_device[0]["NUM_SPLITS"] == 1
    assert small_device[0]["BLOCK_N"] < table_block_n, small_device[0]


def test_interpreter_measures_nothing_and_keeps_the_table_tile(qsa, monkeypatch, batch):
    """Guard: under the interpreter nothing is compiled, so nothing is measured or shrunk."""

    def unread():
        raise AssertionError("the shared-memory limit was read although nothing was compiled")

    monkeypatch.setattr(qsa, "_qsa_shared_memory_limit", unread, raising=False)
    launched = recorded_launches(qsa, monkeypatch, bytes_per_column=None)
    run(qsa, batch)
    tiles = [tuple(k[n] for n in ("BLOCK_N", "num_warps", "NUM_TILES", "NUM_SPLITS")) for k in launched]
    assert tiles == [qsa._select_config(ROWS, 1, True, WIDTH, True)]
