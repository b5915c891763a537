#!/usr/bin/env python3
"""What the hot file's spot-check (issue 38) costs at load: ``read_hot_file`` of one file with the sample of rows
read back from the table (``SPOT_HEAD`` + ``SPOT_SAMPLE`` rows per table) against the same load without it
(both 0: the table files are still opened and their identities checked), in one run, alternating, each load cold
(the hot file's and the table's pages dropped with ``POSIX_FADV_DONTNEED`` first: only this run's files, not the
box's page cache).

The file: ``--mib`` of 160-byte fp8 rows (ids + rows) of one table of ``--table-rows`` random rows, the rows read
back scattered over the whole table as a real hot set's are.

Usage::

    nice -n 10 $PY scripts/bench_hot_spot_check.py --dir /var/tmp --mib 256 --repeats 5 --samples 0 64 256 1024
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang_ssd_stream.sidecar import hot_file as hf  # noqa: E402
from sglang_ssd_stream.sidecar.format import SidecarManifest, SidecarTable  # noqa: E402

ROW_BYTES = 160
LAYER = 0


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _setup(work: Path, mib: int, table_rows: int) -> tuple[Path, SidecarManifest, int]:
    rng = np.random.default_rng(0)
    table = work / "layer-0.bin"
    with open(table, "wb") as f:
        for a in range(0, table_rows, 1 << 20):
            f.write(rng.bytes(min(1 << 20, table_rows - a) * ROW_BYTES))
    t = SidecarTable(LAYER, table.name, table, "0" * 64, "float8_e4m3fn", table_rows, ROW_BYTES, 0,
                     table_rows * ROW_BYTES)
    manifest = SidecarManifest(work / "ssd-stream.json", work, (t,))
    n = (mib << 20) // (ROW_BYTES + 8)
    ids = rng.choice(table_rows, n, replace=False).astype(np.int64)
    data = np.fromfile(table, np.uint8).reshape(table_rows, ROW_BYTES)[ids]
    path = work / "h.plehot"
    hf.write_hot_file(path, manifest, (0, table_rows), {LAYER: (ids, data)}, role="bench")
    return path, manifest, n


_SPOT = hf._spot_check
_spot_s: list[float] = []


def _timed_spot_check(*a, **k):
    """The module's spot-check, timed alone (its share of a load is less noisy than the load's on a busy box)."""
    t0 = time.perf_counter()
    try:
        return _SPOT(*a, **k)
    finally:
        _spot_s.append(time.perf_counter() - t0)


def _load(path: Path, manifest: SidecarManifest, table_rows: int, head: int, sample: int) -> tuple[float, float]:
    hf.SPOT_HEAD, hf.SPOT_SAMPLE = head, sample
    hf._spot_check = _timed_spot_check
    for p in (path, manifest.tables[0].file):
        _drop(p)
    t0 = time.perf_counter()
    got = hf.read_hot_file(path, manifest, (0, table_rows), 1 << 40)
    seconds = time.perf_counter() - t0
    assert got is not None, "the file was refused"
    return seconds, _spot_s.pop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the table and the file are made (a disk)")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--table-rows", type=int, default=2_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--samples", type=int, nargs="+", default=[0, 64, 256, 1024], help="SPOT_SAMPLE values (0: off)")
    args = ap.parse_args()
    head = hf.SPOT_HEAD
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="hot-spot-") as tmp:
        path, manifest, n = _setup(Path(tmp), args.mib, args.table_rows)
        runs = {k: [] for k in args.samples}
        for r in range(args.repeats):
            for k in (args.samples if r % 2 == 0 else args.samples[::-1]):
                runs[k].append(_load(path, manifest, args.table_rows, head if k else 0, k))
    base = statistics.median(s for s, _ in runs[args.samples[0]])
    out = {"rows": n, "mib": args.mib, "table_rows": args.table_rows, "head": head, "repeats": args.repeats,
           "load_s": {k: [round(s, 4) for s, _ in v] for k, v in runs.items()},
           "median_load_s": {k: round(statistics.median(s for s, _ in v), 4) for k, v in runs.items()},
           "median_spot_s": {k: round(statistics.median(c for _, c in v), 4) for k, v in runs.items()},
           "load_over_off": {k: round(statistics.median(s for s, _ in v) / base, 3) for k, v in runs.items()},
           "spot_over_off_load": {k: round(statistics.median(c for _, c in v) / base, 3) for k, v in runs.items()}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
