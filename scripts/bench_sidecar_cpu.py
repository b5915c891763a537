#!/usr/bin/env python3
"""CPU benchmark of the PLE sidecar readers, as ratios against baselines from the same run.

Each reader (``--io pread,mmap``: ``SidecarReader`` and ``MappedReader``) is measured on:

0. (``--io-uring``) fio's io_uring engine at the same queue depth vs its psync jobs: the most an
   io_uring-based reader could gain over threads issuing blocking reads.
1. cold: random rows (page cache dropped with POSIX_FADV_DONTNEED before every call) vs ``fio``
   4 KiB buffered randread on the same file at the same queue depth (one psync job per reader
   thread); ratio = reader 4 KiB pages/s ÷ fio IOPS (target ≥ 0.9).
2. warm: random rows from a page-cached region; ratio = rows/s ÷ 100K rows/s, the write-up's
   pooled 10 µs/row (target ≥ 5).
3. fixed RAM: the reader's working set (and measured RSS growth) for an 8,192-token chunk
   (131,072 rows) (target ≤ 64 MiB).

Writes JSON (with the exact command) to --out. fio is detected, or installed with apt-get when
``--install-fio`` is given. Usage::

    python scripts/bench_sidecar_cpu.py --dir /var/tmp/ple-bench --table-gib 8 --out benchmarks/sidecar/cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang_ssd_stream.sidecar import open_reader  # noqa: E402
from sglang_ssd_stream.sidecar.format import SidecarTable, filesystem_type  # noqa: E402
from sglang_ssd_stream.sidecar.mapped import drop_page_cache  # noqa: E402
from sglang_ssd_stream.sidecar.reader import PAGE_SIZE, rows_for_tokens  # noqa: E402

COLS = 160  # fp8 bytes per row, as in Qwen3.8 Flash-Next
POOLED_ROWS_PER_S = 100_000  # the write-up's PLE row fetch pool: 10 µs/row


def find_fio(install: bool) -> str:
    path = shutil.which("fio")
    if path:
        return path
    if not install:
        raise SystemExit("fio not found; install it (apt-get install -y fio) or pass --install-fio")
    subprocess.run(["apt-get", "install", "-y", "fio"], check=True, stdout=subprocess.DEVNULL)
    path = shutil.which("fio")
    if not path:
        raise SystemExit("apt-get install fio did not provide a fio binary")
    return path


def make_table(path: Path, rows: int) -> None:
    nbytes = rows * COLS
    if path.exists() and path.stat().st_size == nbytes:
        return
    rng = np.random.default_rng(0)
    chunk = 64 << 20
    with open(path, "wb") as f:
        left = nbytes
        while left:
            n = min(chunk, left)
            f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            left -= n
        f.flush()
        os.fsync(f.fileno())


def drop_cache(path: Path, reader=None) -> None:
    drop_page_cache(path, [reader] if reader is not None else [])


def run_fio(fio: str, path: Path, qd: int, seconds: float, engine: str = "psync") -> dict:
    """4 KiB buffered randread at queue depth ``qd``: ``psync`` as ``qd`` jobs (what threads issuing
    blocking reads can do), ``io_uring`` as one job with ``iodepth=qd`` (what an io_uring reader
    could do at best)."""
    drop_cache(path)
    depth = [f"--numjobs={qd}"] if engine == "psync" else ["--numjobs=1", f"--iodepth={qd}"]
    cmd = [fio, "--name=ple-randread", f"--filename={path}", "--rw=randread", "--bs=4k", "--direct=0",
           f"--ioengine={engine}", *depth, "--group_reporting", "--invalidate=1", "--fadvise_hint=1",
           "--norandommap", "--time_based", f"--runtime={seconds}", "--output-format=json"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(r.stdout)["jobs"][0]["read"]
    return {"command": shlex.join(cmd), "iops": job["iops"], "bw_bytes": job["bw_bytes"],
            "version": subprocess.run([fio, "--version"], capture_output=True, text=True).stdout.strip()}


def table_of(path: Path, rows: int) -> SidecarTable:
    return SidecarTable(0, path.name, path, "0" * 64, "float8_e4m3fn", rows, COLS, 0, rows * COLS)


def pages_touched(ids: np.ndarray) -> int:
    """Distinct 4 KiB pages the rows ``ids`` occupy (what either reader must bring in cold)."""
    start = ids.astype(np.int64) * COLS
    return int(np.unique(np.concatenate([start // PAGE_SIZE, (start + COLS - 1) // PAGE_SIZE])).size)


def bench_cold(io: str, path: Path, rows: int, qd: int, per_call: int, calls: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    with open_reader(table_of(path, rows), io, max_rows=per_call, workers=qd) as reader:
        out = np.empty((per_call, COLS), np.uint8)
        secs, pages = 0.0, 0
        for _ in range(calls):
            ids = rng.integers(0, rows, per_call)
            drop_cache(path, reader)
            t = time.perf_counter()
            reader.read_rows(ids, out)
            secs += time.perf_counter() - t
            pages += pages_touched(ids)
    return {"rows": per_call * calls, "pages": pages, "seconds": secs, "rows_per_s": per_call * calls / secs,
            "pages_per_s": pages / secs}


def bench_warm(io: str, path: Path, rows: int, qd: int, per_call: int, calls: int, warm_rows: int, seed: int) -> dict:
    warm_rows = min(rows, warm_rows)
    with open(path, "rb") as f:  # bring the region into the page cache
        left = warm_rows * COLS
        while left > 0:
            left -= len(f.read(min(left, 64 << 20)) or b"x" * left)
    rng = np.random.default_rng(seed)
    with open_reader(table_of(path, rows), io, max_rows=per_call, workers=qd) as reader:
        out = np.empty((per_call, COLS), np.uint8)
        reader.read_rows(rng.integers(0, warm_rows, per_call), out)  # warm-up
        t = time.perf_counter()
        for _ in range(calls):
            reader.read_rows(rng.integers(0, warm_rows, per_call), out)
        secs = time.perf_counter() - t
    return {"rows": per_call * calls, "seconds": secs, "rows_per_s": per_call * calls / secs,
            "region_bytes": warm_rows * COLS}


def bench_memory(io: str, path: Path, rows: int, qd: int, tokens: int) -> dict:
    n = rows_for_tokens(tokens)
    ids = np.random.default_rng(1).integers(0, rows, n)
    out = np.empty((n, COLS), np.uint8)  # the caller's (pinned) staging, not the reader's
    out.fill(0)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open_reader(table_of(path, rows), io, max_rows=n, workers=qd) as reader:
        reader.read_rows(ids, out)
        reader.read_rows(ids, out)
        ws = reader.working_set_bytes
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
    return {"tokens": tokens, "rows": n, "working_set_bytes": ws, "max_rss_growth_bytes": grew,
            "staging_bytes_outside_reader": out.nbytes,
            "note": "mmap: mapped page-cache pages count in RSS but are reclaimable, not the reader's memory"
            if io == "mmap" else ""}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="directory for the test table (the disk under test)")
    ap.add_argument("--table-gib", type=float, default=8.0)
    ap.add_argument("--qd", type=int, default=16, help="reader threads = fio jobs (queue depth)")
    ap.add_argument("--rows-per-call", type=int, default=32768, help="rows per lookup (2,048 tokens × 16)")
    ap.add_argument("--cold-calls", type=int, default=4)
    ap.add_argument("--warm-calls", type=int, default=20)
    ap.add_argument("--warm-gib", type=float, default=1.0, help="page-cached region for the warm run")
    ap.add_argument("--chunk-tokens", type=int, default=8192)
    ap.add_argument("--fio-seconds", type=float, default=10.0)
    ap.add_argument("--install-fio", action="store_true", help="apt-get install fio when it is missing")
    ap.add_argument("--keep", action="store_true", help="keep the test table")
    ap.add_argument("--io-uring", action="store_true", help="also run fio's io_uring engine at the same queue depth")
    ap.add_argument("--io", default="pread,mmap", type=lambda v: v.split(","), help="readers (comma list)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    fio = find_fio(args.install_fio)
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / "ple-bench-table.bin"
    rows = int(args.table_gib * (1 << 30)) // COLS
    make_table(path, rows)
    try:
        fio_res = run_fio(fio, path, args.qd, args.fio_seconds)
        fio_uring = run_fio(fio, path, args.qd, args.fio_seconds, engine="io_uring") if args.io_uring else None
        readers = {}
        for io in args.io:
            readers[io] = {
                "cold": bench_cold(io, path, rows, args.qd, args.rows_per_call, args.cold_calls, seed=2),
                "warm": bench_warm(io, path, rows, args.qd, args.rows_per_call, args.warm_calls,
                                   int(args.warm_gib * (1 << 30)) // COLS, seed=3),
                "memory": bench_memory(io, path, rows, args.qd, args.chunk_tokens),
            }
    finally:
        if not args.keep:
            path.unlink(missing_ok=True)
    result = {
        "command": shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
                    "filesystem": filesystem_type(d),
                    "mem_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")},
        "table": {"rows": rows, "row_bytes": COLS, "bytes": rows * COLS},
        "queue_depth": args.qd,
        "fio": fio_res,
        "fio_io_uring": fio_uring,
        # io_uring's best at the same queue depth over blocking reads: what an io_uring reader could win
        "io_uring_iops_vs_psync_iops": fio_uring["iops"] / fio_res["iops"] if fio_uring else None,
        "readers": readers,
        "ratios": {io: {
            "cold_pages_per_s_vs_fio_iops": r["cold"]["pages_per_s"] / fio_res["iops"],
            "warm_rows_per_s_vs_pooled_10us_per_row": r["warm"]["rows_per_s"] / POOLED_ROWS_PER_S,
            "working_set_vs_64MiB": r["memory"]["working_set_bytes"] / (64 << 20),
        } for io, r in readers.items()},
        "targets": {"cold_pages_per_s_vs_fio_iops": ">= 0.9", "warm_rows_per_s_vs_pooled_10us_per_row": ">= 5",
                    "working_set_vs_64MiB": "<= 1"},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ratios"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
