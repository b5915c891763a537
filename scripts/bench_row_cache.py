#!/usr/bin/env python3
"""Disk reads of the PLE row cache vs the page cache vs Belady's optimum, at equal memory, on a real id stream.

The stream is ``scripts/ple_trace.py``'s (real code, a real BPE, the real n-gram hash into the real
320,001,536-row id space). It is replayed as chunked prefill: each request in order, 2,048 tokens
(32,768 row lookups) per lookup call. Subcommands:

``sim``
    (a) the row cache: the real C cache (``sidecar/row_cache.c``) in simulation mode (every decision
    and counter, no I/O; ``tests/sidecar/test_row_cache.py`` proves its counters equal a real
    cache's), at a capacity that fits the budget with its metadata and buffers, for each policy;
    (c) Belady's optimum on the same chunks (``scripts/belady.c``), with the same rows and with the
    budget's worth of bare 160 B rows, demand (MIN) and with bypass. Reads are counted as rows and as
    the 4 KiB pages of the real layout those rows occupy.
``pagecache``
    (b) the mmap reader (``MappedReader``, ``MADV_RANDOM``) over a table of the real geometry (a
    51.2 GB sparse file: no disk space, no disk reads, but the same page-cache pages, charges and
    faults) in a memory cgroup (v1 ``memory.limit_in_bytes``) whose limit is the process's own memory
    (the stream copied into anonymous memory) + the budget + an allowance for the kernel memory the
    mapping costs (page tables); disk reads = major faults (one per 4 KiB page with ``MADV_RANDOM``).
``validate``
    The two stand-ins against real runs: the sparse file's fault counts against a file of real data
    under the same cgroup limit and id stream, and the simulated cache's counters against a real
    ``RowCache`` reading the same stream with ``O_DIRECT`` from a real table (every row checked).

Writes JSON with the exact command. Usage::

    nice -n 10 $PY scripts/bench_row_cache.py sim --trace /var/tmp/ple-trace --out benchmarks/row_cache/sim.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang_ssd_stream.sidecar.native import build_library  # noqa: E402
from sglang_ssd_stream.sidecar.row_cache import (  # noqa: E402
    DEFAULT_POLICY,
    CacheSimulator,
    capacity_for_budget,
    metadata_bytes,
)

ROW_BYTES = 160
ROWS = 320_001_536
PAGE = 4096
CHUNK_TOKENS = 2048
GIB = 1 << 30
BUDGETS_GIB = (0.5, 1, 2, 4)
INF = np.iinfo(np.int32).max


def load_trace(d: Path, max_tokens: int = 0):
    ids = np.load(d / "ids.npy", mmap_mode="r")
    starts = np.load(d / "starts.npy")
    if max_tokens:
        keep = starts[starts <= max_tokens]
        starts = np.append(keep, max_tokens) if keep[-1] < max_tokens else keep
    return ids, starts


def chunks(starts: np.ndarray, chunk: int = CHUNK_TOKENS):
    """(first token, end token) of every prefill chunk: each request in order, ``chunk`` tokens at a time."""
    for a, b in zip(starts[:-1], starts[1:], strict=False):
        for c in range(int(a), int(b), chunk):
            yield c, min(c + chunk, int(b))


def pages_of(ids: np.ndarray) -> int:
    start = ids.astype(np.int64) * ROW_BYTES
    return int(np.unique(np.concatenate([start // PAGE, (start + ROW_BYTES - 1) // PAGE])).size)


def run_cache(ids, starts, capacity: int, policy: str, s3=None) -> dict:
    kw = {} if s3 is None else {"_s3": s3}
    sim = CacheSimulator(capacity, total_rows=ROWS, row_bytes=ROW_BYTES, policy=policy, **kw)
    t = time.perf_counter()
    for a, b in chunks(starts):
        sim.access(np.asarray(ids[a:b]).reshape(-1))
    st = sim.stats
    sim.close()
    st["seconds"] = round(time.perf_counter() - t, 1)
    return st


def dedup_sequence(ids, starts):
    """The rows each chunk reads, once per chunk, chunk after chunk; and chunk boundaries."""
    parts, bounds = [], [0]
    for a, b in chunks(starts):
        u = np.unique(np.asarray(ids[a:b]).reshape(-1))
        parts.append(u)
        bounds.append(bounds[-1] + u.size)
    return np.concatenate(parts), np.array(bounds, dtype=np.int64)


def next_use(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    nxt = np.full(x.size, INF, dtype=np.int32)
    same = x[order[:-1]] == x[order[1:]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def belady_lib():
    path = build_library(Path(__file__).with_name("belady.c"), "libssd_belady.so")
    lib = ctypes.CDLL(str(path))
    lib.belady.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                           ctypes.c_int, ctypes.c_void_p]
    lib.belady.restype = ctypes.c_int64
    return lib


def run_belady(lib, seq, x, nxt, bounds, distinct: int, capacity: int, bypass: bool) -> dict:
    miss = np.zeros(x.size, np.uint8)
    t = time.perf_counter()
    n = lib.belady(x.ctypes.data, nxt.ctypes.data, x.size, distinct, capacity, int(bypass), miss.ctypes.data)
    if n < 0:
        raise MemoryError("belady: out of memory")
    pages = 0
    for a, b in zip(bounds[:-1], bounds[1:], strict=False):
        m = seq[a:b][miss[a:b].astype(bool)]
        if m.size:
            pages += pages_of(m)
    return {"rows_read": int(n), "pages_read": pages, "seconds": round(time.perf_counter() - t, 1)}


def per_k_tokens(value: int, tokens: int) -> float:
    return round(value * 1000 / tokens, 2)


def cmd_sim(args) -> dict:
    ids, starts = load_trace(args.trace, args.max_tokens)
    tokens = int(starts[-1])
    policies = args.policies.split(",")
    result = {"tokens": tokens, "lookups": tokens * 16, "chunk_tokens": CHUNK_TOKENS, "budgets": []}
    seq, bounds = dedup_sequence(ids, starts)
    uniq, x = np.unique(seq, return_inverse=True)
    x = x.astype(np.int32)
    nxt = next_use(x)
    lib = belady_lib()
    result["distinct_rows"] = int(uniq.size)
    result["compulsory_rows_read"] = int(uniq.size)
    result["compulsory_pages_read"] = pages_of(uniq)  # every row once, each page once (an unbounded cache)
    result["lookups_once_per_chunk"] = int(seq.size)
    variants = [tuple(float(v) if i in (0, 3) else int(v) for i, v in enumerate(s.split(":")))
                for s in args.s3_variants.split(",")] if args.s3_variants else []
    for gib in args.budgets:
        budget = int(gib * GIB)
        row = {"budget_gib": gib, "budget_bytes": budget, "caches": {}, "belady": {}}
        for policy in policies:
            cap = capacity_for_budget(budget, ROW_BYTES, policy=policy, max_rows=CHUNK_TOKENS * 16)
            st = run_cache(ids, starts, cap, policy)
            st.update(capacity_rows=cap, metadata_bytes=metadata_bytes(cap, policy))
            row["caches"][policy] = st
            print(f"{gib} GiB {policy}: {cap} rows, read {st['rows_read']} rows / {st['pages_read']} pages "
                  f"({st['seconds']} s)", flush=True)
        for v in variants:
            cap = capacity_for_budget(budget, ROW_BYTES, policy="s3fifo", max_rows=CHUNK_TOKENS * 16, s3=v)
            st = run_cache(ids, starts, cap, "s3fifo", v)
            st.update(capacity_rows=cap)
            name = f"s3fifo(small={v[0]},threshold={v[1]},keep_freq={v[2]},ghost={v[3]})"
            row["caches"][name] = st
            print(f"{gib} GiB {name}: read {st['rows_read']} rows", flush=True)
        same = capacity_for_budget(budget, ROW_BYTES, policy=DEFAULT_POLICY, max_rows=CHUNK_TOKENS * 16)
        bare = budget // ROW_BYTES
        for label, cap in (("same_rows", same), ("bare_rows", bare)):
            for bypass in (False, True):
                st = run_belady(lib, seq, x, nxt, bounds, uniq.size, cap, bypass)
                st["capacity_rows"] = cap
                row["belady"][f"{label}_{'bypass' if bypass else 'demand'}"] = st
                print(f"{gib} GiB belady {label} {'bypass' if bypass else 'demand'}: read {st['rows_read']} rows",
                      flush=True)
        for d in (row["caches"], row["belady"]):
            for st in d.values():
                st["rows_read_per_1k_tokens"] = per_k_tokens(st["rows_read"], tokens)
                st["pages_read_per_1k_tokens"] = per_k_tokens(st["pages_read"], tokens)
        result["budgets"].append(row)
    return result


# ----------------------------------------------------------------------------- page cache under a cgroup

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")


def own_memory_cgroup() -> Path:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrl, path = line.split(":", 2)
        if "memory" in ctrl.split(","):
            return CGROUP_ROOT / path.lstrip("/")
    raise SystemExit("no cgroup v1 memory controller for this process (this script drives memory.limit_in_bytes)")


def sparse_table(path: Path, rows: int) -> None:
    """A file of ``rows`` x 160 B with no data blocks: reads fault zero pages in, charged like any page."""
    with open(path, "wb") as f:
        f.truncate(rows * ROW_BYTES)


def pagecache_child(args) -> dict:
    """Runs inside the cgroup: the mmap reader over the chunks; counters from rusage and the cgroup."""
    from sglang_ssd_stream.sidecar.format import SidecarTable
    from sglang_ssd_stream.sidecar.mapped import MappedReader, drop_page_cache

    cg = Path(args.cgroup)
    ids, starts = load_trace(args.trace, args.max_tokens)
    ids = np.array(ids[:starts[-1]])  # a copy in anon memory (the baseline), not the trace file's page cache
    _drop_file(args.trace / "ids.npy")  # its page cache is reclaimable: it would hand the table free room
    if args.fold:
        ids = (ids.astype(np.int64) % args.fold_rows).astype(np.uint32)
    rows = args.fold_rows if args.fold else ROWS
    path = Path(args.table)
    table = SidecarTable(0, path.name, path, "0" * 64, "float8_e4m3fn", rows, ROW_BYTES, 0, rows * ROW_BYTES)
    out = np.empty((CHUNK_TOKENS * 16, ROW_BYTES), np.uint8)
    out.fill(0)
    with MappedReader(table, max_rows=CHUNK_TOKENS * 16, workers=args.workers) as reader:
        drop_page_cache(path, [reader])
        ids_bytes = ids.nbytes
        base = int((cg / "memory.usage_in_bytes").read_text())
        # The page cache is held to the budget; the kernel memory the mapping costs (charged to the cgroup
        # too) gets its own allowance: the page tables (one 4 KiB page per 2 MiB mapped, one per 1 GiB above)
        # + 32 MiB for the page cache's own index (xarray nodes) and the rest. Measured: kernel_memory_*.
        mapped = rows * ROW_BYTES
        tables = (-(-mapped // (2 << 20)) + -(-mapped // (1 << 30)) + 1) * 4096 + (32 << 20)
        limit = base + int(args.budget_bytes) + tables
        (cg / "memory.limit_in_bytes").write_text(str(limit))
        for name in ("memory.max_usage_in_bytes", "memory.kmem.max_usage_in_bytes"):
            (cg / name).write_text("0")
        kmem0 = int((cg / "memory.kmem.usage_in_bytes").read_text())
        io0 = _proc_io()
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t = time.perf_counter()
        for a, b in chunks(starts):
            flat = ids[a:b].reshape(-1)
            reader.read_rows(flat, out[:flat.size])
        secs = time.perf_counter() - t
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        io1 = _proc_io()
        st = _memstat(cg)
        peak = int((cg / "memory.max_usage_in_bytes").read_text())
        kmem = int((cg / "memory.kmem.max_usage_in_bytes").read_text()) - kmem0
    return {"major_faults": ru1.ru_majflt - ru0.ru_majflt, "minor_faults": ru1.ru_minflt - ru0.ru_minflt,
            "read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0), "seconds": round(secs, 1),
            "baseline_bytes": base, "trace_in_anon_memory_bytes": ids_bytes, "limit_bytes": limit,
            "kernel_memory_allowance_bytes": tables, "kernel_memory_growth_peak_bytes": kmem, "peak_usage_bytes": peak,
            "peak_over_baseline_bytes": peak - base, "cgroup_stat_end": st}


def _drop_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _proc_io() -> dict:
    try:
        return {k: int(v) for k, v in (ln.split(": ") for ln in Path("/proc/self/io").read_text().splitlines())}
    except OSError:
        return {}


def _memstat(cg: Path) -> dict:
    keep = ("cache", "rss", "mapped_file", "pgmajfault", "total_cache", "total_rss", "active_file", "inactive_file",
            "hierarchical_memory_limit")
    out = {}
    for ln in (cg / "memory.stat").read_text().splitlines():
        k, v = ln.split()
        if k in keep:
            out[k] = int(v)
    return out


def run_in_cgroup(args, budget_bytes: int, table: Path, extra: list[str]) -> dict:
    parent = own_memory_cgroup()
    cg = parent / f"ple-bench-{os.getpid()}"
    cg.mkdir()
    try:
        cmd = [sys.executable, __file__, "_pagecache_child", "--trace", str(args.trace), "--cgroup", str(cg),
               "--table", str(table), "--budget-bytes", str(budget_bytes), "--workers", str(args.workers),
               "--max-tokens", str(args.max_tokens), *extra]
        # the child joins the cgroup before it starts: every page it faults is charged there
        proc = subprocess.run(["sh", "-c", f'echo $$ > "{cg}/cgroup.procs" && exec "$@"', "sh", *cmd],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                (cg / "memory.force_empty").write_text("0") if (cg / "memory.force_empty").exists() else None
                time.sleep(0.1)


def cmd_pagecache(args) -> dict:
    table = args.dir / "ple-real-geometry-sparse.bin"
    args.dir.mkdir(parents=True, exist_ok=True)
    sparse_table(table, ROWS)
    ids, starts = load_trace(args.trace, args.max_tokens)
    tokens = int(starts[-1])
    result = {"tokens": tokens, "table": str(table), "table_bytes": ROWS * ROW_BYTES,
              "table_blocks_allocated": os.stat(table).st_blocks, "budgets": []}
    for gib in args.budgets:
        r = run_in_cgroup(args, int(gib * GIB), table, [])
        r["budget_gib"] = gib
        r["pages_read_per_1k_tokens"] = per_k_tokens(r["major_faults"], tokens)
        result["budgets"].append(r)
        print(f"{gib} GiB page cache: {r['major_faults']} major faults, peak {r['peak_over_baseline_bytes'] / GIB:.2f} "
              f"GiB over baseline ({r['seconds']} s)", flush=True)
    table.unlink()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("sim", "pagecache", "validate", "_pagecache_child"):
        p = sub.add_parser(name)
        p.add_argument("--trace", type=Path, required=True)
        p.add_argument("--max-tokens", type=int, default=0, help="replay only this prefix of the trace (0: all)")
        if name != "_pagecache_child":
            p.add_argument("--out", type=Path)
            p.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS_GIB))
        p.add_argument("--workers", type=int, default=16)
        if name == "sim":
            p.add_argument("--policies", default="s3fifo,clock,lru")
            p.add_argument("--s3-variants", default="",
                           help="small:threshold:keep_freq:ghost,... extra S3-FIFO settings (row_cache.S3_DEFAULTS)")
        if name in ("pagecache", "validate"):
            p.add_argument("--dir", type=Path, default=Path("/var/tmp/ple-bench"))
        if name == "validate":
            p.add_argument("--fold-rows", type=int, default=(1 << 31) // ROW_BYTES)
        if name == "_pagecache_child":
            p.add_argument("--cgroup", required=True)
            p.add_argument("--table", required=True)
            p.add_argument("--budget-bytes", type=int, required=True)
            p.add_argument("--fold", action="store_true")
            p.add_argument("--fold-rows", type=int, default=0)
    args = ap.parse_args(argv)
    if args.cmd == "_pagecache_child":
        print(json.dumps(pagecache_child(args)))
        return 0
    t = time.perf_counter()
    result = {"sim": cmd_sim, "pagecache": cmd_pagecache, "validate": cmd_validate}[args.cmd](args)
    result.update(command=shlex.join(["python", *sys.argv]), machine=platform.machine(), cpus=os.cpu_count(),
                  kernel=platform.release(), seconds=round(time.perf_counter() - t, 1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def write_random_table(path: Path, rows: int) -> None:
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        left = rows * ROW_BYTES
        while left:
            n = min(left, 64 << 20)
            f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            left -= n
        f.flush()
        os.fsync(f.fileno())


def self_describing(ids: np.ndarray) -> np.ndarray:
    """Row ``r``: ``r`` as 8 little-endian bytes, then bytes that depend on ``r``."""
    ids = np.asarray(ids, np.int64)
    out = ((ids[:, None] * 2654435761 + np.arange(ROW_BYTES)[None, :] * 40503) % 251).astype(np.uint8)
    out[:, :8] = ids.astype("<i8").view(np.uint8).reshape(-1, 8)
    return out


def cmd_validate(args) -> dict:
    """(1) page cache: sparse vs real-data file, same stream and limit; (2) simulated vs real row cache."""
    from sglang_ssd_stream.sidecar import SidecarReader
    from sglang_ssd_stream.sidecar.format import SidecarTable
    from sglang_ssd_stream.sidecar.row_cache import RowCache, RowCacheConfig

    args.dir.mkdir(parents=True, exist_ok=True)
    ids, starts = load_trace(args.trace, args.max_tokens)
    tokens = int(starts[-1])
    result = {"tokens": tokens, "fold_rows": args.fold_rows, "pagecache": {}, "row_cache": {}}
    budget = int(args.budgets[0] * GIB)
    # (1) the page cache over a file of real data and over a sparse one, ids folded into it (id mod rows)
    real, sparse = args.dir / "validate-real.bin", args.dir / "validate-sparse.bin"
    write_random_table(real, args.fold_rows)
    sparse_table(sparse, args.fold_rows)
    for name, path in (("real_data", real), ("sparse", sparse)):
        r = run_in_cgroup(args, budget, path, ["--fold", "--fold-rows", str(args.fold_rows)])
        result["pagecache"][name] = r
        print(f"page cache, {name} file: {r['major_faults']} major faults, read_bytes {r['read_bytes']}", flush=True)
    real.unlink()
    sparse.unlink()
    a, b = result["pagecache"]["real_data"]["major_faults"], result["pagecache"]["sparse"]["major_faults"]
    result["pagecache"]["sparse_over_real_faults"] = b / a if a else None
    # (2) the row cache: real O_DIRECT reads of a self-describing table (the stream's distinct rows,
    # renumbered densely: the cache's decisions depend only on which ids repeat), every row checked
    flat = np.asarray(ids[:tokens]).reshape(-1)
    uniq, dense = np.unique(flat, return_inverse=True)
    dense = dense.reshape(-1, 16).astype(np.int64)
    path = args.dir / "validate-rows.bin"
    with open(path, "wb") as f:
        for a0 in range(0, uniq.size, 1 << 20):
            f.write(self_describing(np.arange(a0, min(uniq.size, a0 + (1 << 20)))).tobytes())
        os.fsync(f.fileno())
    table = SidecarTable(0, path.name, path, "0" * 64, "float8_e4m3fn", uniq.size, ROW_BYTES, 0, uniq.size * ROW_BYTES)
    cap = capacity_for_budget(budget, ROW_BYTES, max_rows=CHUNK_TOKENS * 16)
    rows = np.zeros((cap, ROW_BYTES), np.uint8)
    io0 = _proc_io()
    t = time.perf_counter()
    wrong = 0
    cache = RowCache(SidecarReader(table, max_rows=CHUNK_TOKENS * 16), rows,
                     RowCacheConfig(workers=args.workers, seed=7))
    sim = CacheSimulator(cap, total_rows=uniq.size, row_bytes=ROW_BYTES, seed=7)
    out = np.empty((CHUNK_TOKENS * 16, ROW_BYTES), np.uint8)
    for a0, b0 in chunks(starts):
        q = dense[a0:b0].reshape(-1)
        cache.read_rows(q, out[:q.size])
        sim.access(q)
        wrong += int((out[:q.size, :8].view("<i8").reshape(-1) != q).sum())
    real_stats, sim_stats = cache.stats, sim.stats
    io1 = _proc_io()
    cache.close()
    path.unlink()
    result["row_cache"] = {"capacity_rows": cap, "direct": True, "real": real_stats, "simulated": sim_stats,
                           "rows_with_another_id": wrong, "seconds": round(time.perf_counter() - t, 1),
                           "process_read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0)}
    same = {k: real_stats[k] == sim_stats[k] for k in real_stats if k != "bytes_read"}
    result["row_cache"]["counters_equal"] = all(same.values())
    print(f"row cache: real {real_stats['rows_read']} rows read, simulated {sim_stats['rows_read']}, "
          f"equal counters {all(same.values())}, wrong rows {wrong}", flush=True)
    return result


if __name__ == "__main__":
    sys.exit(main())
