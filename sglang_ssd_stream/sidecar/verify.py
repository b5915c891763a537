"""SHA-256 verification of sidecar tables, done once per file version and remembered.

A table is hashed in a streaming pass (fixed 8 MiB buffer, progress bar on stderr). A success is
recorded in a small JSON cache keyed by ``(device, inode, size, mtime_ns, ctime_ns)`` of the table
file and bound to the manifest's SHA-256, so later starts skip the 47 GiB pass until the file changes.
``ctime`` is the part a user cannot set back (``os.utime`` restores mtime, not ctime; any write, chmod or
link updates it), so an in-place edit with its mtime restored is re-hashed. What no stat key sees: a
change made below the file system (raw block device, debugfs, media corruption), a root who moves the
clock back, and file systems that do not keep ctime; ``sidecar verify`` (no cache) re-hashes everything.

The rule (docs/sidecar.md, "The verified cache"), for both engines alike:

- where: next to the manifest (``.ssd-stream-verified.json``); where that cannot be written, under
  ``$SGLANG_SSD_STREAM_HOME/sidecar-verify/`` (default ``~/.cache/sglang-ssd-stream``);
- who writes it: only the callers :func:`may_record` names (an engine loading the sidecar it will
  serve, and the commands that write a sidecar); every reporting command reads it and writes nothing,
  no cache, no lock, no temporary file;
- what is trusted: entries of a file that only the serving user or root could have written
  (:func:`distrust`), for this very manifest; anything else is a miss and the table is hashed. Failures
  are never cached. Skipping verification needs an explicit ``no_verify=True``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from ..atomic_file import write_atomic
from ..paths import data_dir
from .errors import SidecarChecksumMismatch, SidecarIOError, SidecarTruncated
from .format import SidecarManifest, SidecarTable, TableRegion, load_manifest
from .reader import open_table

log = logging.getLogger(__name__)

CACHE_NAME = ".ssd-stream-verified.json"
CACHE_VERSION = 3  # 3: bound to the manifest's SHA-256; 2: the key gained device and ctime_ns. Older: re-hashed
HASH_CHUNK = 8 << 20

# Who calls the verifier, as the one rule on writing the verified cache sees it (:func:`may_record`).
SERVE = "serve"  # an engine loading the sidecar it is about to serve (both plugins)
BUILD = "build"  # a command that writes the sidecar itself (``sidecar build``, ``update-model``)
REPORT = "report"  # every reporting command: both doctors, ``sidecar verify``, preflights
_RECORDS = {SERVE: True, BUILD: True, REPORT: False}


def may_record(caller: str) -> bool:
    """Whether ``caller`` may write the verified cache (and take its lock file): the one place this is decided.
    A report writes nothing: what it hashed is said, not kept, so the cache holds only what a serving start or
    the sidecar's own writer checked."""
    try:
        return _RECORDS[caller]
    except KeyError:
        raise ValueError(f"unknown verified-cache caller {caller!r}; one of {sorted(_RECORDS)}") from None


@dataclass(frozen=True)
class TableCheck:
    """Outcome for one table: ``status`` is ``verified``, ``cached``, ``skipped`` or ``mismatch``. For an
    in-place table ``path``, ``sha256`` and ``actual_sha256`` are those of its first region that differs (the
    table's when none does), ``detail`` names that region."""

    layer: int
    path: str
    status: str
    sha256: str  # the expected value
    actual_sha256: str | None
    bytes: int
    seconds: float
    detail: str | None = None


@dataclass(frozen=True)
class VerifyReport:
    manifest: str
    cache_file: str | None
    tables: tuple[TableCheck, ...]

    @property
    def ok(self) -> bool:
        return all(t.status != "mismatch" for t in self.tables)

    def to_json(self) -> dict:
        return {"manifest": self.manifest, "cache_file": self.cache_file, "ok": self.ok,
                "tables": [asdict(t) for t in self.tables]}


def default_cache_dir() -> Path:
    """Fallback cache directory for read-only artifacts (under the kit's one data directory)."""
    return data_dir() / "sidecar-verify"


def _fallback_cache_file(manifest: SidecarManifest, cache_dir: str | os.PathLike | None) -> Path:
    key = hashlib.sha256(os.path.realpath(manifest.path).encode()).hexdigest()[:24]
    return Path(cache_dir or default_cache_dir()) / f"{key}.json"


