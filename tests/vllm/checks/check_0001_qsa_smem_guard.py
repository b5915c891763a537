"""Patch 0001 on the real vLLM QSA kernel module: quantized tiles fit the device's shared memory.

Runs inside the vLLM venv on a CPU machine. There is no GPU, so the device is simulated where
vLLM and Triton ask for it: capability 11.0 for vLLM, and for Triton's JIT an active driver whose
current target is sm_110 (Triton compiles without a GPU), with the shared-memory limit the patch
reads forced down to ``LIMIT``. Every call of the split-K kernel's ``run`` goes through the real
JIT with ``warmup=True``: a launch (``warmup=False``) is recorded together with the kernel the JIT
compiled for exactly its arguments, so its real shared memory is known without running it; a
compile-only call (the patch's measurement, vLLM's warmup) is recorded as a compile. Needs Triton
compilation, not its interpreter: the outer test runs this module with ``TRITON_INTERPRET=0`` and
``CUDA_VISIBLE_DEVICES=''`` (vLLM then keeps Triton enabled without an active driver).

RED on pristine 0.33.0: FP8 launches and warmup profiles overflow the forced limit, and nothing
measures the launch's compile. GREEN when patched: they fit, and the launch runs the very kernel
the patch measured (the same compiled object from Triton's JIT cache, so the same bytes), measured
once per shape. Guards (pass in both): BF16 tiles are unchanged and never measured, FP8 tiles that
fit are unchanged, and every launched kernel was pre-compiled by the warmup.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget

# A 64-head group at head_dim 256 with an FP8 cache, as compiled for sm_110 by Triton 3.8: 73,728 B
# at BLOCK_N 64 / 2 warps, 53,504 at 32 / 2, 49,408 at 32 / 1, 43,136 at 16 / 2, 41,088 at 16 / 1;
# 82,208 at 32 / 4 and 57,504 at 16 / 4. The forced 49,152 B lies between 43,136 and 49,408: every
# table tile overflows, BLOCK_N halves to 16 and, from 4 warps, the warps halve too.
LIMIT = 48 << 10
ROOMY = 227 << 10
TARGET = GPUTarget("cuda", 110, 32)
HEAD_DIM = 256
TILE = ("BLOCK_N", "num_warps", "NUM_TILES", "NUM_SPLITS")


@pytest.fixture(scope="module")
def qsa():
    importlib.import_module("vllm.models.qwen4_exp.nvidia.model")  # qsa.py cannot be imported first
    return importlib.import_module("vllm.models.qwen4_exp.nvidia.ops.qsa")


class SimulatedDriver:
    """What Triton's JIT asks the active driver for when it compiles (``warmup=True``)."""

    def get_current_target(self):
        return TARGET

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


@pytest.fixture
def sm110(qsa, monkeypatch):
    """A simulated SM110 device with a shared-memory limit the test sets."""
    for name in ("_is_sm80", "_is_sm90", "_is_sm120"):
        getattr(qsa, name).cache_clear()
    monkeypatch.setattr(qsa.current_platform, "get_device_capability", lambda device_id=0: (11, 0))
    monkeypatch.setattr(qsa.current_platform, "has_device_capability",
                        lambda cap, device_id=0: (11 * 10) >= (cap if isinstance(cap, int) else cap[0] * 10 + cap[1]))
    monkeypatch.setattr(triton.runtime.driver, "_active", SimulatedDriver())
    limit = {"bytes": LIMIT}
    monkeypatch.setattr(qsa, "_qsa_shared_memory_limit", lambda: limit["bytes"], raising=False)
    monkeypatch.setattr(qsa, "_qsa_fitted_tiles", {}, raising=False)  # each test fits afresh
    yield limit
    for name in ("_is_sm80", "_is_sm90", "_is_sm120"):
        getattr(qsa, name).cache_clear()


