"""Build a PLE sidecar from a Hugging Face checkpoint's PLE shards.

The checkpoint stores each PLE table split into ``split_ngram_parts`` (default 512) tensors
``…layers.{L}.ple.ple_embedding.ngram_embedding.shard_{k}.weight`` of ``ceil(rows / parts)``
rows each (the last ones shorter or absent), in fp8 (``F8_E4M3``) or bf16. The builder copies
them byte for byte, shard by shard through one 8 MiB buffer (bounded RAM), into
``ple/layer-{L}.bin``, hashing as it writes; tables go to ``.partial`` files renamed only when
all are complete, and ``ssd-stream.json`` is written last, so an interrupted build never leaves
a manifest that points at a half-written table, a failed ``--force`` rebuild leaves the old
sidecar as it was (unless it fails in the final renames), and a rerun starts clean. The PLE ``weight_scale`` tensors
are copied to ``model-plefp8-scale.safetensors`` (unless the output is the checkpoint itself,
which already holds them).

Needs no torch: safetensors headers are parsed directly (and cross-checked with the
``safetensors`` library's ``safe_open``), because numpy has no fp8/bf16 and the bytes are
copied unchanged anyway.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..atomic_file import fsync_dir, write_atomic
from ..errors import EnvironmentProblem, RefusedSourceState
from . import _safetensors
from .errors import SidecarCheckpointError
from .format import (
    DTYPE_ITEMSIZE,
    FORMAT,
    INDEX_NAME,
    MANIFEST_NAME,
    SCALE_FILE_NAME,
    SCALE_TENSOR,
    VERSION,
    SidecarManifest,
    load_manifest,
)
from .verify import BUILD, CACHE_NAME, VerifyReport, verify_sidecar

log = logging.getLogger(__name__)

SHARD_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.ple\.ple_embedding\.ngram_embedding\.shard_(\d+)\.weight$")
DEFAULT_SPLIT_NGRAM_PARTS = 512
COPY_CHUNK = 8 << 20


@dataclass(frozen=True)
class PleLayerSource:
    """The shards of one layer's PLE table in a checkpoint, checked for completeness."""

    layer: int
    dtype: str
    rows: int
    columns: int
    shards: tuple[_safetensors.TensorInfo, ...]  # index k at position k; trailing empty shards may be absent

    @property
    def bytes(self) -> int:
        return self.rows * self.columns * DTYPE_ITEMSIZE[self.dtype]


@dataclass
class BuildResult:
    manifest: SidecarManifest
    scale_file: str | None
    scales: dict[int, str] = field(default_factory=dict)  # layer -> tensor name
    verify: VerifyReport | None = None
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {
            "manifest": str(self.manifest.path),
            "tables": [
                {"layer": t.layer, "path": t.path, "dtype": t.dtype, "rows": t.rows, "columns": t.columns,
                 "row_start": t.row_start, "bytes": t.bytes, "sha256": t.sha256}
                for t in self.manifest.tables
            ],
            "scale_file": self.scale_file,
            "scales": {str(k): v for k, v in sorted(self.scales.items())},
            "verified": None if self.verify is None else self.verify.ok,
            "seconds": round(self.seconds, 3),
        }


def split_ngram_parts_of(checkpoint: str | os.PathLike) -> int:
    """``split_ngram_parts`` from ``config.json`` (top level or ``text_config``), default 512."""
    cfg_path = Path(checkpoint) / "config.json"
    if not cfg_path.is_file():
        return DEFAULT_SPLIT_NGRAM_PARTS
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise SidecarCheckpointError(f"{cfg_path}: unreadable config ({exc})", path=str(cfg_path)) from exc
    for scope in (cfg, cfg.get("text_config") or {}):
        if isinstance(scope, dict) and "split_ngram_parts" in scope:
            v = scope["split_ngram_parts"]
            if type(v) is not int or v < 1:
                raise SidecarCheckpointError(f"{cfg_path}: split_ngram_parts is {v!r}, expected a positive integer",
                                             path=str(cfg_path), actual=v, expected="positive integer")
            return v
    return DEFAULT_SPLIT_NGRAM_PARTS


