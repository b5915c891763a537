#!/usr/bin/env python3
"""The PLE hot file (issue 27 item 4), measured on CPU: first-request and whole-stream disk reads of a restart with
a hot file learned from earlier traffic of the same stream, against today's cold row cache and Belady's demand
optimum; the time to load the hot file against ``fio``'s sequential read of the same bytes; the memory the lookup
counts cost.

Subcommands:

``prose-trace``
    A second, prose stream built like ``scripts/ple_trace.py``'s code stream: a byte-level BPE (``tokenizers``)
    trained on half of a directory's text files (split by the SHA-256 of each file's name), the other half
    shuffled (``--seed``), each file cut into requests of 1,024-8,192 tokens (seeded), each request's ids hashed
    from an EOS history by the kit's n-gram hash into the real 320,001,536-row id space. Writes ``tokens.npy``,
    ``starts.npy`` and ``ids.npy`` like ``ple_trace.py``, and ``files.npy`` (the file each request comes from).
``run``
    For each budget: the real C row cache (``CacheSimulator``: every decision and counter of a real cache, no I/O)
    replays the stream's earlier requests (``--learn-fraction`` of its tokens, cut at a request), as a server
    counts them; the hot set is then ranked by the cache's own C ranking (``rc_snapshot`` + ``rc_rank``, what
    ``RowCache.hottest`` runs) and written as a real hot file (``write_hot_file``; row bytes stand-ins of the real
    size). At "restart" the file is read back and admitted (``HotRows.load``: ``read_hot_file`` + ``RowCache.admit``
    into a real ``RowCache`` over a sparse table of the real geometry, page cache dropped before, timed; ``fio``
    reads the same number of bytes sequentially right after, in the same run), and the held-out later requests are
    replayed into a fresh simulated cache holding the same hot rows (``rc_admit`` with count 1, as ``HotRows.load``
    places them) at each share, and into a cold one (today). Belady's demand optimum (``scripts/belady.c``) replays
    the same calls with the same number of rows, from empty and from the same hot rows. Reads are rows and the 4 KiB
    pages of the real layout those rows occupy, per request (each lookup call's reads charged to its request), for
    the first requests and the whole held-out stream.

    ``--reverse-shares`` also admits a share's rows coldest first (a variant of ``HotRows.load``'s order);
    ``--repeats`` times each load that many times (medians).
``report``
    Markdown tables of ``run``'s JSON (``docs/hot-file-measured.md``).

Replays (``--replay``): ``sequential`` is ``bench_row_cache.py``'s (each request in turn, 2,048-token prefill
chunks); ``server`` runs ``--concurrency`` requests at once: each step gives every running request one call, a
2,048-token chunk of its prompt while it has prompt left, then one decode token (its last ``--decode-tokens``
tokens, at most a quarter of it, are decoded: the text's continuation), a finished request's place taken by the
next one.

Usage (a venv with numpy and tokenizers)::

    nice -n 10 $PY scripts/bench_hot_file.py prose-trace --corpus /usr/share/vim/vim90/doc \\
        --out-dir /var/tmp/prose-trace --stats benchmarks/hot_file/trace_prose.json
    nice -n 10 $PY scripts/bench_hot_file.py run --trace /var/tmp/ple-trace --name cpython --replay sequential \\
        --reverse-shares 50 100 --repeats 3 --out benchmarks/hot_file/cpython.json
    nice -n 10 $PY scripts/bench_hot_file.py run --trace /var/tmp/prose-trace --name prose --replay server \\
        --reverse-shares 50 100 --out benchmarks/hot_file/prose.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_row_cache import belady_lib, next_use, pages_of  # noqa: E402
from ple_trace import EOS_TEXT, frequency_curve, save_trace, train_bpe  # noqa: E402

from sglang_ssd_stream.sidecar.format import SidecarManifest, SidecarTable  # noqa: E402
from sglang_ssd_stream.sidecar.hot_file import read_hot_file, write_hot_file  # noqa: E402
from sglang_ssd_stream.sidecar.hot_rows import HotRows  # noqa: E402
from sglang_ssd_stream.sidecar.ngram import qwen38_flash_next  # noqa: E402
from sglang_ssd_stream.sidecar.row_cache import (  # noqa: E402
    DEFAULT_POLICY,
    STAT_NAMES,
    CacheSimulator,
    RowCache,
    RowCacheConfig,
    capacity_for_budget,
    metadata_bytes,
)

ROW_BYTES = 160
ROWS = 320_001_536
CHUNK_TOKENS = 2048
GIB = 1 << 30
BUDGETS_GIB = (0.25, 0.5, 1, 2, 4)
SHARES_PCT = (10, 25, 50, 75, 100)
FIRST = (1, 4, 16)
LAYER = 0
I_ROWS, I_PAGES = STAT_NAMES.index("rows_read"), STAT_NAMES.index("pages_read")


# ----------------------------------------------------------------------------- the prose stream


def cmd_prose_trace(args) -> dict:
    t0 = time.perf_counter()
    root = args.corpus.resolve()
    files = sorted(p for p in root.rglob(args.glob) if p.is_file())
    if not files:
        raise SystemExit(f"{root}: no {args.glob} files")

    def held(p: Path) -> bool:
        return bool(hashlib.sha256(str(p.relative_to(root)).encode()).digest()[0] & 1)

    def read(p: Path) -> str:
        return p.read_text(encoding="utf-8", errors="replace")

    train = [p for p in files if not held(p)]
    trace = [p for p in files if held(p)]
    rng = np.random.default_rng(args.seed)
    trace = [trace[i] for i in rng.permutation(len(trace))]
    tok = train_bpe([read(p) for p in train], args.vocab_size)
    texts = [read(p) for p in trace]
    enc = tok.encode_batch(texts)
    h = qwen38_flash_next()
    pieces, file_of = [], []
    for f, e in enumerate(enc):
        t = np.asarray(e.ids, dtype=np.uint32)
        a = 0
        while a < t.size:
            n = int(rng.integers(args.min_tokens, args.max_tokens + 1))
            b = t.size if t.size - (a + n) < args.min_tokens // 2 else a + n  # no tiny tail request
            pieces.append(t[a:b])
            file_of.append(f)
            a = b
    lens = np.array([p.size for p in pieces], dtype=np.int64)
    tokens = np.concatenate(pieces)
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    ids = save_trace(args.out_dir, tokens, starts, h)
    np.save(args.out_dir / "files.npy", np.array(file_of, dtype=np.int32))
    flat = ids.reshape(-1)
    stats = {
        "command": shlex.join(["python", *sys.argv]), "corpus": str(root), "glob": args.glob,
        "python": platform.python_version(),
        "tokenizer": {"kind": "byte-level BPE (tokenizers)", "vocab_asked": args.vocab_size,
                      "vocab_trained": tok.get_vocab_size(), "train_files": len(train),
                      "train_bytes": int(sum(p.stat().st_size for p in train)), "eos": EOS_TEXT},
        "files": len(trace), "requests": len(pieces), "request_tokens": [args.min_tokens, args.max_tokens],
        "tokens": int(tokens.size), "chars": int(sum(len(t) for t in texts)),
        "chars_per_token": sum(len(t) for t in texts) / max(1, tokens.size),
        "hash": {"rows": h.rows, "rows_per_token": h.ngram_heads, "ple_layer_index": 0},
        "ids_curve": frequency_curve(flat),
        "distinct_pages_real_layout": pages_of(np.unique(flat)),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    c = stats["ids_curve"]
    print(f"prose: {len(trace)} files, {len(pieces)} requests, {tokens.size} tokens "
          f"({stats['chars_per_token']:.2f} chars/token), {c['distinct']} distinct rows, "
          f"compulsory {c['compulsory_fraction']:.3f}", flush=True)
    return stats


# ----------------------------------------------------------------------------- replays


def calls_of(starts: np.ndarray, reqs: range, replay: str, concurrency: int, decode_tokens: int) -> list:
    """The lookup calls of requests ``reqs``: ``(request, first token, end token)`` in the order a server issues
    them (see the module docstring)."""
    out = []
    if replay == "sequential":
        for r in reqs:
            a, b = int(starts[r]), int(starts[r + 1])
            out.extend((r, c, min(c + CHUNK_TOKENS, b)) for c in range(a, b, CHUNK_TOKENS))
        return out
    pending = list(reqs)[::-1]
    running = []  # [request, next token, prompt end, end]
    while pending or running:
        while pending and len(running) < concurrency:
            r = pending.pop()
            a, b = int(starts[r]), int(starts[r + 1])
            running.append([r, a, b - min(decode_tokens, (b - a) // 4), b])
        for st in running:
            r, pos, pend, end = st
            nxt = min(pos + CHUNK_TOKENS, pend) if pos < pend else pos + 1
            out.append((r, pos, nxt))
            st[1] = nxt
        running = [st for st in running if st[1] < st[3]]
    return out


def replay(sim: CacheSimulator, ids, calls: list, nreq: int, first_req: int) -> dict:
    """Replay ``calls`` into ``sim``; rows and pages read per request (indexes from ``first_req``)."""
    rows, pages = np.zeros(nreq, np.int64), np.zeros(nreq, np.int64)
    buf = np.zeros(len(STAT_NAMES), np.int64)
    lib, c = sim._lib, sim._c
    lib.rc_stats(c, buf.ctypes.data)
    r0, p0 = int(buf[I_ROWS]), int(buf[I_PAGES])
    for r, a, b in calls:
        sim.access(np.asarray(ids[a:b]).reshape(-1))
        lib.rc_stats(c, buf.ctypes.data)
        r1, p1 = int(buf[I_ROWS]), int(buf[I_PAGES])
        rows[r - first_req] += r1 - r0
        pages[r - first_req] += p1 - p0
        r0, p0 = r1, p1
    return {"rows": rows, "pages": pages}


def summary(per: dict, first=FIRST) -> dict:
    out = {"whole_rows": int(per["rows"].sum()), "whole_pages": int(per["pages"].sum())}
    for k in first:
        out[f"first{k}_rows"] = int(per["rows"][:k].sum())
        out[f"first{k}_pages"] = int(per["pages"][:k].sum())
    return out


def dedup_calls(ids, calls: list):
    parts, bounds, req = [], [0], []
    for r, a, b in calls:
        u = np.unique(np.asarray(ids[a:b]).reshape(-1))
        parts.append(u)
        bounds.append(bounds[-1] + u.size)
        req.append(r)
    return parts, np.array(bounds, np.int64), np.array(req, np.int64)


def belady(lib, parts: list, bounds: np.ndarray, req: np.ndarray, nreq: int, first_req: int, cap: int,
           hot: np.ndarray | None) -> dict:
    """Belady's demand optimum (MIN) of ``cap`` rows on the calls; ``hot``: rows it holds at the start (placed by
    a first pseudo-call whose misses are not counted)."""
    pre = [] if hot is None else [np.unique(hot)]
    seq = np.concatenate(pre + parts).astype(np.int64)
    off = 0 if hot is None else pre[0].size
    uniq, x = np.unique(seq, return_inverse=True)
    x = x.astype(np.int32)
    nxt = next_use(x)
    miss = np.zeros(x.size, np.uint8)
    n = lib.belady(x.ctypes.data, nxt.ctypes.data, x.size, uniq.size, cap, 0, miss.ctypes.data)
    if n < 0:
        raise MemoryError("belady: out of memory")
    m = miss[off:].astype(bool)
    rows, pages = np.zeros(nreq, np.int64), np.zeros(nreq, np.int64)
    cum = np.concatenate([[0], np.cumsum(m)])
    per_call = cum[bounds[1:]] - cum[bounds[:-1]]
    np.add.at(rows, req - first_req, per_call)
    body = seq[off:]
    for i in np.nonzero(per_call)[0]:
        a, b = bounds[i], bounds[i + 1]
        pages[req[i] - first_req] += pages_of(body[a:b][m[a:b]])
    return {"rows": rows, "pages": pages}


# ----------------------------------------------------------------------------- the file and its load


def manifest_for(table_file: Path) -> SidecarManifest:
    t = SidecarTable(LAYER, table_file.name, table_file, "0" * 64, "float8_e4m3fn", ROWS, ROW_BYTES, 0,
                     ROWS * ROW_BYTES)
    return SidecarManifest(table_file.parent / "ssd-stream.json", table_file.parent, (t,))


def stand_in_rows(ids: np.ndarray) -> np.ndarray:
    """Row bytes of the real size (the id in the first 8 bytes, then bytes that vary): the hot file's bytes and
    checksums cost what real rows do."""
    rows = np.empty((ids.size, ROW_BYTES), np.uint8)
    for a in range(0, ids.size, 1 << 20):
        b = min(ids.size, a + (1 << 20))
        v = ids[a:b].astype(np.int64)
        rows[a:b] = ((v[:, None] * 2654435761 + np.arange(ROW_BYTES)[None, :] * 40503) % 251).astype(np.uint8)
        rows[a:b, :8] = v.astype("<i8").view(np.uint8).reshape(-1, 8)
    return rows


def drop_caches() -> str:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError as exc:
        return f"not dropped ({exc})"


def fio_read(path: Path, nbytes: int) -> dict:
    """fio's sequential read of ``nbytes`` (bs=1M, one job, psync, O_DIRECT; buffered after a cache drop where
    the filesystem refuses O_DIRECT) from a file of that size laid out beforehand."""
    size = max(1 << 20, -(-nbytes // (1 << 20)) << 20)
    base = ["fio", "--name=hotfile-seq", f"--filename={path}", "--bs=1M", f"--size={size}", "--ioengine=psync",
            "--numjobs=1", "--output-format=json"]
    subprocess.run([*base, "--rw=write", "--direct=1", "--end_fsync=1"], check=True,
                   capture_output=True)  # lay the file out (not timed)
    res = None
    for direct in (1, 0):
        how = drop_caches()
        p = subprocess.run([*base, "--rw=read", f"--direct={direct}"], capture_output=True, text=True)
        if p.returncode != 0:
            continue
        j = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]["read"]
        if res is None:
            res = {"bytes": int(j["io_bytes"]), "seconds": j["runtime"] / 1000, "bw_mib_s": j["bw_bytes"] / 2**20,
                   "direct": bool(direct), "cache": how, "bs": "1M", "ioengine": "psync", "iodepth": 1}
        else:  # also buffered (the page cache dropped before), as read_hot_file reads
            res["buffered_seconds"] = j["runtime"] / 1000
    if res is None:
        raise RuntimeError(f"fio failed: {p.stderr[-500:]}")
    return res


def _proc_read_bytes() -> int:
    for ln in Path("/proc/self/io").read_text().splitlines():
        if ln.startswith("read_bytes:"):
            return int(ln.split()[1])
    return 0


def timed_loads(hot_path: Path, table_file: Path, manifest, cap: int, shares, scratch: Path, repeats: int) -> list:
    """For each share, ``repeats`` times in turn: (1) ``read_hot_file`` alone, (2) ``HotRows.load`` (read +
    ``RowCache.admit`` into a real cache of ``cap`` rows over a sparse table of the real geometry), each after
    dropping the page cache, (3) fio over as many bytes. Medians, and every repeat."""
    from sglang_ssd_stream.sidecar import SidecarReader

    out = []
    storage = np.empty((cap, ROW_BYTES), np.uint8)
    storage.fill(0)  # faulted in before any clock starts, as a server's pinned (registered) storage is
    for pct in shares:
        n = int(cap * pct / 100)
        budget = n * (ROW_BYTES + 8)
        reps = []
        for _ in range(repeats):
            how = drop_caches()
            io0 = _proc_read_bytes()
            t = time.perf_counter()
            got = read_hot_file(hot_path, manifest, (0, ROWS), budget)
            read_s = time.perf_counter() - t
            disk_bytes = _proc_read_bytes() - io0
            if got is None:
                raise RuntimeError(f"{hot_path} refused")
            read_rows, read_bytes = got.rows, got.nbytes
            del got
            cache = RowCache(SidecarReader(manifest.table(LAYER), max_rows=CHUNK_TOKENS * 16), storage,
                             RowCacheConfig(seed=0))
            hr = HotRows(manifest, {LAYER: cache}, share=pct / 100, interval_s=0, role="bench", path=hot_path)
            drop_caches()
            t = time.perf_counter()
            placed = hr.load()
            load_s = time.perf_counter() - t
            occupied = cache.occupancy()[0]
            cache.close()
            fio = fio_read(scratch / "fio-same-bytes.bin", read_bytes)
            (scratch / "fio-same-bytes.bin").unlink()
            reps.append({"read_hot_file_s": round(read_s, 3), "hotrows_load_s": round(load_s, 3),
                         "fio_s": fio["seconds"], "fio_direct": fio["direct"],
                         "fio_buffered_s": fio.get("buffered_seconds"), "process_read_bytes": disk_bytes})
        med = {k: float(np.median([r[k] for r in reps if r[k] is not None] or [np.nan]))
               for k in ("read_hot_file_s", "hotrows_load_s", "fio_s", "fio_buffered_s")}
        out.append({"share_pct": pct, "rows_asked": n, "rows_read": read_rows, "rows_placed": placed,
                    "rows_in_cache_after": occupied, "bytes_read": read_bytes, "cache_before_each": how,
                    "fio": {k: v for k, v in fio.items()
                            if k not in ("seconds", "bw_mib_s", "bytes", "buffered_seconds")},
                    "median": med, "repeats": reps,
                    "read_mib_s": round(read_bytes / med["read_hot_file_s"] / 2**20, 1),
                    "fio_mib_s": round(read_bytes / med["fio_s"] / 2**20, 1),
                    "read_over_fio": round(med["read_hot_file_s"] / med["fio_s"], 2),
                    "load_over_fio": round(med["hotrows_load_s"] / med["fio_s"], 2),
                    "read_over_fio_buffered": round(med["read_hot_file_s"] / med["fio_buffered_s"], 2),
                    "read_over_fio_each": [round(r["read_hot_file_s"] / r["fio_s"], 2) for r in reps],
                    "load_over_fio_each": [round(r["hotrows_load_s"] / r["fio_s"], 2) for r in reps]})
        print(f"  load {pct}%: {read_rows} rows, {read_bytes / 2**20:.0f} MiB: read {med['read_hot_file_s']:.2f} s, "
              f"load {med['hotrows_load_s']:.2f} s, fio {med['fio_s']:.2f} s (medians of {repeats})", flush=True)
    del storage
    return out


# ----------------------------------------------------------------------------- the run


def cmd_run(args) -> dict:
    ids = np.load(args.trace / "ids.npy", mmap_mode="r")
    starts = np.load(args.trace / "starts.npy")
    nreq_all = starts.size - 1
    tokens = int(starts[-1])
    split = int(np.searchsorted(starts, args.learn_fraction * tokens))  # first held-out request
    split = min(max(split, 1), nreq_all - 1)
    learn, held = range(0, split), range(split, nreq_all)
    conc, dec = args.concurrency, args.decode_tokens
    learn_calls = calls_of(starts, learn, args.replay, conc, dec)
    held_calls = calls_of(starts, held, args.replay, conc, dec)
    nheld = len(held)
    parts, bounds, req = dedup_calls(ids, held_calls)
    blib = belady_lib()
    scratch = args.dir
    scratch.mkdir(parents=True, exist_ok=True)
    table_file = scratch / "ple-real-geometry-sparse.bin"
    with open(table_file, "wb") as f:
        f.truncate(ROWS * ROW_BYTES)
    manifest = manifest_for(table_file)
    held_tokens = int(starts[held.stop] - starts[held.start])
    first_tokens = {k: int(starts[min(held.start + k, nreq_all)] - starts[held.start]) for k in FIRST}
    result = {
        "stream": args.name, "trace": str(args.trace), "replay": args.replay,
        "concurrency": conc if args.replay == "server" else 1, "decode_tokens": dec if args.replay == "server" else 0,
        "chunk_tokens": CHUNK_TOKENS, "policy": DEFAULT_POLICY, "requests": nreq_all, "tokens": tokens,
        "learn": {"requests": len(learn), "tokens": int(starts[split]), "calls": len(learn_calls)},
        "held_out": {"requests": nheld, "tokens": held_tokens, "calls": len(held_calls),
                     "first_tokens": first_tokens,
                     "distinct_rows": int(np.unique(np.concatenate(parts)).size)},
        "shares_pct": list(args.shares), "budgets": [],
    }
    print(f"{args.name}: learn {len(learn)} requests ({starts[split]} tokens), held out {nheld} "
          f"({held_tokens} tokens), {args.replay} replay", flush=True)
    for gib in args.budgets:
        budget = int(gib * GIB)
        cap = capacity_for_budget(budget, ROW_BYTES, max_rows=CHUNK_TOKENS * 16)
        row = {"budget_gib": gib, "budget_bytes": budget, "capacity_rows": cap,
               "metadata_bytes": metadata_bytes(cap), "counts_bytes": 2 * cap,
               "counts_share_of_budget": round(2 * cap / budget, 5)}
        t = time.perf_counter()
        sim = CacheSimulator(cap, total_rows=ROWS, row_bytes=ROW_BYTES, seed=0)
        replay(sim, ids, learn_calls, len(learn), 0)
        hot_ids, hot_counts = sim.hottest(cap)  # the file a 100 % share writes: every share's is its prefix
        sim.close()
        hot_path = scratch / f"{args.name}-{gib}gib.plehot"
        rows = stand_in_rows(hot_ids)
        t_w = time.perf_counter()
        size = write_hot_file(hot_path, manifest, (0, ROWS), {LAYER: (hot_ids, rows)}, role="bench")
        row["hot_file"] = {"rows": int(hot_ids.size), "bytes": size, "write_s": round(time.perf_counter() - t_w, 2),
                           "counts_min_max": [int(hot_counts.min()), int(hot_counts.max())] if hot_ids.size else None}
        del rows
        print(f"{gib} GiB: {cap} rows; learned {hot_ids.size} hot rows ({size / 2**20:.0f} MiB file) in "
              f"{time.perf_counter() - t:.1f} s", flush=True)
        got = read_hot_file(hot_path, manifest, (0, ROWS), hot_ids.size * (ROW_BYTES + 8))
        if got is None or not np.array_equal(got.layers[LAYER][0], hot_ids):
            raise RuntimeError("the hot file did not read back as written")
        del got
        runs = {}
        sim = CacheSimulator(cap, total_rows=ROWS, row_bytes=ROW_BYTES, seed=0)
        runs["today_cold"] = summary(replay(sim, ids, held_calls, nheld, held.start))
        sim.close()
        for pct in args.shares:
            n = int(cap * pct / 100)
            sim = CacheSimulator(cap, total_rows=ROWS, row_bytes=ROW_BYTES, seed=0)
            placed = sim.admit(hot_ids[:n])
            s = summary(replay(sim, ids, held_calls, nheld, held.start))
            s["rows_admitted"] = placed
            sim.close()
            runs[f"hot_{pct}"] = s
        for pct in args.reverse_shares:  # the same rows admitted coldest first: the hottest leave the FIFO last
            n = int(cap * pct / 100)
            sim = CacheSimulator(cap, total_rows=ROWS, row_bytes=ROW_BYTES, seed=0)
            placed = sim.admit(hot_ids[:n][::-1])
            s = summary(replay(sim, ids, held_calls, nheld, held.start))
            s["rows_admitted"] = placed
            sim.close()
            runs[f"hot_{pct}_coldest_first"] = s
        runs["belady_cold"] = summary(belady(blib, parts, bounds, req, nheld, held.start, cap, None))
        for pct in args.belady_shares:
            n = int(cap * pct / 100)
            runs[f"belady_hot_{pct}"] = summary(belady(blib, parts, bounds, req, nheld, held.start, cap,
                                                       hot_ids[:n]))
        row["runs"] = runs
        cold = runs["today_cold"]
        ratios = {}
        for name, s in runs.items():
            ratios[name] = {k: round(s[k] / cold[k], 3) if cold[k] else None
                            for k in s if k.endswith("_rows") or k.endswith("_pages")}
        row["ratio_to_today"] = ratios
        for pct in args.shares:
            r = ratios[f"hot_{pct}"]
            print(f"  hot {pct}%: first request {r['first1_rows']}x today's rows, first 4 {r['first4_rows']}x, "
                  f"whole {r['whole_rows']}x", flush=True)
        print(f"  belady cold: first {ratios['belady_cold']['first1_rows']}x, whole "
              f"{ratios['belady_cold']['whole_rows']}x ({time.perf_counter() - t:.1f} s)", flush=True)
        if gib in args.load_budgets:
            row["load"] = timed_loads(hot_path, table_file, manifest, cap, args.shares, scratch, args.repeats)
        hot_path.unlink()
        result["budgets"].append(row)
    table_file.unlink()
    return result


def cmd_report(args) -> str:
    """Markdown tables of ``run`` results (what docs/hot-file-measured.md shows)."""
    out = []
    for path in args.results:
        d = json.loads(Path(path).read_text())
        shares = d["shares_pct"]
        rev = sorted({int(k.split("_")[1]) for b in d["budgets"] for k in b["runs"] if k.endswith("coldest_first")})
        bh = sorted({int(k.rsplit("_", 1)[1]) for b in d["budgets"] for k in b["runs"] if k.startswith("belady_hot_")})
        ho = d["held_out"]
        out.append(f"### {d['stream']} ({path}: {d['replay']} replay; held out {ho['requests']} requests, "
                   f"{ho['tokens']:,} tokens)\n")
        for key, what in (("first1", "the first request"), ("first4", "the first 4 requests"),
                          ("whole", "the whole held-out stream")):
            ntok = ho["first_tokens"].get(key[5:], 0) if key != "whole" else ho["tokens"]
            cols = ([f"hot {p} %" for p in shares] + [f"hot {p} % coldest first" for p in rev]
                    + ["Belady cold"] + [f"Belady from hot {p} %" for p in bh])
            gap = max(abs(q[n][key + "_rows"] - q[n][key + "_pages"]) for b in d["budgets"]
                      for q in [b["ratio_to_today"]] for n in q)
            out.append(f"Rows read by {what} ({ntok:,} tokens): today's cold cache in rows (4 KiB pages in brackets), "
                       f"the others as a ratio to it (the ratio in pages differs by at most {gap:.3f})\n")
            out.append("| budget | today rows (pages) | " + " | ".join(cols) + " |")
            out.append("|" + " --- |" * (len(cols) + 2))
            for b in d["budgets"]:
                r, q = b["runs"], b["ratio_to_today"]
                names = ([f"hot_{p}" for p in shares] + [f"hot_{p}_coldest_first" for p in rev] + ["belady_cold"]
                         + [f"belady_hot_{p}" for p in bh])
                cells = [f"{q[n][key + '_rows']:.2f}" for n in names]
                t = r["today_cold"]
                out.append(f"| {b['budget_gib']} GiB | {t[key + '_rows']:,} ({t[key + '_pages']:,}) | "
                           + " | ".join(cells) + " |")
            out.append("")
        loads = [(b["budget_gib"], ld) for b in d["budgets"] for ld in b.get("load", [])]
        if loads:
            out.append("Loading the hot file (page cache dropped before each) against fio's sequential read of as "
                       "many bytes in the same run: medians of the repeats, their range in brackets\n")
            out.append("| budget | share | rows | MiB | read_hot_file s | HotRows.load s | fio s | read / fio | "
                       "load / fio |")
            out.append("|" + " --- |" * 9)
            for gib, ld in loads:
                if "median" not in ld:  # one sample per share
                    ld = dict(ld, median={"read_hot_file_s": ld["read_hot_file_s"], "hotrows_load_s":
                                          ld["hotrows_load_s"], "fio_s": ld["fio"]["seconds"]},
                              read_over_fio_each=[ld["read_over_fio"]], load_over_fio_each=[ld["load_over_fio"]])
                m = ld["median"]
                rr = "-".join(f"{v:.1f}" for v in (min(ld["read_over_fio_each"]), max(ld["read_over_fio_each"])))
                lr = "-".join(f"{v:.1f}" for v in (min(ld["load_over_fio_each"]), max(ld["load_over_fio_each"])))
                out.append(f"| {gib} GiB | {ld['share_pct']} % | {ld['rows_read']:,} | {ld['bytes_read'] / 2**20:.0f} "
                           f"| {m['read_hot_file_s']:.2f} | {m['hotrows_load_s']:.2f} | {m['fio_s']:.2f} "
                           f"| {ld['read_over_fio']:.1f} ({rr}) | {ld['load_over_fio']:.1f} ({lr}) |")
            out.append("")
        out.append("| budget | slots | counts (2 B a slot) | of the budget | hot rows learned |")
        out.append("| --- | --- | --- | --- | --- |")
        for b in d["budgets"]:
            out.append(f"| {b['budget_gib']} GiB | {b['capacity_rows']:,} | {b['counts_bytes'] / 2**20:.1f} MiB | "
                       f"{100 * b['counts_share_of_budget']:.2f} % | {b['hot_file']['rows']:,} |")
        out.append("")
    return "\n".join(out)


def hash_rate() -> dict:
    """SHA-256 over 256 MiB in memory on one thread and on the reader's 4 (the CPU floor of read_hot_file's
    checks on this box, next to the disk's)."""
    import concurrent.futures

    buf = np.random.default_rng(0).integers(0, 256, 256 << 20, dtype=np.uint8)
    t = time.perf_counter()
    hashlib.sha256(memoryview(buf)).digest()
    one = time.perf_counter() - t
    parts = np.array_split(buf, 4)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        t = time.perf_counter()
        list(pool.map(lambda a: hashlib.sha256(memoryview(a)).digest(), parts))
        four = time.perf_counter() - t
    return {"sha256_1_thread_mib_s": round(256 / one, 1), "sha256_4_threads_mib_s": round(256 / four, 1)}


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    mem = next((int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemTotal")), 0)
    return {"cpu": cpu, "cpus": os.cpu_count(), "kernel": platform.release(), "machine": platform.machine(),
            "memory_bytes": mem, "loadavg": Path("/proc/loadavg").read_text().split()[:3],
            "python": platform.python_version(), "numpy": np.__version__}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prose-trace")
    p.add_argument("--corpus", type=Path, required=True, help="a directory of text files")
    p.add_argument("--glob", default="*.txt")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--stats", type=Path, required=True)
    p.add_argument("--vocab-size", type=int, default=151_643)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=8192)
    p = sub.add_parser("run")
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--replay", choices=("sequential", "server"), default="sequential")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--learn-fraction", type=float, default=0.5)
    p.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS_GIB))
    p.add_argument("--shares", type=int, nargs="+", default=list(SHARES_PCT))
    p.add_argument("--reverse-shares", type=int, nargs="*", default=[],
                   help="shares also measured with the hot rows admitted coldest first (a variant of HotRows.load)")
    p.add_argument("--belady-shares", type=int, nargs="*", default=[25, 100])
    p.add_argument("--load-budgets", type=float, nargs="*", default=list(BUDGETS_GIB),
                   help="budgets whose hot-file loads are timed against fio")
    p.add_argument("--repeats", type=int, default=3, help="timed loads per share (medians reported)")
    p.add_argument("--dir", type=Path, default=Path("/var/tmp/hotbench"), help="scratch: hot files, fio's file")
    p.add_argument("--out", type=Path)
    p = sub.add_parser("report")
    p.add_argument("results", nargs="+", help="JSON files written by run")
    args = ap.parse_args(argv)
    if args.cmd == "report":
        print(cmd_report(args))
        return 0
    t = time.perf_counter()
    start_machine = machine()
    if args.cmd == "prose-trace":
        stats = cmd_prose_trace(args)
        stats["machine"] = machine()
        args.stats.parent.mkdir(parents=True, exist_ok=True)
        args.stats.write_text(json.dumps(stats, indent=1) + "\n")
        return 0
    result = cmd_run(args)
    result.update(command=shlex.join(["python", *sys.argv]), machine=start_machine, hashing=hash_rate(),
                  loadavg_at_end=machine()["loadavg"],
                  seconds=round(time.perf_counter() - t, 1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
