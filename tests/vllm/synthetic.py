"""Synthetic PLE sidecars for the vLLM tests (numpy + stdlib; no engine).

Writes the artifact layout of :mod:`sglang_ssd_stream.sidecar.format` directly (raw row-major
tables plus ``ssd-stream.json`` with real SHA-256), so the tests know every byte they read back.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

ITEMSIZE = {"float8_e4m3fn": 1, "bfloat16": 2}


def random_table(rows: int, row_bytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(rows, row_bytes), dtype=np.uint8)


def finite_fp8_table(rows: int, columns: int, seed: int) -> np.ndarray:
    """Random FP8-e4m3 bytes without the two NaN codes (0x7f, 0xff), so sums are exact."""
    t = random_table(rows, columns, seed)
    t[(t & 0x7F) == 0x7F] &= 0xFE
    return t


def write_sidecar(root: Path, tables: dict[int, tuple[str, np.ndarray]], *, row_start: int = 0) -> Path:
    """Write ``{layer: (dtype, uint8 [rows, row_bytes])}`` as a sidecar in ``root``; returns the manifest."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "ple").mkdir(exist_ok=True)
    entries = []
    for layer, (dtype, data) in sorted(tables.items()):
        rel = f"ple/layer-{layer}.bin"
        raw = np.ascontiguousarray(data).tobytes()
        (root / rel).write_bytes(raw)
        rows, row_bytes = data.shape
        entry = {"layer": layer, "path": rel, "sha256": hashlib.sha256(raw).hexdigest(), "dtype": dtype,
                 "rows": rows, "columns": row_bytes // ITEMSIZE[dtype], "bytes": len(raw)}
        if row_start:
            entry["row_start"] = row_start
        entries.append(entry)
    manifest = root / "ssd-stream.json"
    manifest.write_text(json.dumps({"format": "sglang-ssd-stream", "version": 1, "tables": entries}))
    return manifest


def write_view(view: Path, prepared: Path) -> Path:
    """A model view over the sidecar in ``prepared`` as ``model build-view`` lays it out: the manifest copied,
    each table a symlink into ``prepared``, the marker naming ``prepared`` as a trusted root."""
    from sglang_ssd_stream.sidecar.view import MARKER_FORMAT, MARKER_NAME

    (view / "ple").mkdir(parents=True)
    (view / "ssd-stream.json").write_bytes((prepared / "ssd-stream.json").read_bytes())
    for table in sorted((prepared / "ple").iterdir()):
        (view / "ple" / table.name).symlink_to(table)
    (view / MARKER_NAME).write_text(json.dumps({"format": MARKER_FORMAT, "version": 1, "prepared": str(prepared),
                                                "trusted_roots": [str(prepared)],
                                                "entries": ["ple", "ssd-stream.json"]}))
    return view / "ssd-stream.json"
