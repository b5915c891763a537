#!/usr/bin/env python3
"""The PLE row cache + prompt-ahead prefetch on a GPU: cold prefill hidden, warm exposure, decode graphs,
memory, bit-exactness. NOT YET RUN on a GPU; its CPU parts run in ``tests/sidecar/test_row_cache_gpu_script.py``.

The pipeline under test is the one the engines will run: ``SidecarGather`` (staging/) over a
:class:`~sglang_ssd_stream.sidecar.row_cache.RowCache` (rows in CUDA-registered memory, misses read
with ``O_DIRECT``), its captured reads the cache's native host node (``host_read=captured_read``),
and :class:`~sglang_ssd_stream.sidecar.prefetch.PromptPrefetcher` told of each chunk when it starts.
The reference is sglang 0.5.23's own ``_gather_ple_embedding_from_pinned_kernel`` over the whole
table in pinned RAM (pulled out of a copied ``qwen4_exp.py`` with ``ast``, as ``ple_stream_h200.py``).

Measured (all in one JSON):

- ``fio`` (``--fio``): 4 KiB random reads with ``O_DIRECT`` at 16 and 64 jobs on the table: the disk.
- ``bitexact``: FP8 and BF16 tables, a TP range (other rows zero), 1 / 256 / 32,768 rows, first as
  misses then as hits; eager (``uva`` and ``h2d``) and captured the way sglang captures a decode step
  (ids computed inside the graph, the read a host node, replayed with new inputs).
- ``cold_prefill``: one prompt of ``--chunks`` chunks of ``--chunk-tokens`` tokens over a cold cache
  (every configuration starts with an empty cache; misses bypass the page cache); each chunk is
  ``--layers`` simulated decoder layers of ``--layer-ms`` (a sweep) with the PLE lookup begun one
  layer before the PLE layer ``--ple-layer``, as sglang's ``start_prefetch`` does. Configurations:
  no prefetcher, and prompt-ahead windows ``--windows``. Exposed = chunk time − the same chunk
  without PLE; next to it the chunk's disk reads and what the measured fio IOPS need for them.
- ``warm_prefill``: a 2,048-token chunk whose rows are cached, beside one ``--prefill-layer-ms``
  layer: exposed vs the layer (target ≤ 10 %) and vs sglang's in-RAM gather in the same protocol.
  Run the whole command 3 times for the 3-run target. The chunk runs in a forward's shape
  (``--ple-layer`` − 1 layers, then the lookup beside the next, so the CPU runs ahead of the GPU as
  in a forward; ``--ple-layer 1``: the lookup begins with nothing queued before it).
- ``decode_graphs``: captured lookups of 16 … 1,024 rows beside a ``--decode-layer-ms`` layer
  (target exposed ≤ 0.03 ms), main thread waiting and sleeping.
- ``memory``: RSS growth + the table's page-cache pages (``mincore``) after 8,192-token-chunk
  lookups, against ``--budget-mib`` + 64 MiB (the cache's registered rows are part of the RSS).
- ``long_prompt``: what a 262,144-token cold prompt adds at ``--thor-tok-s`` prefill, from the
  measured disk rate and the trace's distinct-row growth (``--trace-stats``).

Ids: a prompt's tokens (``--tokens``, e.g. the held-out trace's ``tokens.npy``; else Zipf tokens)
hashed by the real n-gram function, then folded into the test table (``id mod rows``): the table
is smaller than the real 320M rows; folding keeps the chunk's distinct-row count within the
collisions of ``rows``.

Usage (GPU box; ``build/gpu/qwen4_exp.py`` a copy of sglang's, ``.gpu/vllm-src/fio`` from
``scripts/gpu/build_static_fio.sh``, ``.gpu/ple-trace-tokens.npy`` the trace's tokens)::

    python3 scripts/gpu/ple_row_cache_h200.py --qwen4-exp build/gpu/qwen4_exp.py --fio .gpu/vllm-src/fio \\
        --tokens .gpu/ple-trace-tokens.npy --trace-stats benchmarks/row_cache/trace.json \\
        --out $OUT/ple_row_cache_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import make_table, run_fio, simulated_layer, sync  # noqa: E402

from sglang_ssd_stream.sidecar.format import SidecarTable  # noqa: E402
from sglang_ssd_stream.sidecar.ngram import qwen38_flash_next  # noqa: E402
from sglang_ssd_stream.sidecar.prefetch import PromptPrefetcher  # noqa: E402
from sglang_ssd_stream.sidecar.reader import SidecarReader  # noqa: E402
from sglang_ssd_stream.sidecar.row_cache import RowCache, RowCacheConfig, captured_read  # noqa: E402
from sglang_ssd_stream.staging.gather import SidecarGather  # noqa: E402

COLS = 160
MIB = 1 << 20
ROWS_PER_TOKEN = 16


# ----------------------------------------------------------------------------- inputs


def table_of(path: Path, rows: int, dtype: str) -> SidecarTable:
    isz = 1 if dtype == "float8_e4m3fn" else 2
    return SidecarTable(0, path.name, path, "0" * 64, dtype, rows, COLS, 0, rows * COLS * isz)


def prompt_tokens(path: str | None, n: int) -> tuple[np.ndarray, str]:
    if path:
        t = np.load(path, mmap_mode="r")
        if t.size < n:
            raise SystemExit(f"{path}: {t.size} tokens, {n} needed")
        return np.asarray(t[:n], dtype=np.int64), f"{path} (first {n} tokens)"
    rng = np.random.default_rng(0)
    return np.minimum(rng.zipf(1.05, n), 80_000).astype(np.int64), "Zipf(1.05) tokens over 80,000 (no --tokens)"


class Folded:
    """A row source whose ids arrive in the real 320M-row space and are folded into the test table."""

    def __init__(self, cache: RowCache, rows: int):
        self.cache, self.rows = cache, rows

    def prefetch(self, ids):
        self.cache.prefetch(np.asarray(ids) % self.rows)


def chunk_ids(h, tokens: np.ndarray, a: int, b: int, rows: int) -> np.ndarray:
    return h.chunk_ids(tokens, a, b) % rows


# ----------------------------------------------------------------------------- the pipeline


def row_cache(path: Path, rows: int, dtype: str, budget_mib: int, *, lo=None, hi=None, max_rows: int, workers: int,
              registered: bool) -> RowCache:
    """The cache as an adapter builds it: sized to the budget, its rows in CUDA-registered memory
    (the GPU could read them in place) on the GPU box."""
    from sglang_ssd_stream.staging.host_memory import allocate_registered

    def registered_memory(nbytes):
        return allocate_registered(nbytes, label="PLE row cache")

    allocate = registered_memory if registered else None
    reader = SidecarReader(table_of(path, rows, dtype), vocab_start=lo, vocab_end=hi, max_rows=max_rows,
                           workers=workers)
    return RowCache.for_budget(reader, budget_mib * MIB, allocate=allocate, config=RowCacheConfig(workers=workers))


def gather_of(cache: RowCache, dtype: str, device: str, *, mode: str, capacity_rows: int, graph_rows: int):
    return SidecarGather(cache, columns=COLS, is_fp8=dtype == "float8_e4m3fn", capacity_rows=capacity_rows,
                         device=device, mode=mode, graph_rows=graph_rows, host_read=captured_read)


def lookup(g: SidecarGather, ids: torch.Tensor, out: torch.Tensor, side) -> None:
    """Eager lookup as the engines drive it: begin on the side stream, wait, join."""
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())
    g.begin(ids, out, side)
    g.wait()
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)


# ----------------------------------------------------------------------------- disk


def best_iops(fio: dict | None) -> float | None:
    vals = [v["iops"] for k, v in (fio or {}).items() if k.startswith("jobs") and "iops" in v]
    return max(vals) if vals else None


# ----------------------------------------------------------------------------- bit-exactness


def reference(kernel, table: torch.Tensor, ids: torch.Tensor, lo: int, hi: int, device: str) -> torch.Tensor:
    """sglang's gather kernel over the whole table in host memory (pinned on the GPU box; on the
    CPU run by the Triton interpreter, which reads the same raw pointer)."""
    import triton

    n = ids.numel()
    out = torch.empty((n, COLS), dtype=torch.bfloat16, device=device)
    base = table.data_ptr() + lo * table.stride(0) * table.element_size()
    kernel[(n,)](base, ids, out, embedding_dim=COLS, tp_vocab_start=lo, tp_vocab_end=hi,
                 is_fp8=table.dtype == torch.float8_e4m3fn, BLOCK_D=triton.next_power_of_2(COLS))
    return out


def host_table(path: Path, rows: int, dtype: str, device: str) -> torch.Tensor:
    rb = COLS * (1 if dtype == "float8_e4m3fn" else 2)
    t = torch.from_numpy(np.fromfile(path, dtype=np.uint8).reshape(rows, rb))
    if device == "cuda":
        t = t.pin_memory()
    return t.view(torch.float8_e4m3fn if dtype == "float8_e4m3fn" else torch.bfloat16)


def check_bitexact(kernel, tables: dict, args, device: str) -> list[dict]:
    cuda = device == "cuda"
    side = torch.cuda.Stream() if cuda else None
    results = []
    for dtype, (path, rows) in tables.items():
        pinned = host_table(path, rows, dtype, device)
        lo, hi = rows // 4, rows - rows // 8  # this "rank" owns the middle; the rest must come back zero
        sizes = [n for n in (1, 256, args.bitexact_rows) if n <= args.bitexact_rows]
        for mode in (("uva", "h2d") if cuda else ("uva",)):
            cache = row_cache(path, rows, dtype, args.budget_mib, lo=lo, hi=hi, max_rows=max(sizes),
                              workers=args.workers, registered=cuda)
            g = gather_of(cache, dtype, device, mode=mode, capacity_rows=max(sizes),
                          graph_rows=max(sizes) if cuda else 0)
            rng = np.random.default_rng(7)
            for n in sizes:
                ids = torch.from_numpy(rng.integers(0, rows, n)).to(device)
                ids[: min(n, 4)] = torch.tensor([0, rows - 1, lo, hi - 1][: min(n, 4)], device=device)
                if n > 8:
                    ids[8] = ids[5]
                ref = reference(kernel, pinned, ids, lo, hi, device)
                row = {"dtype": dtype, "mode": mode, "rows": n}
                for phase in ("miss", "hit"):  # the second pass is served from the cache
                    out = torch.full((n, COLS), 7.0, dtype=torch.bfloat16, device=device)
                    lookup(g, ids, out, side)
                    row[f"eager_{phase}_bitexact"] = torch.equal(out.view(torch.int16), ref.view(torch.int16))
                if cuda:
                    row["captured_bitexact"] = captured_check(g, kernel, pinned, rows, lo, hi, n)
                results.append(row)
                print(f"bit-exact {row}", flush=True)
            g.close()
    return results


def captured_check(g: SidecarGather, kernel, pinned, rows: int, lo: int, hi: int, n: int) -> bool:
    """A graph as sglang captures a decode step: ids computed inside it, the read the cache's host
    node; replays with new inputs and no host call in between equal sglang's kernel."""
    inp = torch.zeros(n, dtype=torch.int64, device="cuda")
    buf = torch.zeros((n, COLS), dtype=torch.bfloat16, device="cuda")
    consumed = torch.zeros_like(buf)
    s, side = torch.cuda.Stream(), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        ids = (inp * 7 + 3) % rows
        side.wait_stream(s)
        g.capture(ids, buf, side)
        s.wait_stream(side)
        consumed.copy_(buf)
    torch.cuda.current_stream().wait_stream(s)
    ok = True
    rng = np.random.default_rng(n)
    for _ in range(4):
        inp.copy_(torch.from_numpy(rng.integers(0, rows, n)))
        graph.replay()
        ref = reference(kernel, pinned, (inp * 7 + 3) % rows, lo, hi, "cuda")
        consumed[:1].cpu()  # a wait that releases the GIL (the host node needs none, but be fair)
        torch.cuda.synchronize()
        ok &= torch.equal(consumed.view(torch.int16), ref.view(torch.int16))
    return ok