class Calls:
    """Replaces the split-K kernel's ``run``: compiles every call through the real JIT, runs none."""

    def __init__(self, kernel):
        self.jit_run = kernel.run
        self.launches = []  # warmup=False: the launch's kwargs and the kernel compiled for its args
        self.compiles = []  # warmup=True: the patch's measurements, vLLM's warmup

    def __call__(self, *args, grid, warmup, **kwargs):
        compiled = self.jit_run(*args, grid=grid, warmup=True, **kwargs)
        (self.compiles if warmup else self.launches).append({**kwargs, "grid": grid, "compiled": compiled})
        return compiled


def record(qsa, monkeypatch) -> Calls:
    kernel = qsa._qsa_sparse_paged_gqa_splitk_kernel
    calls = Calls(kernel)
    monkeypatch.setattr(kernel, "run", calls)
    monkeypatch.setattr(qsa._qsa_merge_splitk_kernel, "run", lambda *a, **k: None)  # never compiled here
    return calls


def shared(call: dict) -> int:
    return call["compiled"].metadata.shared


def tile(call: dict) -> tuple:
    return tuple(call[k] for k in TILE)


def launch(qsa, calls: Calls, *, rows: int, heads: int, kv_heads: int, kv_dtype, prefill: bool) -> dict:
    """Run the real qsa_sparse_paged_attention; returns its one split-K launch."""
    width = 2048
    q = torch.zeros(rows, heads, HEAD_DIM, dtype=torch.bfloat16)
    cache = torch.zeros(8, 64, kv_heads, HEAD_DIM, dtype=kv_dtype)
    indices = torch.zeros(rows, width + 1, dtype=torch.int32)
    table = torch.zeros(2, 64, dtype=torch.int32)
    token_to_req = torch.zeros(rows, dtype=torch.int32)
    quantized = kv_dtype != torch.bfloat16
    before = len(calls.launches)
    qsa.qsa_sparse_paged_attention(q, cache, cache, indices, table, token_to_req, prefill,
                                   k_scale=1.0 if quantized else None, v_scale=1.0 if quantized else None,
                                   output_gate=torch.zeros_like(q))
    assert len(calls.launches) == before + 1
    return calls.launches[-1]


def warm(qsa, *, heads: int, kv_heads: int, quantized: bool) -> set[tuple]:
    """Run the real warmup; returns the (BLOCK_N, num_splits, warps) profiles it reports as warmed."""
    kv_cache = torch.zeros(4, kv_heads, 64, 2 * HEAD_DIM, dtype=torch.uint8 if quantized else torch.bfloat16)
    return set(qsa.warmup_qsa_sparse_paged_attention(kv_cache, torch.zeros(2, 64, dtype=torch.int32),
                                                     num_query_heads=heads, selection_width=2048))


def fp8_launch(qsa, calls, rows, prefill) -> dict:
    return launch(qsa, calls, rows=rows, heads=64, kv_heads=1, kv_dtype=torch.float8_e4m3fn, prefill=prefill)


CASES = pytest.mark.parametrize("rows,prefill", [(300, True), (4096, False)], ids=["prefill-300", "decode-4096"])


# ------------------------------------------------------------------ RED on pristine, GREEN patched

