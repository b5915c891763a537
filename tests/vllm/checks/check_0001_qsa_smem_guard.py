"""Patch 0001 on the real vLLM QSA kernel module: quantized tiles fit the device's shared memory.

Runs inside the vLLM venv on a CPU machine. There is no GPU, so the device is simulated where
vLLM asks for it (capability 11.0, Triton target sm_110, a shared-memory limit forced down to
``LIMIT``), the kernel launches are recorded instead of run, and each recorded tile shape is
compiled for sm_110 by this test itself (Triton compiles without a GPU) to read the shared
memory it really needs. Needs Triton compilation, not its interpreter: the outer test runs
this module with ``TRITON_INTERPRET=0`` and ``CUDA_VISIBLE_DEVICES=''`` (vLLM then keeps Triton
enabled without an active driver).

RED on pristine 0.33.0: FP8 launches and warmup profiles overflow the forced limit.
GREEN when patched. Guards (pass in both): BF16 tiles and FP8 tiles that fit are unchanged,
and every launched tile shape was pre-compiled by the warmup.
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

LIMIT = 40 << 10  # between BLOCK_N 64 and BLOCK_N 16 of a 64-head group at head_dim 256 (sm_110)
ROOMY = 227 << 10
TARGET = GPUTarget("cuda", 110, 32)
HEAD_DIM = 256


@pytest.fixture(scope="module")
def qsa():
    importlib.import_module("vllm.models.qwen4_exp.nvidia.model")  # qsa.py cannot be imported first
    return importlib.import_module("vllm.models.qwen4_exp.nvidia.ops.qsa")


@pytest.fixture
def sm110(qsa, monkeypatch):
    """A simulated SM110 device with a shared-memory limit the test sets."""
    for name in ("_is_sm80", "_is_sm90", "_is_sm120"):
        getattr(qsa, name).cache_clear()
    monkeypatch.setattr(qsa.current_platform, "get_device_capability", lambda device_id=0: (11, 0))
    monkeypatch.setattr(qsa.current_platform, "has_device_capability",
                        lambda cap, device_id=0: (11 * 10) >= (cap if isinstance(cap, int) else cap[0] * 10 + cap[1]))
    monkeypatch.setattr(qsa, "_qsa_device_target", lambda: TARGET, raising=False)
    limit = {"bytes": LIMIT}
    monkeypatch.setattr(qsa, "_qsa_shared_memory_limit", lambda: limit["bytes"], raising=False)
    yield limit
    for name in ("_is_sm80", "_is_sm90", "_is_sm120"):
        getattr(qsa, name).cache_clear()


@functools.lru_cache(maxsize=None)
def compiled_shared(kernel, block_n: int, block_m: int, warps: int, kv_type: str, split: bool) -> int:
    """Shared memory of the installed kernel, compiled by this test for sm_110."""
    const = dict(TOPK=2048, PAGE_SIZE=64, PAGE_TABLE_WIDTH=64, GROUP_SIZE=block_m, HEAD_DIM=HEAD_DIM,
                 NUM_QUERY_HEADS=block_m, NUM_SPLITS=2 if split else 1, NUM_TILES=2048 // block_n,
                 BLOCK_M=block_m, BLOCK_N=block_n)
    pointers = {"q_ptr": "*bf16", "k_cache_ptr": kv_type, "v_cache_ptr": kv_type, "output_ptr": "*bf16",
                "output_gate_ptr": "*bf16", "partial_output_ptr": "*fp32" if split else "*bf16",
                "partial_lse_ptr": "*fp32" if split else "*bf16"}
    sig = {n: "constexpr" if n in const else pointers.get(n, "fp32" if n.endswith("_scale") else
                                                           "*i32" if n.endswith("_ptr") else "i32")
           for n in kernel.arg_names}
    return triton.compile(ASTSource(kernel, sig, const), target=TARGET,
                          options={"num_warps": warps, "num_stages": 2}).metadata.shared


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append(kwargs)


def launch(qsa, monkeypatch, *, rows: int, heads: int, kv_heads: int, kv_dtype, prefill: bool) -> dict:
    """Run the real qsa_sparse_paged_attention with the split-K kernel's launch recorded."""
    rec, merge = Recorder(), Recorder()
    monkeypatch.setattr(qsa._qsa_sparse_paged_gqa_splitk_kernel, "run", rec)
    monkeypatch.setattr(qsa._qsa_merge_splitk_kernel, "run", merge)
    width = 2048
    q = torch.zeros(rows, heads, HEAD_DIM, dtype=torch.bfloat16)
    cache = torch.zeros(8, 64, kv_heads, HEAD_DIM, dtype=kv_dtype)
    indices = torch.zeros(rows, width + 1, dtype=torch.int32)
    table = torch.zeros(2, 64, dtype=torch.int32)
    token_to_req = torch.zeros(rows, dtype=torch.int32)
    quantized = kv_dtype != torch.bfloat16
    qsa.qsa_sparse_paged_attention(q, cache, cache, indices, table, token_to_req, prefill,
                                   k_scale=1.0 if quantized else None, v_scale=1.0 if quantized else None,
                                   output_gate=torch.zeros_like(q))
    assert len(rec.calls) == 1
    return rec.calls[0]


