#!/usr/bin/env python3
"""The PLE row cache + prompt-ahead prefetch on a GPU: cold prefill hidden, warm exposure, decode graphs,
memory, bit-exactness; the hot file's cold chunk and decode rows ahead with MTP (issue 27 item 5). Its CPU parts
run in ``tests/sidecar/test_row_cache_gpu_script.py``; ``hot_chunk`` and ``decode_draft`` ran once on an H200
(``benchmarks/hot_file/h200/``, docs/hot-file-measured.md).

The pipeline under test is the one the engines will run: ``SidecarGather`` (staging/) over a
:class:`~sglang_ssd_stream.sidecar.row_cache.RowCache` (rows in CUDA-registered memory, misses read
with ``O_DIRECT``), its captured reads the cache's native host node (``host_read=captured_read``),
and :class:`~sglang_ssd_stream.sidecar.prefetch.PromptPrefetcher` told of each chunk when it starts.
The reference is sglang 0.5.23's own ``_gather_ple_embedding_from_pinned_kernel`` over the whole
table in pinned RAM (pulled out of a copied ``qwen4_exp.py`` with ``ast``, as ``ple_stream_h200.py``).

Measured (all in one JSON, rewritten after every section; ``--sections`` picks them, default the first six
below; ``--fio`` runs whenever given):

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
- ``hot_chunk`` (not by default): the cold chunk after a restart, with and without a hot file. The hot set is
  learned as a server learns it: the stream's first ``--hot-learn-tokens`` tokens looked up, chunk by chunk,
  through a real cache of ``--hot-budget-mib`` (it counts lookups); per share of ``--hot-shares`` its hottest rows
  (``RowCache.hottest``) written by the real ``write_hot_file`` (fio then reads as many bytes sequentially,
  ``O_DIRECT`` and buffered from a cold page cache). Then, ``--repeats`` times, per configuration (no hot file or
  each share; no prefetcher or each of ``--hot-windows``), a restart: the table's and the hot file's page cache
  dropped, a fresh cache, the file loaded by the real ``HotRows.load`` (timed: MiB/s against fio's), and a held-out
  prompt later in the stream (``--hot-gap-tokens`` after the learned part; ``--hot-chunks`` chunks, the first the
  cold one) run as in ``cold_prefill`` at ``--hot-layer-ms`` (1.9: the H200's layer). Reported per configuration:
  the first chunk's exposed time / compute (goal ≤ 10 %), its page reads, the share of its rows the hot set held,
  the rows delivered bit-exact against the reference (all values and the median over the repetitions).
- ``decode_draft`` (not by default): verify steps of ``--decode-rows`` rows (requests of the last committed token
  and ``--draft-steps`` drafts; 16 rows is one token) with ``--decode-cached-pct`` % of their distinct rows cached
  before each step and the rest read from disk (page cache dropped). A step is ``--draft-steps`` simulated draft
  steps of ``--draft-step-ms``, then the verify forward: ``--layers`` layers of ``--decode-layer-ms``, the eager
  ``SidecarGather`` lookup begun one layer before ``--ple-layer``. Without draft prefetch the lookup reads its
  misses itself; with it, after the draft's GPU work is enqueued, the tokens and n-gram histories are copied to
  pinned memory (non-blocking), an event recorded and ``PromptPrefetcher.drafted(source)`` called, the source
  waiting for the event on the prefetch thread (what ``sglang/prefetch.py``'s ``around_draft`` does): the reads
  overlap the verify's layers before the PLE layer. Exposed = the step's time − the same step with every row
  cached (``--decode-steps`` steps per repetition, each configuration in a fresh cache; goal ≤ 3 % at 256 rows);
  every step's delivered rows checked bit-exact; per size, untimed, the ids ``drafted`` fetched equal the
  lookup's, all cached once it finished, and the verify lookup then reads nothing.

Bit-exactness reference of ``hot_chunk`` and ``decode_draft``: sglang's kernel over the table's own bytes of the
looked-up rows (``--qwen4-exp``), else the kit's conversion kernel over them (then it checks the bytes the cache
delivered, not the conversion: the ``bitexact`` section does that).

Ids: a prompt's tokens (``--tokens``, e.g. the held-out trace's ``tokens.npy``; else Zipf tokens)
hashed by the real n-gram function, then folded into the test table (``id mod rows``): the table
is smaller than the real 320M rows; folding keeps the chunk's distinct-row count within the
collisions of ``rows``.

Usage (GPU box; ``build/gpu/qwen4_exp.py`` a copy of sglang's, ``.gpu/vllm-src/fio`` from
``scripts/gpu/build_static_fio.sh``, ``.gpu/ple-trace-tokens.npy`` the trace's tokens)::

    python3 scripts/gpu/ple_row_cache_h200.py --qwen4-exp build/gpu/qwen4_exp.py --fio .gpu/vllm-src/fio \\
        --tokens .gpu/ple-trace-tokens.npy --trace-stats benchmarks/row_cache/trace.json \\
        --out $OUT/ple_row_cache_h200.json

Issue 27 item 5 (the hot file's cold chunk, decode rows ahead; 3 repetitions inside the run, ~3-4 min)::

    python3 scripts/gpu/ple_row_cache_h200.py --sections hot_chunk decode_draft --qwen4-exp build/gpu/qwen4_exp.py \\
        --fio .gpu/vllm-src/fio --fio-seconds 5 --tokens .gpu/ple-trace-tokens.npy --repeats 3 \\
        --out $OUT/ple_hot_decode_h200.json
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
from _harness import make_table, run_fio, run_fio_seq, simulated_layer, sync  # noqa: E402

from sglang_ssd_stream.sidecar.format import SidecarManifest, SidecarTable  # noqa: E402
from sglang_ssd_stream.sidecar.hot_file import write_hot_file  # noqa: E402
from sglang_ssd_stream.sidecar.hot_rows import HotRows  # noqa: E402
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
               prefetcher: PromptPrefetcher | None, with_ple: bool, *, chunks: int | None = None,
               outs: list | None = None, after_chunk=None) -> list[float]:
    """Per chunk: tell the prefetcher, run ``--layers`` layers with the PLE lookup begun one layer
    before layer ``--ple-layer``; returns each chunk's wall time (ms). ``chunks``: the prompt's
    chunks (default ``--chunks``); ``outs``: a list that gets each chunk's delivered rows (a buffer
    per chunk, checked after the prompt); ``after_chunk()``: called after each chunk's timing."""
    c = args.chunk_tokens
    chunks = args.chunks if chunks is None else chunks
    out = torch.empty((c * ROWS_PER_TOKEN, COLS), dtype=torch.bfloat16, device=device)
    times = []
    for k in range(chunks):
        a, b = k * c, (k + 1) * c
        ids = torch.from_numpy(chunk_ids(h, tokens, a, b, rows)).to(device)
        if outs is not None:
            out = torch.empty((c * ROWS_PER_TOKEN, COLS), dtype=torch.bfloat16, device=device)
            outs.append(out)
        sync(device)
        t = time.perf_counter()
        if prefetcher is not None:
            prefetcher.scheduled("prompt", tokens[:chunks * c], a, b)  # the prompt ends there
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
        if after_chunk is not None:
            after_chunk()
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


