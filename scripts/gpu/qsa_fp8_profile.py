#!/usr/bin/env python3
"""One launch of each named (variant, dtype, config) of the QSA chunk kernel inside a profiler
range, for Nsight Compute: the hardware counters say where the FP8 time goes (issue 8).

    ncu --clock-control none --profile-from-start off --set full --csv --page details \\
        python scripts/gpu/qsa_fp8_profile.py --shim .gpu/qsa/shim-pristine \\
            --variant pristine=PATH --variant f32b=PATH \\
            --launch pristine/bf16/default --launch pristine/fp8/default --launch f32b/fp8/16,1,1

Kernels are profiled in --launch order (all have the same name); rows/topk/ctx as in the probe.
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from qsa_fp8_explore import DEV, H_KV, H_Q, D, launch, load_variant  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shim", required=True)
    ap.add_argument("--variant", action="append", required=True)
    ap.add_argument("--launch", action="append", required=True, help="variant/dtype/config")
    ap.add_argument("--shape", default="2048x512x65536")
    args = ap.parse_args()
    sys.path.insert(0, args.shim)
    mods = {n: load_variant(n, p) for n, p in (v.split("=", 1) for v in args.variant)}
    rows, topk, ctx = (int(x) for x in args.shape.split("x"))
    torch.manual_seed(0)
    k = torch.randn(ctx, H_KV, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kv = {"bf16": (k, v), "fp8": (k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn))}
    q = torch.randn(rows, H_Q, D, device=DEV, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, rows], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, ctx], dtype=torch.int32, device=DEV)
    kvl = torch.tensor([ctx], dtype=torch.int32, device=DEV)
    idx = torch.randint(0, ctx - rows, (rows, H_KV, topk), device=DEV, dtype=torch.int32).sort(-1).values
    calls = []
    for spec in args.launch:
        name, dt, cfg = spec.split("/")
        cfg = None if cfg == "default" else tuple(int(x) for x in cfg.split(","))
        kk, vv = kv[dt]
        calls.append(lambda m=mods[name], kk=kk, vv=vv, cfg=cfg:
                     launch(m, q, kk, vv, idx, cu_q, cu_k, kvl, D ** -0.5, rows, cfg))
    for c in calls:  # compile and warm outside the profiled range
        c()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for c in calls:
        c()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled:", args.launch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
