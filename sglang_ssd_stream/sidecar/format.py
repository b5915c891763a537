"""The PLE sidecar format: ``ssd-stream.json`` plus raw row-major tables, checked before use.

An artifact directory (a prepared model snapshot) holds::

    ssd-stream.json                  # this module's manifest
    ple/<table>.bin                  # raw row-major [rows, columns] tables, no header
    model-plefp8-scale.safetensors   # the PLE ``…ngram_embedding.weight_scale`` tensors (bf16 [1])

Manifest (version 1, compatible with artifacts prepared for garnermccloud/sglang-ssd-stream)::

    {"format": "sglang-ssd-stream", "version": 1,
     "tables": [{"layer": 3, "path": "ple/layer-3.bin", "sha256": "<64 hex>",
                 "dtype": "float8_e4m3fn", "rows": 320001536, "columns": 160,
                 "row_start": 0, "bytes": 51200245760}]}

Global row ``g`` of a table lives at byte ``(g - row_start) * columns * itemsize`` of its file.
``row_start`` is optional (default 0). Every other rule is enforced by :func:`load_manifest`;
the SHA-256 is verified by :func:`sglang_ssd_stream.sidecar.verify.verify_sidecar`.

**In place** (version 2, written by ``sidecar build --in-place`` into the checkpoint itself): no copy of the
rows; each table names *regions* of the checkpoint's own safetensors shards, in row order, that together hold
its rows ``[row_start, row_start + rows)``::

    {"format": "sglang-ssd-stream", "version": 2,
     "tables": [{"layer": 3, "dtype": "float8_e4m3fn", "rows": 320001536, "columns": 160, "row_start": 0,
                 "regions": [{"path": "model-00002-of-00009.safetensors",
                              "tensor": "model.language_model.layers.3.ple.….shard_0.weight",
                              "offset": 1234568, "row_start": 0, "rows": 625003, "sha256": "<64 hex>",
                              "file_bytes": 4987654321, "file_mtime_ns": 1765432100000000000}, ...]}]}

Global row ``g`` of region ``r`` lives at byte ``r.offset + (g - r.row_start) * row_bytes`` of ``r.path``
(relative to the manifest's directory, under the same trust rule as a table path). Each region's bytes are
hashed on their own (``sha256``); ``file_bytes`` is the shard's size, checked at load; ``file_mtime_ns`` is
its mtime when the regions were hashed (a verification that fails says whether the shard was written since).
Every reader gets a region's file and offset from :class:`TableRegion` and never derives them.

Imports only the standard library (no numpy, torch or engine).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import stat
import struct
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .. import strict_json
from ..knobs import SGLANG, VLLM, knob
from . import _safetensors
from .errors import (
    SidecarManifestError,
    SidecarPathEscape,
    SidecarShapeMismatch,
    SidecarSizeMismatch,
    SidecarTruncated,
    SidecarWarning,
)
from .storage import NETWORK_FS_TYPES, filesystem_type  # noqa: F401 - re-exported: part of this module's API

log = logging.getLogger(__name__)

FORMAT = "sglang-ssd-stream"
VERSION = 1  # tables copied into files of their own
VERSION_IN_PLACE = 2  # tables named as regions of the checkpoint's shards
MANIFEST_NAME = "ssd-stream.json"
SCALE_FILE_NAME = "model-plefp8-scale.safetensors"
INDEX_NAME = "model.safetensors.index.json"
ROWS_PER_TOKEN = 16  # (ngram_size - 1) * heads_per_ngram rows per token and PLE layer

DTYPE_ITEMSIZE = {"float8_e4m3fn": 1, "bfloat16": 2}

# Upper bounds: a manifest is small, and no plausible table comes near these. An in-place manifest lists every
# shard tensor (~350 B each, 512 per table in the real checkpoint): 48 such tables are ~9 MiB.
MAX_MANIFEST_BYTES = 16 << 20
MAX_TABLES = 1024
MAX_PATH_CHARS = 1024
MAX_LAYER = 1 << 16
MAX_ROWS = 1 << 40
MAX_COLUMNS = 1 << 16
MAX_TABLE_BYTES = 1 << 50

_TOP_KEYS = ("format", "version", "tables")
_TABLE_REQUIRED = ("layer", "path", "sha256", "dtype", "rows", "columns", "bytes")
_TABLE_OPTIONAL = ("row_start",)
_IN_PLACE_REQUIRED = ("layer", "dtype", "rows", "columns", "regions")
_REGION_KEYS = ("path", "tensor", "offset", "row_start", "rows", "sha256", "file_bytes", "file_mtime_ns")
MAX_REGIONS = 1 << 16  # per table (the real checkpoint splits a table into 512)
MAX_TENSOR_CHARS = 1024
_SHA256 = re.compile(r"[0-9a-f]{64}")
SCALE_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.ple\.ple_embedding\.ngram_embedding\.weight_scale$")



@dataclass(frozen=True)
class TableRegion:
    """Global rows ``[row_start, row_start + rows)`` of a table, row-major at byte ``offset`` of ``file``."""

    path: str  # as written in the manifest (relative POSIX path)
    file: Path  # absolute, symlinks resolved, checked by the trust rule
    offset: int
    row_start: int
    rows: int
    bytes: int  # rows × row_bytes
    sha256: str  # of these bytes
    file_bytes: int  # the whole file's size
    tensor: str | None = None  # in place: the safetensors tensor these bytes are
    file_mtime_ns: int | None = None  # in place: the shard's mtime when the region was hashed

    @property
    def row_end(self) -> int:
        return self.row_start + self.rows


@dataclass(frozen=True)
class SidecarTable:
    """One PLE table: global rows ``[row_start, row_start + rows)`` of decoder layer ``layer``.

    Its bytes are ``regions``: one whole file of its own for a copied table (the default, filled in from the
    other fields), or regions of the checkpoint's shards for an in-place table (``path`` and ``file`` then name
    its first region's shard, for messages only; ``sha256`` is the SHA-256 of the regions' list, the table's
    identity: each region's own SHA-256 covers its bytes)."""

    layer: int
    path: str  # as written in the manifest (relative POSIX path)
    file: Path  # absolute, symlinks resolved, checked to stay inside the artifact
    sha256: str
    dtype: str  # "float8_e4m3fn" | "bfloat16"
    rows: int
    columns: int
    row_start: int
    bytes: int
    regions: tuple[TableRegion, ...] = ()

    def __post_init__(self):
        if not self.regions:  # a copied table: one region, the whole file
            object.__setattr__(self, "regions", (TableRegion(self.path, self.file, 0, self.row_start, self.rows,
                                                             self.bytes, self.sha256, self.bytes),))

    @property
    def in_place(self) -> bool:
        """Whether the rows are regions of checkpoint shards (else one file of the table's own)."""
        return self.regions[0].tensor is not None

    @property
    def files(self) -> tuple[Path, ...]:
        """The distinct files holding the table's rows, in the order of their first region."""
        return tuple(dict.fromkeys(r.file for r in self.regions))

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def row_bytes(self) -> int:
        return self.columns * self.itemsize

    @property
    def row_end(self) -> int:
        """One past the last global row id stored in this table."""
        return self.row_start + self.rows