FILE_KEY_FIELDS = ("device", "inode", "size", "mtime_ns", "ctime_ns")


def file_key(st: os.stat_result) -> dict:
    """What a write to a file changes, as this cache and the hot file (``hot_file.py``) record it."""
    return dict(zip(FILE_KEY_FIELDS, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns), strict=True))


def distrust(st: os.stat_result) -> str | None:
    """Why a cache file's entries are not to be believed, or None. An entry lets a table skip its SHA-256, so
    only a file that nobody but the serving user and root could have written counts: a regular file owned by
    this process's user or root, writable by its owner alone. Its directory may be shared: another writer
    there can remove or replace the file, and a replacement is theirs, so it is refused here."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid not in (os.geteuid(), 0):
        return f"owned by uid {st.st_uid}, neither this user (uid {os.geteuid()}) nor root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by others than its owner (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _read_trusted(path: Path) -> bytes | None:
    """The cache file's bytes when :func:`distrust` finds nothing against it (judged on the open file, never
    through a link), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:  # a symlink (ELOOP), unreadable
        log.warning("PLE sidecar verified cache %s ignored: cannot open it without following a link (%s)", path,
                    exc.strerror or exc)
        return None
    with os.fdopen(fd, "rb") as f:
        why = distrust(os.fstat(fd))
        if why:
            log.warning("PLE sidecar verified cache %s ignored: %s; its tables are hashed", path, why)
            return None
        return f.read()


def _read_cache(path: Path, manifest: SidecarManifest) -> dict:
    """The entries of a trusted cache file written for this manifest's bytes; {} otherwise (only a cache miss)."""
    try:
        raw = _read_trusted(path)
        doc = json.loads(raw) if raw is not None else None
    except (OSError, ValueError):
        return {}
    if (isinstance(doc, dict) and doc.get("version") == CACHE_VERSION and isinstance(doc.get("tables"), dict)
            and doc.get("manifest_sha256") == manifest.sha256):
        return doc["tables"]
    return {}


def _write_cache(path: Path, entries: dict, manifest_sha256: str) -> None:
    """Atomically write the cache (a new file: 0600, this user's); raises OSError when the location is not
    writable."""
    doc = {"version": CACHE_VERSION, "manifest_sha256": manifest_sha256, "tables": entries}
    write_atomic(path, json.dumps(doc, indent=1, sort_keys=True), durable=False)  # a lost cache is a cache miss


def sha256_file(path: str | os.PathLike, *, expected_bytes: int | None = None, progress: bool = True,
                desc: str | None = None, offset: int | None = None) -> str:
    """Streaming SHA-256 with a tqdm progress bar (stderr): of the whole file (a copied table: bytes past
    ``expected_bytes`` are hashed too, so a longer file differs), or, given ``offset``, of exactly
    ``expected_bytes`` from that byte (an in-place region). The builders and the verifier hash with it."""
    from tqdm import tqdm

    region = offset is not None
    if region and expected_bytes is None:
        raise ValueError("a region's SHA-256 needs its size (expected_bytes)")
    h = hashlib.sha256()
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    done = 0
    try:
        with os.fdopen(open_table(path), "rb", buffering=0) as f:
            total = expected_bytes if expected_bytes is not None else os.fstat(f.fileno()).st_size
            try:
                os.posix_fadvise(f.fileno(), offset or 0, total if region else 0, os.POSIX_FADV_SEQUENTIAL)
            except (AttributeError, OSError):
                pass
            if region:
                f.seek(offset)
            with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
                      desc=desc or f"sha256 {Path(path).name}", leave=False) as bar:
                while not region or done < total:
                    n = f.readinto(view[:min(HASH_CHUNK, total - done)] if region else buf)
                    if not n:
                        break
                    h.update(view[:n])
                    done += n
                    bar.update(n)
    except OSError as exc:
        raise SidecarIOError(f"cannot read PLE table {path} for verification: {exc.strerror or exc}",
                             path=str(path)) from exc
    if expected_bytes is not None and done < expected_bytes:
        where = f" from byte {offset}" if region else ""
        raise SidecarTruncated(f"PLE table {path} is truncated: it has {done} bytes{where}, expected {expected_bytes}",
                               path=str(path), actual=done, expected=expected_bytes)
    return h.hexdigest()


