#!/usr/bin/env python3
"""PLE sidecar streaming on a GPU vs sglang 0.5.23's pinned-UVA gather: bit-exactness and overlap.

Self-contained for a machine with torch + triton and NO sglang: sglang's
``_gather_ple_embedding_from_pinned_kernel`` is pulled out of a copied ``qwen4_exp.py`` with
``ast`` (its only dependencies are ``triton`` and ``tl``); our code comes from this repository.

Checks (each recorded in the JSON; the script exits 1 if any fails):
- the same under a graph captured the way sglang captures a decode step: ids computed inside the
  graph, the read a native host node (``SidecarGather.capture``), replayed with new inputs and no
  host call in between; and how long such a replay takes when the main thread waits, runs Python
  or sleeps meanwhile, and cold;
- streamed gather (``SidecarGather`` over both readers, ``--io mmap,pread``; modes ``uva`` and
  ``h2d``; fp8 and bf16 tables; a TP range so some rows are another rank's) == sglang's kernel
  over the whole table in pinned RAM,
  bit for bit, eager and under CUDA-graph replay (the graph waits on an external event; the
  read + conversion is launched before each replay, outside capture).

Measures, next to sglang's pinned-UVA gather on the same protocol (side stream started before a
simulated decoder layer on the main stream, consumer waits after it):
- exposed time = (layer + gather overlapped) − (layer alone), for a 2,048-token prefill chunk
  (32,768 rows) and decode batches (16…256 rows), page cache warm and cold (POSIX_FADV_DONTNEED),
  per reader. The fraction of the table resident in the page cache (``mincore``) is recorded
  before each warm and cold measurement, so a "warm" run that was not warm shows.

Usage::

    python scripts/gpu/ple_stream_h200.py --qwen4-exp build/gpu/qwen4_exp.py --out "$OUT/ple_stream_h200.json"
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sglang_ssd_stream.sidecar import open_reader  # noqa: E402
from sglang_ssd_stream.sidecar.format import SidecarTable  # noqa: E402
from sglang_ssd_stream.sidecar.mapped import drop_page_cache  # noqa: E402
from sglang_ssd_stream.staging.gather import SidecarGather  # noqa: E402
from sglang_ssd_stream.staging.kernels import convert_staged_rows  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import make_table, simulated_layer  # noqa: E402

KERNEL = "_gather_ple_embedding_from_pinned_kernel"
COLS = 160


def load_sglang_kernel(qwen4_exp: Path):
    """sglang's gather kernel, extracted with ast into a module of its own (Triton needs a file)."""
    src = qwen4_exp.read_text()
    tree = ast.parse(src)
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == KERNEL), None)
    if fn is None:
        raise SystemExit(f"{qwen4_exp}: no top-level {KERNEL}")
    start = min(d.lineno for d in fn.decorator_list) - 1
    body = "\n".join(src.splitlines()[start:fn.end_lineno])
    mod_path = Path(tempfile.mkdtemp(prefix="ple-kernel-")) / "sglang_ple_gather_kernel.py"
    mod_path.write_text("import triton\nimport triton.language as tl\n\n\n" + body + "\n")
    spec = importlib.util.spec_from_file_location(mod_path.stem, mod_path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_path.stem] = mod
    spec.loader.exec_module(mod)
    return getattr(mod, KERNEL), body


def drop_cache(path: Path, gathers=()) -> None:
    drop_page_cache(path, list(gathers))


