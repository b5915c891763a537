#!/usr/bin/env python3
"""Patch 0001 (vLLM QSA quantized-tile shared-memory guard) on a real GPU, limit forced down.

Self-contained for a machine with torch + triton and NO vLLM: a pristine and a patched copy of
``models/qwen4_exp/nvidia/ops/qsa.py`` are loaded whole, their vLLM imports replaced by shims:
``current_platform`` answers from ``torch.cuda``, and the warmup helper's ``TritonWarmupTensor``
and ``triton_scalar_specialization_rep`` are taken with ``ast`` from vLLM's own
``jit_warmup_triton_helper.py`` (copied next to them). The split-K kernel's ``run`` is wrapped:
each launch (``warmup=False``) is recorded with the kernel Triton compiled and ran for it
(``CompiledKernel.metadata.shared``), each compile-only call (``warmup=True``: the patch's
measurement, vLLM's warmup) with the kernel it compiled. K and V are strided views of one
``[pages, kv_heads, page, 2 * head_dim]`` cache, as vLLM hands them over.

An H200 has 227 KiB per block, more than any table tile needs, so the device limit the patch
reads (``_qsa_shared_memory_limit``) is forced down, as a smaller device's (SM12x: 99 KiB) or a
wider group's footprint would be: by default to one byte below what the pristine launch of each
case compiled to (``--limit`` fixes it instead). Checks (exit 1 if one fails):

- RED: the pristine launch of an FP8 cache, 64-head group, head_dim 256 needs more than the limit;
- GREEN: the patched launch of the same batch fits the limit (real compiled shared memory);
- the patch's measurement is the launch's compile: the kernel it measured for the launched tile is
  the very object the launch ran (Triton's JIT cache), so the bytes are equal; every tile it gave
  up measured over the limit;
- the patched warmup (the real ``warmup_qsa_sparse_paged_attention``, same forced limit) compiled
  the kernel the launch then ran;
- the halved tiles compute the same attention: patched vs pristine vs a float32 reference;
- unchanged where nothing overflows: BF16 caches (never measured), and FP8 at the device's real
  limit.

Also reports the launch time of the halved tile next to the table tile (ratio, same run).

Usage (the lead, from the repo root; .gpu/vllm-src made by scripts/gpu/vllm_prepare_sources.sh):

    python scripts/gpu/vllm_qsa_smem_guard_h200.py --src .gpu/vllm-src --out "$OUT/vllm_qsa_smem_guard_h200.json"

Any machine, no GPU: ``--check-sources`` only builds both modules from the sources and exits.
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

SHIMMED = ("TritonWarmupTensor", "triton_scalar_specialization_rep")
SHIM = '''import triton
import triton.language as tl
from dataclasses import dataclass
from typing import Any

HAS_TRITON = True


class _Platform:
    """The capability queries the QSA module (and TritonWarmupTensor) make, answered by torch."""

    device_type = "cuda"

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
TILE = ("BLOCK_N", "num_warps", "NUM_TILES", "NUM_SPLITS")


def warmup_helper_shims(helper: Path) -> str:
    """vLLM's own definitions of the warmup helper names the QSA module imports."""
    if not helper.exists():
        raise SystemExit(f"{helper} is missing: re-run scripts/gpu/vllm_prepare_sources.sh")
    text = helper.read_text()
    lines = text.splitlines()
    parts = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in SHIMMED:
            start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            parts[node.name] = "\n".join(lines[start:node.end_lineno])
    missing = set(SHIMMED) - parts.keys()
    if missing:
        raise SystemExit(f"{helper}: no top-level {sorted(missing)}")
    return "\n\n\n".join(parts[n] for n in SHIMMED) + "\n"


def load(src: Path, file: str, name: str):
    """The whole QSA module with its vLLM imports replaced by the shims, as module ``name``."""
    text = (src / file).read_text()
    lines = text.splitlines()
    vllm_imports = [n for n in ast.parse(text).body
                    if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "vllm"]
    if not vllm_imports:
        raise SystemExit(f"{src / file}: no vLLM imports to replace")
    shim = SHIM + warmup_helper_shims(src / "jit_warmup_triton_helper.py")
    for n in vllm_imports:
        lines[n.lineno - 1:n.end_lineno] = [""] * (n.end_lineno - n.lineno + 1)  # keeps line numbers
    first = vllm_imports[0].lineno - 1
    lines[first] = shim
    path = Path(tempfile.mkdtemp(prefix="vllm-qsa-")) / f"{name}.py"
    path.write_text("\n".join(lines) + "\n")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class Calls:
    """Wraps a module's split-K kernel ``run``: launches and compile-only calls, with their kernels."""

    def __init__(self, mod):
        self.kernel = mod._qsa_sparse_paged_gqa_splitk_kernel
        self.launches, self.compiles = [], []

    def __enter__(self):
        real = self._run = self.kernel.run

        def run(*args, grid, warmup, **kwargs):
            compiled = real(*args, grid=grid, warmup=warmup, **kwargs)
            entry = {k: kwargs[k] for k in (*TILE, "BLOCK_M")}
            entry.update(shared=int(compiled.metadata.shared), kernel=compiled)
            (self.compiles if warmup else self.launches).append(entry)
            return compiled

        self.kernel.run = run
        return self

    def __exit__(self, *exc):
        self.kernel.run = self._run