def verify_sidecar(
    manifest: SidecarManifest | str | os.PathLike,
    *,
    caller: str = REPORT,
    no_verify: bool = False,
    use_cache: bool = True,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    layers: Iterable[int] | None = None,
    raise_on_mismatch: bool = True,
) -> VerifyReport:
    """Check every table's SHA-256 against the manifest (or reuse a cached success).

    Args:
        manifest: a loaded manifest, or the path of ``ssd-stream.json`` / its directory.
        caller: :data:`SERVE`, :data:`BUILD` or :data:`REPORT` (the default): whether successes are recorded in
            the verified cache is :func:`may_record`'s decision; a report writes nothing anywhere.
        no_verify: skip hashing entirely (explicit opt-out; logged as a warning).
        use_cache: accept a trusted cached success whose (device, inode, size, mtime_ns, ctime_ns) still match;
            ``False`` forces a full re-check (``sidecar verify`` does this).
        cache_dir: fallback cache directory when the artifact directory is not writable.
        progress: show a tqdm progress bar on stderr.
        layers: only these layers (default: all).
        raise_on_mismatch: raise :class:`SidecarChecksumMismatch` at the end if any table differs;
            with ``False`` the report carries ``status="mismatch"`` instead.

    Returns:
        A :class:`VerifyReport`; its ``cache_file`` is the cache written, or (a report) the one read, or None.
    """
    record = may_record(caller)
    if not isinstance(manifest, SidecarManifest):
        manifest = load_manifest(manifest)
    wanted = None if layers is None else set(layers)
    tables = [t for t in manifest.tables if wanted is None or t.layer in wanted]
    if no_verify:
        log.warning("PLE sidecar %s: SHA-256 verification skipped (--no-verify)", manifest.path)
        return VerifyReport(str(manifest.path), None, tuple(
            TableCheck(t.layer, t.path, "skipped", t.sha256, None, t.bytes, 0.0) for t in tables))

    primary = manifest.root / CACHE_NAME
    fallback = _fallback_cache_file(manifest, cache_dir)
    # One recording process hashes at a time (TP ranks start together); the others then hit the cache.
    with _verify_lock(fallback) if record else contextlib.nullcontext():
        report, mismatches = _verify_locked(manifest, tables, primary, fallback, use_cache, progress, record)
    if mismatches and raise_on_mismatch:
        m = mismatches[0]
        more = f" (and {len(mismatches) - 1} more table(s))" if len(mismatches) > 1 else ""
        where = f" ({m.detail})" if m.detail else ""
        raise SidecarChecksumMismatch(
            f"PLE table {m.path} (layer {m.layer}) has SHA-256 {m.actual_sha256}, expected {m.sha256}{where}{more}",
            path=m.path, actual=m.actual_sha256, expected=m.sha256, report=report.to_json(),
        )
    return report


@contextlib.contextmanager
def _verify_lock(fallback: Path):
    from filelock import FileLock

    lock_path = fallback.with_suffix(".lock")
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(lock_path))
        lock.acquire()
    except OSError as exc:  # no writable place for a lock: verify unlocked (correct, maybe duplicated work)
        log.info("PLE sidecar verify lock %s unavailable (%s); continuing without it", lock_path, exc)
        yield
        return
    try:
        yield
    finally:
        lock.release()


def entry_name(table: SidecarTable, region: TableRegion) -> str:
    """What one cache entry vouches for: a copied table's file (its manifest path), or an in-place region
    (``path@offset+bytes``: a shard holds many)."""
    return f"{region.path}@{region.offset}+{region.bytes}" if table.in_place else region.path


def _region_detail(table: SidecarTable, region: TableRegion, st: os.stat_result) -> str | None:
    if not table.in_place:
        return None
    since = (f"; the shard was written since the manifest was built (mtime {st.st_mtime_ns} ns, built from "
             f"{region.file_mtime_ns})" if st.st_mtime_ns != region.file_mtime_ns else "")
    return f"tensor {region.tensor}: rows [{region.row_start}, {region.row_end}) at byte {region.offset} of " \
           f"{region.file}{since}"