# ----------------------------------------------------------------------------- hot set, decode rows ahead (issue 27)

FP8 = "float8_e4m3fn"
HOT_ROLE = "h200-bench"


def manifest_of(path: Path, rows: int, dtype: str) -> SidecarManifest:
    """The test table as a one-table sidecar (layer 0): what the hot file binds to."""
    return SidecarManifest(path.parent / "ssd-stream.json", path.parent, (table_of(path, rows, dtype),))


def table_bytes(path: Path, rows: int) -> np.ndarray:
    """The FP8 test table's bytes, ``uint8 [rows, COLS]`` (a read-only map: the reference's rows)."""
    return np.memmap(path, dtype=np.uint8, mode="r", shape=(rows, COLS))


def expected_rows(kernel, table: np.ndarray, ids: np.ndarray, device: str) -> torch.Tensor:
    """The rows a lookup of ``ids`` must deliver, from the table's own bytes: sglang's gather kernel over them
    (``--qwen4-exp``; pinned on the GPU box, the Triton interpreter on a CPU), else the kit's conversion kernel
    (the gather's own delivery, so this then checks the bytes the cache delivered, not the conversion)."""
    raw = torch.from_numpy(np.ascontiguousarray(table[np.asarray(ids)]))
    n = raw.shape[0]
    if kernel is not None:
        host = raw.pin_memory() if device == "cuda" else raw
        ref = reference(kernel, host.view(torch.float8_e4m3fn), torch.arange(n, device=device), 0, n, device)
        sync(device)  # the kernel read `host`: keep it alive until then
        return ref
    from sglang_ssd_stream.staging.kernels import convert_staged_rows

    out = torch.empty((n, COLS), dtype=torch.bfloat16, device=device)
    convert_staged_rows(raw.to(device), out, is_fp8=True)
    return out


def same_bits(out: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool(torch.equal(out.view(torch.int16), ref.view(torch.int16)))


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values) if values else None, "values": values}


