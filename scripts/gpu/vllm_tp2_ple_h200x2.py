#!/usr/bin/env python3
"""Issue 7 on two GPUs: streamed PLE rows per TP rank + NCCL all-reduce == TP=1, and its speed.

Self-contained for a machine with torch + triton and NO vLLM (device kind ``nvidia-h200-x2``):
each rank's row range comes from vLLM's own arithmetic (``pad_vocab_size`` and
``VocabParallelEmbedding._get_indices``, pulled out of a copy of
``model_executor/layers/vocab_parallel_embedding.py`` with ``ast``; vLLM pads the PLE table to
``make_ngram_vocab_size_divisible_by``). Rows are delivered by our ``SidecarGather`` with raw output
(as ``StreamedPLEEmbedding`` builds it, over ``open_reader``: the mapped file or the ``pread`` reader),
zero for the other rank's rows, and combined the way vLLM's
``_reduce_etp_embeddings`` does for FP8: an ``int8`` view all-reduced over NCCL.

Checks (exit 1 if one fails), for random ids, ids at the shard boundary, and duplicates:
- eager: the assembled rows on both ranks equal a TP=1 read, bit for bit;
- CUDA-graph replay: a graph holding the NCCL all-reduce and a consumer is replayed after our
  lookup ran eagerly into its input buffer (as vLLM's breakable graphs run it); same result.
- ``--with-sglang``: SGLang's side (``--src`` also holds ``sglang_vocab_parallel_embedding.py``;
  passed on the H200x2, ``benchmarks/vllm_ple/README.md``). Each rank prints every step and keeps
  ``sglang-tp2/sglang-rank{r}.partial.json`` beside ``--out`` up to date; ``--watchdog-s`` makes the
  ranks dump their stacks. What it checks: ranges from sglang's
  arithmetic, rows through our ``SidecarGather`` (BF16), a BF16 NCCL all-reduce, on a table without
  NaN and -0.0 bytes; eager, and a CUDA graph capturing the read as a native host node plus the all-reduce,
  replayed with new ids.
Measures (same run): delivery time of a 2,048-token chunk (32,768 rows), TP=2 (both ranks
gather half the rows, then the all-reduce) vs TP=1, page cache warm and cold; ratio TP2/TP1.

NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, see the device README). Usage::

    python scripts/gpu/vllm_tp2_ple_h200x2.py --src .gpu/vllm-src --out "$OUT/vllm_tp2_ple.json"

CPU smoke test (gloo, no graphs): ``... --device cpu --quick``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sglang_ssd_stream.sidecar import open_reader  # noqa: E402
from sglang_ssd_stream.sidecar.format import load_manifest  # noqa: E402
from sglang_ssd_stream.sidecar.mapped import drop_page_cache  # noqa: E402
from sglang_ssd_stream.sidecar.reader import SidecarReader  # noqa: E402
from sglang_ssd_stream.staging.gather import SidecarGather  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import sync, write_sidecar  # noqa: E402

BACKENDS = ("mmap", "pread")

ROW_BYTES = 160
TOKENS = 2048
HEADS = 16
DIVISOR = 128  # make_ngram_vocab_size_divisible_by of the Qwen3.8 config family
FUNCS = ("pad_vocab_size", "vocab_range_from_per_partition_vocab_size", "vocab_range_from_global_vocab_size")


def load_vllm_ranges(src: Path):
    """vLLM's vocab-range arithmetic, extracted with ast (``divide`` is vLLM's exact-division helper)."""
    text = src.read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    parts = ["from dataclasses import dataclass\nfrom typing import Sequence\nDEFAULT_VOCAB_PADDING_SIZE = 64\n",
             "def divide(numerator, denominator):\n    assert numerator % denominator == 0, (numerator, denominator)\n"
             "    return numerator // denominator\n"]
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in FUNCS:
            parts.append("\n".join(lines[node.lineno - 1:node.end_lineno]))
        if isinstance(node, ast.ClassDef) and node.name == "VocabParallelEmbeddingShardIndices":
            start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            parts.append("\n".join(lines[start:node.end_lineno]))
        if isinstance(node, ast.ClassDef) and node.name == "VocabParallelEmbedding":
            m = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "_get_indices")
            start = min(d.lineno for d in m.decorator_list) - 1
            parts.append("class VocabParallelEmbedding:\n" + "\n".join(lines[start:m.end_lineno]))
    ns: dict = {}
    exec(compile("\n\n".join(parts), str(src), "exec"), ns)  # noqa: S102 - our own copy of vLLM's source
    return ns


def rank_range(ns, rows: int, rank: int, world: int) -> tuple[int, int]:
    padded = ns["pad_vocab_size"](rows, DIVISOR)
    idx = ns["VocabParallelEmbedding"]._get_indices(padded, padded, rows, rows, rank, world)
    return idx.org_vocab_start_index, idx.org_vocab_end_index


def cases(rows: int, bounds, n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    edges = np.array(sorted({x for lo, hi in bounds for x in (lo - 1, lo, hi - 1, hi) if 0 <= x < rows}
                            | {0, rows - 1}), dtype=np.int64)
    boundary = rng.permutation(np.resize(edges, n))
    dup = rng.choice(rng.integers(0, rows, 64), n)
    return {"random": rng.integers(0, rows, n), "boundaries": boundary, "duplicates": dup}


def drop_cache(path, g) -> None:
    drop_page_cache(path, [g.reader])


def deliver(g: SidecarGather, ids: torch.Tensor, out: torch.Tensor, reduce: bool) -> None:
    """One TP rank's lookup as vLLM's streamed backend does it: rows, then the FP8 int8 all-reduce."""
    g.prefetch(ids, out, None)
    g.join(None)
    if reduce:
        dist.all_reduce(out.view(torch.int8))


def rank_main(rank: int, world: int, args) -> None:
    device = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{args.port}")
    ns = load_vllm_ranges(Path(args.src) / "vocab_parallel_embedding.py")
    table = load_manifest(args.manifest).table(3)
    bounds = [rank_range(ns, table.rows, r, world) for r in range(world)]
    lo, hi = bounds[rank]
    n = 512 if args.quick else TOKENS * HEADS
    result = {"rank": rank, "range": [lo, hi], "checks": {}, "timing": []}
    with SidecarReader(table, max_rows=n, workers=4) as full:
        truth = {}
        for name, ids in cases(table.rows, bounds, n).items():
            want = np.empty((n, ROW_BYTES), np.uint8)
            full.read_rows(ids, want)
            truth[name] = (torch.from_numpy(ids).to(device), torch.from_numpy(want).to(device))
    for kind in BACKENDS:
        reader = open_reader(table, kind, vocab_start=lo, vocab_end=hi, total_rows=table.rows, workers=args.workers,
                             rows_per_task=args.rows_per_task, max_rows=min(n, args.workers * args.rows_per_task))
        g = SidecarGather(reader, columns=table.columns, is_fp8=True, capacity_rows=n, device=device, mode="h2d",
                          output="raw")
        out = torch.empty((n, ROW_BYTES), dtype=torch.uint8, device=device)
        for name, (ids, want) in truth.items():
            out.fill_(0xAB)
            deliver(g, ids, out, reduce=True)
            sync(device)
            result["checks"][f"{kind}_{name}_eager"] = bool(torch.equal(out, want))
        if device.type == "cuda":
            result["checks"][f"{kind}_graph"] = graph_check(g, truth, n, device)
            result["timing"] += timing(g, table, truth["random"][0], n, device, args, rank, world, kind)
        g.close()
    Path(args.out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def graph_check(g, truth, n, device) -> bool:
    buf = torch.zeros((n, ROW_BYTES), dtype=torch.uint8, device=device)
    consumed = torch.zeros_like(buf)
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        dist.all_reduce(buf.view(torch.int8))  # warm NCCL's communicator on this stream before capture
        with torch.cuda.graph(graph, stream=s):
            dist.all_reduce(buf.view(torch.int8))
            consumed.copy_(buf ^ 0)
    torch.cuda.current_stream(device).wait_stream(s)
    ok = True
    for ids, want in truth.values():
        g.prefetch(ids, buf, None)
        g.join(None)  # eager, into the graph's fixed input buffer
        graph.replay()
        torch.cuda.synchronize(device)
        ok &= torch.equal(consumed, want)
    return ok


def timing(g, table, ids, n, device, args, rank, world, kind) -> list[dict]:
    out = torch.empty((n, ROW_BYTES), dtype=torch.uint8, device=device)
    rows = []
    for cache in ("warm", "cold"):
        times = []
        for _ in range(args.reps):
            if cache == "cold":
                drop_cache(table.file, g)
            dist.barrier()
            torch.cuda.synchronize(device)
            t = time.perf_counter()
            deliver(g, ids, out, reduce=world > 1)
            torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t) * 1e3)
        rows.append({"source": kind, "cache": cache, "world": world, "rank": rank, "ids": n,
                     "median_ms": statistics.median(times), "min_ms": min(times)})
    return rows


def sglang_rank_main(rank: int, world: int, args) -> None:
    """SGLang's side: ranges from sglang's own arithmetic, rows through our ``SidecarGather`` (BF16
    out, other ranks' rows zero), then a BF16 NCCL all-reduce; eager, and as a CUDA graph that
    captures the read as a host node plus the all-reduce (how a TP decode step would replay)."""
    from sglang_ssd_stream.sidecar import open_reader
    from sglang_ssd_stream.staging.gather import SidecarGather

    if args.watchdog_s:
        import faulthandler

        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{args.port}")
    src = Path(args.src) / "sglang_vocab_parallel_embedding.py"
    if "\nDEFAULT_VOCAB_PADDING_SIZE = 64\n" not in src.read_text():
        raise SystemExit(f"{src}: sglang's PLE padding is not 64 any more; update this script")
    ns = load_vllm_ranges(src)  # same function names as vLLM's; the prelude defines the padding, 64
    table = load_manifest(args.finite_manifest).table(3)
    padded = ns["pad_vocab_size"](table.rows, ns["DEFAULT_VOCAB_PADDING_SIZE"])
    bounds = [(i.org_vocab_start_index, i.org_vocab_end_index) for i in
              (ns["VocabParallelEmbedding"]._get_indices(padded, padded, table.rows, table.rows, r, world)
               for r in range(world))]
    lo, hi = bounds[rank]
    n = 512 if args.quick else TOKENS * HEADS
    raw = np.fromfile(table.file, dtype=np.uint8).reshape(table.rows, ROW_BYTES)
    result = {"rank": rank, "range": [lo, hi], "checks": {}}
    partial = Path(args.out_dir, f"sglang-rank{rank}.partial.json")

    def step(what: str) -> None:  # progress that survives a hang: the log line and the partial file
        print(f"[sglang rank {rank}] {what}", flush=True)
        partial.write_text(json.dumps({**result, "last_step": what}))

    for mode in ("h2d", "uva"):
        step(f"{mode}: open")
        g = SidecarGather(open_reader(table, "mmap", vocab_start=lo, vocab_end=hi, max_rows=n, workers=16),
                          columns=ROW_BYTES, is_fp8=True, capacity_rows=n, device=device, mode=mode, graph_rows=n)
        truth = {}
        for name, ids in cases(table.rows, bounds, n).items():
            want = torch.from_numpy(raw[ids]).to(device).view(torch.float8_e4m3fn).to(torch.bfloat16)
            truth[name] = (torch.from_numpy(ids).to(device), want)
        out = torch.empty((n, ROW_BYTES), dtype=torch.bfloat16, device=device)
        for name, (ids, want) in truth.items():
            step(f"{mode}: eager {name}")
            out.fill_(7.0)
            g.begin(ids, out, torch.cuda.current_stream(device))
            g.wait()
            if world > 1:
                dist.all_reduce(out)
            torch.cuda.synchronize(device)
            result["checks"][f"sglang_{mode}_{name}_eager"] = bool(torch.equal(out.view(torch.int16),
                                                                               want.view(torch.int16)))
        inp = torch.zeros(n, dtype=torch.int64, device=device)
        buf = torch.zeros((n, ROW_BYTES), dtype=torch.bfloat16, device=device)
        consumed = torch.zeros_like(buf)
        st = torch.cuda.Stream(device)
        st.wait_stream(torch.cuda.current_stream(device))
        graph = torch.cuda.CUDAGraph()
        step(f"{mode}: capture")
        with torch.cuda.stream(st):
            if world > 1:
                dist.all_reduce(buf)  # warm NCCL on this stream before capture
            with torch.cuda.graph(graph, stream=st):
                g.capture(inp + 0, buf, st)  # ids produced inside the graph
                if world > 1:
                    dist.all_reduce(buf)
                consumed.copy_(buf)
        torch.cuda.current_stream(device).wait_stream(st)
        ok = True
        for name, (ids, want) in truth.items():
            step(f"{mode}: replay {name}")
            inp.copy_(ids)
            graph.replay()
            torch.cuda.synchronize(device)
            ok &= torch.equal(consumed.view(torch.int16), want.view(torch.int16))
        result["checks"][f"sglang_{mode}_graph_host_node"] = ok
        del graph  # a live graph holding NCCL work kept destroy_process_group() waiting (2026-11-29, H200x2)
        torch.cuda.synchronize(device)
        g.close()
    step("done")
    Path(args.out_dir, f"sglang-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    step("destroy_process_group")
    dist.destroy_process_group()
    step("exit")


def spawn_sglang(world: int, args) -> list[dict]:
    import torch.multiprocessing as mp

    args.port = free_port()
    args.out_dir = str(Path(args.out).parent / f"sglang-tp{world}")  # beside the report: partial files survive a hang
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    mp.start_processes(sglang_rank_main, args=(world, args), nprocs=world, start_method="spawn")
    return [json.loads(Path(args.out_dir, f"sglang-rank{r}.json").read_text()) for r in range(world)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, args) -> list[dict]:
    import torch.multiprocessing as mp

    args.port = free_port()
    args.out_dir = tempfile.mkdtemp(prefix=f"tp{world}-")
    mp.start_processes(rank_main, args=(world, args), nprocs=world, start_method="spawn")
    return [json.loads(Path(args.out_dir, f"rank{r}.json").read_text()) for r in range(world)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True, help="directory with a copy of vocab_parallel_embedding.py")
    ap.add_argument("--dir", default="/var/tmp/vllm-tp2-ple")
    ap.add_argument("--table-gib", type=float, default=4.0)
    ap.add_argument("--workers", type=int, default=24)
    ap.add_argument("--rows-per-task", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--with-sglang", action="store_true",
                    help="also the SGLang-side (SidecarGather) TP check")
    ap.add_argument("--watchdog-s", type=float, default=0, help="SGLang ranks dump their stacks and exit after this")
    ap.add_argument("--sglang-table-gib", type=float, default=1.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off, as the device README asks
    t0 = time.time()
    rows = 20_000 if args.quick else int(args.table_gib * (1 << 30)) // ROW_BYTES // DIVISOR * DIVISOR
    args.manifest = str(write_sidecar(Path(args.dir), rows, ROW_BYTES))
    tp2 = spawn(2, args)
    tp1 = spawn(1, args)
    checks = {f"rank{r['rank']}_{k}": v for r in tp2 for k, v in r["checks"].items()}
    checks.update({f"tp1_{k}": v for k, v in tp1[0]["checks"].items()})
    checks["ranges_tile_the_table"] = tp2[0]["range"][0] == 0 and tp2[0]["range"][1] == tp2[1]["range"][0] \
        and tp2[1]["range"][1] == rows
    report = {"torch": torch.__version__, "rows": rows, "ranges": [r["range"] for r in tp2], "checks": checks,
              "timing": [t for r in tp2 + tp1 for t in r["timing"]]}
    ratios = {}
    for t1 in tp1[0]["timing"]:
        slowest = max(t["median_ms"] for r in tp2 for t in r["timing"]
                      if (t["source"], t["cache"]) == (t1["source"], t1["cache"]))
        ratios[f"{t1['source']}_{t1['cache']}"] = {"tp1_ms": t1["median_ms"], "tp2_ms": slowest,
                                                    "tp2_over_tp1": slowest / t1["median_ms"]}
    report["tp2_vs_tp1"] = ratios
    if args.device == "cuda" and args.with_sglang:
        rows_f = 8_000 if args.quick else int(args.sglang_table_gib * (1 << 30)) // ROW_BYTES // 64 * 64
        args.finite_manifest = str(write_sidecar(Path(args.dir) / "sglang", rows_f, ROW_BYTES, seed=6, finite=True))
        sg2 = spawn_sglang(2, args)
        report["sglang_ranges"] = [r["range"] for r in sg2]
        checks.update({f"sglang_rank{r['rank']}_{k}": v for r in sg2 for k, v in r["checks"].items()})
        checks["sglang_ranges_tile_the_table"] = sg2[0]["range"][0] == 0 and \
            sg2[0]["range"][1] == sg2[1]["range"][0] and sg2[1]["range"][1] == rows_f
    report["ok"] = all(checks.values())
    report["seconds"] = time.time() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({"checks": checks, "tp2_vs_tp1": ratios, "ok": report["ok"]}))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