# ----------------------------------------------------------------------------- timing helpers


def layer_fn(ms: float, device: str):
    """≈ ``ms`` of work on the current stream (GPU: bf16 matmuls; CPU smoke: a sleep)."""
    if device != "cuda":
        return lambda: time.sleep(ms / 1e3), ms
    return simulated_layer(ms)


# ----------------------------------------------------------------------------- cold prefill


def run_prompt(g: SidecarGather, h, tokens: np.ndarray, rows: int, args, layer, device: str, side,
               prefetcher: PromptPrefetcher | None, with_ple: bool) -> list[float]:
    """Per chunk: tell the prefetcher, run ``--layers`` layers with the PLE lookup begun one layer
    before layer ``--ple-layer``; returns each chunk's wall time (ms)."""
    c = args.chunk_tokens
    out = torch.empty((c * ROWS_PER_TOKEN, COLS), dtype=torch.bfloat16, device=device)
    times = []
    for k in range(args.chunks):
        a, b = k * c, (k + 1) * c
        ids = torch.from_numpy(chunk_ids(h, tokens, a, b, rows)).to(device)
        sync(device)
        t = time.perf_counter()
        if prefetcher is not None:
            prefetcher.scheduled("prompt", tokens[:args.chunks * c], a, b)  # the prompt ends there
        for i in range(args.layers):
            if with_ple and i == args.ple_layer - 1:
                if side is not None:
                    side.wait_stream(torch.cuda.current_stream())
                g.begin(ids, out, side)
            layer()
            if with_ple and i == args.ple_layer - 1:
                g.wait()
                if side is not None:
                    torch.cuda.current_stream().wait_stream(side)
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return times