def learn_hot_files(path: Path, rows: int, tokens: np.ndarray, args, fio: str | None) -> tuple[dict, dict]:
    """A server's hot set: the stream's earlier tokens (``--hot-learn-tokens``) looked up chunk by chunk through a
    real cache of ``--hot-budget-mib`` (the cache counts lookups), then, per share, its hottest rows
    (``RowCache.hottest``: the rows ``HotRows`` writes) written with the real ``write_hot_file``; fio reads as many
    bytes sequentially right after each. Returns (what was learned, ``{share: hot file}``)."""
    h = qwen38_flash_next()
    c = args.chunk_tokens
    manifest = manifest_of(path, rows, FP8)
    cache = row_cache(path, rows, FP8, args.hot_budget_mib, max_rows=c * ROWS_PER_TOKEN, workers=args.workers,
                      registered=False)
    learn = tokens[:args.hot_learn_tokens]
    buf = np.empty((c * ROWS_PER_TOKEN, cache.row_bytes), np.uint8)
    drop(path)
    t = time.perf_counter()
    for a in range(0, learn.size, c):
        ids = chunk_ids(h, learn, a, min(a + c, learn.size), rows)
        cache.read_rows(ids, buf[:ids.size])
    st = cache.stats
    learned = {"tokens": int(learn.size), "seconds": time.perf_counter() - t, "capacity_rows": cache.capacity,
               "rows_cached": cache.occupancy()[0], "lookups": st["lookups"], "rows_read": st["rows_read"],
               "pages_read": st["pages_read"], "evictions": st["evictions"]}
    print(f"hot set: learned from {learn.size} tokens in {learned['seconds']:.1f} s ({st['rows_read']} rows read, "
          f"{learned['rows_cached']} of {cache.capacity} cached)", flush=True)
    files = {}
    for pct in args.hot_shares:
        k = int(cache.capacity * pct / 100)  # HotRows' rows per layer: the share of a cache of the same budget
        ids, hot, counts = cache.hottest(k)
        p = args.dir / f"ple-row-cache-hot{pct}.plehot"
        t = time.perf_counter()
        size = write_hot_file(p, manifest, {0: (cache.vocab_start, cache.vocab_end)}, {0: (ids, hot)}, role=HOT_ROLE)
        files[pct] = {"path": p, "rows": int(ids.size), "bytes": int(size), "write_s": time.perf_counter() - t,
                      "min_count": int(counts.min()) if counts.size else None}
        if fio:
            files[pct]["fio_seq"] = run_fio_seq(fio, args.dir / "fio-seq-read.bin", size)
        print(f"hot file {pct} %: {ids.size} rows, {size / MIB:.1f} MiB", flush=True)
    cache.close()
    return learned, files


def hot_chunk_once(path: Path, rows: int, prompt: np.ndarray, args, device: str, layer, side,
                   pct: int, window: int | None, hot: dict | None, refs: list) -> dict:
    """One restart: page cache of the table and the hot file dropped, a fresh cache, the hot file (share ``pct``;
    0: none) loaded by the real ``HotRows.load`` (timed), then the held-out prompt's chunks without and with PLE;
    the rows delivered compared with ``refs`` (each chunk's expected rows)."""
    h = qwen38_flash_next()
    c, chunks = args.chunk_tokens, args.hot_chunks
    n = c * ROWS_PER_TOKEN
    drop(path)
    if hot is not None:
        drop(hot["path"])
    cache = row_cache(path, rows, FP8, args.hot_budget_mib, max_rows=n, workers=args.workers,
                      registered=device == "cuda")
    g = gather_of(cache, FP8, device, mode="h2d", capacity_rows=n, graph_rows=0)
    row = {"hot_share_pct": pct, "window": window}
    if hot is not None:
        hr = HotRows(manifest_of(path, rows, FP8), {0: cache}, share=pct / 100, interval_s=0, role=HOT_ROLE,
                     path=hot["path"])
        t = time.perf_counter()
        placed = hr.load()
        load_s = time.perf_counter() - t
        row.update(hot_rows_loaded=placed, load_s=load_s, load_mib_s=hot["bytes"] / load_s / MIB)
        seq = hot.get("fio_seq", {})
        for how in ("direct", "buffered"):
            if "bw_mib_s" in seq.get(how, {}):
                row[f"load_vs_fio_{how}"] = row["load_mib_s"] / seq[how]["bw_mib_s"]
    need = [np.unique(chunk_ids(h, prompt, k * c, (k + 1) * c, rows)) for k in range(chunks)]
    row["hot_covers_chunk_rows"] = [float(cache.contains(x).mean()) for x in need]  # no policy update
    pf = None if window is None else PromptPrefetcher([(h, Folded(cache, rows))], chunk_tokens=c, window=window)
    base = run_prompt(g, h, prompt, rows, args, layer, device, side, None, with_ple=False, chunks=chunks)
    snaps = [cache.stats]
    outs: list = []
    with_ple = run_prompt(g, h, prompt, rows, args, layer, device, side, pf, with_ple=True, chunks=chunks, outs=outs,
                          after_chunk=lambda: snaps.append(cache.stats))
    if pf is not None:
        pf.drain(600)
        pf.close()
    g.close()
    compute = statistics.median(base)
    exposed = [max(0.0, t - compute) for t in with_ple]
    row.update(chunk_compute_ms=compute, chunk_ms=with_ple, exposed_ms=exposed,
               exposed_vs_compute=[e / compute for e in exposed],
               pages_read=[int(b["pages_read"] - a["pages_read"]) for a, b in zip(snaps, snaps[1:], strict=False)],
               rows_read=[int(b["rows_read"] - a["rows_read"]) for a, b in zip(snaps, snaps[1:], strict=False)],
               hits=[int(b["hits"] - a["hits"]) for a, b in zip(snaps, snaps[1:], strict=False)],
               distinct_rows=[int(x.size) for x in need])
    row["bitexact"] = all(same_bits(out, ref) for out, ref in zip(outs, refs, strict=True))
    cache.close()
    return row


