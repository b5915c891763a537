#!/usr/bin/env python3
"""Patch 0001 (vLLM QSA quantized-tile shared-memory guard) on a real GPU, limit forced down.

Self-contained for a machine with torch + triton and NO vLLM: the QSA split-K kernel, its merge
kernel, the tile tables and ``qsa_sparse_paged_attention`` are pulled out of a pristine and a
patched copy of ``models/qwen4_exp/nvidia/ops/qsa.py`` with ``ast`` (everything that needs vLLM
itself, i.e. the warmup helper, is left out; ``current_platform`` is a two-method shim over
``torch.cuda``). Each launch is recorded with the shared memory of the kernel Triton really
compiled for this GPU (``CompiledKernel.metadata.shared``).

An H200 has 227 KiB per block, more than any table tile needs, so the device limit the patch
reads (``_qsa_shared_memory_limit``) is forced down, as a smaller device's (SM12x: 99 KiB) or a
wider group's footprint would be: by default to one byte below what the pristine launch of each
case compiled to (``--limit`` fixes it instead). Checks (exit 1 if one fails):

- RED: the pristine launch of an FP8 cache, 64-head group, head_dim 256 needs more than the limit;
- GREEN: the patched launch of the same batch fits the limit (real compiled shared memory);
- the patch's own measurement (``_qsa_tile_shared_memory``, a compile for this GPU) is not
  below what the launch compiled, so the guard cannot under-shrink;
- the halved tiles compute the same attention: patched vs pristine vs a float32 reference;
- unchanged where nothing overflows: BF16 caches, and FP8 at the device's real limit.

Also reports the launch time of the halved tile next to the table tile (ratio, same run).

Usage (the lead, from the repo root; .gpu/vllm-src made by scripts/gpu/vllm_prepare_sources.sh):

    python scripts/gpu/vllm_qsa_smem_guard_h200.py --src .gpu/vllm-src --out "$OUT/vllm_qsa_smem_guard_h200.json"
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton

LEFT_OUT = ("TritonWarmupTensor", "triton_scalar_specialization_rep")
HEADER = '''from __future__ import annotations
from functools import lru_cache
import torch
import triton
import triton.language as tl
HAS_TRITON = True


class _Platform:
    """The two capability queries the QSA module makes, answered by torch."""

    @staticmethod
    def get_device_capability(device_id=0):
        return torch.cuda.get_device_capability(device_id)

    @staticmethod
    def has_device_capability(capability, device_id=0):
        major, minor = torch.cuda.get_device_capability(device_id)
        want = capability if isinstance(capability, int) else capability[0] * 10 + capability[1]
        return major * 10 + minor >= want


current_platform = _Platform()

'''


def load(src: Path, name: str):
    """The QSA module's functions without its vLLM imports, as module ``name``."""
    text = src.read_text()
    lines = text.splitlines()
    parts = []
    for node in ast.parse(text).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
        seg = "\n".join(lines[start:node.end_lineno])
        if not any(word in seg for word in LEFT_OUT):
            parts.append(seg)
    path = Path(tempfile.mkdtemp(prefix="vllm-qsa-")) / f"{name}.py"
    path.write_text(HEADER + "\n\n".join(parts) + "\n")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class Launches:
    """Records each split-K launch: its tile and the shared memory Triton compiled it with."""

    def __init__(self, mod):
        self.kernel = mod._qsa_sparse_paged_gqa_splitk_kernel
        self.calls = []
        self._run = self.kernel.run

    def __enter__(self):
        def run(*args, **kwargs):
            compiled = self._run(*args, **kwargs)
            self.calls.append({"BLOCK_N": kwargs["BLOCK_N"], "num_warps": kwargs["num_warps"],
                               "NUM_SPLITS": kwargs["NUM_SPLITS"], "BLOCK_M": kwargs["BLOCK_M"],
                               "shared": int(compiled.metadata.shared)})
            return compiled
        self.kernel.run = run
        return self

    def __exit__(self, *exc):
        self.kernel.run = self._run


def batch(rows: int, heads: int, kv_heads: int, head_dim: int, dtype, seed: int = 0, width: int = 2048,
          page: int = 64, pages: int = 64):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(rows, heads, head_dim, device="cuda", generator=g).to(torch.bfloat16)
    k = (torch.randn(pages, page, kv_heads, head_dim, device="cuda", generator=g) * 0.5).to(dtype)
    v = (torch.randn(pages, page, kv_heads, head_dim, device="cuda", generator=g) * 0.5).to(dtype)
    table = torch.randperm(pages, device="cuda", generator=g).to(torch.int32).reshape(1, pages)
    idx = torch.full((rows, width + 1), -1, dtype=torch.int32, device="cuda")
    counts = torch.randint(1, width + 1, (rows,), device="cuda", generator=g)
    perm = torch.argsort(torch.rand(rows, pages * page, device="cuda", generator=g), dim=1)[:, :width].to(torch.int32)
    cols = torch.arange(width, device="cuda")[None, :]
    idx[:, :width] = torch.where(cols < counts[:, None], perm, -1)
    idx[:, width] = counts.to(torch.int32)
    gate = torch.randn(rows, heads, head_dim, device="cuda", generator=g).to(torch.bfloat16)
    return q, k, v, table, idx, gate


