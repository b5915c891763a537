#!/usr/bin/env python3
"""NEXTN/Mamba track-index bounds of sglang 0.5.23, checked on a GPU (issue 9 item 1).

Self-contained: needs torch and triton only (the GPU machine has torch 2.11 / triton 3.6 and no
sglang). The two Triton kernels that compute the post-verify commit indices, and their Python
launchers, are pulled out of copies of the sglang files with ``ast`` (as the PLE gather kernel is,
see cpu-and-gpu-testing.md §5):

- ``kernels/ops/mamba/mamba_state_scatter_triton.py``: ``_fused_commit_track_indices_kernel`` +
  ``fused_commit_track_indices`` (reached from ``spec_utils._verify_commit_step_indices`` on CUDA);
- ``kernels/ops/speculative/eagle.py``: ``_verify_commit_outputs_kernel`` +
  ``prepare_verify_commit_outputs`` (the NEXTN topk=1 fused verify path of
  ``eagle_worker_common``; the fourth site, not named in the reference).

Property, per request row: ``last`` is the step of accept slot ``al-1``, and when the verify
crosses a tracking-interval boundary the tracked step is the accepted step whose state holds
exactly the last boundary's token count (``-1`` otherwise). The oracle enumerates the accepted
slots; it does not reuse the kernels' closed form. The same property is also run against
upstream PR #35821's verbatim ``min(tp - pre, al - 1)`` form, which must be caught.

Run on the device machine from the repo root (the lead copies the two files first):

    mkdir -p .gpu/nextn-src && cp $SITE/sglang/kernels/ops/mamba/mamba_state_scatter_triton.py \\
        $SITE/sglang/kernels/ops/speculative/eagle.py .gpu/nextn-src/
    python scripts/gpu/nextn_track_bounds_h200.py --src .gpu/nextn-src --out $OUT/nextn_track_bounds.json

(``carry=[".gpu/nextn-src"]``.) On the CPU machine: ``TRITON_INTERPRET=1 ... --device cpu --quick``.
Exit status 0 only when every real kernel row holds and every upstream-form run is caught.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import itertools
import json
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# file name -> (kernel, launcher) to pull out of it
KERNELS = {
    "mamba_state_scatter_triton.py": ("_fused_commit_track_indices_kernel", "fused_commit_track_indices"),
    "eagle.py": ("_verify_commit_outputs_kernel", "prepare_verify_commit_outputs"),
}
# file name -> (0.5.23 snippet, the same line in upstream PR #35821's verbatim form)
UPSTREAM_FORMS = {
    "mamba_state_scatter_triton.py": ("ti = tp - pre - 1", "ti = tl.minimum(tp - pre, al - 1)"),
    "eagle.py": ("post // TRACK_INTERVAL * TRACK_INTERVAL - length - 1, 0",
                 "tl.minimum(post // TRACK_INTERVAL * TRACK_INTERVAL - length, accepted - 1), 0"),
}
_PRELUDE = "import torch\nimport triton\nimport triton.language as tl\n\n\n"
_tmp = tempfile.TemporaryDirectory(prefix="nextn-kernels-")  # sources must outlive the module (triton reads them)


def extract_module(path: Path, names: tuple[str, ...], upstream_form: bool = False):
    """Import just ``names`` (with decorators) from the sglang file at ``path``; optionally in upstream's form."""
    source = path.read_text()
    tree = ast.parse(source)
    found = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names}
    missing = set(names) - set(found)
    if missing:
        raise SystemExit(f"{path}: no top-level function(s) {sorted(missing)}; is this sglang 0.5.23?")
    lines = source.splitlines(keepends=True)
    parts = []
    for name in names:
        node = found[name]
        start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
        parts.append("".join(lines[start:node.end_lineno]))
    body = _PRELUDE + "\n\n".join(parts)
    if upstream_form:
        old, new = UPSTREAM_FORMS[path.name]
        if body.count(old) != 1:
            raise SystemExit(f"{path}: expected the snippet {old!r} exactly once; the code changed")
        body = body.replace(old, new)
    tag = ("upstream_" if upstream_form else "") + path.stem
    out = Path(_tmp.name) / f"{tag}_{hashlib.sha256(body.encode()).hexdigest()[:12]}.py"
    out.write_text(body)
    spec = importlib.util.spec_from_file_location(out.stem, out)
    module = importlib.util.module_from_spec(spec)
    sys.modules[out.stem] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class Batch:
    """One verify step: per row the pre-verify length, accept length and accepted tree nodes."""

    dtn: int  # draft tokens per request (verify width)
    interval: int  # mamba tracking grid
    pre: list[int] = field(default_factory=list)
    al: list[int] = field(default_factory=list)
    nodes: list[list[int]] = field(default_factory=list)  # strictly increasing, nodes[0] == 0 (the root)

    def add(self, pre: int, al: int, nodes: list[int]) -> None:
        assert 1 <= al == len(nodes) <= self.dtn and nodes[0] == 0, (pre, al, nodes)
        self.pre.append(pre)
        self.al.append(al)
        self.nodes.append(nodes)

    def tensors(self, device: str):
        import torch

        bs, width = len(self.al), self.dtn
        accept_index = torch.full((bs, width), -1, dtype=torch.int32)
        for b, nodes in enumerate(self.nodes):
            accept_index[b, : len(nodes)] = torch.tensor(nodes, dtype=torch.int32) + b * self.dtn
        return (accept_index.to(device), torch.tensor(self.al, dtype=torch.int32, device=device),
                torch.tensor(self.pre, dtype=torch.int64, device=device))