def hot_chunk(kernel, path: Path, rows: int, tokens: np.ndarray, args, device: str, fio: str | None,
              iops: float | None) -> dict:
    """The cold chunk after a restart, with and without a hot set (see the module docstring)."""
    c = args.chunk_tokens
    layer, real_ms = layer_fn(args.hot_layer_ms, device)
    side = torch.cuda.Stream() if device == "cuda" else None
    learned, files = learn_hot_files(path, rows, tokens, args, fio)
    at = hot_heldout_at(args)
    prompt = tokens[at:at + args.hot_chunks * c]
    table = table_bytes(path, rows)  # the expected rows, once (the restarts drop the table's page cache)
    refs = [expected_rows(kernel, table, chunk_ids(qwen38_flash_next(), prompt, k * c, (k + 1) * c, rows), device)
            for k in range(args.hot_chunks)]
    del table
    configs = [(pct, w) for pct in (0, *args.hot_shares) for w in (None, *args.hot_windows)]
    runs = []
    for rep in range(args.repeats):  # configurations interleaved within each repetition
        for pct, w in configs:
            r = hot_chunk_once(path, rows, prompt, args, device, layer, side, pct, w,
                               files.get(pct) if pct else None, refs)
            r["repeat"] = rep
            runs.append(r)
            print(f"hot chunk rep {rep} share {pct} % window {w}: first chunk exposed {r['exposed_ms'][0]:.1f} ms of "
                  f"{r['chunk_compute_ms']:.1f} ms ({r['exposed_vs_compute'][0]:.0%}), {r['pages_read'][0]} page "
                  f"reads, hot set covers {r['hot_covers_chunk_rows'][0]:.0%} of its rows; bit-exact {r['bitexact']}",
                  flush=True)
    configurations = []
    for pct, w in configs:
        rs = [r for r in runs if r["hot_share_pct"] == pct and r["window"] == w]
        cfg = {"hot_share_pct": pct, "window": w,
               "first_chunk_exposed_vs_compute": summary([r["exposed_vs_compute"][0] for r in rs]),
               "first_chunk_exposed_ms": summary([r["exposed_ms"][0] for r in rs]),
               "all_chunks_exposed_vs_compute": summary([statistics.median(r["exposed_vs_compute"]) for r in rs]),
               "chunk_compute_ms": summary([r["chunk_compute_ms"] for r in rs]),
               "first_chunk_pages_read": summary([r["pages_read"][0] for r in rs]),
               "hot_covers_first_chunk": summary([r["hot_covers_chunk_rows"][0] for r in rs]),
               "bitexact": all(r["bitexact"] for r in rs)}
        if iops:
            cfg["first_chunk_disk_ms_at_fio_iops"] = cfg["first_chunk_pages_read"]["median"] / iops * 1e3
        if pct:
            cfg["load_mib_s"] = summary([r["load_mib_s"] for r in rs])
            for how in ("direct", "buffered"):
                if all(f"load_vs_fio_{how}" in r for r in rs):
                    cfg[f"load_vs_fio_{how}"] = summary([r[f"load_vs_fio_{how}"] for r in rs])
        cfg["goal_first_chunk_le_10pct"] = cfg["first_chunk_exposed_vs_compute"]["median"] <= 0.10
        configurations.append(cfg)
    return {"layer_ms": args.hot_layer_ms, "layer_ms_measured": real_ms, "layers": args.layers,
            "ple_layer": args.ple_layer, "chunk_tokens": c, "chunks": args.hot_chunks, "heldout_at_token": at,
            "budget_mib": args.hot_budget_mib, "learned": learned,
            "hot_files": {str(k): {kk: (str(vv) if kk == "path" else vv) for kk, vv in v.items()}
                          for k, v in files.items()},
            "configurations": configurations, "runs": runs,
            "bitexact": all(r["bitexact"] for r in runs),
            "note": "exposed = chunk time - the same chunk without PLE (median of the no-PLE chunks); the first chunk "
                    "of the held-out prompt is the cold one (its prefetch, if any, starts with it)"}


def hot_heldout_at(args) -> int:
    return args.hot_learn_tokens + args.hot_gap_tokens if args.hot_heldout_at is None else args.hot_heldout_at


# ------------------------------------------------------------------ decode (verify) steps with draft prefetch