def _checkpoint_tensors(checkpoint: Path) -> dict[str, _safetensors.TensorInfo]:
    """Headers of the checkpoint files that hold PLE shards/scales (via the index when present)."""
    index = checkpoint / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SidecarCheckpointError(f"{index}: unreadable safetensors index ({exc})", path=str(index)) from exc
        wanted: dict[str, set[str]] = {}
        for name, fname in weight_map.items():
            if (SHARD_TENSOR.search(name) or SCALE_TENSOR.search(name)) and "mtp" not in name:
                wanted.setdefault(fname, set()).add(name)
        files: list[tuple[Path, set[str] | None]] = []
        for fname in sorted(wanted):
            p = Path(fname)
            if p.is_absolute() or ".." in p.parts:
                raise SidecarCheckpointError(f"{index}: shard file {fname!r} leaves the checkpoint", path=str(index))
            files.append((checkpoint / p, wanted[fname]))
    else:
        files = [(f, None) for f in sorted(checkpoint.glob("*.safetensors"))]
    tensors: dict[str, _safetensors.TensorInfo] = {}
    for f, only in files:
        if not f.is_file():
            raise SidecarCheckpointError(f"{f}: listed in {INDEX_NAME} but missing", path=str(f))
        header = _safetensors.read_header(f)
        _safetensors.cross_check(f, header)
        for name, info in header.items():
            if only is not None and name not in only:
                continue
            if name in tensors:
                raise SidecarCheckpointError(f"tensor {name} appears in both {tensors[name].file} and {f}", path=str(f))
            tensors[name] = info
    return tensors


def find_ple_shards(
    checkpoint: str | os.PathLike, *, split_ngram_parts: int | None = None,
    tensors: dict[str, _safetensors.TensorInfo] | None = None,
) -> dict[int, PleLayerSource]:
    """Find and check every layer's PLE shards; returns ``{layer: PleLayerSource}``.

    Raises:
        SidecarCheckpointError: no shards, a missing/duplicate shard, mixed dtypes or widths, or
            shard sizes that disagree with ``ceil(rows / split_ngram_parts)``.
    """
    checkpoint = Path(checkpoint)
    parts = split_ngram_parts or split_ngram_parts_of(checkpoint)
    if tensors is None:
        tensors = _checkpoint_tensors(checkpoint)
    by_layer: dict[int, dict[int, _safetensors.TensorInfo]] = {}
    for name, info in tensors.items():
        m = SHARD_TENSOR.search(name)
        if not m or "mtp" in name:
            continue
        layer, k = int(m.group(1)), int(m.group(2))
        by_layer.setdefault(layer, {})[k] = info
    if not by_layer:
        raise SidecarCheckpointError(
            f"{checkpoint}: no PLE shard tensors (…ple.ple_embedding.ngram_embedding.shard_{{k}}.weight) found",
            path=str(checkpoint),
        )
    out: dict[int, PleLayerSource] = {}
    for layer, shards in sorted(by_layer.items()):
        ks = sorted(shards)
        if ks != list(range(len(ks))):
            missing = sorted(set(range(ks[-1] + 1)) - set(ks))
            raise SidecarCheckpointError(
                f"{checkpoint}: PLE layer {layer} is missing shard(s) {missing[:10]}{'…' if len(missing) > 10 else ''}",
                path=str(checkpoint), layer=layer, actual=len(ks), expected=ks[-1] + 1,
            )
        if len(ks) > parts:
            raise SidecarCheckpointError(
                f"{checkpoint}: PLE layer {layer} has {len(ks)} shards, expected at most split_ngram_parts = {parts}",
                path=str(checkpoint), layer=layer, actual=len(ks), expected=parts,
            )
        infos = [shards[k] for k in ks]
        dtypes = {i.dtype for i in infos}
        widths = {i.shape[1] if len(i.shape) == 2 else None for i in infos}
        if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPE_ITEMSIZE:
            raise SidecarCheckpointError(
                f"{checkpoint}: PLE layer {layer} shards have dtype(s) {sorted(dtypes)}, expected one of "
                f"{sorted(DTYPE_ITEMSIZE)}", path=str(checkpoint), layer=layer, actual=sorted(dtypes),
            )
        if len(widths) != 1 or None in widths:
            raise SidecarCheckpointError(
                f"{checkpoint}: PLE layer {layer} shards have shapes {sorted({i.shape for i in infos})}, "
                f"expected 2-D [rows, columns] with one width", path=str(checkpoint), layer=layer,
            )
        # Every shard before the last non-empty one has the first shard's row count.
        size0 = infos[0].shape[0]
        last = max((k for k, i in enumerate(infos) if i.shape[0] > 0), default=0)
        for k, info in enumerate(infos):
            if info.shape[0] > size0 or (k < last and info.shape[0] != size0):
                raise SidecarCheckpointError(
                    f"{info.file}: {info.name} has {info.shape[0]} rows, expected {size0} like shard_0",
                    path=str(info.file), layer=layer, actual=info.shape[0], expected=size0,
                )
        rows = sum(i.shape[0] for i in infos)
        size = math.ceil(rows / parts)
        for k, info in enumerate(infos):
            want = max(0, min(size, rows - k * size))
            if info.shape[0] != want:
                raise SidecarCheckpointError(
                    f"{info.file}: {info.name} has {info.shape[0]} rows, expected {want} "
                    f"(ceil({rows} / {parts}) = {size} rows per shard)",
                    path=str(info.file), layer=layer, actual=info.shape[0], expected=want,
                )
        if len(ks) < math.ceil(rows / size):
            raise SidecarCheckpointError(
                f"{checkpoint}: PLE layer {layer} has {len(ks)} shards, expected {math.ceil(rows / size)}",
                path=str(checkpoint), layer=layer, actual=len(ks), expected=math.ceil(rows / size),
            )
        out[layer] = PleLayerSource(layer, infos[0].dtype, rows, next(iter(widths)), tuple(infos))
    return out