def expected(pre: int, al: int, nodes: list[int], interval: int) -> tuple[int, int]:
    """(last step, tracked step or -1) by enumeration: slot i holds the state after pre+i+1 tokens."""
    boundary_slots = [i for i in range(al) if (pre + i + 1) % interval == 0]
    return nodes[al - 1], (nodes[boundary_slots[-1]] if boundary_slots else -1)


def violations(batch: Batch, last, track) -> list[dict]:
    """Rows where the kernel disagrees with the oracle (or tracks a step that was not accepted)."""
    bad = []
    for b, (pre, al, nodes) in enumerate(zip(batch.pre, batch.al, batch.nodes, strict=False)):
        want_last, want_track = expected(pre, al, nodes, batch.interval)
        got_last, got_track = int(last[b]), int(track[b])
        accepted_step = got_track == -1 or got_track in nodes
        if (got_last, got_track) != (want_last, want_track) or not accepted_step:
            bad.append({"seq_len_pre": pre, "accept_len": al, "interval": batch.interval, "draft_tokens": batch.dtn,
                        "accepted_nodes": nodes, "got": [got_last, got_track], "want": [want_last, want_track]})
    return bad


def run_fused_commit(module, batch: Batch, device: str):
    accept_index, accept_lens, seq_lens = batch.tensors(device)
    last, track = module.fused_commit_track_indices(accept_index, accept_lens, seq_lens, batch.dtn, batch.interval)
    return last.cpu().tolist(), track.cpu().tolist()


def run_verify_commit_outputs(module, batch: Batch, device: str):
    import torch

    accept_index, accept_lens, seq_lens = batch.tensors(device)
    predict = torch.zeros(accept_index.shape[0] * batch.dtn, dtype=torch.int32, device=device)
    _, _, (last, track), _ = module.prepare_verify_commit_outputs(
        predict, accept_index, accept_lens, seq_lens, num_draft_tokens=batch.dtn, mamba_track_interval=batch.interval)
    return last.cpu().tolist(), track.cpu().tolist()


RUNNERS = {"mamba_state_scatter_triton.py": run_fused_commit, "eagle.py": run_verify_commit_outputs}


def pre_lengths(interval: int, dtn: int) -> list[int]:
    """Every length up to three intervals when small; otherwise the neighbourhoods of boundaries (incl. ~1M)."""
    if 3 * interval + dtn + 2 <= 400:
        return list(range(1, 3 * interval + dtn + 2))
    around = [k * interval for k in (1, 2, 3, 1_000_003 // interval)]
    return sorted({max(1, c + off) for c in around for off in range(-dtn - 1, dtn + 2)} | set(range(1, dtn + 2)))


def grid_batches(dtns, intervals, seed: int):
    """One batch per (draft width, interval): every (pre, al) as a chain (topk=1) row and a random tree row."""
    rng = random.Random(seed)
    for dtn, interval in itertools.product(dtns, intervals):
        batch = Batch(dtn, interval)
        for pre in pre_lengths(interval, dtn):
            for al in range(1, dtn + 1):
                batch.add(pre, al, list(range(al)))
                batch.add(pre, al, [0] + sorted(rng.sample(range(1, dtn), al - 1)))
        yield batch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, required=True, help="folder with copies of " + " and ".join(KERNELS))
    ap.add_argument("--out", type=Path, required=True, help="JSON result file")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small grid (for the CPU interpreter)")
    ap.add_argument("--seed", type=int, default=9)
    args = ap.parse_args(argv)

    import torch
    import triton

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device; use --device cpu with TRITON_INTERPRET=1")
    if args.quick:
        dtns, intervals = (1, 2, 4), (1, 2, 3, 5, 64)
    else:  # DRAFT_WIDTH and TRACK_INTERVAL are constexpr in eagle.py: each pair compiles once
        dtns, intervals = (1, 2, 3, 4, 5, 8), (1, 2, 3, 4, 5, 7, 8, 16, 33, 64, 128, 256, 512, 1024)
    started = time.time()
    result = {"command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (TRITON_INTERPRET)",
              "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
              "sglang_files": {}, "real": {}, "upstream_form": {}}
    for name, names in KERNELS.items():
        path = args.src / name
        result["sglang_files"][name] = hashlib.sha256(path.read_bytes()).hexdigest()
        for key, upstream in (("real", False), ("upstream_form", True)):
            module = extract_module(path, names, upstream_form=upstream)
            rows, bad = 0, []
            for batch in grid_batches(dtns, intervals, args.seed):
                rows += len(batch.al)
                bad += violations(batch, *RUNNERS[name](module, batch, args.device))
            result[key][names[0]] = {"rows": rows, "violations": len(bad), "examples": bad[:3]}
    result["ok"] = (all(r["violations"] == 0 for r in result["real"].values())
                    and all(r["violations"] > 0 for r in result["upstream_form"].values()))
    result["seconds"] = round(time.time() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("device", "ok", "seconds")}
                     | {k: {n: v["violations"] for n, v in result[k].items()} for k in ("real", "upstream_form")}))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