def attend(mod, b, prefill: bool, scales):
    q, k, v, table, idx, gate = b
    kw = dict(k_scale=scales[0], v_scale=scales[1]) if k.dtype != torch.bfloat16 else {}
    return mod.qsa_sparse_paged_attention(q, k, v, idx, table, torch.zeros(q.shape[0], dtype=torch.int32,
                                          device="cuda"), prefill, output_gate=gate, **kw)


def reference(b, scales) -> torch.Tensor:
    q, k, v, table, idx, gate = b
    rows, heads, d = q.shape
    kv_heads, width = k.shape[2], idx.shape[1] - 1
    group = heads // kv_heads
    out = torch.zeros(rows, heads, d, device="cuda")
    page = k.shape[1]
    for r in range(rows):
        n = int(idx[r, width])
        tok = idx[r, :n].long()
        phys = table[0, tok // page].long()
        keys = k[phys, tok % page].float() * scales[0]  # [n, kv, d]
        vals = v[phys, tok % page].float() * scales[1]
        for h in range(kv_heads):
            qq = q[r, h * group:(h + 1) * group].float()
            p = torch.softmax(qq @ keys[:, h].T * d ** -0.5, dim=-1)
            out[r, h * group:(h + 1) * group] = (p @ vals[:, h]).to(torch.bfloat16).float()
    return out * torch.sigmoid(gate.float())


def timed_ms(fn, reps=20) -> float:
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True, type=Path, help="directory with qsa.pristine.py and qsa.patched.py")
    ap.add_argument("--limit", type=int, help="forced shared-memory limit in bytes (default: per case, one byte "
                    "below the pristine launch's compiled shared memory)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    t0 = time.time()
    pristine = load(args.src / "qsa.pristine.py", "qsa_pristine")
    patched = load(args.src / "qsa.patched.py", "qsa_patched")
    real_limit = patched._qsa_shared_memory_limit()
    fp8 = torch.float8_e4m3fn
    scales = (0.7, 1.3)
    report = {"device": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability(),
              "torch": torch.__version__, "triton": triton.__version__, "real_limit": real_limit,
              "cases": []}
    checks = {}
    cases = [("prefill_300_rows", 300, True), ("decode_4096_rows", 4096, False)]
    for name, rows, prefill in cases:
        b = batch(rows, 64, 1, 256, fp8, seed=rows)
        with Launches(pristine) as lp:
            out_p = attend(pristine, b, prefill, scales)
        limit = args.limit or lp.calls[0]["shared"] - 1
        patched._qsa_shared_memory_limit = lambda: limit  # the smaller device
        with Launches(patched) as lg:
            out_g = attend(patched, b, prefill, scales)
        est = patched._qsa_tile_shared_memory(lg.calls[0]["BLOCK_N"], lg.calls[0]["BLOCK_M"], 256,
                                              lg.calls[0]["num_warps"], "*fp8e4nv", lg.calls[0]["NUM_SPLITS"] > 1)
        t_table = timed_ms(lambda: attend(pristine, b, prefill, scales))
        t_fitted = timed_ms(lambda: attend(patched, b, prefill, scales))
        patched._qsa_shared_memory_limit = lambda: real_limit
        with Launches(patched) as lr:
            attend(patched, b, prefill, scales)
        sample = slice(0, 48)  # the float32 reference is a Python loop over rows
        ref = reference(tuple(t[sample] if t.shape[0] == rows else t for t in b), scales)
        err_p = (out_p[sample].float() - ref).abs().max().item()
        err_g = (out_g[sample].float() - ref).abs().max().item()
        diff = (out_p.float() - out_g.float()).abs().max().item()
        case = {"case": name, "forced_limit": limit, "pristine": lp.calls[0], "patched_forced": lg.calls[0], "patched_real": lr.calls[0],
                "patch_measured_shared": est, "max_err_pristine_vs_ref": err_p, "max_err_patched_vs_ref": err_g,
                "max_diff_patched_vs_pristine": diff, "ms_table_tile": t_table, "ms_fitted_tile": t_fitted,
                "ratio_fitted_over_table": t_fitted / t_table}
        report["cases"].append(case)
        checks[f"{name}_red_pristine_overflows"] = lp.calls[0]["shared"] > limit
        checks[f"{name}_green_patched_fits"] = lg.calls[0]["shared"] <= limit
        checks[f"{name}_measurement_not_below_compiled"] = est >= lg.calls[0]["shared"]
        checks[f"{name}_numerics"] = err_p < 3e-2 and err_g < 3e-2 and diff < 3e-2
        checks[f"{name}_real_limit_unchanged"] = {k: lr.calls[0][k] for k in ("BLOCK_N", "num_warps")} == \
            {k: lp.calls[0][k] for k in ("BLOCK_N", "num_warps")}
        print(json.dumps(case), flush=True)
    b16 = batch(300, 64, 1, 256, torch.bfloat16, seed=1)
    patched._qsa_shared_memory_limit = lambda: min(c["forced_limit"] for c in report["cases"])
    with Launches(pristine) as lp, Launches(patched) as lg:
        attend(pristine, b16, True, scales)
        attend(patched, b16, True, scales)
    checks["bf16_unchanged"] = (lp.calls[0]["BLOCK_N"], lp.calls[0]["num_warps"]) == \
        (lg.calls[0]["BLOCK_N"], lg.calls[0]["num_warps"])
    report["bf16"] = {"pristine": lp.calls[0], "patched_forced": lg.calls[0]}
    report["checks"] = checks
    report["ok"] = all(checks.values())
    report["seconds"] = time.time() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({"checks": checks, "ok": report["ok"]}))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