def select_sources(checkpoint: Path, sources: dict[int, PleLayerSource], *, layers: Iterable[int] | None = None,
                   expected_rows: int | None = None, expected_columns: int | None = None
                   ) -> dict[int, PleLayerSource]:
    """``sources`` of the layers asked for (default all), each refused unless of the expected shape."""
    if layers is not None:
        wanted = sorted(set(layers))
        absent = [n for n in wanted if n not in sources]
        if absent:
            raise SidecarCheckpointError(
                f"{checkpoint}: no PLE shards for layer(s) {absent}; the checkpoint has layers {sorted(sources)}",
                path=str(checkpoint), actual=sorted(sources), expected=wanted,
            )
        sources = {n: sources[n] for n in wanted}
    for s in sources.values():
        if expected_rows is not None and s.rows != expected_rows:
            raise SidecarCheckpointError(
                f"{checkpoint}: PLE layer {s.layer} has {s.rows} rows, expected {expected_rows}",
                path=str(checkpoint), layer=s.layer, actual=s.rows, expected=expected_rows)
        if expected_columns is not None and s.columns != expected_columns:
            raise SidecarCheckpointError(
                f"{checkpoint}: PLE layer {s.layer} has {s.columns} columns, expected {expected_columns}",
                path=str(checkpoint), layer=s.layer, actual=s.columns, expected=expected_columns)
    return sources


def table_name(layer: int) -> str:
    return f"ple/layer-{layer}.bin"




def _copy_layer(src: PleLayerSource, dest: Path, buf: bytearray, bar) -> str:
    """Copy one layer's shards into ``dest``; returns the SHA-256 of what was written."""
    h = hashlib.sha256()
    view = memoryview(buf)
    with open(dest, "wb", buffering=0) as out:
        for info in src.shards:
            with open(info.file, "rb", buffering=0) as f:
                pos, end = info.offset, info.offset + info.nbytes
                while pos < end:
                    n = min(len(buf), end - pos)
                    f.seek(pos)
                    got = f.readinto(view[:n])
                    if not got:
                        raise SidecarCheckpointError(
                            f"{info.file}: {info.name} ended early at byte {pos}", path=str(info.file))
                    chunk = view[:got]
                    h.update(chunk)
                    written = 0
                    while written < got:
                        written += out.write(chunk[written:])
                    pos += got
                    bar.update(got)
        os.fsync(out.fileno())
    return h.hexdigest()