def cold_prefill(path: Path, rows: int, tokens: np.ndarray, args, device: str, iops: float | None) -> list[dict]:
    h = qwen38_flash_next()
    side = torch.cuda.Stream() if device == "cuda" else None
    out = []
    need = [np.unique(chunk_ids(h, tokens, k * args.chunk_tokens, (k + 1) * args.chunk_tokens, rows))
            for k in range(args.chunks)]
    for ms in args.layer_ms:
        layer, real_ms = layer_fn(ms, device)
        for config in ("none", *(f"window{w}" for w in args.windows)):
            cache = row_cache(path, rows, "float8_e4m3fn", args.budget_mib, max_rows=args.chunk_tokens * ROWS_PER_TOKEN,
                              workers=args.workers, registered=device == "cuda")
            g = gather_of(cache, "float8_e4m3fn", device, mode="h2d", capacity_rows=args.chunk_tokens * ROWS_PER_TOKEN,
                          graph_rows=0)
            pf = None if config == "none" else PromptPrefetcher(
                [(h, Folded(cache, rows))], chunk_tokens=args.chunk_tokens, window=int(config[len("window"):]))
            base = run_prompt(g, h, tokens, rows, args, layer, device, side, None, with_ple=False)
            st0 = cache.stats
            with_ple = run_prompt(g, h, tokens, rows, args, layer, device, side, pf, with_ple=True)
            if pf is not None:
                pf.drain(600)
                pf.close()
            st = cache.stats
            g.close()
            compute = statistics.median(base)
            exposed = [max(0.0, t - compute) for t in with_ple]
            reads = int(st["pages_read"] - st0["pages_read"])
            row = {"layer_ms": ms, "layer_ms_measured": real_ms, "config": config, "chunk_compute_ms": compute,
                   "chunk_ms": with_ple, "exposed_ms": exposed, "exposed_median_ms": statistics.median(exposed),
                   "exposed_vs_compute": statistics.median(exposed) / compute if compute else None,
                   "distinct_rows_per_chunk": [int(x.size) for x in need], "pages_read": reads,
                   "pages_read_per_chunk": reads / args.chunks, "rows_read": int(st["rows_read"] - st0["rows_read"]),
                   "prefetch_hits": int(st["prefetch_hits"] - st0["prefetch_hits"]),
                   "waits": int(st["waits"] - st0["waits"])}
            if iops:
                row["disk_ms_per_chunk_at_fio_iops"] = reads / args.chunks / iops * 1e3
                row["disk_keeps_up"] = row["disk_ms_per_chunk_at_fio_iops"] <= compute
            out.append(row)
            print(f"cold prefill layer {ms} ms, {config}: exposed {row['exposed_median_ms']:.1f} ms of "
                  f"{compute:.1f} ms per chunk, {row['pages_read_per_chunk']:.0f} reads per chunk", flush=True)
    return out


