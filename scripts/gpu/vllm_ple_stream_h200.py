#!/usr/bin/env python3
"""vLLM 0.33.0's pinned-UVA PLE lookup vs our streamed backends (``mmap``, ``pread``) on a GPU, under FULL
CUDA graphs: bit-exactness, decode exposure behind a layer, non-blocking eager start, and the disk (fio).

Self-contained for a machine with torch + triton and NO vLLM: vLLM's
``_lookup_ple_embedding_from_pinned_kernel`` (the one-program-per-row UVA byte copy its pinned class
launches on a side stream in ``start_prefetch``) is pulled out of a copy of ``common/ngram_embedding.py``
with ``ast`` (``scripts/gpu/vllm_prepare_sources.sh``). Our side is what ``StreamedPLEEmbedding`` runs: a
``SidecarGather`` over ``open_reader(table, backend)`` (and, as ``cache``, the mmap reader behind the
row cache, VLLM_PLE_ROW_CACHE_MB's default path) with raw output (``mode="h2d"``,
``output="raw"``), driven by the same two calls the embedding makes, ``prefetch(ids, out, side)`` in
``start_prefetch`` and ``join(side)`` in ``_finalize_prefetch``. Inside a FULL graph capture (vLLM runs
both methods inside the capture then) ``prefetch`` records D2H of the ids -> native host node reading
the rows -> H2D copy into the prefetch buffer.

Checks (JSON ``checks``; exit 1 if any fails):
- ``full_graph_bitexact``: a graph captured as vLLM's FULL decode graph captures the lookup (ids
  produced by a kernel inside the graph from a static input, prefetch on a side stream, join, a
  consumer), replayed with new ids and no host call in between, equals vLLM's kernel captured the
  same way (upstream's side-stream structure), byte for byte: FP8 and BF16 rows of 160 bytes, both
  backends, TP ranges (rows outside must be zero), random / boundary / duplicate / mixed ids,
  16 … 8,192 rows;
- ``eager_bitexact``: the same outside capture (no graph, or a breakable PIECEWISE graph, which runs
  ``start_prefetch``/``_finalize_prefetch`` eagerly between its segments);
- ``start_does_not_wait_for_gpu``: with ~50 ms of GPU work queued ahead of the ids, the eager
  ``prefetch`` returns in a small fraction of it (the ids cross by an async D2H + event);
- ``decode_hidden``: decode steps as FULL graphs (lookup for layer i+1 on the side stream beside a
  simulated 0.25 ms layer i) expose at most 0.03 ms over the layer-only graph, 16 … 1,024 rows, page
  cache warm, main thread waiting or asleep, per backend (``decode_hidden_mmap``/``_pread``/``_cache``); vLLM's
  in-RAM lookup in the same graph shape beside it. Each repetition replays every graph once, in turn
  (a slow moment of the host hits all of them), and the medians are compared;
- ``registered_same_rows``: vLLM's kernel reads our registered (page-aligned) table as a
  ``pin_memory`` one (the ``pinned`` backend).

fio (``--fio``, a static binary from ``scripts/gpu/build_static_fio.sh``): 4 KiB random reads of the
timing table, O_DIRECT, 1 and 16 psync jobs: the disk under the cold numbers.

Usage (repo root; .gpu/vllm-src from scripts/gpu/vllm_prepare_sources.sh, carried)::

    python3 scripts/gpu/vllm_ple_stream_h200.py --src .gpu/vllm-src --fio .gpu/vllm-src/fio \\
        --out $OUT/vllm_ple_full_graphs_h200.json

CPU smoke test (Triton interpreter, tiny tables, no graphs; the captured path runs with the host node
called at once instead of ``cuLaunchHostFunc``)::

    TRITON_INTERPRET=1 python scripts/gpu/vllm_ple_stream_h200.py --src .gpu/vllm-src --device cpu --quick \\
        --fio .gpu/vllm-src/fio --out /tmp/vllm_ple_cpu.json
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sglang_ssd_stream.sidecar import load_manifest, open_reader  # noqa: E402
from sglang_ssd_stream.sidecar.row_cache import RowCache, captured_read  # noqa: E402
from sglang_ssd_stream.staging import hostfunc, native_read  # noqa: E402
from sglang_ssd_stream.staging.gather import SidecarGather  # noqa: E402
from sglang_ssd_stream.staging.host_memory import allocate_registered, caching_allocator_bytes  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import run_fio, simulated_layer, sync, write_sidecar  # noqa: E402

KERNEL = "_lookup_ple_embedding_from_pinned_kernel"
ROW_BYTES = 160  # Qwen3.8 Flash-Next: 160 fp8 columns (80 bf16)
HEADS = 16  # rows per token per PLE layer
BACKENDS = ("mmap", "pread", "cache")  # cache: the mmap reader behind a RowCache (VLLM_PLE_ROW_CACHE_MB > 0)


def load_vllm_kernel(src: Path):
    """vLLM's UVA lookup kernel, extracted with ast into a file of its own (Triton needs a file)."""
    text = src.read_text()
    fn = next((n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == KERNEL), None)
    if fn is None:
        raise SystemExit(f"{src}: no top-level {KERNEL}")
    start = min(d.lineno for d in fn.decorator_list) - 1
    body = "\n".join(text.splitlines()[start:fn.end_lineno])
    path = Path(tempfile.mkdtemp(prefix="vllm-ple-kernel-")) / "vllm_ple_lookup_kernel.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n" + body + "\n")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return getattr(mod, KERNEL), hashlib.sha256(body.encode()).hexdigest()


