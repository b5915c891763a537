"""Hot files and tables as a forger or a careless operator leaves them (issue 38 item 1): what the e2e suites of
both engines start their servers over. Uses the kit's own hot-file reader and writer, so a forged file passes
every check of the file itself (header, checksums, binding); only the rows' spot-check against the table can
refuse it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np


def _ranges(path: Path) -> tuple[dict[int, tuple[int, int]], dict]:
    """Each table's row range recorded in hot file ``path``, and its header."""
    from sglang_ssd_stream.sidecar import hot_file

    with open(path, "rb") as f:
        _, _, meta_len, _ = hot_file._PREFIX.unpack(f.read(hot_file._PREFIX.size))
        meta = json.loads(f.read(meta_len))
    return {t["layer"]: tuple(t["row_range"]) for t in meta["tables"]}, meta


def forge(src: Path, src_sidecar: Path, dest: Path, dest_sidecar: Path) -> int:
    """Write at ``dest`` hot file ``src`` (a good one of ``src_sidecar``) with every row's bits flipped and its
    checksums recomputed, bound to ``dest_sidecar``'s table files as they are now: 600 of 600 rows wrong, as
    issue 38 found one loaded without a word. Returns the rows forged."""
    from sglang_ssd_stream.sidecar.format import load_manifest
    from sglang_ssd_stream.sidecar.hot_file import read_hot_file, write_hot_file

    ranges, meta = _ranges(src)
    good = read_hot_file(src, load_manifest(src_sidecar), ranges, 1 << 40)
    if good is None or not good.rows:
        raise AssertionError(f"{src} is not a good hot file of {src_sidecar} to forge from")
    forged = {layer: (ids, np.bitwise_not(rows)) for layer, (ids, rows) in good.layers.items()}
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_hot_file(dest, load_manifest(dest_sidecar), ranges, forged, role=meta["role"],
                   block_rows=meta["block_rows"])
    return good.rows


def rewrite_in_place(table: Path, data: bytes) -> None:
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


def restore_by_rename(table: Path, data: bytes) -> None:
    """What the docs tell an operator: the right table written as a new file, renamed over the old one."""
    tmp = table.with_name(table.name + ".restore")
    tmp.write_bytes(data)
    os.replace(tmp, table)