@dataclass(frozen=True)
class SidecarManifest:
    """A validated ``ssd-stream.json``; ``root`` is the artifact directory (not resolved)."""

    path: Path
    root: Path
    tables: tuple[SidecarTable, ...]
    sha256: str = ""  # of the manifest's bytes as they were read (the verified cache is bound to it)

    def table(self, layer: int) -> SidecarTable:
        """The table of decoder layer ``layer``."""
        for t in self.tables:
            if t.layer == layer:
                return t
        raise SidecarShapeMismatch(
            f"{self.path}: no PLE table for layer {layer}; tables exist for layers {[t.layer for t in self.tables]}",
            path=str(self.path), actual=[t.layer for t in self.tables], expected=layer,
        )


def _bad(manifest: Path, what: str, actual: object, expected: str) -> SidecarManifestError:
    return SidecarManifestError(
        f"{manifest}: {what} is {actual!r}, expected {expected}", path=str(manifest), field=what,
        actual=actual, expected=expected,
    )


def _int_field(manifest: Path, what: str, value: object, lo: int, hi: int) -> int:
    if type(value) is not int:  # bool and float are not accepted
        raise _bad(manifest, what, value, f"an integer in [{lo}, {hi}]")
    if not lo <= value <= hi:
        raise _bad(manifest, what, value, f"an integer in [{lo}, {hi}]")
    return value