def build_sidecar(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike | None = None,
    *,
    split_ngram_parts: int | None = None,
    layers: Iterable[int] | None = None,
    expected_rows: int | None = None,
    expected_columns: int | None = None,
    force: bool = False,
    verify: bool = True,
    progress: bool = True,
    cache_dir: str | os.PathLike | None = None,
) -> BuildResult:
    """Build ``ssd-stream.json`` + ``ple/layer-{L}.bin`` (+ scale file) from a checkpoint.

    Args:
        checkpoint: HF-format checkpoint directory with the PLE shard tensors.
        output: artifact directory to write (default: the checkpoint directory itself).
        split_ngram_parts: override ``config.json`` (default 512).
        layers: only these decoder layers (default: every layer that has PLE shards).
        expected_rows, expected_columns: refuse a table of another shape.
        force: replace an existing sidecar in ``output``.
        verify: re-read the written tables and check their SHA-256 (fills the verify cache).
        progress: tqdm progress bars on stderr.

    Raises:
        SidecarCheckpointError: unusable checkpoint; RefusedSourceState: ``output`` already has
        a sidecar and ``force`` is off; EnvironmentProblem: not enough disk space or an I/O error.
    """
    from tqdm import tqdm

    t0 = time.monotonic()
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise SidecarCheckpointError(f"{checkpoint}: checkpoint directory not found", path=str(checkpoint))
    out_dir = Path(output) if output is not None else checkpoint
    tensors = _checkpoint_tensors(checkpoint)
    sources = select_sources(checkpoint, find_ple_shards(checkpoint, split_ngram_parts=split_ngram_parts,
                                                         tensors=tensors),
                             layers=layers, expected_rows=expected_rows, expected_columns=expected_columns)

    manifest_path = out_dir / MANIFEST_NAME
    if manifest_path.exists() or manifest_path.is_symlink():
        if not force:
            raise RefusedSourceState(f"{manifest_path} already exists; pass --force to rebuild the sidecar")
    (out_dir / "ple").mkdir(parents=True, exist_ok=True)

    total = sum(s.bytes for s in sources.values())
    # New tables are written next to any old ones (which stay usable until the very end).
    free = shutil.disk_usage(out_dir).free
    if free < total:
        raise EnvironmentProblem(
            f"{out_dir}: the sidecar needs {total} bytes, but only {free} bytes are free")

    partials: list[Path] = []
    digests: dict[int, str] = {}
    buf = bytearray(COPY_CHUNK)
    try:
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
                  desc="build PLE sidecar") as bar:
            for layer, src in sources.items():
                final = out_dir / table_name(layer)
                partial = final.with_name(f".{final.name}.partial")
                partials.append(partial)
                digests[layer] = _copy_layer(src, partial, buf, bar)
        if manifest_path.exists() or manifest_path.is_symlink():
            # The old manifest goes before its tables are replaced: it never describes new bytes.
            manifest_path.unlink()
            fsync_dir(out_dir)
        for layer in sources:
            final = out_dir / table_name(layer)
            os.replace(final.with_name(f".{final.name}.partial"), final)
        partials.clear()
        fsync_dir(out_dir / "ple")

        scale_file, scales = _write_scales(checkpoint, out_dir, tensors, sources)

        doc = {
            "format": FORMAT,
            "version": VERSION,
            "tables": [
                {"layer": n, "path": table_name(n), "sha256": digests[n], "dtype": s.dtype, "rows": s.rows,
                 "columns": s.columns, "row_start": 0, "bytes": s.bytes}
                for n, s in sources.items()
            ],
        }
        write_atomic(manifest_path, json.dumps(doc, indent=2) + "\n")
    except OSError as exc:
        if isinstance(exc, EnvironmentProblem):  # already one of ours
            raise
        raise EnvironmentProblem(f"building the PLE sidecar in {out_dir} failed: {exc}") from exc
    finally:
        for p in partials:
            try:
                p.unlink()
            except OSError:
                pass

    manifest = load_manifest(manifest_path)
    report = None
    if verify:
        # The builder hashed what it wrote; this re-reads it from disk and records the result.
        report = verify_sidecar(manifest, caller=BUILD, use_cache=False, cache_dir=cache_dir, progress=progress)
    return BuildResult(manifest, scale_file, scales, report, time.monotonic() - t0)


def _write_scales(checkpoint: Path, out_dir: Path, tensors, sources) -> tuple[str | None, dict[int, str]]:
    found: dict[int, _safetensors.TensorInfo] = {}
    for name, info in tensors.items():
        m = SCALE_TENSOR.search(name)
        if m and "mtp" not in name and int(m.group(1)) in sources:
            found[int(m.group(1))] = info
    for layer, src in sources.items():
        if layer not in found:
            log.warning("PLE layer %d (%s) has no weight_scale tensor in %s", layer, src.dtype, checkpoint)
    names = {n: i.name for n, i in found.items()}
    if not found:
        return None, names
    if os.path.realpath(out_dir) == os.path.realpath(checkpoint):
        files = sorted({str(i.file) for i in found.values()})
        return (files[0] if len(files) == 1 else ",".join(files)), names
    dest = out_dir / SCALE_FILE_NAME
    _safetensors.write_small(dest, {i.name: (i.dtype, i.shape, _safetensors.read_tensor_bytes(i))
                                    for i in found.values()})
    return str(dest), names


__all__ = ["build_sidecar", "find_ple_shards", "split_ngram_parts_of", "PleLayerSource", "BuildResult",
           "DEFAULT_SPLIT_NGRAM_PARTS", "CACHE_NAME"]
