"""What the GPU scripts share: test tables, the disk baseline (fio: random and sequential reads), device sync and a
simulated layer.

Imported as ``_harness`` by the scripts beside it (``python scripts/gpu/<script>.py`` puts this folder on
sys.path). Imports torch and numpy only where a helper needs them, so a CPU smoke run without CUDA works.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path


def make_table(path: Path, rows: int, row_bytes: int) -> None:
    """A random table of ``rows`` x ``row_bytes`` (seed 0), written once and fsynced; reused when its size fits."""
    import numpy as np

    if path.exists() and path.stat().st_size == rows * row_bytes:
        return
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        left = rows * row_bytes
        while left:
            n = min(left, 256 << 20)
            f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            left -= n
        f.flush()
        os.fsync(f.fileno())


def write_sidecar(d: Path, rows: int, row_bytes: int, *, layer: int = 3, dtype: str = "float8_e4m3fn",
                  seed: int = 5, finite: bool = False) -> Path:
    """A sidecar (``ssd-stream.json`` + one table of random bytes, written in 256 MiB pieces); its manifest.
    ``finite``: no NaN (0x7F/0xFF) and no -0.0 (0x80) bytes, so that a BF16 all-reduce of ``row + 0`` is exact."""
    import hashlib

    import numpy as np

    d.mkdir(parents=True, exist_ok=True)
    path, sha, rng = d / f"layer-{layer}.bin", hashlib.sha256(), np.random.default_rng(seed)
    with open(path, "wb") as f:
        left = rows * row_bytes
        while left:
            chunk = rng.integers(0, 256, min(left, 256 << 20), dtype=np.uint8)
            if finite:
                chunk[((chunk & 0x7F) == 0x7F) | (chunk == 0x80)] = 0
            f.write(chunk.tobytes())
            sha.update(chunk.tobytes())
            left -= chunk.size
    manifest = d / "ssd-stream.json"
    manifest.write_text(json.dumps({"format": "sglang-ssd-stream", "version": 1, "tables": [
        {"layer": layer, "path": path.name, "sha256": sha.hexdigest(), "dtype": dtype, "rows": rows,
         "columns": row_bytes // (1 if dtype == "float8_e4m3fn" else 2), "bytes": rows * row_bytes}]}))
    return manifest


def run_fio(fio: str, path: Path, seconds: float, jobs: tuple[int, ...] = (1, 16)) -> dict:
    """4 KiB random reads of ``path`` with O_DIRECT (the disk, not the page cache), psync, per job count: the
    baseline every I/O number of a run is compared with (disks differ between boxes)."""
    res = {"version": subprocess.run([fio, "--version"], capture_output=True, text=True).stdout.strip(),
           "file": str(path), "file_bytes": path.stat().st_size}
    for n in jobs:
        cmd = [fio, "--name=ple-randread", f"--filename={path}", "--rw=randread", "--bs=4k", "--direct=1",
               "--ioengine=psync", f"--numjobs={n}", "--group_reporting", "--time_based",
               f"--runtime={seconds}", "--output-format=json"]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            res[f"jobs{n}"] = {"error": p.stderr[-2000:], "command": shlex.join(cmd)}
            continue
        job = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]["read"]
        res[f"jobs{n}"] = {"iops": job["iops"], "bw_mib_s": job["bw"] / 1024,
                           "clat_mean_us": job["clat_ns"]["mean"] / 1e3, "command": shlex.join(cmd)}
        print(f"fio randread 4k O_DIRECT {n:2d} jobs: {job['iops']:.0f} IOPS", flush=True)
    return res


def run_fio_seq(fio: str, path: Path, nbytes: int) -> dict:
    """fio's sequential read of ``nbytes`` (rounded up to 1 MiB; 1 MiB blocks, one job, psync) from a file of that
    size that fio lays out at ``path`` first (not timed; removed afterwards): with ``O_DIRECT`` (the disk), and
    buffered from a cold page cache (``--invalidate=1``: fio drops the file's pages first), which is how the hot
    file's reader reads (read-ahead included). The baseline a hot file's load time is compared with."""
    size = max(1 << 20, -(-int(nbytes) // (1 << 20)) << 20)
    base = [fio, "--name=ple-seqread", f"--filename={path}", "--bs=1M", f"--size={size}", "--ioengine=psync",
            "--numjobs=1", "--output-format=json"]
    res: dict = {"bytes": size}
    try:
        p = subprocess.run([*base, "--rw=write", "--direct=1", "--end_fsync=1"], capture_output=True, text=True)
        if p.returncode:  # a filesystem without O_DIRECT (tmpfs): lay it out buffered
            p = subprocess.run([*base, "--rw=write", "--direct=0", "--end_fsync=1"], capture_output=True, text=True)
        if p.returncode:
            res["error"] = p.stderr[-2000:]
            return res
        for name, direct in (("direct", 1), ("buffered", 0)):
            cmd = [*base, "--rw=read", f"--direct={direct}", "--invalidate=1"]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode:
                res[name] = {"error": p.stderr[-2000:], "command": shlex.join(cmd)}
                continue
            job = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]["read"]
            res[name] = {"bw_mib_s": job["bw"] / 1024, "seconds": job["runtime"] / 1e3, "command": shlex.join(cmd)}
            print(f"fio sequential read {size / 2**20:.0f} MiB ({name}): {job['bw'] / 1024:.0f} MiB/s", flush=True)
    finally:
        path.unlink(missing_ok=True)
    return res


def sync(device) -> None:
    """Wait for ``device`` (a torch.device or its type string); a no-op off CUDA."""
    import torch

    if getattr(device, "type", device) == "cuda":
        torch.cuda.synchronize(device if not isinstance(device, str) else None)


def simulated_layer(ms: float):
    """A closure that enqueues about ``ms`` of GPU work on the current stream (bf16 matmuls), and the ms it
    really takes (a whole number of matmuls)."""
    import torch

    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(a, b)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        torch.mm(a, b)
    e.record()
    torch.cuda.synchronize()
    per = s.elapsed_time(e) / 20
    k = max(1, round(ms / per))

    def layer():
        for _ in range(k):
            torch.mm(a, b)
    return layer, k * per