def _check_tables(tables, entries: dict, use_cache: bool, progress: bool):
    """Each table (each of its regions) against the manifest, a trusted matching entry standing for its hash:
    (results, mismatches, whether ``entries`` changed). ``entries`` is updated in place with the successes and
    failures."""
    results: list[TableCheck] = []
    mismatches: list[TableCheck] = []
    dirty = False
    for t in tables:
        t0, cached, bad = time.monotonic(), 0, None
        for r in t.regions:
            try:
                st = os.stat(r.file)
            except OSError as exc:
                raise SidecarIOError(f"cannot stat PLE table {r.file}: {exc.strerror or exc}",
                                     path=str(r.file)) from exc
            key, name = file_key(st), entry_name(t, r)
            if use_cache and entries.get(name) == {**key, "sha256": r.sha256}:
                cached += 1
                continue
            actual = sha256_file(r.file, expected_bytes=r.bytes, progress=progress, desc=f"verify layer {t.layer}",
                                 offset=r.offset if t.in_place else None)
            dirty = True
            if actual != r.sha256:
                entries.pop(name, None)
                bad = bad or (r, actual, _region_detail(t, r, st))
            else:
                # Record the stat taken *before* hashing: a write during the pass changes mtime/ctime and
                # invalidates the entry.
                entries[name] = {**key, "sha256": r.sha256}
        dt = time.monotonic() - t0
        if bad is not None:
            r, actual, detail = bad
            check = TableCheck(t.layer, r.path, "mismatch", r.sha256, actual, t.bytes, dt, detail)
            mismatches.append(check)
        elif cached == len(t.regions):
            check = TableCheck(t.layer, t.path, "cached", t.sha256, t.sha256, t.bytes, 0.0)
        else:
            check = TableCheck(t.layer, t.path, "verified", t.sha256, t.sha256, t.bytes, dt)
        results.append(check)
    return results, mismatches, dirty


def _verify_locked(manifest, tables, primary, fallback, use_cache, progress, record):
    # Entries are always loaded (so a partial re-check keeps the others) but trusted only with use_cache.
    cache_file = primary
    entries = _read_cache(primary, manifest)
    if not entries:
        entries = _read_cache(fallback, manifest)
        if entries:
            cache_file = fallback
    read_from = str(cache_file) if entries else None

    results, mismatches, dirty = _check_tables(tables, entries, use_cache, progress)
    written = read_from
    if dirty and record:
        targets = (primary, fallback) if cache_file == primary else (fallback,)
        written = _record(manifest, entries, targets)
    return VerifyReport(str(manifest.path), written, tuple(results)), mismatches


def _record(manifest: SidecarManifest, entries: dict, targets) -> str | None:
    """Write ``entries`` to the first of ``targets`` that takes them: its path, or None (logged)."""
    for target in targets:
        try:
            _write_cache(target, entries, manifest.sha256)
            return str(target)
        except OSError as exc:
            log.info("PLE sidecar verify cache %s not writable (%s); trying the next location", target, exc)
    log.warning("PLE sidecar %s: could not record verification in %s", manifest.path,
                " or ".join(str(t) for t in targets))
    return None


def table_file_key(table: SidecarTable) -> dict:
    """The (device, inode, size, mtime_ns, ctime_ns) cache key of a table file (for adapters that log it)."""
    return file_key(os.stat(table.file))


def record_built(manifest: SidecarManifest, before: dict[Path, os.stat_result], *,
                 cache_dir: str | os.PathLike | None = None) -> str | None:
    """Record what a builder hashed itself, as :data:`BUILD` (no second pass over the bytes): ``before`` maps each
    table file (resolved, as the manifest has it) to its stat from *before* it was hashed (the builder refuses a
    file whose stat moved during the pass). Returns the cache file written, or None."""
    entries = {entry_name(t, r): {**file_key(before[r.file]), "sha256": r.sha256}
               for t in manifest.tables for r in t.regions}
    primary, fallback = manifest.root / CACHE_NAME, _fallback_cache_file(manifest, cache_dir)
    with _verify_lock(fallback):
        return _record(manifest, entries, (primary, fallback))