def resident_fraction(path: Path) -> float:
    """Fraction of the file's pages in the page cache (``mincore`` over a read-only mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = np.zeros(pages, dtype=np.uint8)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
        view = np.frombuffer(m, dtype=np.uint8)
        rc = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size),
                          ctypes.c_void_p(vec.ctypes.data))
        del view
    return float((vec & 1).mean()) if rc == 0 else float("nan")


def pinned_table(path: Path, rows: int, row_bytes: int, dtype) -> torch.Tensor:
    t = torch.empty((rows, row_bytes), dtype=torch.uint8, pin_memory=True)
    with open(path, "rb", buffering=0) as f:
        mv = memoryview(t.numpy()).cast("B")
        got = 0
        while got < len(mv):
            got += f.readinto(mv[got:got + (256 << 20)])
    return t.view(dtype)


class Sglang:
    """sglang's gather over the pinned table (the baseline)."""

    def __init__(self, kernel, table: torch.Tensor, lo: int, hi: int):
        self.kernel, self.table, self.lo, self.hi = kernel, table, lo, hi

    def __call__(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        # The table holds global rows [0, rows); sglang's rank table starts at `lo`.
        base = self.table.data_ptr() + self.lo * self.table.stride(0) * self.table.element_size()
        self.kernel[(ids.numel(),)](base, ids, out, embedding_dim=COLS, tp_vocab_start=self.lo,
                                    tp_vocab_end=self.hi, is_fp8=self.table.dtype == torch.float8_e4m3fn,
                                    BLOCK_D=triton.next_power_of_2(COLS))


def time_ms(fn, reps: int, before=None) -> list[float]:
    out = []
    for _ in range(reps):
        if before:
            before()
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def check_bitexact(kernel, tables, args, results) -> bool:
    ok = True
    side = torch.cuda.Stream()
    for dtype, (path, rows, _row_bytes, pinned) in tables.items():
        lo, hi = rows // 4, rows - rows // 8  # this "rank" owns the middle; the rest must come back zero
        base = Sglang(kernel, pinned, lo, hi)
        for io, mode in [(io, mode) for io in args.io for mode in ("uva", "h2d")]:
            reader = open_reader(_table(path, rows, dtype), io, vocab_start=lo, vocab_end=hi, max_rows=32768,
                                 workers=args.workers)
            g = SidecarGather(reader, columns=COLS, is_fp8=dtype == "float8_e4m3fn", capacity_rows=32768,
                              device="cuda", mode=mode, graph_rows=32768)
            rng = np.random.default_rng(7)
            for n in (1, 256, 32768):
                ids = torch.from_numpy(rng.integers(0, rows, n)).cuda()
                ids[: min(n, 4)] = torch.tensor([0, rows - 1, lo, hi - 1][: min(n, 4)], device="cuda")
                if n > 8:
                    ids[8] = ids[5]  # duplicate
                ref = torch.empty((n, COLS), dtype=torch.bfloat16, device="cuda")
                base(ids, ref)
                out = torch.full((n, COLS), 7.0, dtype=torch.bfloat16, device="cuda")
                side.wait_stream(torch.cuda.current_stream())
                g.begin(ids, out, side)
                g.wait()
                torch.cuda.current_stream().wait_stream(side)
                eager = torch.equal(out.view(torch.int16), ref.view(torch.int16))
                graph = _graph_check(g, base, ids, n)
                captured = _captured_read_check(g, base, rows, lo, hi, n)
                results.append({"dtype": dtype, "io": io, "mode": mode, "rows": n, "eager_bitexact": eager,
                                "graph_bitexact": graph, "captured_read_bitexact": captured})
                ok &= eager and graph and captured
            g.close()
    return ok


def _graph_check(g: SidecarGather, base: Sglang, ids: torch.Tensor, n: int) -> bool:
    """Capture: wait on an external event, then consume the fixed buffer. Replay: read + convert
    outside capture, record the event, replay. Compared with sglang's kernel captured the same way."""
    buf = torch.zeros((n, COLS), dtype=torch.bfloat16, device="cuda")
    consumed = torch.zeros_like(buf)
    ref_buf = torch.zeros_like(buf)
    ev = torch.cuda.Event(external=True)
    side = torch.cuda.Stream()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph, ref_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        ev.record(s)  # capture needs the event to have been recorded once
        with torch.cuda.graph(graph, stream=s):
            SidecarGather.capture_wait(ev)
            consumed.copy_(buf)  # a plain copy: arithmetic (`buf * 1`) would canonicalise BF16 NaN payloads
        with torch.cuda.graph(ref_graph, stream=s):
            base(ids, ref_buf)
    torch.cuda.current_stream().wait_stream(s)
    ok = True
    for rep in range(3):
        shift = rep * 17
        ids_now = torch.roll(ids, shift)
        g.launch_for_replay(ids_now.cpu().numpy(), buf, side, ev)
        graph.replay()
        ids.copy_(ids_now)
        ref_graph.replay()
        torch.cuda.synchronize()
        ok &= torch.equal(consumed.view(torch.int16), ref_buf.view(torch.int16))
        ids.copy_(torch.roll(ids_now, -shift))
    return ok


def _captured_graph(g: SidecarGather, rows: int, n: int):
    """A graph as sglang captures a decode step: ids computed on the GPU inside the graph, the PLE
    gather on a side stream (``SidecarGather.capture``: D2H, host-node read, conversion), a consumer."""
    inp = torch.zeros(n, dtype=torch.int64, device="cuda")
    buf = torch.zeros((n, COLS), dtype=torch.bfloat16, device="cuda")
    consumed = torch.zeros_like(buf)
    s, side = torch.cuda.Stream(), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph, stream=s):
            ids = (inp * 7 + 3) % rows  # the model's hashing stands here
            side.wait_stream(s)
            g.capture(ids, buf, side)
            s.wait_stream(side)
            consumed.copy_(buf)
    torch.cuda.current_stream().wait_stream(s)
    return graph, inp, consumed


