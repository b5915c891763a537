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


def forge(hot_path: str | os.PathLike, manifest_path: str | os.PathLike) -> dict:
    """Rewrite the hot file ``hot_path`` of the sidecar ``manifest_path`` (its directory or ``ssd-stream.json``):
    every row's bytes inverted, the checksums those rows need, the header's binding and table identities as they
    were (atomically, by the kit's writer). The file must read back whole before (it is checked here). Returns
    ``{layer: rows}`` forged."""
    path = Path(hot_path)
    manifest = load_sidecar(manifest_path)
    meta = header(path)
    ranges = {t["layer"]: tuple(t["row_range"]) for t in meta["tables"]}
    got = hot_file.read_hot_file(path, manifest, ranges, path.stat().st_size)
    if got is None or got.cut:
        raise AssertionError(f"{path}: not a whole hot file of {manifest_path} to forge from")
    identities = {t["layer"]: SimpleNamespace(**dict(zip(_STAT_NAMES, (t["file"][k] for k in FILE_KEY_FIELDS),
                                                         strict=True)))
                  for t in meta["tables"]}
    forged = {layer: (ids, rows ^ 0xFF) for layer, (ids, rows) in got.layers.items()}
    hot_file.write_hot_file(path, manifest, ranges, forged, role=meta["role"], block_rows=meta["block_rows"],
                            table_stats=identities)
    return {layer: int(ids.size) for layer, (ids, _) in forged.items()}