# ----------------------------------------------------------------------------- warm prefill and decode


def warm_prefill(kernel, path: Path, rows: int, tokens: np.ndarray, args, device: str, workers: int) -> dict:
    """A cached chunk in a forward's shape: ``--ple-layer`` − 1 layers, then the lookup begun beside the
    layer before the PLE layer (sglang's ``start_prefetch``), against the same layers without PLE: the
    CPU launches ahead of the GPU as in a forward (``--ple-layer 1``: the lookup begins with nothing
    queued before it). ``workers`` 1: the cache copies hits on one thread (its parallel pass needs 2 or
    more)."""
    h = qwen38_flash_next()
    n = args.chunk_tokens * ROWS_PER_TOKEN
    cache = row_cache(path, rows, "float8_e4m3fn", args.budget_mib, max_rows=n, workers=workers,
                      registered=device == "cuda")
    g = gather_of(cache, "float8_e4m3fn", device, mode="h2d", capacity_rows=n, graph_rows=0)
    ids_np = chunk_ids(h, tokens, 0, args.chunk_tokens, rows)
    cache.prefetch(ids_np)  # warm: every row of the chunk cached
    ids = torch.from_numpy(ids_np).to(device)
    out = torch.empty((n, COLS), dtype=torch.bfloat16, device=device)
    side = torch.cuda.Stream() if device == "cuda" else None
    layer, real_ms = layer_fn(args.prefill_layer_ms, device)
    pinned = host_table(path, rows, "float8_e4m3fn", device) if device == "cuda" else None
    first = max(args.ple_layer - 1, 0)  # layers before the one beside which the lookup runs

    def timed(fn) -> float:
        samples = []
        for _ in range(args.reps):
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            samples.append((time.perf_counter() - t) * 1e3)
        return statistics.median(samples)

    def forward(lookup_fn=None):
        for _ in range(first):
            layer()
        if lookup_fn is None:
            layer()
            return
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        finish = lookup_fn()
        layer()
        finish()
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)

    def with_cache():
        g.begin(ids, out, side)
        return g.wait

    def with_sglang():
        with torch.cuda.stream(side):
            reference(kernel, pinned, ids, 0, rows, device)
        return lambda: None

    host_out = np.empty((n, cache.row_bytes), np.uint8)
    before = cache.stats
    res = {"rows": n, "workers": workers, "layers_before_lookup": first,
           "layer_ms": real_ms, "layer_only_ms": timed(layer), "forward_only_ms": timed(forward),
           # where the exposure comes from: the host read alone, the whole lookup without a layer beside it
           "host_read_ms": timed(lambda: cache.read_rows(ids_np, host_out)),
           "lookup_alone_ms": timed(lambda: lookup(g, ids, out, side))}
    g.stats = type(g.stats)()
    res["row_cache_ms"] = timed(lambda: forward(with_cache))
    res["beside_layer_read_ms"] = g.stats.read_s / max(g.stats.lookups, 1) * 1e3
    res["beside_layer_ids_wait_ms"] = g.stats.ids_wait_s / max(g.stats.lookups, 1) * 1e3
    res["lookups"] = g.stats.lookups
    after = cache.stats
    res["rows_read_during_warm"] = int(after["rows_read"] - before["rows_read"])  # must be 0: all hits
    res["parallel_passes"] = int(after["parallel_passes"] - before["parallel_passes"])
    res["row_cache_exposed_ms"] = max(0.0, res["row_cache_ms"] - res["forward_only_ms"])
    res["row_cache_exposed_vs_layer"] = res["row_cache_exposed_ms"] / res["layer_only_ms"]
    if pinned is not None:
        res["sglang_in_ram_ms"] = timed(lambda: forward(with_sglang))
        res["sglang_in_ram_exposed_ms"] = max(0.0, res["sglang_in_ram_ms"] - res["forward_only_ms"])
    g.close()
    print(f"warm prefill ({workers} workers, lookup after {first} layers): exposed "
          f"{res['row_cache_exposed_ms']:.3f} ms of a {res['layer_only_ms']:.3f} ms layer; host read alone "
          f"{res['host_read_ms']:.3f} ms, lookup alone {res['lookup_alone_ms']:.3f} ms, read beside the layer "
          f"{res['beside_layer_read_ms']:.3f} ms; sglang in RAM exposed "
          f"{res.get('sglang_in_ram_exposed_ms', 0):.3f} ms",
          flush=True)
    return res