@CASES
def test_fp8_launch_fits_shared_memory(qsa, sm110, monkeypatch, rows, prefill):
    kw = fp8_launch(qsa, record(qsa, monkeypatch), rows, prefill)
    assert shared(kw) <= LIMIT, f"BLOCK_N={kw['BLOCK_N']} warps={kw['num_warps']} needs {shared(kw)} B > {LIMIT} B"
    assert kw["NUM_TILES"] == -(-2048 // kw["BLOCK_N"]) and 1 <= kw["NUM_SPLITS"] <= kw["NUM_TILES"]
    assert kw["grid"] == (rows, 1, kw["NUM_SPLITS"])


@CASES
def test_fp8_launch_runs_the_measured_compile(qsa, sm110, monkeypatch, rows, prefill):
    """The patch's measurement is the launch's own compile, not an estimate of it."""
    calls = record(qsa, monkeypatch)
    kw = fp8_launch(qsa, calls, rows, prefill)
    measured = [c for c in calls.compiles if tile(c) == tile(kw)]
    assert measured, f"nothing measured the launched tile {tile(kw)} (compiles: {[tile(c) for c in calls.compiles]})"
    # Same object from Triton's JIT cache: the launch compiled nothing else, and the bytes the patch
    # compared with the limit are exactly the launched kernel's.
    assert all(c["compiled"] is kw["compiled"] for c in measured)
    assert shared(measured[-1]) == shared(kw) <= LIMIT
    # Every tile it gave up measured over the limit, and each step halved BLOCK_N, then the warps.
    rejected = [c for c in calls.compiles if tile(c) != tile(kw)]
    assert rejected and all(shared(c) > LIMIT for c in rejected)
    steps = [(c["BLOCK_N"], c["num_warps"]) for c in calls.compiles]
    for (n0, w0), (n1, w1) in zip(steps, steps[1:], strict=False):
        assert (n1, w1) == ((max(16, n0 // 2), w0) if n0 > 16 else (n0, w0 // 2))
    # Memoized: the same shape again compiles and measures nothing, and launches the same kernel.
    compiles = len(calls.compiles)
    again = fp8_launch(qsa, calls, rows, prefill)
    assert len(calls.compiles) == compiles and again["compiled"] is kw["compiled"]


def test_fp8_warmup_profiles_fit_shared_memory(qsa, sm110, monkeypatch):
    calls = record(qsa, monkeypatch)
    warmed = warm(qsa, heads=64, kv_heads=1, quantized=True)
    assert warmed
    over = {}
    for c in calls.compiles:
        if (c["BLOCK_N"], c["NUM_SPLITS"], c["num_warps"]) in warmed and shared(c) > LIMIT:
            over[(c["BLOCK_N"], c["num_warps"], c["NUM_SPLITS"])] = shared(c)
    assert not over, f"warmup prepares profiles that overflow {LIMIT} B: {over}"


# ------------------------------------------------------------------ guards: unchanged behaviour

def test_bf16_tiles_unchanged(qsa, sm110, monkeypatch):
    calls = record(qsa, monkeypatch)
    kw = launch(qsa, calls, rows=300, heads=64, kv_heads=1, kv_dtype=torch.bfloat16, prefill=True)
    assert tile(kw) == qsa._select_config(300, 1, True, 2048, False)  # the table, no guard
    assert not calls.compiles, "a BF16 launch must not be measured"


def test_fitting_fp8_tiles_unchanged(qsa, sm110, monkeypatch):
    sm110["bytes"] = ROOMY
    calls = record(qsa, monkeypatch)
    for rows, prefill in ((300, True), (4096, False), (8, False)):
        kw = launch(qsa, calls, rows=rows, heads=16, kv_heads=1, kv_dtype=torch.float8_e4m3fn, prefill=prefill)
        assert tile(kw) == qsa._select_config(rows, 1, prefill, 2048, True)
        assert shared(kw) <= ROOMY


def test_warmup_covers_every_launch(qsa, sm110, monkeypatch):
    calls = record(qsa, monkeypatch)
    warmed = warm(qsa, heads=64, kv_heads=1, quantized=True)
    prepared = [c for c in calls.compiles if (c["BLOCK_N"], c["NUM_SPLITS"], c["num_warps"]) in warmed]
    for rows, prefill in ((1, False), (300, True), (4096, False), (4096, True)):
        kw = fp8_launch(qsa, calls, rows, prefill)
        assert tile(kw) in {tile(c) for c in prepared}
        assert any(c["compiled"] is kw["compiled"] for c in prepared), f"{tile(kw)} was compiled again at launch"
