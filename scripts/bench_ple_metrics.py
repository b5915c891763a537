#!/usr/bin/env python3
"""The kit's metrics' cost per PLE lookup, as a ratio against the same lookup without them, in one run.

One layer's warm lookup of a ``--tokens`` chunk (``--tokens`` x 16 rows, every row in the row cache) through the
staged gather on this CPU, timed around ``SidecarGather.begin`` (synchronous on a CPU-only process: the read, the
delivery and the observer's calls). The metrics are on (the gather's observer is the layer's publisher, writing
into prometheus_client's multiprocess files as in a serving process) and off (no observer) in alternating
lookups, so both see the same machine: the ratio is the median of the paired differences (on - off, each pair
back to back, which cancels the load of a shared box) over the median lookup without metrics (the issue's bound:
under 1 %). Also timed: the observer's calls inside real lookups (what a lookup pays directly: the caches are
cold after its copy), and one publish of the layer (the daemon thread's work each second: the queued durations
observed and the cache's increases added).

Writes JSON with the exact command to ``--out``. Usage::

    python scripts/bench_ple_metrics.py --out benchmarks/ple_metrics/cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.ple_metrics.gpu_overhead import TimedObserver, summary  # noqa: E402 - one timing for CPU and GPU


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rows-per-token", type=int, default=16)
    ap.add_argument("--table-rows", type=int, default=200_000)
    ap.add_argument("--pairs", type=int, default=1000, help="lookups with metrics on, and as many off")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ple-metrics-bench-"))
    prom = work / "prom"
    prom.mkdir()
    if "prometheus_client" in sys.modules:
        raise SystemExit("prometheus_client was imported before the multiprocess directory was set")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(prom)  # before prometheus_client's import, as the engines do

    import numpy as np
    import torch

    from sglang_ssd_stream.ple_metrics.publish import for_process
    from sglang_ssd_stream.sidecar import SidecarReader
    from sglang_ssd_stream.sidecar.format import SidecarTable
    from sglang_ssd_stream.sidecar.row_cache import RowCache, RowCacheConfig
    from sglang_ssd_stream.staging.gather import SidecarGather

    rb, rows = 160, args.table_rows
    n = args.tokens * args.rows_per_token
    path = work / "table.bin"
    np.random.default_rng(0).integers(0, 256, rows * rb, dtype=np.uint8).tofile(path)
    table = SidecarTable(0, path.name, path, "0" * 64, "float8_e4m3fn", rows, rb, 0, rows * rb)
    cache = RowCache(SidecarReader(table, max_rows=n, workers=2), np.zeros((rows, rb), np.uint8),
                     RowCacheConfig(workers=2))
    gather = SidecarGather(cache, columns=rb, is_fp8=True, capacity_rows=n, device="cpu", mode="h2d", output="raw")
    metrics = for_process("sglang", tp_rank=0, pp_rank=0)
    if metrics is None:
        raise SystemExit("prometheus_client is not in multiprocess mode")
    publisher = metrics.layer(0, cache)
    rng = np.random.default_rng(1)
    lookups = [torch.from_numpy(rng.integers(0, rows, n)) for _ in range(16)]
    out = torch.empty((n, rb), dtype=torch.uint8)
    cache.prefetch(np.arange(rows))  # every row cached: warm lookups
    for ids in lookups:  # warm up both paths
        gather.observer = publisher
        gather.begin(ids, out)
        gather.observer = None
        gather.begin(ids, out)
    before = cache.stats
    on, off = [], []
    for i in range(args.pairs):
        ids = lookups[i % len(lookups)]
        order = (publisher, None) if i % 2 else (None, publisher)  # alternate which goes first
        for observer in order:
            gather.observer = observer
            t = time.perf_counter()
            gather.begin(ids, out)
            (on if observer is not None else off).append(time.perf_counter() - t)
    after = cache.stats
    metrics.publish()
    calls, publishes = [], []

    gather.observer = TimedObserver(publisher, calls)
    for i in range(min(args.pairs, 300)):
        gather.begin(lookups[i % len(lookups)], out)
        t = time.perf_counter()
        publisher.publish()  # one lookup's durations and increases
        publishes.append(time.perf_counter() - t)
    gather.observer = None

    s_on, s_off, s_calls = summary(on), summary(off), summary(calls)
    looked = after["lookups"] - before["lookups"]
    result = {
        "command": "python " + shlex.join([os.path.relpath(__file__, Path.cwd()), *sys.argv[1:]]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average": os.getloadavg()},
        "lookup": {"tokens": args.tokens, "rows": n, "row_bytes": rb, "table_rows": rows,
                   "hit_rate": (after["hits"] - before["hits"]) / looked, "pairs": args.pairs},
        "metrics_on": s_on, "metrics_off": s_off, "observer_calls_in_lookup": s_calls,
        "publish_one_layer": summary(publishes),
        "overhead_ratio": statistics.median(a - b for a, b in zip(on, off, strict=True)) * 1e6 / s_off["median_us"],
        "overhead_ratio_of_medians": s_on["median_us"] / s_off["median_us"] - 1,
        "observer_share_of_lookup": s_calls["median_us"] / s_off["median_us"],
        "bound": 0.01,
    }
    result["within_bound"] = result["overhead_ratio"] < 0.01 and result["observer_share_of_lookup"] < 0.01
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("overhead_ratio", "overhead_ratio_of_medians",
                                             "observer_share_of_lookup", "within_bound")}))
    print(f"lookup off {s_off['median_us']:.0f} us, on {s_on['median_us']:.0f} us, observer in the lookup "
          f"{s_calls['median_us']:.1f} us, one publish {result['publish_one_layer']['median_us']:.1f} us (medians)")
    gather.close()
    cache.close()
    return 0 if result["within_bound"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