class UvaPointer:
    """What Triton needs of a pointer argument; the address is a pinned host address (UVA)."""

    dtype = torch.uint8

    def __init__(self, t: torch.Tensor):
        self.t = t

    def data_ptr(self) -> int:
        return self.t.data_ptr()


class Vllm:
    """vLLM's ``lookup_from_pinned`` over one rank's pinned table (rows [lo, hi) of the global table)."""

    def __init__(self, kernel, rank_table: torch.Tensor, lo: int, hi: int, device):
        self.kernel, self.lo, self.hi, self.table = kernel, lo, hi, rank_table
        self.weight = UvaPointer(rank_table) if device.type == "cuda" else rank_table

    def __call__(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        if ids.numel():
            self.kernel[(ids.numel(),)](self.weight, ids, out, ROW_BYTES, self.lo, self.hi,
                                        BLOCK_D=triton.next_power_of_2(ROW_BYTES))


def read_into(path: Path, t: torch.Tensor, first_row: int) -> None:
    mv = memoryview(t.numpy()).cast("B")
    with open(path, "rb", buffering=0) as f:
        f.seek(first_row * ROW_BYTES)
        got = 0
        while got < len(mv):
            got += f.readinto(mv[got:got + (256 << 20)])


def pinned_rows(path: Path, lo: int, hi: int, device) -> torch.Tensor:
    t = torch.empty((hi - lo, ROW_BYTES), dtype=torch.uint8, pin_memory=device.type == "cuda")
    read_into(path, t, lo)
    return t


def gather_for(table, backend: str, lo: int, hi: int, device, args, capacity: int, graph_rows: int) -> SidecarGather:
    """What StreamedPLEEmbedding builds for one rank (vllm_ple_offload/embedding.py): ``cache`` is its
    default with a row cache budget, the mmap reader behind a ``RowCache`` of ``--cache-mib`` in
    registered memory, captured reads the cache's native host node."""
    reader = open_reader(table, "mmap" if backend == "cache" else backend, vocab_start=lo, vocab_end=hi,
                         total_rows=table.rows, workers=args.workers, rows_per_task=args.rows_per_task,
                         max_rows=max(1, min(capacity, args.workers * args.rows_per_task)))
    host_read = None
    if backend == "cache":
        def allocate(nbytes: int):
            if device.type == "cuda":
                return allocate_registered(nbytes, label="PLE row cache")
            return np.zeros(nbytes, np.uint8)

        reader, host_read = RowCache.for_budget(reader, args.cache_mib << 20, allocate=allocate), captured_read
    return SidecarGather(reader, columns=table.columns, is_fp8=table.dtype == "float8_e4m3fn", capacity_rows=capacity,
                         device=device, mode="h2d", output="raw", graph_rows=graph_rows, host_read=host_read)


def id_cases(rows: int, lo: int, hi: int, n: int, rng) -> dict[str, np.ndarray]:
    edges = np.array(sorted({x for x in (0, 1, lo - 1, lo, lo + 1, hi - 2, hi - 1, hi, rows - 2, rows - 1)
                             if 0 <= x < rows}), dtype=np.int64)
    mixed = rng.integers(0, rows, n)
    mixed[rng.integers(0, n, max(1, n // 4))] = rng.choice(edges, max(1, n // 4))
    return {"random": rng.integers(0, rows, n), "boundaries": np.resize(edges, n),
            "duplicates": rng.choice(rng.integers(0, rows, 3), n), "mixed": mixed}


# ---------------------------------------------------------------------------------------------- checks


def check_bitexact(kernel, manifests, args, device) -> list[dict]:
    """Eager and FULL-graph lookups == vLLM's kernel, byte for byte."""
    results = []
    sizes = (16, 1024) if args.quick else (16, 1024, 8192)
    rng = np.random.default_rng(7)
    for dtype, manifest in manifests.items():
        table = load_manifest(manifest).table(3)
        rows = table.rows
        half = rows // 2 // 8 * 8
        for lo, hi in ((0, rows), (0, half), (half, rows), (rows // 4, rows - rows // 8)):
            base = Vllm(kernel, pinned_rows(table.file, lo, hi, device), lo, hi, device)
            for backend in BACKENDS:
                g = gather_for(table, backend, lo, hi, device, args, capacity=max(sizes), graph_rows=max(sizes))
                for n in sizes:
                    cases = id_cases(rows, lo, hi, n, rng)
                    row = {"dtype": dtype, "backend": backend, "range": [lo, hi], "rows": n}
                    row["eager"] = eager_check(g, base, cases, device)
                    row["full_graph"] = full_graph_check(g, base, cases, device) if device.type == "cuda" \
                        else simulated_capture_check(g, base, cases, device)
                    results.append(row)
                    print(f"bitexact {dtype:14s} {backend:5s} [{lo:9d},{hi:9d}) n={n:5d} eager={row['eager']} "
                          f"full_graph={row['full_graph']}", flush=True)
                g.close()
    return results


def eager_check(g: SidecarGather, base: Vllm, cases, device) -> dict:
    side = torch.cuda.Stream() if device.type == "cuda" else None
    out = {}
    for name, ids_np in cases.items():
        ids = torch.from_numpy(ids_np).to(device)
        n = ids.numel()
        ref = torch.empty((n, ROW_BYTES), dtype=torch.uint8, device=device)
        base(ids, ref)
        got = torch.full((n, ROW_BYTES), 0xAB, dtype=torch.uint8, device=device)
        g.prefetch(ids, got, side)
        g.join(side)
        sync(device)
        out[name] = bool(torch.equal(got, ref))
    return out


def full_graph_check(g: SidecarGather, base: Vllm, cases, device) -> dict:
    """Capture as vLLM's FULL graph does: ids produced inside the graph, prefetch on a side stream,
    join, consumer. Replay with each case's ids copied into the static input; no host call between."""
    n = next(iter(cases.values())).size
    static = torch.zeros(n, dtype=torch.int64, device=device)
    buf = torch.zeros((n, ROW_BYTES), dtype=torch.uint8, device=device)
    ref_buf = torch.zeros_like(buf)
    consumed, ref_consumed = torch.zeros_like(buf), torch.zeros_like(buf)
    s, side, ref_side = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    graph, ref_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph, stream=s):
            ids = static + 0  # the model's n-gram hash stands here: a kernel inside the graph writes the ids
            g.prefetch(ids, buf, side)  # StreamedPLEEmbedding.start_prefetch, captured
            g.join(side)  # ... _finalize_prefetch, captured
            consumed.copy_(buf)
        with torch.cuda.graph(ref_graph, stream=s):  # upstream's pinned start_prefetch/_finalize_prefetch
            ids = static + 0
            ref_side.wait_stream(s)
            with torch.cuda.stream(ref_side):
                base(ids, ref_buf)
            s.wait_stream(ref_side)
            ref_consumed.copy_(ref_buf)
    torch.cuda.current_stream().wait_stream(s)
    out = {}
    for name, ids_np in cases.items():
        static.copy_(torch.from_numpy(ids_np))
        consumed.fill_(0xAB)
        graph.replay()
        ref_graph.replay()
        torch.cuda.synchronize()
        out[name] = bool(torch.equal(consumed, ref_consumed))
    del graph, ref_graph
    return out


def simulated_capture_check(g: SidecarGather, base: Vllm, cases, device) -> dict:
    """CPU smoke test of the captured path: ``capture`` with the host node run at once."""
    real = hostfunc.launch_native_host_func
    hostfunc.launch_native_host_func = lambda stream, node: node.run()
    try:
        out = {}
        for name, ids_np in cases.items():
            ids = torch.from_numpy(ids_np)
            ref = torch.empty((ids.numel(), ROW_BYTES), dtype=torch.uint8)
            base(ids, ref)
            got = torch.full_like(ref, 0xAB)
            g.capture(ids, got, None)
            out[name] = bool(torch.equal(got, ref))
        return out
    finally:
        hostfunc.launch_native_host_func = real


def check_start_nonblocking(manifest, args) -> list[dict]:
    """Host time of the eager ``prefetch`` while the ids are still behind ~50 ms of queued GPU work."""
    table = load_manifest(manifest).table(3)
    rows, out_rows = table.rows, []
    busy_cycles = int(torch.cuda.get_device_properties(0).clock_rate) * 50  # kHz x 50 ms
    n = 2048 * HEADS
    data = np.fromfile(table.file, np.uint8).reshape(rows, ROW_BYTES)
    for backend in BACKENDS:
        g = gather_for(table, backend, 0, rows, torch.device("cuda"), args, capacity=n, graph_rows=0)
        side = torch.cuda.Stream()
        ids = torch.from_numpy(np.random.default_rng(5).integers(0, rows, n)).cuda()
        out = torch.empty((n, ROW_BYTES), dtype=torch.uint8, device="cuda")
        for _ in range(2):  # warm-up: events, threads, page cache
            g.prefetch(ids, out, side)
            g.join(side)
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(busy_cycles)
        ids.add_(0)  # the ids now come out of the queue only after the busy work
        t = time.perf_counter()
        g.prefetch(ids, out, side)
        start_ms = (time.perf_counter() - t) * 1e3
        e.record()
        g.join(side)
        torch.cuda.synchronize()
        busy_ms = s.elapsed_time(e)
        ok = bool(np.array_equal(out.cpu().numpy(), data[ids.cpu().numpy()]))
        out_rows.append({"backend": backend, "gpu_busy_ms": busy_ms, "start_host_ms": start_ms,
                         "start_fraction_of_busy": start_ms / busy_ms, "rows_ok": ok})
        print(f"prefetch() {backend}: {start_ms:.3f} ms on the host while the GPU was busy {busy_ms:.1f} ms",
              flush=True)
        g.close()
    return out_rows


def host_reserved() -> int | None:
    try:
        value = torch.cuda.host_memory_stats().get("allocated_bytes.current")  # pinned blocks, after rounding
    except (AttributeError, RuntimeError):
        return None
    return None if value is None else int(value)


def check_registered(kernel, manifest, device) -> dict:
    """vLLM's kernel over our registered table == over a pin_memory table; what each reserves."""
    table = load_manifest(manifest).table(3)
    nbytes = table.rows * ROW_BYTES
    torch.cuda.init()  # the host allocator reports statistics only once CUDA is initialised
    before = host_reserved()
    pinned = torch.empty((table.rows, ROW_BYTES), dtype=torch.uint8, pin_memory=True)
    after = host_reserved()
    registered = allocate_registered(nbytes, label="bench").view(table.rows, ROW_BYTES)
    read_into(table.file, pinned, 0)
    read_into(table.file, registered, 0)
    ids = torch.from_numpy(np.random.default_rng(3).integers(0, table.rows, 65536)).to(device)
    a = torch.empty((ids.numel(), ROW_BYTES), dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    Vllm(kernel, pinned, 0, table.rows, device)(ids, a)
    Vllm(kernel, registered, 0, table.rows, device)(ids, b)
    sync(device)
    reserved = None if before is None or after is None else int(after) - int(before)
    return {"table_bytes": nbytes, "registered_is_pinned": bool(registered.is_pinned()),
            "same_rows": bool(torch.equal(a, b)), "pin_memory_reserved_bytes": reserved,
            "power_of_two_would_be": caching_allocator_bytes(nbytes)}


# ---------------------------------------------------------------------------------------------- timing


def replay_ms(graphs: dict, reps: int, sleep_s: float = 0.0) -> dict[str, list[float]]:
    """GPU time of each graph's replay (events), the graphs taking turns within each repetition; the
    main thread waits in synchronize() or sleeps meanwhile (as an engine thread that goes on)."""
    times = {w: [] for w in graphs}
    for _ in range(reps):
        for w, graph in graphs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            graph.replay()
            b.record()
            if sleep_s:
                time.sleep(sleep_s)
            torch.cuda.synchronize()
            times[w].append(a.elapsed_time(b))
    return times


def decode_graphs(kernel, manifest, args) -> list[dict]:
    """Decode steps as FULL graphs: the lookup for layer i+1 on the side stream beside layer i."""
    table = load_manifest(manifest).table(3)
    rows = table.rows
    device = torch.device("cuda")
    base = Vllm(kernel, pinned_rows(table.file, 0, rows, device), 0, rows, device)
    layer, _ = simulated_layer(args.decode_layer_ms)
    gathers = {b: gather_for(table, b, 0, rows, device, args, capacity=1024, graph_rows=1024) for b in BACKENDS}
    out_rows = []
    for n in (16, 64, 256, 1024):
        static = torch.from_numpy(np.random.default_rng(n).integers(0, rows, n)).cuda()
        buf = torch.zeros((n, ROW_BYTES), dtype=torch.uint8, device="cuda")
        consumed = torch.zeros_like(buf)

        def build(which: str):
            s, side = torch.cuda.Stream(), torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
                ids = (static * 7 + 3) % rows  # the n-gram hash stands here
                if which in gathers:
                    gathers[which].prefetch(ids, buf, side)
                elif which == "vllm_pinned_uva":
                    side.wait_stream(s)
                    with torch.cuda.stream(side):
                        base(ids, buf)
                layer()
                if which in gathers:
                    gathers[which].join(side)
                elif which == "vllm_pinned_uva":
                    s.wait_stream(side)
                if which != "layer_only":
                    consumed.copy_(buf)
            torch.cuda.current_stream().wait_stream(s)
            return graph

        graphs = {w: build(w) for w in ("layer_only", "vllm_pinned_uva", *gathers)}
        for gr in graphs.values():  # warm: one replay each (the rows' pages are in the page cache)
            gr.replay()
        torch.cuda.synchronize()
        row = {"rows": n, "tokens": n // HEADS, "layer_ms_target": args.decode_layer_ms}
        for how, sleep_s in (("waiting", 0.0), ("asleep", 0.005)):
            times = replay_ms(graphs, args.reps, sleep_s)
            for w, t in times.items():
                row[f"{w}_{how}_ms"] = statistics.median(t)
                row[f"{w}_{how}_p90_ms"] = float(np.percentile(t, 90))
            for w in ("vllm_pinned_uva", *gathers):
                row[f"{w}_{how}_exposed_ms"] = max(0.0, row[f"{w}_{how}_ms"] - row[f"layer_only_{how}_ms"])
        out_rows.append(row)
        print(f"decode graph {n:5d} rows: layer {row['layer_only_waiting_ms']:.3f} ms; exposed (waiting / asleep) "
              + ", ".join(f"{w} {row[f'{w}_waiting_exposed_ms']:.3f} / {row[f'{w}_asleep_exposed_ms']:.3f}"
                          for w in ("vllm_pinned_uva", *gathers)) + " ms", flush=True)
        del graphs
    for g in gathers.values():
        g.close()
    return out_rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True, type=Path, help="directory with a copy of common/ngram_embedding.py")
    ap.add_argument("--dir", default="/var/tmp/vllm-ple-gpu", help="where the test tables are written")
    ap.add_argument("--table-gib", type=float, default=4.0, help="FP8 table for the decode graphs and fio")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--cache-mib", type=int, default=64, help="the row cache of the 'cache' backend (evicts on the "
                    "bit-exact tables)")
    ap.add_argument("--rows-per-task", type=int, default=2048)
    ap.add_argument("--decode-layer-ms", type=float, default=0.25)
    ap.add_argument("--exposed-limit-ms", type=float, default=0.03)
    ap.add_argument("--reps", type=int, default=41)
    ap.add_argument("--fio", help="a fio binary (scripts/gpu/build_static_fio.sh); omitted: no disk numbers")
    ap.add_argument("--fio-seconds", type=float, default=5.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny tables, no timing (CPU smoke test)")
    ap.add_argument("--watchdog-s", type=float, default=0, help="dump every thread's stack and exit after this long")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.watchdog_s:
        import faulthandler

        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    device = torch.device(args.device)
    kernel, kernel_sha = load_vllm_kernel(args.src / "ngram_embedding.py")
    d = Path(args.dir)
    t0 = time.time()
    small = 20_011 if args.quick else 2_000_003
    manifests = {dt: write_sidecar(d / f"bitexact-{dt}", small, ROW_BYTES, layer=3, dtype=dt, seed=i)
                 for i, dt in enumerate(("float8_e4m3fn", "bfloat16"))}
    cc = native_read.compiler()
    report = {"command": shlex.join([Path(sys.executable).name, *sys.argv]), "host": platform.node(),
              "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "cpus": os.cpu_count(),
              "native_compiler": subprocess.run([*cc, "--version"], capture_output=True,
                                                text=True).stdout.split("\n")[0],
              "vllm_kernel_sha256": kernel_sha, "args": {k: str(v) for k, v in vars(args).items()}}
    sources = args.src / "SOURCES.json"
    if sources.exists():
        report["sources"] = json.loads(sources.read_text())
    checks = {}
    if device.type == "cuda":  # first: before PyTorch's host allocator caches any pinned block
        report["registered_vs_pin_memory"] = check_registered(kernel, manifests["float8_e4m3fn"], device)
        checks["registered_same_rows"] = report["registered_vs_pin_memory"]["same_rows"] \
            and report["registered_vs_pin_memory"]["registered_is_pinned"]
    report["bitexact"] = check_bitexact(kernel, manifests, args, device)
    checks["eager_bitexact"] = all(all(r["eager"].values()) for r in report["bitexact"])
    checks["full_graph_bitexact"] = all(all(r["full_graph"].values()) for r in report["bitexact"])
    if device.type == "cuda":
        report["start_nonblocking"] = check_start_nonblocking(manifests["float8_e4m3fn"], args)
        checks["start_does_not_wait_for_gpu"] = all(r["start_fraction_of_busy"] < 0.1 and r["rows_ok"]
                                                    for r in report["start_nonblocking"])
    big = None
    if device.type == "cuda" and not args.quick:
        big = write_sidecar(d / "timing", int(args.table_gib * (1 << 30)) // ROW_BYTES, ROW_BYTES, seed=9)
        report["decode_graphs"] = decode_graphs(kernel, big, args)
        for b in BACKENDS:
            checks[f"decode_hidden_{b}"] = all(r[f"{b}_{how}_exposed_ms"] <= args.exposed_limit_ms
                                               for r in report["decode_graphs"] for how in ("waiting", "asleep"))
    if args.fio:
        target = load_manifest(big).table(3).file if big else load_manifest(manifests["float8_e4m3fn"]).table(3).file
        report["fio"] = run_fio(args.fio, target, 1.0 if args.quick else args.fio_seconds)
    report["checks"] = checks
    report["ok"] = all(checks.values())
    report["seconds"] = time.time() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"checks": checks, "ok": report["ok"]}))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
