"""The hot file: one process's hottest PLE rows (ids and bytes), kept across restarts and read back in one pass.

Why: a restart empties the row cache and the first prompts after it pay every row's first-touch read (random
4 KiB reads); the same rows, written once as one file, come back with large sequential reads (issue 27). This
module is the file's format and its trusted reader and writer only; counting accesses, choosing when to write and
loading rows into a cache belong to the row cache and the engines.

Layout (little-endian; ``docs/hot-file.md`` has the table)::

    prefix   magic b"\\x89PLEHOT\\n", u32 version, u32 meta_len, u64 segments            24 bytes
    meta     strict JSON: format, manifest identity, block_rows, role, tables [{layer, sha256, row_bytes,
             row_range, count, file}]                                                   meta_len bytes
    digests  SHA-256 of each segment (ids bytes then rows bytes), in file order           32 × segments
    check    SHA-256 of everything above                                                32 bytes
    blocks   block b = for each table (meta order) with rows there: ids int64 [n], rows uint8 [n, row_bytes]
             for its ranks [b × block_rows, b × block_rows + n); rows are written hottest first

Blocks go rank-major across tables, so any prefix of the file holds every table's hottest rows: a budget cut
reads a prefix and stops, never skipping forward or back. Trust: the version, then the header checksum, then the
binding (the sidecar's manifest identity, every table's SHA-256 and row size as the manifest records them, this
process's row range of each table: tables of different sizes split differently over TP ranks, and each table
file's identity, ``file``: device, inode, size, mtime and ctime of the file the rows were read from; for a table in
more than one file, an in-place table's shards, a list of them in the manifest's file order) are checked
before any row is read; each segment's SHA-256 before any row is returned; the ids after that (inside the range
and the table, no duplicates); then a sample of the rows against the table file itself. Anything else is
``None`` and one warning line. The segment checksums prove only that the file is whole; the binding and the
sample are what tie its rows to the table (``docs/hot-file.md``, "Trust model").

SHA-256 (``hashlib``, no new dependency; xxhash is not one of ours): hardware-assisted on x86 (SHA-NI) and Arm
(crypto extensions) where BLAKE2b is not (here, with SHA-NI: 1.1 GiB/s a core against BLAKE2b's 1.0), and the
reader hashes segments on a few threads (hashlib releases the GIL) while it reads the next one.

Imports only the standard library and numpy (no engine, no torch).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import re
import stat
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import strict_json
from ..atomic_file import replacing
from ..paths import data_dir
from .errors import SidecarRowOutOfRange, SidecarShapeMismatch
from .format import FORMAT as SIDECAR_FORMAT
from .format import SidecarManifest, SidecarTable
from .reader import RegionIndex, open_table
from .verify import FILE_KEY_FIELDS, file_key

log = logging.getLogger(__name__)

MAGIC = b"\x89PLEHOT\n"  # the high bit and the newline catch 7-bit and text-mode copies
VERSION = 3  # 3: each table file's identity; 2: a row range per table (1 had one for every table; never released)
FORMAT = "sglang-ssd-stream-hot"
SUFFIX = ".plehot"
HOT_DIR = "hot"
_PREFIX = struct.Struct("<8sIIQ")
DIGEST = 32  # SHA-256
DEFAULT_BLOCK_ROWS = 8192  # a segment of fp8 rows is ~1.3 MiB: large reads, and a budget cut reads < 1 block extra
MAX_BLOCK_ROWS = 1 << 22
MAX_META_BYTES = 1 << 20
HASH_THREADS = 4
READAHEAD = 32 << 20  # asked for ahead of the reader (cold 1 GiB: 0.10-0.48 -> 0.17-0.55 GiB/s on a VM's disk)
# The rows read back from the table at load: each table's hottest SPOT_HEAD (the first looked up) and SPOT_SAMPLE
# more drawn afresh from os.urandom at each load, so a forger cannot know which. K = 64: its 80 random reads took
# 10-12 ms, 2.6 % of a cold 256 MiB load (0.40-0.44 s) on the CPU box in two runs; 256 took 30-34 ms (7.6-7.8 %),
# 1,024 104-132 ms (26-30 %) (scripts/bench_hot_spot_check.py; docs/hot-file.md, "Trust model"). A file whose rows
# are wrong in part f passes
# with (1 - f)^K: 64 misses 10 % wrong rows once in about 850 loads, and no K short of the whole set catches one
# wrong row, so more reads buy little.
SPOT_HEAD = 16
SPOT_SAMPLE = 64
_ROLE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_ID = np.dtype("<i8")

RowRange = tuple[int, int]
RowRanges = dict  # {layer: (start, end)}: each table's rows this process serves; a single RowRange means all


@dataclass
class HotSet:
    """The rows a hot file gave back, every one checked: ``layers[layer] = (ids int64 [n], rows uint8
    [n, row_bytes])``, hottest first. ``cut``: the budget left rows of the file out."""

    path: Path
    row_range: RowRanges
    layers: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    cut: bool = False
    rows_in_file: int = 0

    @property
    def rows(self) -> int:
        return sum(ids.size for ids, _ in self.layers.values())

    @property
    def nbytes(self) -> int:
        """Memory the set holds (ids + rows): what ``budget_bytes`` bounds."""
        return sum(ids.nbytes + rows.nbytes for ids, rows in self.layers.values())


class _Bad(Exception):
    """Why a hot file is ignored (the one warning line's text)."""


# ----------------------------------------------------------------------------- names


def manifest_identity(manifest: SidecarManifest) -> str:
    """SHA-256 (hex) of what makes a sidecar's rows what they are: per table its layer, SHA-256, dtype and
    shape. Not its path: a moved or re-linked artifact keeps its hot files."""
    doc = [SIDECAR_FORMAT] + [[t.layer, t.sha256, t.dtype, t.rows, t.columns, t.row_start, t.bytes]
                              for t in sorted(manifest.tables, key=lambda t: t.layer)]
    return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()


def _check_range(row_range: RowRange) -> RowRange:
    lo, hi = (int(v) for v in row_range)
    if not 0 <= lo < hi:
        raise ValueError(f"row range {tuple(row_range)}: expected (start, end) with 0 <= start < end")
    return lo, hi


def _ranges(manifest: SidecarManifest, row_range, layers) -> dict[int, RowRange]:
    """``{layer: (start, end)}`` for ``layers`` from one range (every table) or a mapping (checked)."""
    if isinstance(row_range, dict):
        missing = [layer for layer in layers if layer not in row_range]
        if missing:
            raise ValueError(f"no row range for layer(s) {missing}")
        return {layer: _check_range(row_range[layer]) for layer in layers}
    one = _check_range(row_range)
    return {layer: one for layer in layers}


def _layers(manifest: SidecarManifest, row_range) -> list[int]:
    """The layers a process serves: a mapping's, else every table's."""
    return sorted(row_range) if isinstance(row_range, dict) else [t.layer for t in manifest.tables]


def _range_tag(ranges: dict[int, RowRange]) -> str:
    """The file name's part for this process's rows: ``rows<lo>-<hi>`` when every table has one range, else a
    digest of the per-table ranges."""
    values = set(ranges.values())
    if len(values) == 1:
        lo, hi = values.pop()
        return f"rows{lo}-{hi}"
    doc = json.dumps(sorted([layer, lo, hi] for layer, (lo, hi) in ranges.items()), separators=(",", ":"))
    return "ranges" + hashlib.sha256(doc.encode()).hexdigest()[:12]


def hot_file_path(manifest: SidecarManifest, row_range: RowRange | RowRanges, role: str) -> Path:
    """This process's hot file under the kit's data directory: one per sidecar (manifest identity), row range
    (TP rank) and ``role`` (the caller's name for the process, e.g. ``sglang-dp1-tp0``: DP replicas share a
    range, so the role tells them apart). ``role``: 1-64 of ``[A-Za-z0-9._-]``, starting with a letter or digit."""
    if not isinstance(role, str) or not _ROLE.fullmatch(role):
        raise ValueError(f"hot file role {role!r}: expected 1-64 characters of [A-Za-z0-9._-], starting with a "
                         f"letter or digit")
    ranges = _ranges(manifest, row_range, _layers(manifest, row_range))
    return data_dir() / HOT_DIR / f"{manifest_identity(manifest)[:16]}-{_range_tag(ranges)}-{role}{SUFFIX}"


def hottest(ids: np.ndarray, counts: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` ids with the highest counts, hottest first (ties: the smaller id first, so the choice is
    deterministic). ``ids`` and ``counts`` are parallel 1-D arrays."""
    ids, counts = np.asarray(ids, np.int64).ravel(), np.asarray(counts).ravel()
    if ids.shape != counts.shape:
        raise ValueError(f"hottest: {ids.size} ids but {counts.size} counts")
    k = max(0, min(int(k), ids.size))
    if k == 0:
        return np.empty(0, np.int64)
    if k < ids.size:  # partition first: O(n), then sort only the k chosen
        part = np.argpartition(counts, ids.size - k)[ids.size - k:]
        # the k-th count may tie with rows left out; take the smallest ids among those tied at the edge
        edge = counts[part].min()
        above = np.flatnonzero(counts > edge)
        tied = np.flatnonzero(counts == edge)
        tied = tied[np.argsort(ids[tied], kind="stable")][: k - above.size]
        part = np.concatenate([above, tied])
    else:
        part = np.arange(ids.size)
    order = np.lexsort((ids[part], -counts[part]))
    return ids[part][order]


# ----------------------------------------------------------------------------- writing


def _tables_for(manifest: SidecarManifest, ranges: dict[int, RowRange],
                rows_by_layer: dict[int, tuple[np.ndarray, np.ndarray]]) -> list[tuple[int, np.ndarray, np.ndarray]]:
    out = []
    for layer in sorted(rows_by_layer):
        t = manifest.table(layer)  # SidecarShapeMismatch for a layer the sidecar lacks
        lo, hi = ranges[layer]
        ids, rows = rows_by_layer[layer]
        ids = np.ascontiguousarray(ids, dtype=_ID)
        rows = np.ascontiguousarray(rows)
        if ids.ndim != 1 or rows.dtype != np.uint8 or rows.shape != (ids.size, t.row_bytes):
            raise SidecarShapeMismatch(
                f"hot rows of layer {layer}: ids {ids.shape} and rows {rows.dtype} {rows.shape}, expected ids [n] "
                f"and uint8 [n, {t.row_bytes}]", actual=(ids.shape, str(rows.dtype), rows.shape),
                expected=t.row_bytes)
        if ids.size and (ids.min() < max(lo, t.row_start) or ids.max() >= min(hi, t.row_end)):
            raise SidecarRowOutOfRange(
                f"hot rows of layer {layer}: ids [{ids.min()}, {ids.max()}] leave the rows [{max(lo, t.row_start)}, "
                f"{min(hi, t.row_end)}) of this range and table", actual=(int(ids.min()), int(ids.max())),
                expected=(lo, hi))
        if _has_duplicates(ids):
            raise SidecarRowOutOfRange(f"hot rows of layer {layer}: an id is listed twice", actual="duplicate ids")
        out.append((layer, ids, rows))
    return out


def _file_keys(table: SidecarTable, stats) -> dict | list[dict]:
    """What the header records of a table's files: one ``file_key`` (a table in one file, as version 3 has it) or
    a list of them in ``table.files`` order. ``stats``: a stat result or a sequence of them; None: the files now."""
    if stats is None:
        stats = [os.stat(f) for f in table.files]
    elif isinstance(stats, os.stat_result) or not isinstance(stats, tuple | list):  # a stat result is a tuple too
        stats = [stats]
    if len(stats) != len(table.files):
        raise ValueError(f"layer {table.layer}: {len(stats)} file identities for a table in {len(table.files)} files")
    keys = [file_key(st) for st in stats]
    return keys[0] if len(keys) == 1 else keys


def write_hot_file(path: str | os.PathLike, manifest: SidecarManifest, row_range: RowRange | RowRanges,
                   rows_by_layer: dict[int, tuple[np.ndarray, np.ndarray]], *, role: str = "",
                   block_rows: int = DEFAULT_BLOCK_ROWS, table_stats: dict[int, os.stat_result] | None = None) -> int:
    """Write ``rows_by_layer`` (``{layer: (ids int64 [n], rows uint8 [n, row_bytes])}``, hottest first) as the
    hot file ``path`` of ``manifest``'s sidecar and ``row_range`` (this rank's ``(vocab_start, vocab_end)``).
    ``table_stats``: ``{layer: os.fstat(fd)}`` of the table files the rows were read from, a tuple of them (the
    table's files in order) for an in-place table (default: each table file as it is now); the reader refuses the
    file once a table is another file or was written since.

    Atomic: a temporary file beside ``path``, fsync, rename, fsync of the directory; a failure (raised:
    ``OSError``) leaves the old file as it was. Bad input (a layer the sidecar lacks, a wrong row size, an id
    outside the range or the table, an id twice) raises before anything is written. Returns the file's size.
    """
    ranges = _ranges(manifest, row_range, sorted(rows_by_layer))
    block_rows = int(block_rows)
    if not 1 <= block_rows <= MAX_BLOCK_ROWS:
        raise ValueError(f"block_rows {block_rows}: expected 1..{MAX_BLOCK_ROWS}")
    tables = _tables_for(manifest, ranges, rows_by_layer)
    segments = _segments([ids.size for _, ids, _ in tables], block_rows)
    stats = table_stats or {}
    meta = {
        "format": FORMAT, "manifest": manifest_identity(manifest), "block_rows": block_rows,
        "role": str(role), "written_unix": int(time.time()),
        "tables": [{"layer": layer, "sha256": manifest.table(layer).sha256, "row_bytes": int(rows.shape[1]),
                    "row_range": list(ranges[layer]), "count": int(ids.size),
                    "file": _file_keys(manifest.table(layer), stats.get(layer))}
                   for layer, ids, rows in tables],
    }
    raw_meta = json.dumps(meta, separators=(",", ":")).encode()
    if len(raw_meta) > MAX_META_BYTES:
        raise ValueError(f"hot file header of {len(raw_meta)} bytes: at most {MAX_META_BYTES}")
    parts = [(tables[t][1][a:b], tables[t][2][a:b]) for t, a, b in segments]
    digests = [_digest(ids, rows) for ids, rows in parts]
    header = _PREFIX.pack(MAGIC, VERSION, len(raw_meta), len(segments)) + raw_meta + b"".join(digests)
    header += hashlib.sha256(header).digest()

    with replacing(path) as f:  # whole or not at all: the old file stays until the rename
        fd = f.fileno()
        _write_all(fd, [header])
        for ids, rows in parts:
            _write_all(fd, [ids, rows])
        size = os.fstat(fd).st_size
    return size


def _has_duplicates(ids: np.ndarray) -> bool:
    s = np.sort(ids)  # a sort: np.unique's hash took 20x longer on 160k ids here
    return bool((s[1:] == s[:-1]).any())


def _segments(counts: list[int], block_rows: int) -> list[tuple[int, int, int]]:
    """``(table index, first rank, end rank)`` of each segment, in file order (rank-major across tables)."""
    out = []
    for b in range(-(-max(counts, default=0) // block_rows)):
        a = b * block_rows
        out.extend((t, a, min(a + block_rows, n)) for t, n in enumerate(counts) if a < n)
    return out


def _digest(*parts: np.ndarray) -> bytes:
    """SHA-256 of a segment's bytes in file order (its ids, then its rows; either may come in two pieces)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.data)
    return h.digest()


def _write_all(fd: int, bufs: list) -> None:
    views = [memoryview(b).cast("B") for b in bufs]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][n:]


# ----------------------------------------------------------------------------- reading


def read_hot_file(path: str | os.PathLike, manifest: SidecarManifest, row_range: RowRange | RowRanges,
                  budget_bytes: int) -> HotSet | None:
    """The rows of hot file ``path`` for ``manifest``'s sidecar and ``row_range``, at most ``budget_bytes``
    of them (ids + rows; each table's hottest first, equal ranks across tables), or None and one warning line
    naming why (missing, unreadable, not a regular file, another version, truncated, a checksum that does not
    match, another sidecar, another row range, a table file that is not the one the rows were read from, invalid
    ids, a sampled row that differs from its table). Never raises for a bad file and never returns a row that was
    not checked.

    One pass: the header, then the file's prefix that the budget takes, read in increasing offsets with large
    reads straight into the returned arrays; no seek, no read twice."""
    p = Path(path)
    try:
        return _read(p, manifest, _ranges(manifest, row_range, _layers(manifest, row_range)), int(budget_bytes))
    except _Bad as exc:
        why = str(exc)
    except FileNotFoundError:
        why = "missing"
    except PermissionError as exc:
        why = f"unreadable ({exc.strerror})"
    except OSError as exc:
        why = f"unreadable ({exc.strerror or exc})"
    except Exception as exc:  # never a traceback at start: the server goes on cold
        why = f"unexpected error ({type(exc).__name__}: {exc})"
    log.warning("PLE hot file %s ignored (%s); the row cache starts cold", p, why)
    return None


def _open(path: Path) -> int:
    """A descriptor of a regular file; non-blocking open so a FIFO at the path cannot hang the start."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _Bad(f"not a regular file ({stat.filemode(mode)})")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_exact(fd: int, bufs: list, what: str) -> None:
    """Fill ``bufs`` from the file position on (sequential ``readv``); a short file is :class:`_Bad`."""
    views = [memoryview(b).cast("B") for b in bufs]
    views = [v for v in views if len(v)]
    while views:
        n = os.readv(fd, views)
        if n == 0:
            raise _Bad(f"truncated in {what}")
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][n:]


def _meta(raw: bytes) -> dict:
    try:
        meta = strict_json.loads(raw)
    except ValueError as exc:
        raise _Bad(f"corrupt header ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _Bad("corrupt header (not a hot file's)")
    return meta


def _int(v: object, lo: int, hi: int, what: str) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _Bad(f"corrupt header ({what} is {v!r})")
    return v


def _bind(meta: dict, manifest: SidecarManifest, ranges: dict[int, RowRange]
          ) -> tuple[int, list[tuple[int, int, int]], dict[int, dict]]:
    """Check the file's binding to this sidecar and range; ``(block_rows, [(layer, row_bytes, count)],
    {layer: the table file's identity when the rows were read})``."""
    if meta.get("manifest") != manifest_identity(manifest):
        raise _Bad(f"written for another sidecar (manifest identity {str(meta.get('manifest'))[:16]}…, this one's "
                   f"is {manifest_identity(manifest)[:16]}…)")
    tables = meta.get("tables")
    if not isinstance(tables, list) or len(tables) > len(manifest.tables):
        raise _Bad("corrupt header (tables)")
    out, seen, files = [], set(), {}
    for t in tables:
        if not isinstance(t, dict):
            raise _Bad("corrupt header (tables)")
        layer = _int(t.get("layer"), 0, 1 << 16, "a table's layer")
        mine = next((m for m in manifest.tables if m.layer == layer), None)
        if mine is None or layer in seen:
            raise _Bad(f"written for another sidecar (layer {layer} is not one of its tables or is listed twice)")
        seen.add(layer)
        if t.get("sha256") != mine.sha256 or t.get("row_bytes") != mine.row_bytes:
            raise _Bad(f"written for another sidecar (layer {layer}: table SHA-256 {str(t.get('sha256'))[:16]}…, "
                       f"{t.get('row_bytes')} B rows; this one's {mine.sha256[:16]}…, {mine.row_bytes} B)")
        if layer not in ranges or t.get("row_range") != list(ranges[layer]):
            raise _Bad(f"written for another row range (layer {layer}: {t.get('row_range')}, this process serves "
                       f"{list(ranges[layer]) if layer in ranges else 'none of its rows'})")
        count = _int(t.get("count"), 0, mine.rows, f"layer {layer}'s count")
        if count > ranges[layer][1] - ranges[layer][0]:
            raise _Bad("corrupt header (more rows than the range holds)")
        files[layer] = _recorded_files(t.get("file"), layer, len(mine.files))
        out.append((layer, mine.row_bytes, count))
    return _int(meta.get("block_rows"), 1, MAX_BLOCK_ROWS, "block_rows"), out, files


def _recorded_files(doc: object, layer: int, nfiles: int) -> list[dict]:
    """A table's recorded file identities (``file_key``'s fields, each an integer), one per file of the table: a
    single one for a table in one file, else a list."""
    docs = [doc] if nfiles == 1 else doc
    if not isinstance(docs, list) or len(docs) != nfiles:
        raise _Bad(f"corrupt header (layer {layer}'s table file identities: expected {nfiles})")
    for d in docs:
        if not isinstance(d, dict) or set(d) != set(FILE_KEY_FIELDS):
            raise _Bad(f"corrupt header (layer {layer}'s table file identity)")
        for name in FILE_KEY_FIELDS:
            _int(d[name], -(1 << 63), (1 << 64) - 1, f"layer {layer}'s {name}")  # times before 1970 are negative
    return docs


def changed_fields(recorded: dict | os.stat_result, now: dict | os.stat_result) -> str:
    """What differs between two identities of a file (``file_key``'s fields), e.g. ``"inode 12 -> 13"``; ``""``
    when none does."""
    a = recorded if isinstance(recorded, dict) else file_key(recorded)
    b = now if isinstance(now, dict) else file_key(now)
    return ", ".join(f"{name} {a.get(name)} -> {b[name]}" for name in FILE_KEY_FIELDS if a.get(name) != b[name])


def _open_tables(manifest: SidecarManifest, files: dict[int, list[dict]], fds: dict[int, list[int]]) -> None:
    """Open each file of each table the file has rows of into ``fds`` (the caller closes them), refusing one that
    is not the very file its rows were read from: another inode (a table replaced by a rename), or the same one
    written since (its size, mtime or ctime moved: ctime even when the writer put mtime back)."""
    for layer, recorded in files.items():
        table = manifest.table(layer)
        opened = fds.setdefault(layer, [])
        for path, key in zip(table.files, recorded, strict=True):
            try:
                opened.append(fd := open_table(path))
                now = os.fstat(fd)
            except OSError as exc:
                raise _Bad(f"layer {layer}'s table {path} cannot be opened ({exc.strerror or exc})") from None
            why = changed_fields(key, now)
            if why:
                raise _Bad(f"layer {layer}'s table {path} is not the file its rows were read from ({why})")
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # the sample's reads: one page each, no read-ahead


def _spot_check(manifest: SidecarManifest, fds: dict[int, list[int]], out: dict, pool) -> None:
    """Read a sample of the rows read back from the tables themselves (each table's first SPOT_HEAD, SPOT_SAMPLE
    more drawn from os.urandom) and refuse the file at the first that differs: the checksums only prove the file
    is whole, and a forged one (its identities copied) or a writer's bug carries wrong rows with right sums."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(16), "little"))
    checks = []
    for layer, (ids, rows) in out.items():
        n = ids.size
        ranks = np.union1d(np.arange(min(SPOT_HEAD, n)), rng.choice(n, min(SPOT_SAMPLE, n), replace=False))
        checks.append((layer, pool.submit(_first_differing, fds[layer], manifest.table(layer), ids[ranks],
                                          rows[ranks])))
    for layer, fut in checks:
        bad = fut.result()
        if bad is not None:
            raise _Bad(f"layer {layer}'s row {bad} differs from its table {manifest.table(layer).file}")


def _first_differing(fds: list[int], table: SidecarTable, ids: np.ndarray, rows: np.ndarray) -> int | None:
    """The first of ``ids`` whose bytes in the table (``fds``: its files, in ``table.files`` order) are not its row
    of ``rows``; None when every one matches. Each row is read where the manifest's regions put it."""
    rb = table.row_bytes
    region, offsets = RegionIndex(table).locate(ids.astype(np.int64))
    file_of = [table.files.index(r.file) for r in table.regions]
    for k, (i, row) in enumerate(zip(ids.tolist(), rows, strict=True)):
        fd = fds[0] if region is None else fds[file_of[region[k]]]
        if os.pread(fd, rb, int(offsets[k])) != row.tobytes():
            return i
    return None


def _take(tables: list[tuple[int, int, int]], budget: int) -> int:
    """The most ranks ``r`` whose rows ``min(r, count)`` of every table, ids included, fit ``budget``."""
    def cost(r: int) -> int:
        return sum(min(r, n) * (rb + _ID.itemsize) for _, rb, n in tables)
    lo, hi = 0, max((n for _, _, n in tables), default=0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= budget else (lo, mid - 1)
    return lo


def _read(path: Path, manifest: SidecarManifest, ranges: dict[int, RowRange], budget: int) -> HotSet:
    fd = _open(path)
    pool = None
    tables_fds: dict[int, list[int]] = {}
    try:
        size = os.fstat(fd).st_size
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger read-ahead window for the one pass
        prefix = bytearray(_PREFIX.size)
        _read_exact(fd, [prefix], "the header")
        magic, version, meta_len, nseg = _PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise _Bad("not a hot file (bad magic)")
        if version != VERSION:
            raise _Bad(f"another version ({version}; this kit reads version {VERSION})")
        if meta_len > MAX_META_BYTES or nseg > size // DIGEST:
            raise _Bad(f"corrupt header (a {meta_len}-byte header with {nseg} segments)")
        rest = bytearray(meta_len + DIGEST * nseg + DIGEST)
        if _PREFIX.size + len(rest) > size:
            raise _Bad(f"truncated in the header ({size} bytes)")
        _read_exact(fd, [rest], "the header")
        header_end = _PREFIX.size + len(rest)
        if hashlib.sha256(prefix + rest[:-DIGEST]).digest() != rest[-DIGEST:]:
            raise _Bad("corrupt header (checksum mismatch)")
        block_rows, tables, files = _bind(_meta(bytes(rest[:meta_len])), manifest, ranges)
        _open_tables(manifest, files, tables_fds)  # before any row is read: a stale file costs no I/O
        segments = _segments([n for _, _, n in tables], block_rows)
        if len(segments) != nseg:
            raise _Bad(f"corrupt header ({nseg} segments listed, {len(segments)} described)")
        want = header_end + sum((b - a) * (tables[t][1] + _ID.itemsize) for t, a, b in segments)
        if size != want:  # before any row is read: a truncated file costs no I/O
            raise _Bad(f"truncated ({size} bytes, expected {want})" if size < want
                       else f"corrupt ({size} bytes, expected {want})")
        digests = [bytes(rest[meta_len + DIGEST * i: meta_len + DIGEST * (i + 1)]) for i in range(nseg)]

        r = _take(tables, budget)
        # the end of the last segment the cut needs: the read-ahead stops there, so a small share reads no more
        need_end = header_end + sum((b - a) * (tables[t][1] + _ID.itemsize) for t, a, b in segments if a < r)
        out = {layer: (np.empty(min(r, n), _ID), np.empty((min(r, n), rb), np.uint8)) for layer, rb, n in tables}
        pool = concurrent.futures.ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="ple-hot-check")
        checks = []
        pos, ahead = header_end, header_end
        for i, (t, a, b) in enumerate(segments):
            if a >= r:
                break  # rank-major: every later segment is past the cut too
            layer, rb, _ = tables[t]
            if pos >= ahead - READAHEAD // 2 and ahead < need_end:
                # ask for the next window while this thread copies (the disk stays busy), and drop what was
                # copied: the rows now live in the caller's memory, the page cache need not hold them twice
                os.posix_fadvise(fd, ahead, min(READAHEAD, need_end - ahead), os.POSIX_FADV_WILLNEED)
                os.posix_fadvise(fd, 0, pos, os.POSIX_FADV_DONTNEED)
                ahead += READAHEAD
            pos += (b - a) * (rb + _ID.itemsize)
            ids, rows = out[layer]
            if b <= r:  # straight into the result
                seg = [ids[a:b], rows[a:b]]
            else:  # the cut falls inside: the head into the result, the tail (its checksum covers it) aside
                seg = [ids[a:r], np.empty(b - r, _ID), rows[a:r], np.empty((b - r, rb), np.uint8)]
            _read_exact(fd, seg, f"layer {layer}'s rows {a}..{b}")
            checks.append((i, layer, a, b, pool.submit(_digest, *seg)))
        for i, layer, a, b, fut in checks:
            if fut.result() != digests[i]:
                raise _Bad(f"corrupt rows (checksum mismatch in layer {layer}'s rows {a}..{b})")
        for layer, (ids, _) in out.items():
            t = manifest.table(layer)
            lo, hi = ranges[layer]
            if ids.size and (ids.min() < max(lo, t.row_start) or ids.max() >= min(hi, t.row_end)
                             or _has_duplicates(ids)):
                raise _Bad(f"invalid ids in layer {layer} (outside the range or the table, or listed twice)")
        _spot_check(manifest, tables_fds, out, pool)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        total = sum(n for _, _, n in tables)
        return HotSet(path, {layer: ranges[layer] for layer in out}, out,
                      cut=r < max((n for _, _, n in tables), default=0), rows_in_file=total)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        for table_fd in (fd for opened in tables_fds.values() for fd in opened):
            os.close(table_fd)
        os.close(fd)


__all__ = ["HotSet", "changed_fields", "hot_file_path", "hottest", "manifest_identity", "read_hot_file",
           "write_hot_file", "VERSION", "MAGIC", "DEFAULT_BLOCK_ROWS"]