def tile(entry: dict) -> tuple:
    return tuple(entry[k] for k in TILE)


def plain(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k != "kernel"}


def batch(rows: int, heads: int, kv_heads: int, head_dim: int, dtype, seed: int = 0, width: int = 2048,
          page: int = 64, pages: int = 64, device: str = "cuda") -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(rows, heads, head_dim, device=device, generator=g).to(torch.bfloat16)
    # vLLM's layout: one cache per layer, K and V are strided views of it.
    kv = (torch.randn(pages, kv_heads, page, 2 * head_dim, device=device, generator=g) * 0.5).to(dtype)
    k, v = kv.transpose(1, 2).split(head_dim, dim=-1)
    table = torch.randperm(pages, device=device, generator=g).to(torch.int32).reshape(1, pages)
    idx = torch.full((rows, width + 1), -1, dtype=torch.int32, device=device)
    counts = torch.randint(1, width + 1, (rows,), device=device, generator=g)
    perm = torch.argsort(torch.rand(rows, pages * page, device=device, generator=g), dim=1)[:, :width].to(torch.int32)
    cols = torch.arange(width, device=device)[None, :]
    idx[:, :width] = torch.where(cols < counts[:, None], perm, -1)
    idx[:, width] = counts.to(torch.int32)
    gate = torch.randn(rows, heads, head_dim, device=device, generator=g).to(torch.bfloat16)
    # The warmup takes the cache as allocated: FP8 as uint8 storage.
    storage = kv.view(torch.uint8) if dtype != torch.bfloat16 else kv
    return {"q": q, "k": k, "v": v, "table": table, "idx": idx, "gate": gate, "kv_storage": storage}


def attend(mod, b: dict, prefill: bool, scales):
    kw = dict(k_scale=scales[0], v_scale=scales[1]) if b["k"].dtype != torch.bfloat16 else {}
    token_to_req = torch.zeros(b["q"].shape[0], dtype=torch.int32, device=b["q"].device)
    return mod.qsa_sparse_paged_attention(b["q"], b["k"], b["v"], b["idx"], b["table"], token_to_req, prefill,
                                          output_gate=b["gate"], **kw)


def warm(mod, b: dict) -> set:
    """The module's own warmup for this batch's cache; returns the (BLOCK_N, splits, warps) it warmed."""
    return set(mod.warmup_qsa_sparse_paged_attention(b["kv_storage"], b["table"], num_query_heads=b["q"].shape[1],
                                                     selection_width=b["idx"].shape[1] - 1))


def reference(b: dict, rows: slice, scales) -> torch.Tensor:
    q, k, v, table, idx, gate = (b[n] for n in ("q", "k", "v", "table", "idx", "gate"))
    q, idx, gate = q[rows], idx[rows], gate[rows]
    n_rows, heads, d = q.shape
    kv_heads, width = k.shape[2], idx.shape[1] - 1
    group = heads // kv_heads
    out = torch.zeros(n_rows, heads, d, device="cuda")
    page = k.shape[1]
    for r in range(n_rows):
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


def set_limit(mod, limit: int) -> None:
    """The device limit the patch reads; fitted tiles are memoized, so forget them."""
    mod._qsa_shared_memory_limit = lambda: limit
    mod._qsa_fitted_tiles.clear()


