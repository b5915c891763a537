"""A forged hot file for the end-to-end suites: a real hot file whose rows are changed and whose checksums are
recomputed, its binding (manifest identity, tables' SHA-256, row ranges, each table file's identity) kept. Its
header and segments are whole, so only the reader's spot check of rows against the tables can refuse it
(``docs/hot-file.md``, "Trust model"). Made with the kit's own reader and writer, never by hand."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

from sglang_ssd_stream.sidecar import hot_file
from sglang_ssd_stream.sidecar.verify import FILE_KEY_FIELDS
from sglang_ssd_stream.sidecar.view import load_sidecar

_STAT_NAMES = ("st_dev", "st_ino", "st_size", "st_mtime_ns", "st_ctime_ns")  # file_key's fields, in its order


def header(path: str | os.PathLike) -> dict:
    """The hot file's header (its meta JSON)."""
    with open(path, "rb") as f:
        prefix = f.read(hot_file._PREFIX.size)
        _, _, meta_len, _ = hot_file._PREFIX.unpack(prefix)
        return json.loads(f.read(meta_len))


def forge(hot_path: str | os.PathLike, manifest_path: str | os.PathLike, *, dest: str | os.PathLike | None = None,
          bind_to: str | os.PathLike | None = None) -> dict:
    """Rewrite the hot file ``hot_path`` of the sidecar ``manifest_path`` (its directory or ``ssd-stream.json``):
    every row's bytes inverted, the checksums those rows need, the header's binding and table identities as they
    were (atomically, by the kit's writer). The file must read back whole before (it is checked here). ``dest``:
    write the forged file there instead; ``bind_to``: bind it to that sidecar's table files as they are now (a
    copy of the same tables) instead of the recorded identities. Returns ``{layer: rows}`` forged."""
    path = Path(hot_path)
    manifest = load_sidecar(manifest_path)
    meta = header(path)
    ranges = {t["layer"]: tuple(t["row_range"]) for t in meta["tables"]}
    got = hot_file.read_hot_file(path, manifest, ranges, path.stat().st_size)
    if got is None or got.cut:
        raise AssertionError(f"{path}: not a whole hot file of {manifest_path} to forge from")
    if bind_to is None:
        def identity(key: dict) -> SimpleNamespace:
            return SimpleNamespace(**dict(zip(_STAT_NAMES, (key[k] for k in FILE_KEY_FIELDS), strict=True)))

        # one table file's identity, or a list of them (an in-place table's shards)
        identities = {t["layer"]: (tuple(map(identity, t["file"])) if isinstance(t["file"], list)
                                   else identity(t["file"])) for t in meta["tables"]}
    else:
        manifest = load_sidecar(bind_to)
        identities = {t.layer: os.stat(t.file) for t in manifest.tables}
    forged = {layer: (ids, rows ^ 0xFF) for layer, (ids, rows) in got.layers.items()}
    out = Path(dest) if dest is not None else path
    out.parent.mkdir(parents=True, exist_ok=True)
    hot_file.write_hot_file(out, manifest, ranges, forged, role=meta["role"], block_rows=meta["block_rows"],
                            table_stats=identities)
    return {layer: int(ids.size) for layer, (ids, _) in forged.items()}


def rewrite_in_place(table: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` into ``table``'s own inode and put its mtime back (``touch -d``): a change the reader's
    size/mtime check cannot see (docs/hot-file.md, "Trust model"); only the inode's ctime moves."""
    st = os.stat(table)
    if len(data) != st.st_size:
        raise AssertionError(f"{table}: {len(data)} bytes for a {st.st_size}-byte table")
    with open(table, "r+b") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.utime(table, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(table)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)


def restore_by_rename(table: str | os.PathLike, data: bytes) -> None:
    """What the docs tell an operator: the right table written as a new file, renamed over the old one."""
    table = Path(table)
    tmp = table.with_name(table.name + ".restore")
    tmp.write_bytes(data)
    os.replace(tmp, table)