def hf_blobs_root(root: Path) -> Path | None:
    """For a Hugging Face snapshot ``…/models--o--n/snapshots/<rev>``, its ``blobs`` directory."""
    if root.parent.name == "snapshots":
        blobs = root.parent.parent / "blobs"
        if blobs.is_dir():
            return blobs
    return None


def _allowed_roots(root: Path, trusted_roots: Iterable[str | os.PathLike]) -> list[str]:
    roots = [os.path.realpath(root)]
    blobs = hf_blobs_root(root)
    if blobs is not None:  # snapshot files are symlinks into ../../blobs by design
        roots.append(os.path.realpath(blobs))
    roots.extend(os.path.realpath(r) for r in trusted_roots)
    return roots


def _inside(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def resolve_table_path(manifest: Path, root: Path, rel: object, roots: list[str]) -> Path:
    """Check a manifest table path lexically and after resolving symlinks; return the real file."""
    if not isinstance(rel, str) or not rel:
        raise _bad(manifest, "table path", rel, "a non-empty relative POSIX path")
    if len(rel) > MAX_PATH_CHARS:
        raise _bad(manifest, "table path length", len(rel), f"at most {MAX_PATH_CHARS} characters")
    if "\x00" in rel or "\\" in rel:
        raise _bad(manifest, "table path", rel, "a relative POSIX path without NUL or backslash")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts:
        raise SidecarPathEscape(
            f"{manifest}: table path {rel!r} leaves the artifact directory {root} (absolute or '..'), "
            f"expected a path inside it",
            path=str(manifest), actual=rel, expected=str(root),
        )
    real = os.path.realpath(root / pure)
    if not _inside(real, roots):
        raise SidecarPathEscape(
            f"{manifest}: table path {rel!r} resolves to {real}, outside the artifact directory {root} "
            f"(symlink escape); expected a file under {', '.join(roots)}; a table kept elsewhere needs its directory "
            f"named in {' or '.join(knob(e, 'TRUSTED_ROOTS').name for e in (SGLANG, VLLM))} "
            f"(`sidecar verify` and `sidecar profile`: --trusted-root)",
            path=str(manifest), actual=real, expected=roots,
        )
    return Path(real)


def _check_table_file(manifest: Path, t: SidecarTable) -> None:
    try:
        st = os.stat(t.file)
    except FileNotFoundError:
        raise SidecarManifestError(
            f"{manifest}: table file {t.path} ({t.file}) does not exist, expected a {t.bytes}-byte file",
            path=str(t.file), actual=None, expected=t.bytes,
        ) from None
    except OSError as exc:  # ELOOP (a symlink loop), EACCES, ...: named, never a traceback
        raise SidecarManifestError(
            f"{manifest}: table file {t.path} ({t.file}) cannot be opened: {exc.strerror or exc}",
            path=str(t.file), actual=exc.errno, expected="a regular file",
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise SidecarManifestError(
            f"{manifest}: table file {t.path} ({t.file}) is not a regular file", path=str(t.file),
            actual=stat.filemode(st.st_mode), expected="regular file",
        )
    if st.st_size < t.bytes:
        raise SidecarTruncated(
            f"PLE table {t.file} is truncated: it has {st.st_size} bytes, expected {t.bytes}",
            path=str(t.file), actual=st.st_size, expected=t.bytes,
        )
    if st.st_size != t.bytes:
        raise SidecarSizeMismatch(
            f"PLE table {t.file} has {st.st_size} bytes, expected {t.bytes}",
            path=str(t.file), actual=st.st_size, expected=t.bytes,
        )


def regions_digest(regions: Iterable[TableRegion]) -> str:
    """An in-place table's identity: the SHA-256 of its regions' ``row_start rows sha256`` lines, in row order
    (``SidecarTable.sha256``, which the hot file's binding names; each region's own SHA-256 covers its bytes)."""
    return hashlib.sha256("".join(f"{r.row_start} {r.rows} {r.sha256}\n" for r in regions).encode()).hexdigest()


def _sha_field(manifest: Path, what: str, sha: object) -> str:
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        raise _bad(manifest, what, sha if not isinstance(sha, str) or len(sha) <= 80 else sha[:80] + "…",
                   "64 lowercase hex digits")
    return sha


def _in_place_table(p: Path, root: Path, where: str, entry: dict, roots: list[str]) -> SidecarTable:
    """One version-2 table entry: its regions must tile its rows in row order, each inside its file."""
    missing = [k for k in _IN_PLACE_REQUIRED if k not in entry]
    if missing:
        raise _bad(p, f"{where} missing field(s)", missing, f"all of {list(_IN_PLACE_REQUIRED)}")
    extra = sorted(set(entry) - set(_IN_PLACE_REQUIRED) - set(_TABLE_OPTIONAL))
    if extra:
        raise _bad(p, f"{where} unknown field(s)", extra, f"only {list(_IN_PLACE_REQUIRED + _TABLE_OPTIONAL)}")
    layer = _int_field(p, f"{where}.layer", entry["layer"], 0, MAX_LAYER)
    dtype = entry["dtype"]
    if dtype not in DTYPE_ITEMSIZE:
        raise _bad(p, f"{where}.dtype", dtype, f"one of {sorted(DTYPE_ITEMSIZE)}")
    rows = _int_field(p, f"{where}.rows", entry["rows"], 1, MAX_ROWS)
    columns = _int_field(p, f"{where}.columns", entry["columns"], 1, MAX_COLUMNS)
    row_start = _int_field(p, f"{where}.row_start", entry.get("row_start", 0), 0, MAX_ROWS)
    row_bytes = columns * DTYPE_ITEMSIZE[dtype]
    raw = entry["regions"]
    if not isinstance(raw, list) or not raw or len(raw) > MAX_REGIONS:
        raise _bad(p, f"{where}.regions", raw if not isinstance(raw, list) else f"{len(raw)} regions",
                   f"a list of 1 to {MAX_REGIONS} regions")
    regions: list[TableRegion] = []
    next_row = row_start
    for j, r in enumerate(raw):
        at = f"{where}.regions[{j}]"
        if not isinstance(r, dict):
            raise _bad(p, at, type(r).__name__, "a JSON object")
        if set(r) != set(_REGION_KEYS):
            raise _bad(p, f"{at} fields", sorted(r), f"exactly {list(_REGION_KEYS)}")
        tensor = r["tensor"]
        if not isinstance(tensor, str) or not tensor or len(tensor) > MAX_TENSOR_CHARS:
            raise _bad(p, f"{at}.tensor", tensor, f"a tensor name of 1 to {MAX_TENSOR_CHARS} characters")
        r_start = _int_field(p, f"{at}.row_start", r["row_start"], 0, MAX_ROWS)
        if r_start != next_row:  # regions are listed in row order, each starting where the last one ended
            raise _bad(p, f"{at}.row_start", r_start, f"{next_row} (regions tile the table's rows in row order)")
        r_rows = _int_field(p, f"{at}.rows", r["rows"], 1, MAX_ROWS)
        next_row = r_start + r_rows
        offset = _int_field(p, f"{at}.offset", r["offset"], 0, MAX_TABLE_BYTES)
        file_bytes = _int_field(p, f"{at}.file_bytes", r["file_bytes"], 1, MAX_TABLE_BYTES)
        mtime = _int_field(p, f"{at}.file_mtime_ns", r["file_mtime_ns"], 0, 1 << 63)
        nbytes = r_rows * row_bytes
        if offset + nbytes > file_bytes:
            raise SidecarSizeMismatch(
                f"{p}: {at} ({tensor}) spans bytes [{offset}, {offset + nbytes}) of {r['path']!r}, beyond its "
                f"file_bytes {file_bytes}", path=str(p), actual=offset + nbytes, expected=file_bytes)
        file = resolve_table_path(p, root, r["path"], roots)
        regions.append(TableRegion(r["path"], file, offset, r_start, r_rows, nbytes,
                                   _sha_field(p, f"{at}.sha256", r["sha256"]), file_bytes, tensor, mtime))
    if next_row != row_start + rows:
        raise _bad(p, f"{where}.regions", f"rows [{row_start}, {next_row})",
                   f"rows [{row_start}, {row_start + rows}) (the table's rows, all of them)")
    first = regions[0]
    return SidecarTable(layer, first.path, first.file, regions_digest(regions), dtype, rows, columns, row_start,
                        rows * row_bytes, tuple(regions))


def _check_disjoint(p: Path, tables: list[SidecarTable]) -> None:
    """No two regions of a manifest share a byte of one file (each row has one home), and the regions of one file
    agree on its size and mtime (one file, one identity)."""
    spans: dict[Path, list[tuple[int, int, str]]] = {}
    seen: dict[Path, TableRegion] = {}
    for t in tables:
        for r in t.regions:
            spans.setdefault(r.file, []).append((r.offset, r.offset + r.bytes, r.tensor or r.path))
            first = seen.setdefault(r.file, r)
            if (r.file_bytes, r.file_mtime_ns) != (first.file_bytes, first.file_mtime_ns):
                raise _bad(p, "regions", f"{first.tensor} and {r.tensor} record different sizes or mtimes of "
                           f"{r.file}", "one size and mtime per file")
    for file, s in spans.items():
        s.sort()
        for (_, end, a), (start, _, b) in zip(s, s[1:], strict=False):
            if start < end:
                raise _bad(p, "regions", f"{a} and {b} overlap in {file}", "regions that share no byte")


def _check_region_files(manifest: Path, t: SidecarTable) -> None:
    """Every shard an in-place table reads is a regular file of the size the manifest recorded."""
    for r in t.regions:
        try:
            st = os.stat(r.file)
        except OSError as exc:  # missing, ELOOP, EACCES, ...: named, never a traceback
            raise SidecarManifestError(
                f"{manifest}: shard {r.path} ({r.file}) of PLE layer {t.layer} cannot be opened: "
                f"{exc.strerror or exc}", path=str(r.file), actual=exc.errno, expected=r.file_bytes) from None
        if not stat.S_ISREG(st.st_mode):
            raise SidecarManifestError(
                f"{manifest}: shard {r.path} ({r.file}) of PLE layer {t.layer} is not a regular file",
                path=str(r.file), actual=stat.filemode(st.st_mode), expected="regular file")
        if st.st_size != r.file_bytes:
            cls = SidecarTruncated if st.st_size < r.file_bytes else SidecarSizeMismatch
            raise cls(
                f"shard {r.file} of PLE layer {t.layer} has {st.st_size} bytes, but the manifest {manifest} was "
                f"built from one of {r.file_bytes} bytes (the checkpoint changed since: rebuild it with "
                f"`sidecar build --in-place`)", path=str(r.file), actual=st.st_size, expected=r.file_bytes)


def _read_regular(p: Path, limit: int) -> bytes:
    """At most ``limit`` bytes of ``p`` if it is a regular file (a symlink to one is fine: HF snapshots link
    into blobs/). Opened non-blocking and checked with fstat, so a FIFO or device raises instead of hanging."""
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit)
    finally:
        os.close(fd)


def load_manifest(
    path: str | os.PathLike,
    *,
    trusted_roots: Iterable[str | os.PathLike] = (),
    check_files: bool = True,
    mounts_path: str | None = None,
) -> SidecarManifest:
    """Load and validate ``ssd-stream.json`` (or the artifact directory holding it).

    Args:
        path: the manifest file, or the artifact directory containing ``ssd-stream.json``.
        trusted_roots: extra directories table files may resolve into (e.g. the prepared
            snapshot a model view links to). The artifact directory, and for a Hugging Face
            snapshot its ``blobs/`` directory, are always allowed.
        check_files: also check that every table file exists with exactly ``bytes`` bytes.
        mounts_path: mounts table used to warn about network filesystems (default /proc/mounts).

    Returns:
        The validated :class:`SidecarManifest`. The SHA-256 is *not* checked here; see
        :func:`sglang_ssd_stream.sidecar.verify.verify_sidecar`.

    Raises:
        SidecarManifestError, SidecarPathEscape, SidecarSizeMismatch, SidecarTruncated.
    """
    p = Path(os.path.abspath(path))  # keep symlinks: an HF snapshot's manifest is a link into blobs/
    if p.is_dir():
        p = p / MANIFEST_NAME
    root = p.parent
    try:
        raw = _read_regular(p, MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise SidecarManifestError(f"{p}: sidecar manifest not found", path=str(p), actual=None,
                                   expected=MANIFEST_NAME) from None
    except OSError as exc:
        raise SidecarManifestError(f"{p}: cannot read the sidecar manifest ({exc.strerror or exc})",
                                   path=str(p)) from exc
    if len(raw) > MAX_MANIFEST_BYTES:
        raise _bad(p, "manifest size", f">{MAX_MANIFEST_BYTES} bytes", f"at most {MAX_MANIFEST_BYTES} bytes")
    try:
        doc = strict_json.loads(raw)
    except strict_json.NestedTooDeeply:
        raise SidecarManifestError(f"{p}: not a sidecar manifest (JSON nested too deeply)", path=str(p)) from None
    except ValueError as exc:
        raise SidecarManifestError(f"{p}: not valid JSON ({exc})", path=str(p)) from exc

    if not isinstance(doc, dict):
        raise _bad(p, "top level", type(doc).__name__, "a JSON object")
    missing = [k for k in _TOP_KEYS if k not in doc]
    if missing:
        raise _bad(p, "missing field(s)", missing, f"all of {list(_TOP_KEYS)}")
    extra = sorted(set(doc) - set(_TOP_KEYS))
    if extra:
        raise _bad(p, "unknown field(s)", extra, f"only {list(_TOP_KEYS)}")
    if doc["format"] != FORMAT:
        raise _bad(p, "format", doc["format"], repr(FORMAT))
    version = doc["version"]
    if type(version) is not int or version not in (VERSION, VERSION_IN_PLACE):
        raise _bad(p, "version", version, f"{VERSION} (copied tables) or {VERSION_IN_PLACE} (in place): this kit "
                                          f"reads these only")
    tables = doc["tables"]
    if not isinstance(tables, list) or not tables:
        raise _bad(p, "tables", tables if not isinstance(tables, list) else "[]", "a non-empty list")
    if len(tables) > MAX_TABLES:
        raise _bad(p, "number of tables", len(tables), f"at most {MAX_TABLES}")

    roots = _allowed_roots(root, trusted_roots)
    out: list[SidecarTable] = []
    layers: set[int] = set()
    files: set[Path] = set()
    for i, entry in enumerate(tables):
        where = f"tables[{i}]"
        if not isinstance(entry, dict):
            raise _bad(p, where, type(entry).__name__, "a JSON object")
        if version == VERSION_IN_PLACE:
            table = _in_place_table(p, root, where, entry, roots)
            if table.layer in layers:
                raise _bad(p, f"{where}.layer", table.layer, "a layer not listed twice")
            layers.add(table.layer)
            out.append(table)
            continue
        missing = [k for k in _TABLE_REQUIRED if k not in entry]
        if missing:
            raise _bad(p, f"{where} missing field(s)", missing, f"all of {list(_TABLE_REQUIRED)}")
        extra = sorted(set(entry) - set(_TABLE_REQUIRED) - set(_TABLE_OPTIONAL))
        if extra:
            raise _bad(p, f"{where} unknown field(s)", extra, f"only {list(_TABLE_REQUIRED + _TABLE_OPTIONAL)}")
        layer = _int_field(p, f"{where}.layer", entry["layer"], 0, MAX_LAYER)
        if layer in layers:
            raise _bad(p, f"{where}.layer", layer, "a layer not listed twice")
        layers.add(layer)
        dtype = entry["dtype"]
        if dtype not in DTYPE_ITEMSIZE:
            raise _bad(p, f"{where}.dtype", dtype, f"one of {sorted(DTYPE_ITEMSIZE)}")
        sha = _sha_field(p, f"{where}.sha256", entry["sha256"])
        rows = _int_field(p, f"{where}.rows", entry["rows"], 1, MAX_ROWS)
        columns = _int_field(p, f"{where}.columns", entry["columns"], 1, MAX_COLUMNS)
        row_start = _int_field(p, f"{where}.row_start", entry.get("row_start", 0), 0, MAX_ROWS)
        nbytes = _int_field(p, f"{where}.bytes", entry["bytes"], 1, MAX_TABLE_BYTES)
        want = rows * columns * DTYPE_ITEMSIZE[dtype]
        if nbytes != want:
            raise SidecarSizeMismatch(
                f"{p}: {where}.bytes is {nbytes}, expected rows × columns × itemsize = "
                f"{rows} × {columns} × {DTYPE_ITEMSIZE[dtype]} = {want}",
                path=str(p), actual=nbytes, expected=want,
            )
        file = resolve_table_path(p, root, entry["path"], roots)
        if file in files:
            raise _bad(p, f"{where}.path", entry["path"], "a file not used by another table")
        files.add(file)
        out.append(SidecarTable(layer, entry["path"], file, sha, dtype, rows, columns, row_start, nbytes))

    if version == VERSION_IN_PLACE:
        _check_disjoint(p, out)
    manifest = SidecarManifest(p, root, tuple(out), hashlib.sha256(raw).hexdigest())
    if check_files:
        for t in manifest.tables:
            if t.in_place:
                _check_region_files(p, t)
            else:
                _check_table_file(p, t)
        warned: set[str] = set()
        for file in dict.fromkeys(f for t in manifest.tables for f in t.files):
            fs = filesystem_type(file, mounts_path=mounts_path)
            if fs in NETWORK_FS_TYPES and fs not in warned:
                warned.add(fs)
                _warn_network(file, fs)
    return manifest


def check_model_shape(
    table: SidecarTable, *, dtype: str, columns: int, rows: int | None = None, row_range: tuple[int, int] | None = None
) -> None:
    """Refuse a table that does not match the embedding the engine built.

    Args:
        dtype: the engine's table dtype (``"float8_e4m3fn"``/``"bfloat16"``; a ``torch.`` prefix is ignored).
        columns: the embedding width (elements per row, 160 for Qwen3.8 Flash-Next).
        rows: the padded vocabulary size, if the table must hold all of it.
        row_range: ``(vocab_start, vocab_end)`` of this TP rank; the table must cover it.
    """
    want_dtype = str(dtype).removeprefix("torch.")
    if table.dtype != want_dtype:
        raise SidecarShapeMismatch(
            f"PLE table {table.path} (layer {table.layer}) is {table.dtype}, but the model expects {want_dtype}",
            path=table.path, field="dtype", actual=table.dtype, expected=want_dtype,
        )
    if table.columns != columns:
        raise SidecarShapeMismatch(
            f"PLE table {table.path} (layer {table.layer}) has {table.columns} columns, "
            f"but the model expects {columns}",
            path=table.path, field="columns", actual=table.columns, expected=columns,
        )
    if rows is not None and (table.row_start, table.row_end) != (0, rows):
        raise SidecarShapeMismatch(
            f"PLE table {table.path} (layer {table.layer}) holds rows [{table.row_start}, {table.row_end}), "
            f"but the model expects [0, {rows})",
            path=table.path, field="rows", actual=(table.row_start, table.row_end), expected=(0, rows),
        )
    if row_range is not None:
        lo, hi = row_range
        if not (table.row_start <= lo < hi <= table.row_end):
            raise SidecarShapeMismatch(
                f"PLE table {table.path} (layer {table.layer}) covers rows [{table.row_start}, {table.row_end}), "
                f"not this rank's rows [{lo}, {hi})",
                path=table.path, field="row_range", actual=(table.row_start, table.row_end), expected=(lo, hi),
            )


# ----------------------------------------------------------------------------- weight_scale


@dataclass(frozen=True)
class WeightScale:
    """The PLE ``weight_scale`` of one layer (a bf16 ``[1]`` tensor in the checkpoint)."""

    layer: int
    file: Path
    tensor: str
    dtype: str
    shape: tuple[int, ...]
    raw: bytes

    @property
    def value(self) -> float:
        if self.dtype == "bfloat16":
            return struct.unpack("<f", b"\x00\x00" + self.raw[:2])[0]
        if self.dtype == "float16":
            return struct.unpack("<e", self.raw[:2])[0]
        return struct.unpack("<f", self.raw[:4])[0]


_SCALE_DTYPES = ("bfloat16", "float16", "float32")


def _scale_from(info: _safetensors.TensorInfo, layer: int) -> WeightScale:
    if info.dtype not in _SCALE_DTYPES or info.shape not in ((1,), ()):
        raise SidecarShapeMismatch(
            f"{info.file}: {info.name} is {info.dtype} {list(info.shape)}, expected bfloat16 [1]",
            path=str(info.file), actual=(info.dtype, info.shape), expected=("bfloat16", (1,)),
        )
    return WeightScale(layer, info.file, info.name, info.dtype, info.shape, _safetensors.read_tensor_bytes(info))


def find_weight_scales(root: str | os.PathLike) -> dict[int, WeightScale]:
    """Locate the PLE ``weight_scale`` tensors of an artifact or checkpoint directory.

    Looks in ``model-plefp8-scale.safetensors`` first; otherwise follows
    ``model.safetensors.index.json`` (where prepared snapshots list it for the engine's loader).
    Tensors of the MTP draft (names containing ``mtp``) are ignored. Returns ``{layer: WeightScale}``
    (empty when the directory has none).
    """
    root = Path(root)
    candidates: dict[str, list[str]] = {}
    scale_file = root / SCALE_FILE_NAME
    if scale_file.is_file():
        candidates[str(scale_file)] = []
    else:
        index = root / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise SidecarManifestError(f"{index}: unreadable safetensors index ({exc})", path=str(index)) from exc
            for name, fname in weight_map.items():
                if SCALE_TENSOR.search(name) and "mtp" not in name:
                    if (not isinstance(fname, str) or PurePosixPath(fname).is_absolute()
                            or ".." in PurePosixPath(fname).parts):
                        raise SidecarPathEscape(f"{index}: {name} maps to {fname!r}, outside {root}", path=str(index),
                                                actual=fname)
                    candidates.setdefault(str(root / fname), []).append(name)
    found: dict[int, WeightScale] = {}
    for fname, names in candidates.items():
        header = _safetensors.read_header(fname)
        for name, info in header.items():
            m = SCALE_TENSOR.search(name)
            if not m or "mtp" in name or (names and name not in names):
                continue
            layer = int(m.group(1))
            if layer in found:
                raise SidecarManifestError(f"{fname}: two weight_scale tensors for PLE layer {layer}", path=fname)
            found[layer] = _scale_from(info, layer)
    return found


# ----------------------------------------------------------------------------- network filesystems


def _warn_network(path: Path, fstype: str) -> None:
    msg = (
        f"PLE sidecar {path} is on a network filesystem ({fstype}); random 4 KiB row reads will be "
        f"slow. Copy the artifact to a local NVMe disk."
    )
    log.warning(msg)
    warnings.warn(msg, SidecarWarning, stacklevel=3)


def warn_if_network_fs(path: str | os.PathLike, *, mounts_path: str | None = None) -> str | None:
    """Warn (``SidecarWarning`` + log) if ``path`` is on a network filesystem; return its fs type."""
    fs = filesystem_type(path, mounts_path=mounts_path)
    if fs in NETWORK_FS_TYPES:
        _warn_network(Path(path), fs)
    return fs
