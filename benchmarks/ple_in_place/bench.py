#!/usr/bin/env python3
"""PLE rows in place (the checkpoint's safetensors shards) against the copied sidecar, in one run.

Builds a synthetic checkpoint with the real table's row geometry (160-column F8_E4M3 rows of 160 B, split into
``--parts`` shard tensors over ``--files`` safetensors files, rows scaled to ``--table-gib``), builds both sidecar
kinds from it (timed, disk counted), runs ``fio`` random reads of the row size on the same files as the baseline,
then times lookups (uniform and Zipf-like ids; 1, 64 and 2,048 tokens = 16 rows each) through every read path
(mmap, pread, the row cache cold and warm), in place and copied interleaved (ABBA) in every repeat. Cold runs drop
the benchmark's own files from the page cache (``POSIX_FADV_DONTNEED`` + ``MADV_DONTNEED`` on the mappings):
targeted, so other work on a shared machine keeps its cache. With CUDA, every lookup lands in a CUDA tensor
(read into pinned host memory, then copied; both timed).

CPU box (as run for the committed results, 2 GiB table; refuses to leave less than --min-free-gib on the disk):

    PYTHONPATH=. nice -n 10 $(scripts/engine-venv.sh sglang) benchmarks/ple_in_place/bench.py \\
        --out benchmarks/ple_in_place/cpu --work /var/tmp/ple-in-place

GPU box (the repository carried as source; data generated there under $OUT; under 4 minutes):

    BENCH_COMMIT=<commit> PYTHONPATH=. python3 benchmarks/ple_in_place/bench.py --quick \
        --out $OUT/ple_in_place --work /tmp/ple-in-place

The JSON (``results.json`` in --out) holds the exact command, machine facts, the commit and every sample.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # this checkout's package, not an installed one

from sglang_ssd_stream.atomic_file import write_atomic  # noqa: E402
from sglang_ssd_stream.sidecar import ROWS_PER_TOKEN, load_manifest, open_reader  # noqa: E402
from sglang_ssd_stream.sidecar.build import build_sidecar  # noqa: E402
from sglang_ssd_stream.sidecar.in_place import build_in_place  # noqa: E402
from sglang_ssd_stream.sidecar.mapped import drop_page_cache  # noqa: E402
from sglang_ssd_stream.sidecar.row_cache import RowCache, RowCacheConfig  # noqa: E402

PREFIX = "model.language_model.layers.{layer}.ple.ple_embedding.ngram_embedding"
LAYER, COLUMNS, ROW_BYTES = 3, 160, 160  # the real table's row: 160 FP8 values
REAL_ROWS = 320_001_536  # the real table (47.7 GiB)
TINY_ROWS = 20_011  # the tests' tiny table
WORKERS = 16  # the readers' default queue depth


def _gib(n: int) -> float:
    return round(n / 2**30, 4)


def _disk_bytes(paths) -> int:
    """Blocks allocated (what the disk loses), not apparent sizes."""
    return sum(os.stat(p).st_blocks * 512 for p in paths)


def write_checkpoint(path: Path, rows: int, parts: int, files: int, seed: int) -> list[Path]:
    """Shard tensors k = 0..parts-1 of ceil(rows / parts) rows, consecutive over ``files`` files (as
    ``save_pretrained`` shards them), one file in memory at a time."""
    import torch
    from safetensors.torch import save_file

    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    size = math.ceil(rows / parts)
    shards = [(k, k * size, min((k + 1) * size, rows)) for k in range(parts) if k * size < rows]
    per_file = math.ceil(len(shards) / files)
    weight_map, written = {}, []
    for i in range(files):
        chunk = shards[i * per_file:(i + 1) * per_file]
        if not chunk:
            break
        named = {f"{PREFIX.format(layer=LAYER)}.shard_{k}.weight":
                 torch.from_numpy(rng.integers(0, 256, size=(hi - lo, ROW_BYTES), dtype=np.uint8))
                 .view(torch.float8_e4m3fn) for k, lo, hi in chunk}
        if i == 0:
            named[f"{PREFIX.format(layer=LAYER)}.weight_scale"] = torch.tensor([0.125], dtype=torch.bfloat16)
            named["model.language_model.embed_tokens.weight"] = torch.zeros(4, 8, dtype=torch.bfloat16)
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        save_file(named, str(path / name))
        weight_map.update({n: name for n in named})
        written.append(path / name)
        del named
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({"model_type": "qwen4_exp",
                                                  "text_config": {"split_ngram_parts": parts}}))
    return written


def drop(files, readers=()) -> None:
    for i, f in enumerate(files):
        drop_page_cache(f, readers if i == 0 else ())


def build_both(ck: Path, copy_dir: Path, cache_dir: Path, files: list[Path]) -> dict:
    """Each kind built from a cold page cache, timed; the disk each adds."""
    drop(files)
    t = time.perf_counter()
    build_sidecar(ck, copy_dir, progress=False, cache_dir=cache_dir)
    copy_s = time.perf_counter() - t
    drop(files)
    t = time.perf_counter()
    build_in_place(ck, progress=False, cache_dir=cache_dir)
    in_place_s = time.perf_counter() - t
    copy_files = [p for p in copy_dir.rglob("*") if p.is_file()]
    return {
        "copy": {"build_s": round(copy_s, 3), "disk_bytes": _disk_bytes(copy_files),
                 "files": sorted(p.name for p in copy_files)},
        "in_place": {"build_s": round(in_place_s, 3), "disk_bytes": _disk_bytes([ck / "ssd-stream.json"]),
                     "files": ["ssd-stream.json"]},
        "checkpoint_disk_bytes": _disk_bytes(files),
        "note": "both builds hash every PLE byte once; the copy also writes and re-reads it; the verified cache "
                "(a few KiB) is left out of both",
    }


def run_fio(name: str, files: list[Path], runtime: int, direct: bool) -> dict | None:
    """Random reads on ``files`` at the readers' queue depth: 160 B buffered (the row; a table that fits RAM ends
    up in the page cache during the run) or 4 KiB O_DIRECT (a page from the device: the cold baseline); IOPS and
    mean latency."""
    fio = shutil.which("fio")
    if fio is None:
        return None
    drop(files)
    bs = 4096 if direct else ROW_BYTES
    cmd = [fio, f"--name={name}", "--filename=" + ":".join(str(f) for f in files), "--rw=randread", f"--bs={bs}",
           f"--direct={int(direct)}", "--ioengine=psync", f"--numjobs={WORKERS}", "--group_reporting",
           "--time_based", f"--runtime={runtime}", "--invalidate=1", "--output-format=json"]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        return {"command": " ".join(cmd), "error": res.stderr.strip()[-500:]}
    job = json.loads(res.stdout[res.stdout.index("{"):])["jobs"][0]["read"]
    return {"command": " ".join(cmd), "iops": round(job["iops"], 1),
            "mean_lat_us": round(job["lat_ns"]["mean"] / 1e3, 2), "bs": bs, "direct": direct}


def zipf_ids(rng, rows: int, n: int, a: float = 1.1) -> np.ndarray:
    """Zipf-like ids: a rank drawn with exponent ``a``, scattered over the table by a fixed permutation hash (as the
    n-gram hash scatters hot n-grams)."""
    rank = rng.zipf(a, n).astype(np.uint64) % np.uint64(rows)
    return ((rank * np.uint64(2654435761) + np.uint64(97)) % np.uint64(rows)).astype(np.int64)


class Sink:
    """Where rows land: host numpy, or pinned host memory copied into a CUDA tensor."""

    def __init__(self, max_rows: int, device: str):
        import torch
        self.device = device
        pin = device == "cuda"
        self.host = torch.empty((max_rows, ROW_BYTES), dtype=torch.uint8, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.dev = torch.empty((max_rows, ROW_BYTES), dtype=torch.uint8, device=device) if pin else None

    def lookup(self, reader, ids: np.ndarray) -> float:
        n = ids.size
        t = time.perf_counter()
        reader.read_rows(ids, self.host_np[:n])
        if self.dev is not None:
            import torch
            self.dev[:n].copy_(self.host[:n], non_blocking=True)
            torch.cuda.synchronize()
        return time.perf_counter() - t


def open_path(kind_table, path: str, max_rows: int, cache_rows: int):
    """(reader or cache, closer) for one read path."""
    if path in ("mmap", "pread"):
        r = open_reader(kind_table, path, max_rows=max_rows, workers=WORKERS)
        return r, r.close
    r = open_reader(kind_table, "pread", max_rows=max_rows, workers=WORKERS)
    storage = np.empty((cache_rows, ROW_BYTES), np.uint8)
    c = RowCache(r, storage, RowCacheConfig(workers=WORKERS, seed=1))
    return c, c.close


def lookups(tables: dict, files: dict, args, device: str, rows: int) -> list[dict]:
    """Every (path, ids, tokens) case: per repeat, cold then warm, in place and copy in ABBA order."""
    rng = np.random.default_rng(args.seed)
    max_rows = max(args.tokens) * ROWS_PER_TOKEN
    sink = Sink(max_rows, device)
    out = []
    for path in ("mmap", "pread", "cache"):
        for dist in ("uniform", "zipf"):
            for tokens in args.tokens:
                n = tokens * ROWS_PER_TOKEN
                case = {"path": path, "ids": dist, "tokens": tokens, "rows": n,
                        "cold_s": {"in_place": [], "copy": []}, "warm_s": {"in_place": [], "copy": []}}
                for rep in range(args.repeats):
                    ids = rng.integers(0, rows, n) if dist == "uniform" else zipf_ids(rng, rows, n)
                    order = ("in_place", "copy") if rep % 2 == 0 else ("copy", "in_place")
                    for kind in order:
                        reader, close = open_path(tables[kind], path, max_rows, max(4 * max_rows, 1024))
                        try:
                            drop(files[kind], [reader])
                            case["cold_s"][kind].append(sink.lookup(reader, ids))
                            case["warm_s"][kind].append(sink.lookup(reader, ids))
                        finally:
                            close()
                out.append(summarize(case))
                print(f"{path:5} {dist:7} {tokens:5} tok  cold in/copy {case['cold_ratio']['median']:.3f} "
                      f"warm {case['warm_ratio']['median']:.3f}", file=sys.stderr, flush=True)
    return out


def summarize(case: dict) -> dict:
    for phase in ("cold", "warm"):
        s = case[f"{phase}_s"]
        ratios = [a / b for a, b in zip(s["in_place"], s["copy"], strict=True)]  # paired: same ids, same repeat
        case[f"{phase}_ratio"] = {"median": round(float(np.median(ratios)), 4), "min": round(min(ratios), 4),
                                  "max": round(max(ratios), 4)}
        case[f"{phase}_median_s"] = {k: float(np.median(v)) for k, v in s.items()}
    return case


def machine(work: Path, device: str) -> dict:
    import torch
    facts = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
             "numpy": np.__version__, "torch": torch.__version__, "device": device,
             "mem_total_kib": next((int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith(
                 "MemTotal")), None), "loadavg_start": os.getloadavg()}
    try:
        facts["filesystem"] = subprocess.run(["findmnt", "-n", "-o", "SOURCE,FSTYPE", "--target", str(work)],
                                             capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        facts["filesystem"] = None
    if device == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(0)
    return facts


def commit() -> str | None:
    try:
        res = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=False)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return os.environ.get("BENCH_COMMIT")
    return (res.stdout.strip() + ("+dirty" if dirty else "")) if res.returncode == 0 else os.environ.get("BENCH_COMMIT")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="results directory (results.json)")
    ap.add_argument("--work", required=True, type=Path, help="where the synthetic checkpoint and copy are written "
                    "(emptied first, removed after unless --keep)")
    ap.add_argument("--table-gib", type=float, default=2.0)
    ap.add_argument("--parts", type=int, default=512, help="shard tensors (split_ngram_parts; the engines' default)")
    ap.add_argument("--files", type=int, default=8, help="safetensors files the shards lie in")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 2048])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--fio-runtime", type=int, default=10)
    ap.add_argument("--min-free-gib", type=float, default=15.0)
    ap.add_argument("--quick", action="store_true", help="0.25 GiB table, 4 repeats, 3 s fio: under 4 minutes")
    ap.add_argument("--smoke", action="store_true", help="a 4 MiB table, 2 repeats, no fio (the test)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.table_gib, args.repeats, args.fio_runtime = 0.25, 4, 3
    if args.smoke:
        args.table_gib, args.repeats, args.fio_runtime, args.parts, args.files = 1 / 256, 2, 0, 64, 3
        args.tokens = [1, 64]
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"

    rows = int(args.table_gib * 2**30) // ROW_BYTES
    need = 2 * rows * ROW_BYTES + 2 * TINY_ROWS * ROW_BYTES  # checkpoint + copy, large and tiny
    args.work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.work).free
    if free - need < args.min_free_gib * 2**30:
        print(f"refused: {args.work} has {_gib(free)} GiB free; checkpoint + copy need {_gib(need)} GiB and "
              f"{args.min_free_gib} GiB must stay free (lower --table-gib)", file=sys.stderr)
        return 2
    for sub in ("tiny", "table"):
        shutil.rmtree(args.work / sub, ignore_errors=True)
    result = {"command": " ".join([sys.executable, *sys.argv]), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ",
              time.gmtime()), "commit": commit(), "machine": machine(args.work, device),
              "geometry": {"rows": rows, "row_bytes": ROW_BYTES, "dtype": "F8_E4M3", "parts": args.parts,
                           "files": args.files, "table_bytes": rows * ROW_BYTES,
                           "fraction_of_real_rows": round(rows / REAL_ROWS, 5), "rows_per_token": ROWS_PER_TOKEN},
              "page_cache_drop": "POSIX_FADV_DONTNEED per file + MADV_DONTNEED on the mappings (this run's files "
                                 "only)", "builds": {}, "fio": {}}
    t0 = time.perf_counter()
    try:
        for sub, n, parts, nfiles in (("tiny", TINY_ROWS, 16, 3), ("table", rows, args.parts, args.files)):
            ck, copy_dir = args.work / sub / "ckpt", args.work / sub / "copy"
            t = time.perf_counter()
            shard_files = write_checkpoint(ck, n, parts, nfiles, args.seed)
            result["builds"][sub] = {"rows": n, "parts": parts, "files": nfiles,
                                     "write_checkpoint_s": round(time.perf_counter() - t, 3),
                                     **build_both(ck, copy_dir, args.work / sub / "vcache", shard_files)}
            print(f"built {sub}: {result['builds'][sub]['copy']['build_s']} s copy, "
                  f"{result['builds'][sub]['in_place']['build_s']} s in place", file=sys.stderr, flush=True)
        tables = {"in_place": load_manifest(ck).tables[0], "copy": load_manifest(copy_dir).tables[0]}
        files = {"in_place": list(tables["in_place"].files), "copy": list(tables["copy"].files)}
        if args.fio_runtime:
            for kind in ("copy", "in_place"):
                for direct in (False, True):
                    key = f"{kind}_{'4k_direct' if direct else 'row_buffered'}"
                    result["fio"][key] = run_fio(key, files[kind], args.fio_runtime, direct)
            if shutil.which("fio") is None:
                result["fio"] = {"absent": "fio is not installed on this machine"}
        result["lookups"] = lookups(tables, files, args, device, rows)
        fio_page = result["fio"].get("copy_4k_direct") or {}
        if fio_page.get("iops"):
            for case in result["lookups"]:  # a cold row costs one page read: fio's time for as many pages, same depth
                base = case["rows"] / fio_page["iops"]
                case["cold_vs_fio_4k"] = {k: round(v / base, 3) for k, v in case["cold_median_s"].items()}
    finally:
        if not args.keep:
            for sub in ("tiny", "table"):
                shutil.rmtree(args.work / sub, ignore_errors=True)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["machine"]["loadavg_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "results.json", json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out / 'results.json'} ({result['wall_s']} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