def warmed_profiles(qsa, monkeypatch, *, heads: int, kv_heads: int, quantized: bool) -> list[dict]:
    rec = Recorder()
    monkeypatch.setattr(qsa._qsa_sparse_paged_gqa_splitk_kernel, "warmup", rec)
    monkeypatch.setattr(qsa._qsa_merge_splitk_kernel, "warmup", Recorder())
    kv_cache = torch.zeros(4, kv_heads, 64, 2 * HEAD_DIM, dtype=torch.uint8 if quantized else torch.bfloat16)
    qsa.warmup_qsa_sparse_paged_attention(kv_cache, torch.zeros(2, 64, dtype=torch.int32),
                                          num_query_heads=heads, selection_width=2048)
    return rec.calls


def kv_type(dtype) -> str:
    return "*fp8e4nv" if dtype == torch.float8_e4m3fn else "*u8"


# ------------------------------------------------------------------ RED on pristine, GREEN patched

@pytest.mark.parametrize("rows,prefill", [(300, True), (4096, False)], ids=["prefill-300", "decode-4096"])
def test_fp8_launch_fits_shared_memory(qsa, sm110, monkeypatch, rows, prefill):
    kw = launch(qsa, monkeypatch, rows=rows, heads=64, kv_heads=1, kv_dtype=torch.float8_e4m3fn, prefill=prefill)
    need = compiled_shared(qsa._qsa_sparse_paged_gqa_splitk_kernel, kw["BLOCK_N"], kw["BLOCK_M"], kw["num_warps"],
                           "*fp8e4nv", kw["NUM_SPLITS"] > 1)
    assert need <= LIMIT, f"BLOCK_N={kw['BLOCK_N']} warps={kw['num_warps']} needs {need} B > {LIMIT} B"
    assert kw["NUM_TILES"] == -(-2048 // kw["BLOCK_N"]) and 1 <= kw["NUM_SPLITS"] <= kw["NUM_TILES"]


def test_fp8_warmup_profiles_fit_shared_memory(qsa, sm110, monkeypatch):
    calls = warmed_profiles(qsa, monkeypatch, heads=64, kv_heads=1, quantized=True)
    assert calls
    over = {(c["BLOCK_N"], c["num_warps"], c["NUM_SPLITS"]) for c in calls
            if compiled_shared(qsa._qsa_sparse_paged_gqa_splitk_kernel, c["BLOCK_N"], c["BLOCK_M"], c["num_warps"],
                               "*fp8e4nv", c["NUM_SPLITS"] > 1) > LIMIT}
    assert not over, f"warmup compiles profiles that overflow {LIMIT} B: {sorted(over)}"


# ------------------------------------------------------------------ guards: unchanged behaviour

def test_bf16_tiles_unchanged(qsa, sm110, monkeypatch):
    kw = launch(qsa, monkeypatch, rows=300, heads=64, kv_heads=1, kv_dtype=torch.bfloat16, prefill=True)
    block_n, warps, tiles, splits = qsa._select_config(300, 1, True, 2048, False)  # the table, no guard
    assert (kw["BLOCK_N"], kw["num_warps"], kw["NUM_TILES"], kw["NUM_SPLITS"]) == (block_n, warps, tiles, splits)


def test_fitting_fp8_tiles_unchanged(qsa, sm110, monkeypatch):
    sm110["bytes"] = ROOMY
    for rows, prefill in ((300, True), (4096, False), (8, False)):
        kw = launch(qsa, monkeypatch, rows=rows, heads=16, kv_heads=1, kv_dtype=torch.float8_e4m3fn, prefill=prefill)
        table = qsa._select_config(rows, 1, prefill, 2048, True)
        assert (kw["BLOCK_N"], kw["num_warps"], kw["NUM_TILES"], kw["NUM_SPLITS"]) == table


def test_warmup_covers_every_launch(qsa, sm110, monkeypatch):
    warmed = {(c["BLOCK_N"], c["num_warps"], c["NUM_SPLITS"], c["NUM_TILES"])
              for c in warmed_profiles(qsa, monkeypatch, heads=64, kv_heads=1, quantized=True)}
    for rows, prefill in ((1, False), (300, True), (4096, False), (4096, True)):
        kw = launch(qsa, monkeypatch, rows=rows, heads=64, kv_heads=1, kv_dtype=torch.float8_e4m3fn, prefill=prefill)
        assert (kw["BLOCK_N"], kw["num_warps"], kw["NUM_SPLITS"], kw["NUM_TILES"]) in warmed