def _captured_read_check(g: SidecarGather, base: Sglang, rows: int, lo: int, hi: int, n: int) -> bool:
    """Replays with new inputs and no host call in between equal sglang's kernel on the same ids."""
    graph, inp, consumed = _captured_graph(g, rows, n)
    rng = np.random.default_rng(n)
    ok = True
    ref = torch.empty((n, COLS), dtype=torch.bfloat16, device="cuda")
    for _rep in range(4):
        raw = rng.integers(0, rows, n)
        if __import__("math").gcd(7, rows) == 1:  # inputs whose ids are this rank's first and last rows
            inv = pow(7, -1, rows)
            raw[: min(n, 2)] = [(lo - 3) * inv % rows, (hi - 4) * inv % rows][: min(n, 2)]
        inp.copy_(torch.from_numpy(raw))
        graph.replay()
        base((inp * 7 + 3) % rows, ref)
        # waits that must release the GIL, or the host node could never run (their values are unused:
        # a sum of random BF16 rows overflows to NaN)
        consumed.view(torch.int16)[:1, :1].item()
        consumed[:1].cpu().tolist()
        torch.cuda.synchronize()
        ok &= torch.equal(consumed.view(torch.int16), ref.view(torch.int16))
    return ok


def captured_latency(g: SidecarGather, rows: int, n: int, reps: int, busy_ms: float,
                     switch_interval_s: float | None = None, cold_path: Path | None = None) -> dict:
    """GPU time of a captured gather replay when the main thread waits (GIL released) vs when it
    runs Python for ``busy_ms`` right after the replay (a Python host node then waits for the GIL) vs
    when it sleeps that long (no GIL held, and no thread waiting inside CUDA);
    with ``cold_path``, also idle with that table dropped from the page cache before each replay."""
    graph, inp, _ = _captured_graph(g, rows, n)
    inp.copy_(torch.from_numpy(np.random.default_rng(3).integers(0, rows, n)))
    res = {}
    for how in ("idle", "python_busy", "sleeping", *(("cold_idle",) if cold_path else ())):
        if how == "python_busy" and switch_interval_s is not None:
            old_interval = sys.getswitchinterval()
            sys.setswitchinterval(switch_interval_s)
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if how == "cold_idle":
                drop_cache(cold_path, [g])
            torch.cuda.synchronize()
            a.record()
            graph.replay()
            b.record()
            if how == "python_busy":
                end = time.perf_counter() + busy_ms / 1e3
                x = 0
                while time.perf_counter() < end:
                    x += 1
            elif how == "sleeping":  # neither holding the GIL nor waiting in a CUDA call
                time.sleep(busy_ms / 1e3)
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        res[f"{how}_ms"] = statistics.median(times)
        res["switch_interval_ms"] = sys.getswitchinterval() * 1e3
        if how == "python_busy" and switch_interval_s is not None:
            sys.setswitchinterval(old_interval)
    res.update(rows=n, busy_ms=busy_ms)
    return res


