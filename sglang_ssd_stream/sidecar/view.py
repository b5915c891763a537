"""The model view's marker, as the runtime reads it: which directories a view's sidecar may link into.

``model build-view`` (:mod:`sglang_ssd_stream.operate.model_view`) writes ``.ssd-stream-view.json``
into a view; both plugins read it here, so a sidecar whose tables are links into the prepared
snapshot loads without trusting anything else. ``SGLANG_SSD_STREAM_TRUSTED_ROOTS`` adds roots.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import SidecarManifestError
from .format import hf_blobs_root

MARKER_NAME = ".ssd-stream-view.json"
MARKER_FORMAT = "sglang-ssd-stream-view"
TRUSTED_ROOTS_ENV = "SGLANG_SSD_STREAM_TRUSTED_ROOTS"  # os.pathsep-separated extra roots


class ForeignView(SidecarManifestError):
    """A directory's view marker is unreadable or not ours."""


def read_marker(view: str | os.PathLike) -> dict | None:
    """The builder's record of a view (None when ``view`` has none)."""
    p = Path(view) / MARKER_NAME
    if not p.exists():
        return None
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise ForeignView(f"{p}: unreadable view marker ({exc}); refusing to use {view}") from exc
    if not isinstance(doc, dict) or doc.get("format") != MARKER_FORMAT or not isinstance(doc.get("entries"), list):
        raise ForeignView(f"{p}: not a {MARKER_FORMAT} marker; refusing to use {view}")
    return doc


def view_trusted_roots(view: str | os.PathLike) -> list[str]:
    """Directories the view's table links may resolve into (for ``load_manifest(trusted_roots=…)``)."""
    marker = read_marker(view)
    return list(marker.get("trusted_roots", [])) if marker else []


def trusted_roots(artifact_dir: str | os.PathLike, environ=None) -> list[str]:
    """Roots a sidecar in ``artifact_dir`` may resolve into: the view's, the variable's, and their HF blobs."""
    env = os.environ if environ is None else environ
    roots = view_trusted_roots(artifact_dir)
    roots += [r for r in env.get(TRUSTED_ROOTS_ENV, "").split(os.pathsep) if r]
    return roots + [str(b) for b in [hf_blobs_root(Path(r)) for r in roots] if b is not None]
