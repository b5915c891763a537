"""``patches/<engine>/series``: the one place the patch order is written (quilt's format).

One patch file name per line, applied top to bottom; blank lines and ``#`` comments are allowed.
Quilt's per-line options (``-p0``) are not: every patch of ours is ``-p1`` with ``a/`` ``b/`` names.
A release's manifest says which of these patches apply there; the order is always this file's.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import BadKitData
from .engines import Engine
from .files import read_kit_file

SERIES = "series"
PATCH_ID = re.compile(r"^[0-9]{4}-[a-z0-9][a-z0-9-]*$")
MAX_SERIES_BYTES = 64 << 10


def series_path(root: Path, engine: Engine) -> Path:
    return root / "patches" / engine.name / SERIES


def patch_path(root: Path, engine: Engine, patch_id: str) -> Path:
    return root / "patches" / engine.name / f"{patch_id}.patch"


def load_series(root: Path, engine: Engine) -> tuple[str, ...]:
    """Patch ids (file names without ``.patch``) in application order."""
    path = series_path(root, engine)
    raw = read_kit_file(path, "patch series", MAX_SERIES_BYTES)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadKitData(f"patch series {path} is not UTF-8: {exc}") from None
    ids: list[str] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        name = entry[:-len(".patch")] if entry.endswith(".patch") else None
        if name is None or not PATCH_ID.match(name):
            raise BadKitData(f"{path}:{lineno}: {entry!r} is not a patch file name NNNN-name.patch "
                             f"(one name per line; quilt options are not supported)")
        if name in ids:
            raise BadKitData(f"{path}:{lineno}: {entry} is listed twice")
        ids.append(name)
    if not ids:
        raise BadKitData(f"patch series {path} lists no patch")
    return tuple(ids)
