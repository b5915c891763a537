"""Tensor-parallel PLE on CPU: each engine's real vocab-range arithmetic, gloo all-reduce, TP=1 bytes.

Engine-neutral (torch, numpy, our sidecar reader); the engine only supplies its range function,
imported from the engine's own ``vocab_parallel_embedding`` module, so the same driver runs in
the vLLM venv (``--engine vllm``) and in the SGLang venv (``--engine sglang``)::

    python -m tests.vllm.tp_ple --engine vllm --world 2 --out /tmp/tp

The ranges are the engine's, computed once by the driver (the range function is pure in ``rank``
and ``world``, so each rank gets exactly what it would compute itself) and handed to the ranks,
which import torch and our sidecar reader but not the engine (its import is most of a rank's
start). Every rank reads only the rows its range owns (``SidecarReader(vocab_start, vocab_end)``; other
ranks' rows stay zero), then an all-reduce over gloo assembles full rows: FP8 bytes as an
``int8`` view (exactly one rank owns each row, so the sum is that rank's byte), BF16 as BF16
(``x + 0`` is exact for the finite, non-negative-zero values the test table holds). The result
must equal a TP=1 read bit for bit, for random ids, ids at every shard boundary, and duplicates.
Exit status 0 when every case matches; the report is ``<out>/report.json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import sys
from pathlib import Path

import numpy as np

PADDING = {  # (module, padding constant used for the PLE table) per engine
    "vllm": ("vllm.model_executor.layers.vocab_parallel_embedding", None),  # vLLM pads to the table divisor
    "sglang": ("sglang.srt.layers.vocab_parallel_embedding", "DEFAULT_VOCAB_PADDING_SIZE"),
}


def engine_range(engine: str, rows: int, divisor: int, rank: int, world: int) -> tuple[int, int]:
    """``[org_vocab_start_index, org_vocab_end_index)`` of ``rank``, computed by the engine itself."""
    module_name, padding_attr = PADDING[engine]
    mod = importlib.import_module(module_name)
    padding = divisor if padding_attr is None else getattr(mod, padding_attr)
    padded = mod.pad_vocab_size(rows, padding)
    idx = mod.VocabParallelEmbedding._get_indices(padded, padded, rows, rows, rank, world)
    return idx.org_vocab_start_index, idx.org_vocab_end_index


def id_cases(rows: int, bounds: list[tuple[int, int]], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    edges = sorted({x for lo, hi in bounds for x in (lo - 1, lo, lo + 1, hi - 1, hi) if 0 <= x < rows} | {0, rows - 1})
    edges = np.array(edges, dtype=np.int64)
    return {
        "random": rng.integers(0, rows, 4096),
        "boundaries": edges,
        "duplicates": rng.choice(edges, 257).astype(np.int64),
        "mixed": rng.permutation(np.concatenate([edges, edges, rng.integers(0, rows, 300)])),
    }


def _rank(rank: int, world: int, args) -> None:
    import torch
    import torch.distributed as dist

    from sglang_ssd_stream.sidecar import SidecarReader, load_manifest

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world)
    table = load_manifest(args.sidecar).table(args.layer)
    bounds = args.bounds  # the engine's own ranges, computed by the driver (run)
    lo, hi = bounds[rank]
    cases = id_cases(table.rows, bounds)
    with SidecarReader(table, vocab_start=lo, vocab_end=hi, max_rows=4096, workers=2) as reader:
        out = {}
        for name, ids in cases.items():
            rows = np.empty((ids.size, table.row_bytes), np.uint8)
            reader.read_rows(ids, rows)
            t = torch.from_numpy(rows)
            if table.dtype == "float8_e4m3fn":
                t = t.view(torch.int8)  # what vLLM's _reduce_etp_embeddings does for FP8
            else:
                t = t.view(torch.bfloat16)
            dist.all_reduce(t)
            out[name] = t.view(torch.uint8).numpy().copy()
    if rank == 0:
        np.savez(Path(args.out) / "tp.npz", **out)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(engine: str, sidecar: str, layer: int, divisor: int, world: int, out: str) -> dict:
    import torch.multiprocessing as mp

    from sglang_ssd_stream.sidecar import SidecarReader, load_manifest

    table = load_manifest(sidecar).table(layer)
    bounds = [engine_range(engine, table.rows, divisor, r, world) for r in range(world)]
    args = argparse.Namespace(sidecar=sidecar, layer=layer, out=out, port=free_port(), bounds=bounds)
    Path(out).mkdir(parents=True, exist_ok=True)
    mp.start_processes(_rank, args=(world, args), nprocs=world, start_method="spawn")
    got = np.load(Path(out) / "tp.npz")
    report = {"engine": engine, "world": world, "dtype": table.dtype, "rows": table.rows, "bounds": bounds,
              "cases": {}}
    with SidecarReader(table, max_rows=4096, workers=1) as full:  # TP=1: every row owned
        for name, ids in id_cases(table.rows, bounds).items():
            want = np.empty((ids.size, table.row_bytes), np.uint8)
            full.read_rows(ids, want)
            report["cases"][name] = {"ids": int(ids.size), "equal": bool(np.array_equal(got[name], want))}
    covered = bounds[0][0] == 0 and bounds[-1][1] == table.rows and all(
        bounds[i][1] == bounds[i + 1][0] for i in range(world - 1))
    report["ranges_tile_the_table"] = covered
    report["ok"] = covered and all(c["equal"] for c in report["cases"].values())
    (Path(out) / "report.json").write_text(json.dumps(report, indent=1))
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=sorted(PADDING), required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", choices=["float8_e4m3fn", "bfloat16"], default="float8_e4m3fn")
    p.add_argument("--rows", type=int, default=2000, help="table rows (not a multiple of 64: engine padding matters)")
    p.add_argument("--divisor", type=int, default=8, help="make_ngram_vocab_size_divisible_by of the config")
    a = p.parse_args(argv)
    from tests.vllm.synthetic import finite_fp8_table, write_sidecar

    cols = 10
    data = finite_fp8_table(a.rows, cols * (1 if a.dtype == "float8_e4m3fn" else 2), seed=7)
    if a.dtype == "bfloat16":
        data[:, 1::2] &= 0x7F  # non-negative bf16 (high byte's sign bit clear): no -0.0, x + 0 is exact
        data[:, 1::2] = np.minimum(data[:, 1::2], 0x7E)  # and finite (exponent below all-ones)
    manifest = write_sidecar(Path(a.out) / "sidecar", {3: (a.dtype, data)})
    report = run(a.engine, str(manifest), 3, a.divisor, a.world, a.out)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
