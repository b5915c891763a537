#!/usr/bin/env python3
"""Exploration for issue 8: where sglang 0.5.23's QSA chunk kernel loses time with FP8 KV.

Times ``_sparse_gqa_chunk_prefill`` of several ``sparse_attn.py`` variants (pristine first),
launched directly so the tile configuration (BLOCK_N, num_warps, num_stages) can be swept, for
BF16 and FP8 (E4M3) K/V, in one run, with ``triton.testing.do_bench`` medians. Also checks each
variant's FP8 output against pristine's (bit-identity at the same configuration), against a
float64 reference, and that a NaN in the cache still reaches the output. Times the pristine vs
descaled (0002) gather kernels ``_compact_kv`` / ``_pack_qsa_prefill_kv`` for FP8 vs BF16 pools.

    python scripts/gpu/qsa_fp8_explore.py --shim .gpu/qsa/shim-pristine \\
        --variant pristine=.gpu/qsa/shim-pristine/sglang/srt/layers/attention/qsa/sparse_attn.py \\
        --variant hw=.gpu/qsa/cand/cand3_hw.py ... --out $OUT/explore.json

The committed record of a run is benchmarks/qsa_fp8/ (README.md says which command made it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

H_Q, H_KV, D = 16, 2, 256
DEV = "cuda"
DRY_RUN = False  # --dry-run: CPU + TRITON_INTERPRET=1, tiny shapes, wall-clock timing (script test only)


def fix_interpreter():
    """--dry-run only: make Triton's CPU interpreter compute what compiled code does (a Python
    float argument is an fp32 scalar; tl.dot multiplies bf16 values, not their bit patterns)."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    cvt, dot = interp._implicit_cvt, interp.InterpreterBuilder.create_dot

    def implicit_cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(interp.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return cvt(arg)

    def widen(h):
        if h.dtype == tl.bfloat16:
            return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    interp._implicit_cvt = implicit_cvt
    interp.InterpreterBuilder.create_dot = lambda self, a, b, d, *rest: dot(self, widen(a), widen(b), d, *rest)
    torch.cuda.get_device_name = lambda *a: "NVIDIA H200"


def load_variant(name: str, path: str):
    spec = importlib.util.spec_from_file_location(f"qsa_variant_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def launch(mod, q, k, v, idx, cu_q, cu_k, kv_lens, scale, rows, cfg, v_scale=1.0):
    """One launch of mod._sparse_gqa_chunk_prefill as sparse_gqa_fwd_interface_triton_ck does,
    with an explicit (BLOCK_N, num_warps, num_stages); cfg None = the module's own choice."""
    kern = mod._sparse_gqa_chunk_prefill
    extra = {}
    if "FP8_KV_F16_DOT" in kern.arg_names:  # 0003: E4M3 K/V take the f16 path and its tile table
        extra["FP8_KV_F16_DOT"] = mod._fp8_kv_f16_dot(q, k)
        default = mod._get_best_config(q.shape[0], extra["FP8_KV_F16_DOT"]) if not DRY_RUN else (16, 1, 2)
    else:
        default = mod._get_best_config(q.shape[0]) if not DRY_RUN else (16, 1, 2)
    block_n, warps, stages = cfg or default
    out = torch.empty_like(q)
    scalars = [scale, v_scale] if "v_scale" in kern.arg_names else [scale]
    if "WIDEN_IN_REGISTERS" in kern.arg_names:
        extra["WIDEN_IN_REGISTERS"] = mod._widen_in_registers(q, k)
    kern[(rows, H_KV)](
        q, k, v, out, idx, cu_q, cu_k, kv_lens, *scalars, idx.shape[-1],
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        idx.stride(0), idx.stride(1), idx.stride(2),
        NUM_KV_HEADS=H_KV, GROUP_SIZE=H_Q // H_KV, BLOCK_M=16, BLOCK_N=block_n, HEAD_DIM=D,
        SLOT_INDICES=False, num_warps=warps, num_stages=stages, **extra)
    return out


def bench(fn):
    fn()
    if DRY_RUN:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def reference(q, k, v, idx, scale, k_scale=1.0, v_scale=1.0):
    """float64 sparse GQA over the selected tokens (k/v dequantized with the descales)."""
    qq = q.double()
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    g = H_Q // H_KV
    for h in range(H_KV):
        sel = idx[:, h].long()  # [rows, topk]
        kk = k[:, h].double()[sel] * k_scale  # [rows, topk, D]
        vv = v[:, h].double()[sel] * v_scale
        s = torch.einsum("rgd,rtd->rgt", qq[:, h * g:(h + 1) * g], kk) * scale
        out[:, h * g:(h + 1) * g] = torch.einsum("rgt,rtd->rgd", torch.softmax(s, -1), vv)
    return out


def rel_err(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shim", required=True)
    ap.add_argument("--variant", action="append", required=True, help="name=path to sparse_attn.py")
    ap.add_argument("--sweep", action="append", default=[],
                    help="name: variant whose FP8 kernel is swept over --configs (repeatable)")
    ap.add_argument("--sweep-base", action="store_true", help="also sweep the first variant's BF16 kernel")
    ap.add_argument("--configs", default="16,1,2;16,2,2;32,2,2;32,4,2;32,4,3;64,4,2;32,8,2;64,8,2;16,1,3;16,4,2")
    ap.add_argument("--shapes", default="16x512x65536;64x512x65536;256x512x65536;1024x512x65536;"
                                        "2048x512x65536;8192x512x65536;256x2048x65536;2048x2048x65536")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    global DEV, DRY_RUN
    if args.dry_run:
        DEV, DRY_RUN = "cpu", True
        fix_interpreter()
    sys.path.insert(0, args.shim)
    variants = dict(v.split("=", 1) for v in args.variant)
    mods = {n: load_variant(n, p) for n, p in variants.items()}
    base = next(iter(mods))
    configs = [tuple(int(x) for x in c.split(",")) for c in args.configs.split(";")]
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(";")]
    res = {"gpu": torch.cuda.get_device_name() if not DRY_RUN else "cpu", "torch": torch.__version__,
           "triton": triton.__version__, "python": platform.python_version(), "argv": sys.argv, "variants": variants,
           "default_configs": {}, "chunk": [], "checks": {}, "gather": []}
    torch.manual_seed(0)
    scale = D ** -0.5
    t0 = time.time()
    ctxs = sorted({s[2] for s in shapes})
    kv = {}
    for ctx in ctxs:
        k = torch.randn(ctx, H_KV, D, device=DEV, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kv[ctx] = {"bf16": (k, v), "fp8": (k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn))}
    for rows, topk, ctx in shapes:
        q = torch.randn(rows, H_Q, D, device=DEV, dtype=torch.bfloat16)
        cu_q = torch.tensor([0, rows], dtype=torch.int32, device=DEV)
        cu_k = torch.tensor([0, ctx], dtype=torch.int32, device=DEV)
        kvl = torch.tensor([ctx], dtype=torch.int32, device=DEV)
        idx = torch.randint(0, ctx - rows, (rows, H_KV, topk), device=DEV, dtype=torch.int32).sort(-1).values
        row = {"rows": rows, "topk": topk, "ctx": ctx, "ms": {}}
        if not DRY_RUN:
            res["default_configs"][rows] = list(mods[base]._get_best_config(rows))
        outs = {}
        for name, mod in mods.items():
            for dt in ("bf16", "fp8"):
                k, v = kv[ctx][dt]
                cfgs = [None] + (configs if (name in args.sweep and dt == "fp8") or
                                 (name == base and dt == "bf16" and args.sweep_base) else [])
                for cfg in cfgs:
                    key = f"{name}/{dt}/" + ("default" if cfg is None else ",".join(map(str, cfg)))
                    try:
                        fn = lambda: launch(mod, q, k, v, idx, cu_q, cu_k, kvl, scale, rows, cfg)  # noqa: E731
                        if cfg is None:
                            outs[(name, dt)] = fn()
                        row["ms"][key] = round(bench(fn), 5)
                    except Exception as exc:  # a config that does not compile (shared memory) is data
                        row["ms"][key] = f"error: {type(exc).__name__}: {str(exc)[:160]}"
        # pristine timed again last: the spread of one configuration within the run
        k, v = kv[ctx]["fp8"]
        row["ms"][f"{base}/fp8/default#2"] = round(bench(
            lambda: launch(mods[base], q, k, v, idx, cu_q, cu_k, kvl, scale, rows, None)), 5)
        for dt in ("fp8", "bf16"):
            row[f"{dt}_equal_to_base"] = {
                n: bool(torch.equal(outs[(n, dt)], outs[(base, dt)])) for n in mods if (n, dt) in outs}
            row[f"{dt}_max_abs_diff_to_base"] = {
                n: float((outs[(n, dt)].float() - outs[(base, dt)].float()).abs().max())
                for n in mods if (n, dt) in outs}
        res["chunk"].append(row)
        print(json.dumps({k2: row[k2] for k2 in ("rows", "topk", "ctx")}),
              {k2: row["ms"][k2] for k2 in row["ms"] if k2.endswith("default")}, flush=True)

    # accuracy vs float64 on realistic data, and every finite e4m3 code through the widening
    rows, topk, ctx = (128, 512, 16384) if not DRY_RUN else (4, 32, 256)
    q = torch.randn(rows, H_Q, D, device=DEV, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, rows], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, ctx], dtype=torch.int32, device=DEV)
    kvl = torch.tensor([ctx], dtype=torch.int32, device=DEV)
    idx = torch.randint(0, ctx - rows, (rows, H_KV, topk), device=DEV, dtype=torch.int32).sort(-1).values
    k8 = (torch.randn(ctx, H_KV, D, device=DEV) * 2).to(torch.float8_e4m3fn)
    v8 = (torch.randn(ctx, H_KV, D, device=DEV) * 2).to(torch.float8_e4m3fn)
    ref = reference(q, k8, v8, idx, scale)
    res["checks"]["rel_err_vs_float64"] = {
        n: rel_err(launch(m, q, k8, v8, idx, cu_q, cu_k, kvl, scale, rows, None), ref) for n, m in mods.items()}
    codes = torch.arange(256, dtype=torch.int32, device=DEV).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # the two NaN codes are checked below
    raw_k = codes[torch.randint(0, codes.numel(), (ctx, H_KV, D), device=DEV)].view(torch.float8_e4m3fn)
    raw_v = codes[torch.randint(0, codes.numel(), (ctx, H_KV, D), device=DEV)].view(torch.float8_e4m3fn)
    qs = q * 0.01  # keep softmax soft over +-448 keys
    base_out = launch(mods[base], qs, raw_k, raw_v, idx, cu_q, cu_k, kvl, scale, rows, None)
    res["checks"]["all_codes_equal_to_base"] = {
        n: bool(torch.equal(launch(m, qs, raw_k, raw_v, idx, cu_q, cu_k, kvl, scale, rows, None), base_out))
        for n, m in mods.items()}
    nan_k = k8.clone()
    nan_k.view(torch.uint8)[idx[0, 0, 0], 0, 0] = 0x7F
    res["checks"]["nan_reaches_output"] = {}
    for n, m in mods.items():
        out = launch(m, q, nan_k, v8, idx, cu_q, cu_k, kvl, scale, rows, None)
        res["checks"]["nan_reaches_output"][n] = bool(torch.isnan(out[0, :H_Q // H_KV]).all())

    # gather kernels: pristine vs the others, FP8 pool -> BF16 scratch vs BF16 -> BF16
    for name, mod in mods.items():
        for topk, batch in ((2048, 64), (2048, 256)) if not DRY_RUN else ((32, 2),):
            pool = {"bf16": kv[min(kv)]["bf16"], "fp8": kv[min(kv)]["fp8"]}
            n_pool = pool["bf16"][0].shape[0]
            req_to_token = torch.randperm(n_pool, device=DEV, dtype=torch.int32)[None].repeat(batch, 1)
            req_idx = torch.arange(batch, device=DEV, dtype=torch.int32)
            seq = torch.full((batch,), n_pool, device=DEV, dtype=torch.int32)
            ind = torch.randint(0, n_pool, (batch, topk), device=DEV, dtype=torch.int32)
            cu = torch.arange(batch + 1, device=DEV, dtype=torch.int32) * topk
            entry = {"kernel": "compact", "variant": name, "batch": batch, "topk": topk, "ms": {}}
            for dt, (kk, vv) in pool.items():
                ok = torch.empty(batch * topk, H_KV, D, device=DEV, dtype=torch.bfloat16)
                ov = torch.empty_like(ok)
                entry["ms"][dt] = round(bench(lambda: mod.qwen_sparse_kv_extraction_compact_triton(
                    kk, vv, req_to_token, req_idx, ind, seq, cu, ok, ov, batch, topk)), 5)
            res["gather"].append(entry)
        total = min(kv)
        entry = {"kernel": "pack", "variant": name, "total_k": total, "ms": {}}
        r2t = torch.randperm(total, device=DEV, dtype=torch.int32)[None]
        for dt, (kk, vv) in {"bf16": kv[total]["bf16"], "fp8": kv[total]["fp8"]}.items():
            entry["ms"][dt] = round(bench(lambda: mod.pack_qsa_prefill_kv(
                k=kk, v=vv, req_to_token=r2t, req_indices=torch.zeros(1, device=DEV, dtype=torch.int32),
                cu_k=torch.tensor([0, total], device=DEV, dtype=torch.int32), total_k=total, max_k=total,
                output_dtype=torch.bfloat16)), 5)
        res["gather"].append(entry)
    res["seconds"] = round(time.time() - t0, 1)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res["checks"]), "\ngather", json.dumps(res["gather"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
