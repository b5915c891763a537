"""RED/GREEN check for patch 0003 (FP8 QSA K/V read through an f16 tensor-core path).

Runs inside the sglang venv against whichever sglang is first on sys.path.

- The speed fix, proven without a GPU: the chunk kernel that the real launchers would run for
  E4M3 K/V is compiled for sm_90 with the venv's own Triton and ptxas (no driver needed), and
  its SASS must hold no per-value f16 -> bf16 convert (``F2F.BF16.F16``, the instruction that
  made FP8 1.65x slower than BF16 on an H200) and only f16 tensor-core MMAs. Pristine fails.
- Correctness on the CPU (Triton interpreter, small shapes): the three launchers of the chunk
  kernel stay within tolerance of a float64 reference with E4M3 K/V, also for queries of extreme
  magnitude (the f16 path rescales q by a power of two); outputs and errors are written to
  ``$QSA_CHECK_OUT`` so the outer test can compare the pristine and the patched run
  (BF16 bit-identical, FP8 error not larger).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import qsa_interpreter  # sibling module: shared interpreter fixes
import torch
import triton.language as tl
from sglang.srt.layers.attention.qsa import sparse_attn as sa

H_Q, H_KV, D = 16, 2, 64
SCALE = D ** -0.5
FP8 = torch.float8_e4m3fn
OUT = qsa_interpreter.output_dir("qsa-0003-")
qsa_interpreter.install()


def _save(name, *tensors):
    qsa_interpreter.save(OUT, name, *tensors)


def test_interpreter_fix_matches_torch():
    """The two interpreter fixes above are themselves right (bf16 dot, float argument)."""
    import triton

    @triton.jit
    def k(a, b, o, s):
        i = tl.arange(0, 16)
        x = tl.load(a + i[:, None] * 16 + i[None, :])
        y = tl.load(b + i[:, None] * 16 + i[None, :])
        tl.store(o + i[:, None] * 16 + i[None, :], tl.dot(x * s, y.to(tl.float32)))

    a, b = torch.randn(16, 16).bfloat16(), torch.randn(16, 16).bfloat16()
    o = torch.empty(16, 16)
    k[(1,)](a, b, o, 0.5)
    torch.testing.assert_close(o, (a.float() * 0.5) @ b.float(), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- SASS (sm_90)

_COMPILE = textwrap.dedent(r"""
    import json, os, subprocess, sys, tempfile
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H200"
    from sglang.srt.layers.attention.qsa import sparse_attn as sa

    D = 256

    def sass_ops(rows, topk, kdt):
        q = torch.empty(rows, 16, D, dtype=torch.bfloat16, device="meta")
        k = torch.empty(8, 2, D, dtype=getattr(torch, kdt), device="meta")
        fn = sa._sparse_gqa_chunk_prefill
        # what the launcher would pass for these tensors on a GPU
        f16_dot = getattr(sa, "_fp8_kv_f16_dot", None)
        flag = bool(f16_dot(q, k)) if f16_dot else None
        block_n, warps, stages = sa._get_best_config(rows, flag, topk) if f16_dot else sa._get_best_config(rows)
        tname = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4nv"}[k.dtype]
        sig = {"q": "*bf16", "k": f"*{tname}", "v": f"*{tname}", "out": "*bf16", "indices": "*i32",
               "cu_q": "*i32", "cu_k": "*i32", "kv_lens": "*i32", "scale": "fp32", "v_scale": "fp32",
               "topk": "i32"}
        const = dict(sq_m=16 * D, sq_h=D, sq_d=1, sk_n=2 * D, sk_h=D, sk_d=1, sv_n=2 * D, sv_h=D, sv_d=1,
                     so_m=16 * D, so_h=D, so_d=1, si_m=2 * topk, si_g=topk, si_n=1, NUM_KV_HEADS=2,
                     GROUP_SIZE=8, BLOCK_M=16, BLOCK_N=block_n, HEAD_DIM=D, SLOT_INDICES=False,
                     FP8_KV_F16_DOT=flag)
        sig = {a: sig.get(a, "constexpr") for a in fn.arg_names}
        const = {a: v for a, v in const.items() if a in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
                 if sig[a].startswith("*") or a == "topk"}
        kern = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages))
        cubin = tempfile.NamedTemporaryFile(suffix=".cubin", delete=False)
        cubin.write(kern.asm["cubin"]); cubin.close()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        sass = subprocess.run([tool, "-sass", cubin.name], capture_output=True, text=True, check=True).stdout
        ops = [l.split("*/", 1)[1].split(";")[0].split() for l in sass.splitlines() if "/*" in l and "*/ " in l]
        ops = [o[1] if o[0].startswith("@") else o[0] for o in ops if o]
        return {"config": [block_n, warps, stages], "ops": ops}

    # Every case in this one process (a fresh one, without the interpreter); a case that fails to
    # compile is reported as its error, so the other cases still get their ops.
    results = {}
    for case in sys.argv[1:]:
        rows, topk, kdt = case.split(",")
        try:
            results[case] = sass_ops(int(rows), int(topk), kdt)
        except Exception:
            import traceback
            results[case] = {"error": traceback.format_exc()[-3000:]}
    print(json.dumps(results))