def captured_overlap(kernel, g: SidecarGather, pinned: torch.Tensor, rows: int, n: int, layer_ms: float,
                     reps: int) -> dict:
    """A decode step as a graph: the PLE lookup for layer i+1 on a side stream while layer i (a
    simulated layer) runs on the main stream, then a consumer. Exposed = replay − the layer-only
    graph's replay; the same for sglang's in-RAM gather kernel in the same graph shape."""
    layer, _ = simulated_layer(layer_ms)
    base = Sglang(kernel, pinned, 0, rows)
    inp = torch.from_numpy(np.random.default_rng(n).integers(0, rows, n)).cuda()
    buf = torch.zeros((n, COLS), dtype=torch.bfloat16, device="cuda")
    consumed = torch.zeros_like(buf)

    def build(which: str):
        s, side = torch.cuda.Stream(), torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
            ids = (inp * 7 + 3) % rows
            if which != "layer_only":
                side.wait_stream(s)
                if which == "sidecar":
                    g.capture(ids, buf, side)
                else:
                    with torch.cuda.stream(side):
                        base(ids, buf)
            layer()
            if which != "layer_only":
                s.wait_stream(side)
                consumed.copy_(buf)
        torch.cuda.current_stream().wait_stream(s)
        return graph

    graphs = {w: build(w) for w in ("layer_only", "sglang_pinned_uva", "sidecar")}
    res = {"rows": n, "layer_ms_target": layer_ms, "switch_interval_ms": sys.getswitchinterval() * 1e3}
    for name, graph in graphs.items():
        res[f"{name}_ms"] = statistics.median(time_ms(graph.replay, reps))
        res[f"{name}_main_sleeps_ms"] = statistics.median(gpu_time_ms(graph.replay, reps, sleep_s=0.005))
    for name in ("sglang_pinned_uva", "sidecar"):
        res[f"{name}_exposed_ms"] = max(0.0, res[f"{name}_ms"] - res["layer_only_ms"])
        res[f"{name}_main_sleeps_exposed_ms"] = max(0.0,
                                                    res[f"{name}_main_sleeps_ms"] - res["layer_only_main_sleeps_ms"])
    return res


def gpu_time_ms(fn, reps: int, sleep_s: float) -> list[float]:
    """GPU time of ``fn``'s work (events) while the host sleeps instead of waiting inside CUDA, as an
    engine thread that goes on with other work does."""
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        time.sleep(sleep_s)
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return out


def _table(path: Path, rows: int, dtype: str) -> SidecarTable:
    isz = 1 if dtype == "float8_e4m3fn" else 2
    return SidecarTable(0, path.name, path, "0" * 64, dtype, rows, COLS, 0, rows * COLS * isz)


class _Phases:
    """Host-side phases of the eager gather's worker (instrumentation of ``SidecarGather._work``):
    waiting for the ids, reading the rows, launching the conversion."""

    def __init__(self):
        self.samples: list[tuple[float, float, float]] = []
        self._original = SidecarGather._work

    def __enter__(self):
        phases = self

        def work(g, n, out, stream):
            t0 = time.perf_counter()
            g._ids_ready.synchronize()
            t1 = time.perf_counter()
            with torch.cuda.device(g.device), torch.cuda.stream(stream):
                g.reader.read_rows(g._ids_np[:n], g._rows_np[:n])
                t2 = time.perf_counter()
                src = g.rows_host[:n]
                if g.rows_device is not None:
                    g.rows_device[:n].copy_(src, non_blocking=True)
                    src = g.rows_device[:n]
                convert_staged_rows(src, out, is_fp8=g.is_fp8)
                g._slot_free.record(stream)
            phases.samples.append((t1 - t0, t2 - t1, time.perf_counter() - t2))

        SidecarGather._work = work
        return self

    def __exit__(self, *exc):
        SidecarGather._work = self._original

    def medians_ms(self) -> dict:
        if not self.samples:
            return {}
        cols = list(zip(*self.samples, strict=False))
        return {k: statistics.median(c) * 1e3
                for k, c in zip(("ids_wait", "read", "convert_launch"), cols, strict=False)}