def decode_shape(rows_per_step: int, draft_steps: int) -> tuple[int, int]:
    """(requests, tokens per request) of a verify step of ``rows_per_step`` rows: each request's last committed
    token then its ``draft_steps`` drafts (fewer when the step has fewer tokens: 16 rows is one token)."""
    tokens = max(1, rows_per_step // ROWS_PER_TOKEN)
    width = min(1 + draft_steps, tokens)
    return tokens // width, width


def decode_at(args) -> int:
    return hot_heldout_at(args) + args.hot_chunks * args.chunk_tokens


def decode_tokens_needed(args) -> int:
    """Tokens of the stream the decode steps use (after ``decode_at``)."""
    total = 0
    for r in args.decode_rows:
        reqs, w = decode_shape(r, args.draft_steps)
        total += (1 + args.repeats * (1 + args.decode_steps)) * reqs * (w + 2)  # check, then warm-up + steps per rep
    return total


class Recording(Folded):
    """A folded row source that also keeps every id it was asked to prefetch (the drafted check)."""

    def __init__(self, cache: RowCache, rows: int):
        super().__init__(cache, rows)
        self.seen: list[np.ndarray] = []

    def prefetch(self, ids):
        self.seen.append(np.asarray(ids) % self.rows)
        super().prefetch(ids)


def make_step(h, tokens: np.ndarray, pos: int, reqs: int, width: int, rows: int, device: str) -> dict:
    """A verify step's inputs from the stream at ``pos``: per request, its n-gram history (the 2 tokens before)
    and its tokens (the last committed one, then the drafts); the ids its PLE lookup reads (folded)."""
    ctx = h.ngram_size - 1
    hist, toks = [], []
    for j in range(reqs):
        p = pos + j * (width + ctx) + ctx
        hist.append(tokens[p - ctx:p])
        toks.append(tokens[p:p + width])
    hist, toks = np.asarray(hist, np.int64), np.asarray(toks, np.int64)
    ids = np.concatenate([h.ids(t, hh).reshape(-1) for hh, t in zip(hist, toks, strict=True)]) % rows
    return {"hist": hist, "toks": toks, "ids": ids, "ids_dev": torch.from_numpy(ids).to(device),
            "hist_dev": torch.from_numpy(hist).to(device), "toks_dev": torch.from_numpy(toks).to(device)}


def draft_announcer(pf: PromptPrefetcher, step: dict, device: str):
    """What the SGLang adapter does after the draft (``sglang/prefetch.py``: ``draft_source``/``around_draft``):
    the draft's tokens and the histories copied to pinned memory without waiting, an event, and
    ``drafted(source)``, the source waiting for the event on the prefetch thread."""
    def announce():
        if device == "cuda":
            toks = torch.empty(step["toks_dev"].shape, dtype=torch.int64, pin_memory=True)
            hist = torch.empty(step["hist_dev"].shape, dtype=torch.int64, pin_memory=True)
            toks.copy_(step["toks_dev"], non_blocking=True)
            hist.copy_(step["hist_dev"], non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            toks, hist, ready = step["toks_dev"].clone(), step["hist_dev"].clone(), None

        def source():
            if ready is not None:
                ready.synchronize()
            return list(zip(hist.numpy(), toks.numpy(), strict=True))

        pf.drafted(source)
    return announce


def verify_step(g: SidecarGather, step: dict, out: torch.Tensor, args, draft_layer, layer, device: str, side,
                announce=None) -> float:
    """One decode step, timed (ms): ``--draft-steps`` draft steps, then (``announce``: the draft's tokens handed to
    the prefetcher) the verify forward of ``--layers`` layers with its eager PLE lookup begun one layer before
    ``--ple-layer`` as the engines begin it."""
    sync(device)
    t = time.perf_counter()
    for _ in range(args.draft_steps):
        draft_layer()
    if announce is not None:
        announce()
    for i in range(args.layers):
        if i == args.ple_layer - 1:
            if side is not None:
                side.wait_stream(torch.cuda.current_stream())
            g.begin(step["ids_dev"], out, side)
        layer()
        if i == args.ple_layer - 1:
            g.wait()
            if side is not None:
                torch.cuda.current_stream().wait_stream(side)
    sync(device)
    return (time.perf_counter() - t) * 1e3


def prepare_step(cache: RowCache, step: dict, cached_pct: float, all_cached: bool, seed: int, path: Path) -> int:
    """Before a step (not timed): every row of it cached, or ``cached_pct`` % of its distinct rows (the rest chosen
    among rows not cached now, so they are read from disk); the table's page cache dropped. Returns the step's
    distinct rows not cached."""
    uniq = np.unique(step["ids"])
    if all_cached:
        cache.prefetch(uniq)
    else:
        order = np.random.default_rng(seed).permutation(uniq.size)
        cold_n = int(round(uniq.size * (1 - cached_pct / 100)))
        cached = cache.contains(uniq)
        cold = uniq[order][~cached[order]][:cold_n]
        cache.prefetch(np.setdiff1d(uniq, cold))
    drop(path)
    return int((~cache.contains(uniq)).sum())


def drafted_check(path: Path, rows: int, step: dict, args, device: str, n: int) -> dict:
    """Untimed: the ids ``drafted`` fetched for a step's (history, tokens) are exactly the ids its lookup reads, all
    cached once the thread finished, and the verify lookup then reads nothing."""
    h = qwen38_flash_next()
    cache = row_cache(path, rows, FP8, args.decode_budget_mib, max_rows=n, workers=args.workers,
                      registered=device == "cuda")
    g = gather_of(cache, FP8, device, mode="h2d", capacity_rows=n, graph_rows=0)
    src = Recording(cache, rows)
    pf = PromptPrefetcher([(h, src)], chunk_tokens=args.chunk_tokens, window=0)
    prepare_step(cache, step, args.decode_cached_pct, False, 0, path)
    draft_announcer(pf, step, device)()
    pf.drain(600)
    fetched = np.unique(np.concatenate(src.seen)) if src.seen else np.empty(0, np.int64)
    want = np.unique(step["ids"])
    res = {"drafted_ids_equal_lookup_ids": bool(np.array_equal(fetched, want)),
           "lookup_rows_cached_after_drafted": bool(cache.contains(want).all()),
           "draft_steps": pf.stats.draft_steps, "errors": list(pf.stats.errors)}
    pf.close()
    before = cache.stats
    out = torch.empty((step["ids"].size, COLS), dtype=torch.bfloat16, device=device)
    lookup(g, step["ids_dev"], out, torch.cuda.Stream() if device == "cuda" else None)
    sync(device)
    res["verify_rows_read_after_drafted"] = int(cache.stats["rows_read"] - before["rows_read"])
    res["ok"] = (res["drafted_ids_equal_lookup_ids"] and res["lookup_rows_cached_after_drafted"]
                 and res["verify_rows_read_after_drafted"] == 0 and res["draft_steps"] == 1 and not res["errors"])
    g.close()
    cache.close()
    return res


DECODE_CONFIGS = ("all_cached", "on_demand", "drafted")


def decode_draft(kernel, path: Path, rows: int, tokens: np.ndarray, args, device: str) -> list[dict]:
    """Verify steps with ``--decode-cached-pct`` % of their rows cached, with and without draft prefetch (see the
    module docstring); exposed = the step's time - the same step with every row cached."""
    h = qwen38_flash_next()
    side = torch.cuda.Stream() if device == "cuda" else None
    draft_layer, draft_ms = layer_fn(args.draft_step_ms, device)
    layer, layer_ms = layer_fn(args.decode_layer_ms, device)
    table = table_bytes(path, rows)
    pos = decode_at(args)
    results = []
    for r_asked in args.decode_rows:
        reqs, w = decode_shape(r_asked, args.draft_steps)
        n = reqs * w * ROWS_PER_TOKEN
        per_step = reqs * (w + h.ngram_size - 1)

        def next_step():
            nonlocal pos
            s = make_step(h, tokens, pos, reqs, w, rows, device)
            pos += per_step
            return s

        check = drafted_check(path, rows, next_step(), args, device, n)
        reps = []
        for rep in range(args.repeats):
            warm = next_step()
            steps = [next_step() for _ in range(args.decode_steps)]
            rec = {"repeat": rep}
            for config in DECODE_CONFIGS:  # the same steps in each configuration, each in a fresh cache
                cache = row_cache(path, rows, FP8, args.decode_budget_mib, max_rows=n, workers=args.workers,
                                  registered=device == "cuda")
                g = gather_of(cache, FP8, device, mode="h2d", capacity_rows=n, graph_rows=0)
                pf = (PromptPrefetcher([(h, Folded(cache, rows))], chunk_tokens=args.chunk_tokens, window=0)
                      if config == "drafted" else None)
                out = torch.empty((n, COLS), dtype=torch.bfloat16, device=device)
                verify_step(g, warm, out, args, draft_layer, layer, device, side,
                            None if pf is None else draft_announcer(pf, warm, device))  # warm-up (threads, kernels)
                if pf is not None:
                    pf.drain(600)
                times, cold, reads, exact = [], [], [], True
                for s_i, step in enumerate(steps):
                    cold.append(prepare_step(cache, step, args.decode_cached_pct, config == "all_cached",
                                             1000 * rep + s_i, path))
                    before = cache.stats["pages_read"]
                    times.append(verify_step(g, step, out, args, draft_layer, layer, device, side,
                                             None if pf is None else draft_announcer(pf, step, device)))
                    if pf is not None:
                        pf.drain(600)
                    reads.append(int(cache.stats["pages_read"] - before))
                    if "expected" not in step:  # once per step: the configurations run the same steps
                        step["expected"] = expected_rows(kernel, table, step["ids"], device)
                    exact &= same_bits(out, step["expected"])
                rec[config] = {"step_ms": times, "cold_rows": cold, "pages_read": reads, "bitexact": exact}
                if pf is not None:
                    rec[config].update(draft_steps=pf.stats.draft_steps,
                                       draft_steps_dropped=pf.stats.draft_steps_dropped, errors=list(pf.stats.errors))
                    pf.close()
                g.close()
                cache.close()
            base = rec["all_cached"]["step_ms"]
            for config in DECODE_CONFIGS[1:]:
                delta = [t - b for t, b in zip(rec[config]["step_ms"], base, strict=True)]
                exp = [max(0.0, d) for d in delta]
                rec[config]["delta_ms"] = delta  # unclipped: noise shows as negative values
                rec[config]["exposed_ms"] = statistics.median(exp)
                rec[config]["exposed_vs_step"] = statistics.median([e / b for e, b in zip(exp, base, strict=True)])
            reps.append(rec)
            print(f"decode {n} rows rep {rep}: step {statistics.median(base):.2f} ms; exposed on demand "
                  f"{rec['on_demand']['exposed_ms']:.3f} ms ({rec['on_demand']['exposed_vs_step']:.1%}), drafted "
                  f"{rec['drafted']['exposed_ms']:.3f} ms ({rec['drafted']['exposed_vs_step']:.1%})", flush=True)
        row = {"rows": n, "rows_asked": r_asked, "requests": reqs, "tokens_per_request": w,
               "cached_pct": args.decode_cached_pct, "draft_steps": args.draft_steps, "draft_step_ms": draft_ms,
               "layers": args.layers, "layer_ms": layer_ms, "ple_layer": args.ple_layer, "steps_per_repeat":
               args.decode_steps, "drafted_check": check,
               "step_ms_all_cached": summary([statistics.median(r["all_cached"]["step_ms"]) for r in reps]),
               "bitexact": all(r[c]["bitexact"] for r in reps for c in DECODE_CONFIGS), "repeats": reps}
        for config in DECODE_CONFIGS[1:]:
            row[config] = {"exposed_ms": summary([r[config]["exposed_ms"] for r in reps]),
                           "exposed_vs_step": summary([r[config]["exposed_vs_step"] for r in reps]),
                           "cold_rows_per_step": summary([statistics.median(r[config]["cold_rows"]) for r in reps]),
                           "pages_read_per_step": summary([statistics.median(r[config]["pages_read"]) for r in reps])}
            row[config]["goal_le_3pct"] = row[config]["exposed_vs_step"]["median"] <= 0.03
        results.append(row)
    return results



# ----------------------------------------------------------------------------- main


SECTIONS = ("bitexact", "cold_prefill", "warm_prefill", "decode_graphs", "memory", "long_prompt", "hot_chunk",
            "decode_draft")
DEFAULT_SECTIONS = SECTIONS[:6]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--qwen4-exp", type=Path,
                    help="a copy of sglang 0.5.23 srt/models/qwen4_exp.py (the reference kernel; required by bitexact "
                         "and warm_prefill, else the reference is the kit's conversion of the table's bytes)")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(DEFAULT_SECTIONS),
                    help=f"what to measure (default: {' '.join(DEFAULT_SECTIONS)}); fio runs whenever --fio is given")
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
    ap.add_argument("--repeats", type=int, default=3, help="hot_chunk and decode_draft: repetitions inside the run")
    hot = ap.add_argument_group("hot_chunk")
    hot.add_argument("--hot-layer-ms", type=float, default=1.9, help="the simulated layer of the cold chunk")
    hot.add_argument("--hot-budget-mib", type=int, default=256, help="the row cache budget of the hot-set runs")
    hot.add_argument("--hot-shares", type=int, nargs="+", default=[50, 100], help="hot shares (percent of the cache)")
    hot.add_argument("--hot-windows", type=int, nargs="*", default=[1],
                     help="prompt-ahead windows measured beside no prefetcher (none: only without)")
    hot.add_argument("--hot-learn-tokens", type=int, default=262_144,
                     help="the earlier part of the stream the hot set is learned from")
    hot.add_argument("--hot-gap-tokens", type=int, default=32_768, help="tokens skipped between it and the held-out "
                     "prompt")
    hot.add_argument("--hot-heldout-at", type=int, help="the held-out prompt's first token (default learn + gap)")
    hot.add_argument("--hot-chunks", type=int, default=3, help="chunks of the held-out prompt (the first is cold)")
    dec = ap.add_argument_group("decode_draft")
    dec.add_argument("--decode-rows", type=int, nargs="+", default=[16, 256, 1024], help="rows per verify step")
    dec.add_argument("--decode-cached-pct", type=float, default=80.0, help="the step's distinct rows cached before it")
    dec.add_argument("--decode-steps", type=int, default=8, help="steps per configuration and repetition")
    dec.add_argument("--decode-budget-mib", type=int, default=64, help="the row cache budget of the decode runs")
    dec.add_argument("--draft-steps", type=int, default=3)
    dec.add_argument("--draft-step-ms", type=float, default=0.25, help="simulated GPU work of one draft step")
    ap.add_argument("--fio", help="a fio binary (scripts/gpu/build_static_fio.sh)")
    ap.add_argument("--fio-seconds", type=float, default=10)
    ap.add_argument("--only-warm", action="store_true", help="fio and the warm-prefill sections only (a rerun)")
    ap.add_argument("--cpu-smoke", action="store_true", help="no GPU: the CPU parts only, tiny sizes (tests)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    sections = ["warm_prefill"] if args.only_warm else list(dict.fromkeys(args.sections))

    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --cpu-smoke for the CPU parts)")
    args.dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    res = {"command": shlex.join([Path(sys.executable).name, *sys.argv]), "device": device,
           "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "torch": torch.__version__,
           "python": platform.python_version(), "budget_mib": args.budget_mib, "sections": sections}

    def save() -> None:  # after every section: a run cut short keeps what it measured
        res["seconds"] = round(time.perf_counter() - t0, 1)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")

    kernel = None
    if args.qwen4_exp is None and {"bitexact", "warm_prefill"} & set(sections):
        raise SystemExit("--qwen4-exp is required (sglang's gather kernel is the bit-exactness reference)")
    if args.qwen4_exp is not None:
        from ple_stream_h200 import load_sglang_kernel

        kernel, _ = load_sglang_kernel(args.qwen4_exp)
    res["reference"] = ("sglang 0.5.23's _gather_ple_embedding_from_pinned_kernel" if kernel is not None else
                        "the kit's conversion kernel over the table's bytes (no --qwen4-exp)")
    big_rows = int(args.table_gib * (1 << 30)) // COLS
    big = args.dir / "ple-row-cache-fp8.bin"
    make_table(big, big_rows, COLS)
    small = {}
    if "bitexact" in sections:
        for dtype, rb in (("float8_e4m3fn", COLS), ("bfloat16", 2 * COLS)):
            r = int(args.bitexact_mib * MIB) // rb
            p = args.dir / f"ple-row-cache-bitexact-{dtype}.bin"
            make_table(p, r, rb)
            small[dtype] = (p, r)
    if args.fio:
        res["fio"] = run_fio(args.fio, big, args.fio_seconds, jobs=(16, 64))
    iops = best_iops(res.get("fio"))
    need = 0
    if {"cold_prefill", "warm_prefill", "memory"} & set(sections):
        need = max(args.chunks * args.chunk_tokens, args.memory_chunks * args.memory_chunk_tokens)
    if "hot_chunk" in sections:
        need = max(need, hot_heldout_at(args) + args.hot_chunks * args.chunk_tokens)
    if "decode_draft" in sections:
        need = max(need, decode_at(args) + decode_tokens_needed(args))
    tokens, source = prompt_tokens(args.tokens, max(need, 1))
    res["tokens"] = source
    flags: list[bool] = []
    if "bitexact" in sections:
        res["bitexact"] = check_bitexact(kernel, small, args, device)
        flags += [v for r in res["bitexact"] for k, v in r.items() if k.endswith("bitexact")]
        save()
    if "cold_prefill" in sections:
        res["cold_prefill"] = cold_prefill(big, big_rows, tokens, args, device, iops)
        save()
    if "warm_prefill" in sections:
        res["warm_prefill"] = warm_prefill(kernel, big, big_rows, tokens, args, device, args.workers)
        res["warm_prefill_one_copy_thread"] = warm_prefill(kernel, big, big_rows, tokens, args, device, 1)
        save()
    if args.only_warm:
        return 0
    if "hot_chunk" in sections:
        res["hot_chunk"] = hot_chunk(kernel, big, big_rows, tokens, args, device, args.fio, iops)
        flags.append(res["hot_chunk"]["bitexact"])
        save()
    checks_ok = True
    if "decode_draft" in sections:
        res["decode_draft"] = decode_draft(kernel, big, big_rows, tokens, args, device)
        flags += [r["bitexact"] for r in res["decode_draft"]]
        checks_ok = all(r["drafted_check"]["ok"] for r in res["decode_draft"])
        res["drafted_checks_ok"] = checks_ok
        save()
    if "decode_graphs" in sections and device == "cuda":
        res["decode_graphs"] = decode_graphs(big, big_rows, args)
        save()
    if "memory" in sections:
        res["memory"] = memory_check(big, big_rows, tokens, args, device)
        save()
    if "long_prompt" in sections:
        res["long_prompt"] = long_prompt(args.trace_stats, iops, args.thor_tok_s)
    goals = {}
    if "hot_chunk" in sections:
        goals["cold_chunk_exposed_le_10pct_of_compute"] = {
            f"share{c['hot_share_pct']}_window{c['window']}": c["goal_first_chunk_le_10pct"]
            for c in res["hot_chunk"]["configurations"]}
    if "decode_draft" in sections:
        goals["decode_exposed_le_3pct_at_256_rows"] = {
            config: r[config]["goal_le_3pct"] for r in res["decode_draft"] if r["rows"] == 256
            for config in DECODE_CONFIGS[1:]}
    if goals:
        res["goals"] = goals
    res["all_bitexact"] = all(flags) if flags else None
    save()
    print(f"all bit-exact: {res['all_bitexact']}; {res['seconds']} s", flush=True)
    return 0 if res["all_bitexact"] is not False and checks_ok else 1


if __name__ == "__main__":
    sys.exit(main())