""")


SASS_CASES = [(16, 512), (64, 512), (128, 2048), (256, 512), (2048, 512)]


@pytest.fixture(scope="module")
def fp8_sass():
    """The sm_90 builds of every case, compiled in one process (importing sglang once, not per case)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    cases = [f"{rows},{topk},float8_e4m3fn" for rows, topk in SASS_CASES]
    r = subprocess.run([sys.executable, "-c", _COMPILE, *cases], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("rows,topk", SASS_CASES)
def test_fp8_chunk_kernel_runs_f16_dots_without_per_value_converts(fp8_sass, rows, topk):
    """The sm_90 build the launcher would run for E4M3 K/V: no F2F.BF16.F16, f16 MMAs only."""
    got = fp8_sass[f"{rows},{topk},float8_e4m3fn"]
    assert "error" not in got, got["error"]
    ops = got["ops"]
    mma = sorted({o for o in ops if o.startswith("HMMA")})
    assert "F2F.BF16.F16" not in ops, (got["config"], ops.count("F2F.BF16.F16"), "slow f16->bf16 converts")
    assert mma == ["HMMA.16816.F32"], (got["config"], mma)


# --------------------------------------------------------------------------- interpreter

def _problem(seed, rows=8, topk=64, ctx=384):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, H_Q, D, generator=g).bfloat16()
    k = torch.randn(ctx, H_KV, D, generator=g) * 2
    v = torch.randn(ctx, H_KV, D, generator=g) * 2
    idx = torch.stack([torch.randperm(ctx - rows, generator=g)[:topk].sort().values
                       for _ in range(rows * H_KV)]).reshape(rows, H_KV, topk).int()
    return q, k, v, idx


def _reference(q, k, v, sel):
    return qsa_interpreter.reference_attention(q, k, v, sel, SCALE, H_KV)


_rel = qsa_interpreter.rel_err


def _chunk(q, k, v, idx):
    rows, ctx = q.shape[0], k.shape[0]
    return sa.sparse_gqa_fwd_interface_triton_ck(
        q, k, v, idx, torch.tensor([0, rows], dtype=torch.int32), torch.tensor([0, ctx], dtype=torch.int32),
        torch.tensor([ctx], dtype=torch.int32), SCALE, max_q=rows)


def _paged(q, k, v, idx):
    """The CP prefill launcher: reads the pool in place through a slot table (one entry)."""
    rows, ctx = q.shape[0], k.shape[0]
    perm = torch.randperm(ctx, generator=torch.Generator().manual_seed(7)).int()
    pool_k, pool_v = torch.empty_like(k), torch.empty_like(v)
    pool_k[perm.long()], pool_v[perm.long()] = k, v
    ind = idx[:, 0].contiguous()  # the paged launcher takes one index row per query row
    out = sa.sparse_gqa_paged_prefill_triton(
        q, pool_k, pool_v, perm[None], ind, torch.tensor([0, rows], dtype=torch.int32),
        torch.tensor([ctx], dtype=torch.int32), SCALE, max_q=rows)
    return out, torch.stack([ind, ind], 1)


def _decode(q, k, v, idx):
    """The packed decode launcher: one row per request over its packed top-k K/V."""
    rows, topk = q.shape[0], idx.shape[-1]
    ind = idx[:, 0].long()
    kp, vp = k[ind].reshape(rows * topk, H_KV, D), v[ind].reshape(rows * topk, H_KV, D)
    rel = torch.arange(topk, dtype=torch.int32).expand(rows, -1).contiguous()
    cu_q = torch.arange(rows + 1, dtype=torch.int32)
    out = sa.sparse_gqa_packed_decode_triton(q, kp, vp, rel, cu_q, cu_q * topk,
                                             torch.full((rows,), topk, dtype=torch.int32), SCALE)
    flat = (torch.arange(rows)[:, None] * topk + torch.arange(topk)[None, :]).int()
    return out, kp, vp, torch.stack([flat, flat], 1)


PATHS = ("chunk", "paged", "decode")


def _run(path, q, k, v, idx):
    """(output, k, v, idx) with k/v/idx as the reference must see them."""
    if path == "chunk":
        return _chunk(q, k, v, idx), k, v, idx
    if path == "paged":
        out, ridx = _paged(q, k, v, idx)
        return out, k, v, ridx
    out, kp, vp, ridx = _decode(q, k, v, idx)
    return out, kp, vp, ridx


def _record(name, value):
    path = OUT / "errors.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[name] = value
    path.write_text(json.dumps(data, indent=1))


@pytest.mark.parametrize("path", PATHS)
def test_fp8_kv_close_to_float64_reference(path):
    q, k, v, idx = _problem(1)
    k8, v8 = k.to(FP8), v.to(FP8)
    out, kr, vr, ir = _run(path, q, k8, v8, idx)
    err = _rel(out, _reference(q, kr, vr, ir))
    _record(f"{path}/fp8", err)
    assert err < 1e-2, err


@pytest.mark.parametrize("magnitude", [1e-6, 30.0, 1e6])
def test_fp8_kv_queries_of_extreme_magnitude(magnitude):
    """q x 1e6 overflows f16 unless the f16 path rescales it; q x 1e-6 underflows."""
    q, k, v, idx = _problem(2)
    q = (q.float() * magnitude).bfloat16()
    k8, v8 = k.to(FP8), v.to(FP8)
    out = _chunk(q, k8, v8, idx)
    assert torch.isfinite(out.float()).all()
    err = _rel(out, _reference(q, k8, v8, idx))
    _record(f"chunk/fp8/q*{magnitude:g}", err)
    assert err < 2e-2, err


@pytest.mark.parametrize("path", PATHS)
def test_bf16_outputs_for_comparison(path):
    """BF16 K/V: outputs saved for the outer test, which needs them bit-identical to pristine's."""
    q, k, v, idx = _problem(3)
    kb, vb = k.bfloat16(), v.bfloat16()
    out, kr, vr, ir = _run(path, q, kb, vb, idx)
    _save(f"{path}-bf16", out)
    assert _rel(out, _reference(q, kr, vr, ir)) < 1e-2