def check_sources(pristine, patched) -> int:
    want = ("_select_config", "qsa_sparse_paged_attention", "warmup_qsa_sparse_paged_attention",
            "_qsa_sparse_paged_gqa_splitk_kernel", "_qsa_merge_splitk_kernel")
    found = {"pristine": [n for n in want if hasattr(pristine, n)],
             "patched": [n for n in (*want, "_qsa_fit_tile", "_qsa_tile_key", "_qsa_fitted_tiles",
                                     "_qsa_shared_memory_limit") if hasattr(patched, n)]}
    ok = len(found["pristine"]) == len(want) and len(found["patched"]) == len(want) + 4
    print(json.dumps({"sources": found, "triton": triton.__version__, "ok": ok}))
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True, type=Path,
                    help="directory with qsa.pristine.py, qsa.patched.py and jit_warmup_triton_helper.py")
    ap.add_argument("--limit", type=int, help="forced shared-memory limit in bytes (default: per case, one byte "
                    "below the pristine launch's compiled shared memory)")
    ap.add_argument("--out", help="report JSON (required unless --check-sources)")
    ap.add_argument("--check-sources", action="store_true",
                    help="only build both modules from the sources (no GPU needed) and exit")
    args = ap.parse_args(argv)
    pristine = load(args.src, "qsa.pristine.py", "qsa_pristine")
    patched = load(args.src, "qsa.patched.py", "qsa_patched")
    if args.check_sources:
        return check_sources(pristine, patched)
    if not args.out:
        ap.error("--out is required")
    t0 = time.time()
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
        with Calls(pristine) as lp:
            out_p = attend(pristine, b, prefill, scales)
        launched_p = lp.launches[0]
        limit = args.limit or launched_p["shared"] - 1
        set_limit(patched, limit)  # the smaller device
        with Calls(patched) as lg:
            out_g = attend(patched, b, prefill, scales)
        launched = lg.launches[0]
        measured = [c for c in lg.compiles if tile(c) == tile(launched)]
        rejected = [c for c in lg.compiles if tile(c) != tile(launched)]
        set_limit(patched, limit)  # warmup first, then the launch: the memo starts empty again
        with Calls(patched) as lw:
            warmed = warm(patched, b)
            n_warmup = len(lw.compiles)
            attend(patched, b, prefill, scales)
        prepared = [c for c in lw.compiles[:n_warmup] if (c["BLOCK_N"], c["NUM_SPLITS"], c["num_warps"]) in warmed]
        after_warmup = lw.launches[-1]
        t_table = timed_ms(lambda: attend(pristine, b, prefill, scales))
        t_fitted = timed_ms(lambda: attend(patched, b, prefill, scales))
        set_limit(patched, real_limit)
        with Calls(patched) as lr:
            attend(patched, b, prefill, scales)
        sample = slice(0, 48)  # the float32 reference is a Python loop over rows
        ref = reference(b, sample, scales)
        err_p = (out_p[sample].float() - ref).abs().max().item()
        err_g = (out_g[sample].float() - ref).abs().max().item()
        diff = (out_p.float() - out_g.float()).abs().max().item()
        case = {"case": name, "forced_limit": limit, "pristine": plain(launched_p), "patched_forced": plain(launched),
                "patch_measured": [plain(c) for c in lg.compiles], "patched_real": plain(lr.launches[0]),
                "patched_real_measured": [plain(c) for c in lr.compiles],
                "warmed_profiles": sorted(warmed), "warmup_compiles": n_warmup,
                "launch_compiles_after_warmup": len(lw.compiles) - n_warmup,
                "max_err_pristine_vs_ref": err_p, "max_err_patched_vs_ref": err_g,
                "max_diff_patched_vs_pristine": diff, "ms_table_tile": t_table, "ms_fitted_tile": t_fitted,
                "ratio_fitted_over_table": t_fitted / t_table}
        report["cases"].append(case)
        checks[f"{name}_red_pristine_overflows"] = launched_p["shared"] > limit
        checks[f"{name}_green_patched_fits"] = launched["shared"] <= limit
        checks[f"{name}_measurement_equals_compiled"] = bool(measured) and all(
            c["kernel"] is launched["kernel"] and c["shared"] == launched["shared"] for c in measured)
        checks[f"{name}_rejected_tiles_overflow"] = bool(rejected) and all(c["shared"] > limit for c in rejected)
        checks[f"{name}_warmup_compiled_the_launch"] = tile(after_warmup) == tile(launched) and any(
            c["kernel"] is after_warmup["kernel"] for c in prepared)
        checks[f"{name}_numerics"] = err_p < 3e-2 and err_g < 3e-2 and diff < 3e-2
        checks[f"{name}_real_limit_unchanged"] = tile(lr.launches[0]) == tile(launched_p)
        print(json.dumps(case), flush=True)
    b16 = batch(300, 64, 1, 256, torch.bfloat16, seed=1)
    set_limit(patched, min(c["forced_limit"] for c in report["cases"]))
    with Calls(pristine) as lp, Calls(patched) as lg:
        attend(pristine, b16, True, scales)
        attend(patched, b16, True, scales)
    checks["bf16_unchanged_and_unmeasured"] = tile(lp.launches[0]) == tile(lg.launches[0]) and not lg.compiles
    report["bf16"] = {"pristine": plain(lp.launches[0]), "patched_forced": plain(lg.launches[0]),
                      "patched_measured": len(lg.compiles)}
    report["checks"] = checks
    report["ok"] = all(checks.values())
    report["seconds"] = time.time() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({"checks": checks, "ok": report["ok"]}))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