def decode_graphs(path: Path, rows: int, args) -> list[dict]:
    """Captured lookups (the cache's host node) on a side stream beside a decode layer, warm."""
    from ple_stream_h200 import gpu_time_ms, time_ms

    layer, _ = layer_fn(args.decode_layer_ms, "cuda")
    cache = row_cache(path, rows, "float8_e4m3fn", args.budget_mib, max_rows=1024, workers=args.workers,
                      registered=True)
    g = gather_of(cache, "float8_e4m3fn", "cuda", mode="h2d", capacity_rows=1024, graph_rows=1024)
    res = []
    for n in (16, 64, 256, 1024):
        inp = torch.from_numpy(np.random.default_rng(n).integers(0, rows, n)).cuda()
        cache.prefetch(((inp * 7 + 3) % rows).cpu().numpy())
        buf = torch.zeros((n, COLS), dtype=torch.bfloat16, device="cuda")

        def build(with_ple: bool):
            s, side = torch.cuda.Stream(), torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
                ids = (inp * 7 + 3) % rows
                if with_ple:
                    side.wait_stream(s)
                    g.capture(ids, buf, side)
                layer()
                if with_ple:
                    s.wait_stream(side)
            torch.cuda.current_stream().wait_stream(s)
            return graph

        only, ple = build(False), build(True)
        r = {"rows": n, "layer_only_ms": statistics.median(time_ms(only.replay, args.reps)),
             "with_lookup_ms": statistics.median(time_ms(ple.replay, args.reps)),
             "layer_only_sleeping_ms": statistics.median(gpu_time_ms(only.replay, args.reps, sleep_s=0.005)),
             "with_lookup_sleeping_ms": statistics.median(gpu_time_ms(ple.replay, args.reps, sleep_s=0.005))}
        r["exposed_ms"] = max(0.0, r["with_lookup_ms"] - r["layer_only_ms"])
        r["exposed_sleeping_ms"] = max(0.0, r["with_lookup_sleeping_ms"] - r["layer_only_sleeping_ms"])
        res.append(r)
        print(f"decode graph {n} rows: exposed {r['exposed_ms']:.3f} / sleeping {r['exposed_sleeping_ms']:.3f} ms",
              flush=True)
    g.close()
    return res