def overlap(kernel, path, rows, pinned, args) -> list[dict]:
    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()
    base = Sglang(kernel, pinned, 0, rows)
    out_rows = []
    cases = [("prefill_2048_tokens", 32768, args.prefill_layer_ms)] + ([] if args.only_prefill else [
        (f"decode_{n // 16}_tokens", n, args.decode_layer_ms) for n in (16, 64, 256)])
    gathers = {}
    for io, mode in [(io, mode) for io in args.io for mode in ("uva", "h2d")]:
        reader = open_reader(_table(path, rows, "float8_e4m3fn"), io, max_rows=32768, workers=args.workers)
        gathers[f"sidecar_{io}_{mode}"] = SidecarGather(reader, columns=COLS, is_fp8=True, capacity_rows=32768,
                                                       device="cuda", mode=mode)
    rng = np.random.default_rng(11)
    for name, n, layer_ms in cases:
        layer, actual_layer_ms = simulated_layer(layer_ms)
        out = torch.empty((n, COLS), dtype=torch.bfloat16, device="cuda")
        ids = torch.from_numpy(rng.integers(0, rows, n)).cuda()
        layer_alone = statistics.median(time_ms(layer, args.reps))
        variants = {"sglang_pinned_uva": None, **gathers}
        for cache in ("warm", "cold"):
            for vname, g in variants.items():
                if g is None and cache == "cold":
                    continue  # the pinned table has no page cache
                before = (lambda: drop_cache(path, gathers.values())) if cache == "cold" else None

                def gather_only(g=g):
                    if g is None:
                        base(ids, out)
                    else:
                        g.begin(ids, out, main)
                        g.wait()

                def overlapped(g=g):
                    side.wait_stream(main)
                    if g is None:
                        with torch.cuda.stream(side):
                            base(ids, out)
                    else:
                        g.begin(ids, out, side)
                    layer()
                    if g is not None:
                        g.wait()
                    main.wait_stream(side)
                    out.sum()  # the consumer

                if cache == "warm" and g is not None:
                    gather_only()  # these ids' pages are now in the page cache
                if before:
                    before()
                resident = None if g is None else resident_fraction(path)
                with _Phases() as ph_alone:
                    alone = statistics.median(time_ms(gather_only, args.reps, before))
                with _Phases() as ph_both:
                    both = statistics.median(time_ms(overlapped, args.reps, before))
                exposed = max(0.0, both - layer_alone)
                out_rows.append({"case": name, "rows": n, "cache": cache, "variant": vname, "workers": args.workers,
                                 "host_phases_alone_ms": ph_alone.medians_ms(),
                                 "host_phases_overlapped_ms": ph_both.medians_ms(),
                                 "table_resident_fraction_before": resident,
                                 "layer_ms": layer_alone, "simulated_layer_target_ms": layer_ms,
                                 "gather_alone_ms": alone, "overlapped_ms": both, "exposed_ms": exposed,
                                 "exposed_fraction_of_gather": exposed / alone if alone else 0.0,
                                 "exposed_fraction_of_layer": exposed / layer_alone})
                print(f"{name:22s} {cache:4s} {vname:18s} gather {alone:8.3f} ms  layer {layer_alone:7.3f} ms  "
                      f"exposed {exposed:7.3f} ms  phases {ph_both.medians_ms()}", flush=True)
    for g in gathers.values():
        g.close()
    return out_rows


