"""Build an in-place PLE sidecar: ``ssd-stream.json`` naming regions of the checkpoint's own shards, no copy.

A safetensors tensor is one contiguous row-major byte range of its file, so each PLE shard tensor
``…ngram_embedding.shard_{k}.weight`` is already rows ``[k × ceil(rows / parts), …)`` of its table as
the engines hold it. The builder reads the safetensors headers (checked against the ``safetensors``
library, as the copying builder does), hashes each region once, and writes the manifest (version 2,
:mod:`.format`) atomically into the checkpoint directory. Nothing else is written there but the
verified cache of the hashes it took, recorded as the copying builder's re-read is
(:func:`.verify.record_built`), so the first serving start re-reads nothing: the ``weight_scale``
tensors stay in the checkpoint's shards, where ``find_weight_scales`` finds them through the index.

Refused, naming the tensor: a PLE shard tensor that is not a 2-D ``[rows, columns]`` matrix filling its
byte range, and one whose dtype the engines would convert at load (anything but ``F8_E4M3``/``BF16``,
or, where ``config.json`` declares ``ple_embedding_dtype``, another dtype than that). A dtype the engine
picks from a quantization config is checked when it serves (``check_model_shape``), as for a copy.
Refused too: a shard outside the trust rule (the checkpoint's directory and, for a Hugging Face
snapshot, its ``blobs/``), and a shard written while it was hashed.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path

from ..atomic_file import write_atomic
from ..errors import EnvironmentProblem, RefusedSourceState
from . import _safetensors
from .build import (
    SHARD_TENSOR,
    BuildResult,
    PleLayerSource,
    _checkpoint_tensors,
    _write_scales,
    find_ple_shards,
    select_sources,
)
from .errors import SidecarCheckpointError
from .format import (
    DTYPE_ITEMSIZE,
    FORMAT,
    MANIFEST_NAME,
    VERSION_IN_PLACE,
    _allowed_roots,
    resolve_table_path,
)
from .verify import BUILD, file_key, record_built, sha256_file, verify_sidecar
from .view import load_sidecar, view_trusted_roots


def declared_ple_dtype(checkpoint: Path) -> str | None:
    """``ple_embedding_dtype`` from ``config.json`` (top level or ``text_config``), when it says one."""
    cfg_path = checkpoint / "config.json"
    if not cfg_path.is_file():
        return None
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise SidecarCheckpointError(f"{cfg_path}: unreadable config ({exc})", path=str(cfg_path)) from exc
    for scope in (cfg, cfg.get("text_config") if isinstance(cfg, dict) else None):
        if isinstance(scope, dict) and scope.get("ple_embedding_dtype") is not None:
            return str(scope["ple_embedding_dtype"]).removeprefix("torch.")
    return None


def refuse_unservable(checkpoint: Path, tensors: dict[str, _safetensors.TensorInfo]) -> None:
    """Every PLE shard tensor can be served from where it lies, or :class:`SidecarCheckpointError` naming it."""
    declared = declared_ple_dtype(checkpoint)
    for name in sorted(tensors):
        info = tensors[name]
        if not SHARD_TENSOR.search(name) or "mtp" in name:
            continue
        if info.dtype not in DTYPE_ITEMSIZE or (declared is not None and info.dtype != declared):
            want = declared if declared is not None else " or ".join(sorted(DTYPE_ITEMSIZE))
            raise SidecarCheckpointError(
                f"{info.file}: PLE tensor {name} is {info.dtype}, but the engines hold the table as {want} and would "
                f"convert it at load, so its bytes are not the rows they serve; serve it from a copied sidecar "
                f"(`sidecar build CHECKPOINT -o DIR`) of a checkpoint in {want}",
                path=str(info.file), actual=info.dtype, expected=want)
        if len(info.shape) != 2 or info.nbytes != info.shape[0] * info.shape[1] * DTYPE_ITEMSIZE[info.dtype]:
            raise SidecarCheckpointError(
                f"{info.file}: PLE tensor {name} has shape {list(info.shape)} in {info.nbytes} bytes, not a row-major "
                f"[rows, columns] matrix filling its byte range; it cannot be read in place",
                path=str(info.file), actual=list(info.shape), expected="[rows, columns]")


def _regions(checkpoint: Path, src: PleLayerSource, manifest_path: Path, roots: list[str]) -> list[dict]:
    """The layer's non-empty shards in row order as manifest regions (hashes still to come), each file checked
    against the trust rule before a byte of it is read."""
    out, row = [], 0
    row_bytes = src.columns * DTYPE_ITEMSIZE[src.dtype]
    for info in src.shards:
        rows = info.shape[0]
        if rows == 0:
            continue  # trailing empty shards hold no row
        rel = info.file.relative_to(checkpoint).as_posix()
        real = resolve_table_path(manifest_path, checkpoint, rel, roots)
        out.append({"path": rel, "tensor": info.name, "offset": info.offset, "row_start": row, "rows": rows,
                    "sha256": None, "file_bytes": None, "file_mtime_ns": None, "_file": real,
                    "_bytes": rows * row_bytes})
        row += rows
    return out


def _hash_regions(regions: list[dict], progress: bool) -> dict[Path, os.stat_result]:
    """Hash every region once, file by file in offset order; fill sha256, file_bytes and file_mtime_ns. Returns
    each file's stat from before its regions were hashed, refusing a file whose stat moved meanwhile."""
    by_file: dict[Path, list[dict]] = {}
    for r in regions:
        by_file.setdefault(r["_file"], []).append(r)
    stats = {}
    for file, rs in by_file.items():
        before = os.stat(file)
        for r in sorted(rs, key=lambda r: r["offset"]):
            r["sha256"] = sha256_file(file, expected_bytes=r["_bytes"], offset=r["offset"], progress=progress,
                                      desc=f"hash {Path(r['path']).name}")
            r["file_bytes"], r["file_mtime_ns"] = before.st_size, before.st_mtime_ns
        if file_key(os.stat(file)) != file_key(before):
            raise SidecarCheckpointError(f"{file} was written while its PLE regions were hashed; build again once "
                                         f"the checkpoint is complete", path=str(file))
        stats[file] = before
    return stats