# ----------------------------------------------------------------------------- memory


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def resident_pages(path: Path) -> int:
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    vec = np.zeros((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE, np.uint8)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
        view = np.frombuffer(m, np.uint8)
        rc = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), ctypes.c_void_p(vec.ctypes.data))
        del view
    return int((vec & 1).sum()) if rc == 0 else -1


def drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def memory_check(path: Path, rows: int, tokens: np.ndarray, args, device: str) -> dict:
    """RSS growth + the table's page cache after lookups of ``--memory-chunk-tokens`` chunks."""
    h = qwen38_flash_next()
    c = args.memory_chunk_tokens
    n = c * ROWS_PER_TOKEN
    drop(path)
    rss0 = rss_bytes()
    cache = row_cache(path, rows, "float8_e4m3fn", args.budget_mib, max_rows=n, workers=args.workers,
                      registered=device == "cuda")
    g = gather_of(cache, "float8_e4m3fn", device, mode="h2d", capacity_rows=n, graph_rows=0)
    out = torch.empty((n, COLS), dtype=torch.bfloat16, device=device)
    side = torch.cuda.Stream() if device == "cuda" else None
    for k in range(min(args.memory_chunks, tokens.size // c)):
        lookup(g, torch.from_numpy(chunk_ids(h, tokens, k * c, (k + 1) * c, rows)).to(device), out, side)
    sync(device)
    rss = rss_bytes() - rss0
    page_cache = resident_pages(path) * 4096
    res = {"chunk_tokens": c, "budget_bytes": args.budget_mib * MIB, "cache_working_set_bytes": cache.working_set_bytes,
           "staging_bytes": g.pinned_bytes, "rss_growth_bytes": rss, "table_page_cache_bytes": page_cache,
           "total_bytes": rss + page_cache, "limit_bytes": args.budget_mib * MIB + 64 * MIB}
    res["within_limit"] = res["total_bytes"] <= res["limit_bytes"]
    g.close()
    print(f"memory: RSS +{rss / MIB:.0f} MiB, table page cache {page_cache / MIB:.1f} MiB, limit "
          f"{res['limit_bytes'] / MIB:.0f} MiB", flush=True)
    return res


def long_prompt(stats_path: str | None, iops: float | None, tok_s: float, tokens: int = 262_144) -> dict | None:
    """A cold prompt's disk reads (the trace's distinct rows after that many lookups; each a page read
    with O_DIRECT) at the measured IOPS, against its compute at ``tok_s``."""
    if not stats_path or not iops:
        return None
    growth = json.loads(Path(stats_path).read_text())["ids_curve"]["distinct_after_lookups"]
    lookups = tokens * ROWS_PER_TOKEN
    xs, ys = zip(*growth, strict=False)
    distinct = int(np.interp(lookups, xs, ys))
    disk_s = distinct / iops
    compute_s = tokens / tok_s
    return {"tokens": tokens, "distinct_rows": distinct, "disk_s_at_fio_iops": disk_s, "compute_s": compute_s,
            "added_without_prefetch_s": disk_s, "added_with_prefetch_s": max(0.0, disk_s - compute_s),
            "note": "distinct rows from the held-out trace's growth curve; one 4 KiB read per row (O_DIRECT)"}


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--qwen4-exp", type=Path,
                    help="a copy of sglang 0.5.23 srt/models/qwen4_exp.py (the reference kernel)")
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/ple-row-cache"))
    ap.add_argument("--table-gib", type=float, default=4.0)
    ap.add_argument("--bitexact-mib", type=float, default=64.0, help="size of each bit-exact table (fp8 and bf16)")
    ap.add_argument("--bitexact-rows", type=int, default=32768)
    ap.add_argument("--budget-mib", type=int, default=1024, help="the row cache budget")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--tokens", help="prompt tokens (.npy); default Zipf tokens")
    ap.add_argument("--trace-stats", help="benchmarks/row_cache/trace.json: distinct-row growth for the long prompt")
    ap.add_argument("--chunk-tokens", type=int, default=2048)
    ap.add_argument("--chunks", type=int, default=6)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--ple-layer", type=int, default=3)
    ap.add_argument("--layer-ms", type=float, nargs="+", default=[1.9, 8.0, 30.0],
                    help="simulated layer times for the cold sweep (1.9: the H200's; ~30: Thor at 1.4K tok/s)")
    ap.add_argument("--windows", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--prefill-layer-ms", type=float, default=1.9)
    ap.add_argument("--decode-layer-ms", type=float, default=0.25)
    ap.add_argument("--memory-chunk-tokens", type=int, default=8192)
    ap.add_argument("--memory-chunks", type=int, default=8)
    ap.add_argument("--thor-tok-s", type=float, default=1400.0)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--fio", help="a fio binary (scripts/gpu/build_static_fio.sh)")
    ap.add_argument("--fio-seconds", type=float, default=10)
    ap.add_argument("--only-warm", action="store_true", help="fio and the warm-prefill sections only (a rerun)")
    ap.add_argument("--cpu-smoke", action="store_true", help="no GPU: the CPU parts only, tiny sizes (tests)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --cpu-smoke for the CPU parts)")
    args.dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    res = {"command": shlex.join([Path(sys.executable).name, *sys.argv]), "device": device,
           "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "torch": torch.__version__,
           "python": platform.python_version(), "budget_mib": args.budget_mib}
    if args.qwen4_exp is None:
        raise SystemExit("--qwen4-exp is required (sglang's gather kernel is the bit-exactness reference)")
    from ple_stream_h200 import load_sglang_kernel

    kernel, _ = load_sglang_kernel(args.qwen4_exp)
    big_rows = int(args.table_gib * (1 << 30)) // COLS
    big = args.dir / "ple-row-cache-fp8.bin"
    make_table(big, big_rows, COLS)
    small = {}
    for dtype, rb in (("float8_e4m3fn", COLS), ("bfloat16", 2 * COLS)):
        r = int(args.bitexact_mib * MIB) // rb
        p = args.dir / f"ple-row-cache-bitexact-{dtype}.bin"
        make_table(p, r, rb)
        small[dtype] = (p, r)
    if args.fio:
        res["fio"] = run_fio(args.fio, big, args.fio_seconds, jobs=(16, 64))
    iops = best_iops(res.get("fio"))
    tokens, source = prompt_tokens(args.tokens, max(args.chunks * args.chunk_tokens,
                                                   args.memory_chunks * args.memory_chunk_tokens))
    res["tokens"] = source
    if not args.only_warm:
        res["bitexact"] = check_bitexact(kernel, small, args, device)
        res["cold_prefill"] = cold_prefill(big, big_rows, tokens, args, device, iops)
    res["warm_prefill"] = warm_prefill(kernel, big, big_rows, tokens, args, device, args.workers)
    res["warm_prefill_one_copy_thread"] = warm_prefill(kernel, big, big_rows, tokens, args, device, 1)
    if args.only_warm:
        res["seconds"] = round(time.perf_counter() - t0, 1)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
        return 0
    if device == "cuda":
        res["decode_graphs"] = decode_graphs(big, big_rows, args)
    res["memory"] = memory_check(big, big_rows, tokens, args, device)
    res["long_prompt"] = long_prompt(args.trace_stats, iops, args.thor_tok_s)
    flags = [v for r in res["bitexact"] for k, v in r.items() if k.endswith("bitexact")]
    res["all_bitexact"] = all(flags)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"all bit-exact: {res['all_bitexact']}; {res['seconds']} s", flush=True)
    return 0 if res["all_bitexact"] else 1


if __name__ == "__main__":
    sys.exit(main())