def _compiler_version() -> str:
    import subprocess

    from sglang_ssd_stream.staging import native_read

    out = subprocess.run([*native_read.compiler(), "--version"], capture_output=True, text=True).stdout
    return f"{' '.join(native_read.compiler())}: {out.splitlines()[0] if out else '?'}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--qwen4-exp", required=True, type=Path, help="a copy of sglang 0.5.23 srt/models/qwen4_exp.py")
    ap.add_argument("--dir", default="/var/tmp/ple-gpu", help="where the test tables are written")
    ap.add_argument("--table-gib", type=float, default=8.0, help="fp8 table size for the timing runs")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--io", default="mmap,pread", type=lambda v: v.split(","), help="readers to run (comma list)")
    ap.add_argument("--prefill-layer-ms", type=float, default=2.0, help="simulated decoder layer, 2,048-token chunk")
    ap.add_argument("--decode-layer-ms", type=float, default=0.25, help="simulated decoder layer, decode step")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--skip-timing", action="store_true", help="bit-exactness checks only")
    ap.add_argument("--skip-overlap", action="store_true",
                    help="no eager overlap timing (captured-read latency still runs)")
    ap.add_argument("--skip-latency", action="store_true", help="no captured-read latency sweep")
    ap.add_argument("--only-prefill", action="store_true", help="eager overlap: the 2,048-token chunk only")
    ap.add_argument("--skip-decode-graphs", action="store_true", help="no decode-graph overlap")
    ap.add_argument("--switch-interval-us", type=float, default=0,
                    help="set the GIL switch interval first, as the plugin does under CUDA graphs (0: Python's)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--watchdog-s", type=float, default=0, help="dump every thread's stack and exit after this long")
    args = ap.parse_args(argv)
    if args.watchdog_s:
        import faulthandler

        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)  # e.g. a host node that never gets the GIL

    if args.switch_interval_us:
        sys.setswitchinterval(args.switch_interval_us / 1e6)
    kernel, kernel_src = load_sglang_kernel(args.qwen4_exp)
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rows8 = int(args.table_gib * (1 << 30)) // COLS
    fp8 = d / "ple-fp8.bin"
    make_table(fp8, rows8, COLS)
    rows16 = 1_000_003
    bf16 = d / "ple-bf16.bin"
    make_table(bf16, rows16, COLS * 2)
    tables = {"float8_e4m3fn": (fp8, rows8, COLS, pinned_table(fp8, rows8, COLS, torch.float8_e4m3fn)),
              "bfloat16": (bf16, rows16, COLS * 2,
                           pinned_table(bf16, rows16, COLS * 2, torch.bfloat16).view(rows16, COLS))}
    correctness: list[dict] = []
    ok = check_bitexact(kernel, tables, args, correctness)
    timings = ([] if args.skip_timing or args.skip_overlap
               else overlap(kernel, fp8, rows8, tables["float8_e4m3fn"][3], args))
    decode_graphs = []
    if not args.skip_timing and not args.skip_decode_graphs:
        reader = open_reader(_table(fp8, rows8, "float8_e4m3fn"), args.io[0], max_rows=4096, workers=args.workers)
        g = SidecarGather(reader, columns=COLS, is_fp8=True, capacity_rows=4096, device="cuda", graph_rows=4096)
        for n in (16, 64, 256, 1024):
            row = {"io": args.io[0], **captured_overlap(kernel, g, tables["float8_e4m3fn"][3], rows8, n,
                                                        args.decode_layer_ms, args.reps)}
            decode_graphs.append(row)
            print(f"decode graph {n:5d} rows: layer {row['layer_only_ms']:.3f} ms, exposed sglang "
                  f"{row['sglang_pinned_uva_exposed_ms']:.3f} ms, sidecar {row['sidecar_exposed_ms']:.3f} ms; "
                  f"main thread asleep: layer {row['layer_only_main_sleeps_ms']:.3f} ms, exposed sglang "
                  f"{row['sglang_pinned_uva_main_sleeps_exposed_ms']:.3f} ms, sidecar "
                  f"{row['sidecar_main_sleeps_exposed_ms']:.3f} ms", flush=True)
        g.close()
    latency = []
    if not args.skip_timing and not args.skip_latency:
        for io in args.io:
            reader = open_reader(_table(fp8, rows8, "float8_e4m3fn"), io, max_rows=4096, workers=args.workers)
            g = SidecarGather(reader, columns=COLS, is_fp8=True, capacity_rows=4096, device="cuda", graph_rows=4096)
            for n in (16, 256, 4096):
                for interval in (None, 5e-4, 1e-4):  # None: Python's default (5 ms)
                    row = {"io": io, **captured_latency(g, rows8, n, args.reps, busy_ms=20.0,
                                                        switch_interval_s=interval,
                                                        cold_path=fp8 if interval is None else None)}
                    latency.append(row)
                    cold = f", cold {row['cold_idle_ms']:.3f} ms" if "cold_idle_ms" in row else ""
                    print(f"captured read {io} {n:5d} rows: idle {row['idle_ms']:.3f} ms, python-busy main "
                          f"thread {row['python_busy_ms']:.3f} ms, sleeping {row['sleeping_ms']:.3f} ms "
                          f"(switch interval {row['switch_interval_ms']:.2f} ms)"
                          f"{cold}", flush=True)
            g.close()
    result = {
        "command": shlex.join(["python", *sys.argv]),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "switch_interval_ms": sys.getswitchinterval() * 1e3,
        "native_compiler": _compiler_version(),
        "table": {"fp8_rows": rows8, "bf16_rows": rows16, "row_bytes_fp8": COLS},
        "sglang_kernel_sha_of_source": __import__("hashlib").sha256(kernel_src.encode()).hexdigest(),
        "bitexact_ok": ok, "correctness": correctness, "overlap": timings, "captured_read_latency": latency,
        "decode_graph_overlap": decode_graphs, "seconds": time.time() - t0,
        "targets": {"prefill_exposed_fraction_of_gather": "<= 0.10", "decode_exposed_ms": "0 (fully hidden)"},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("bit-exact:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