def build_in_place(
    checkpoint: str | os.PathLike,
    *,
    split_ngram_parts: int | None = None,
    layers: Iterable[int] | None = None,
    expected_rows: int | None = None,
    expected_columns: int | None = None,
    force: bool = False,
    progress: bool = True,
    cache_dir: str | os.PathLike | None = None,
) -> BuildResult:
    """Write ``CHECKPOINT/ssd-stream.json`` naming the PLE shards' regions in place (one hashing pass, no copy).

    Args and refusals as :func:`.build.build_sidecar` (``RefusedSourceState`` for an existing manifest without
    ``force``), plus :func:`refuse_unservable`'s. The shards may resolve where the one loader
    (:func:`.view.load_sidecar`) lets this directory's tables resolve: a model view built in place reads its
    dense snapshot's. The result's ``verify`` is the serving check's view of the verified cache just recorded
    (every table ``cached``).
    """
    t0 = time.monotonic()
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise SidecarCheckpointError(f"{checkpoint}: checkpoint directory not found", path=str(checkpoint))
    tensors = _checkpoint_tensors(checkpoint)
    refuse_unservable(checkpoint, tensors)
    sources = select_sources(checkpoint, find_ple_shards(checkpoint, split_ngram_parts=split_ngram_parts,
                                                         tensors=tensors),
                             layers=layers, expected_rows=expected_rows, expected_columns=expected_columns)
    manifest_path = checkpoint / MANIFEST_NAME
    if (manifest_path.exists() or manifest_path.is_symlink()) and not force:
        raise RefusedSourceState(f"{manifest_path} already exists; pass --force to rebuild the sidecar")

    roots = _allowed_roots(checkpoint, view_trusted_roots(checkpoint))
    tables = {n: _regions(checkpoint, s, manifest_path, roots) for n, s in sources.items()}
    stats = _hash_regions([r for rs in tables.values() for r in rs], progress)
    doc = {
        "format": FORMAT,
        "version": VERSION_IN_PLACE,
        "tables": [
            {"layer": n, "dtype": s.dtype, "rows": s.rows, "columns": s.columns, "row_start": 0,
             "regions": [{k: v for k, v in r.items() if not k.startswith("_")} for r in tables[n]]}
            for n, s in sources.items()
        ],
    }
    try:
        write_atomic(manifest_path, json.dumps(doc, indent=1) + "\n")
    except OSError as exc:  # a read-only checkpoint, a full disk: the copied sidecar writes elsewhere
        raise EnvironmentProblem(f"cannot write {manifest_path}: {exc.strerror or exc}; an in-place sidecar lives in "
                                 f"the checkpoint's directory (a copied one goes where -o says)") from exc
    manifest = load_sidecar(manifest_path)  # the one loader validates what was just written
    record_built(manifest, stats, cache_dir=cache_dir)
    report = verify_sidecar(manifest, caller=BUILD, cache_dir=cache_dir, progress=progress)
    scale_file, scales = _write_scales(checkpoint, checkpoint, tensors, sources)  # in the checkpoint: writes nothing
    return BuildResult(manifest, scale_file, scales, report, time.monotonic() - t0)


__all__ = ["build_in_place", "refuse_unservable", "declared_ple_dtype"]
