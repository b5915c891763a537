"""The model view's marker, as the runtime reads it: which directories a view's sidecar may link into.

``model build-view`` (:mod:`sglang_ssd_stream.operate.model_view`) writes ``.ssd-stream-view.json``
into a view; both plugins read it here (:func:`load_sidecar`), so a sidecar whose tables are links
into the prepared snapshot loads without trusting anything else. The marker names the snapshot; it
grants nothing by itself (the snapshot must hold the same manifest, table for table). A view whose PLE
tables are served in place from the dense snapshot's own shards (``"ple": "in-place"``) is bound to that
snapshot region for region instead: the snapshot's own index must map each region's tensor to the region's
file, and the view's link must resolve to that very file. ``SGLANG_SSD_STREAM_TRUSTED_ROOTS`` adds roots on
SGLang.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import SidecarManifestError
from .format import INDEX_NAME, MANIFEST_NAME, hf_blobs_root

if TYPE_CHECKING:
    from .format import SidecarManifest

MARKER_NAME = ".ssd-stream-view.json"
MARKER_FORMAT = "sglang-ssd-stream-view"
PLE_IN_PLACE = "in-place"  # the marker's "ple": the tables are regions of the dense snapshot's own shards


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


def _snapshot_roots(snapshot: Path) -> list[str]:
    real = Path(os.path.realpath(snapshot))  # a link to an HF snapshot: its blobs/ are beside the real one
    blobs = hf_blobs_root(real)
    return [str(real)] + ([os.path.realpath(blobs)] if blobs is not None else [])


def _dense_weight_map(marker: dict) -> dict[str, str] | None:
    """The dense snapshot's own index (outside the view) for a view served in place from it, else None."""
    if marker.get("ple") != PLE_IN_PLACE or not isinstance(marker.get("dense"), str):
        return None
    try:
        wm = json.loads((Path(marker["dense"]) / INDEX_NAME).read_text(encoding="utf-8")).get("weight_map")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return wm if isinstance(wm, dict) else None


def view_trusted_roots(view: str | os.PathLike) -> list[str]:
    """Directories a view's table links may resolve into: the prepared snapshot it was built from (and its
    HF blobs), and only while that snapshot holds a byte-identical ``ssd-stream.json``; for a view served in
    place, the dense snapshot (and its blobs) while its own index is readable (:func:`load_sidecar` then binds
    every region to it). Nothing written in the artifact grants more: the marker's own ``trusted_roots`` field
    is ignored."""
    marker = read_marker(view)
    if not marker:
        return []
    if marker.get("ple") == PLE_IN_PLACE:
        return _snapshot_roots(Path(marker["dense"])) if _dense_weight_map(marker) is not None else []
    if not isinstance(marker.get("prepared"), str):
        return []
    prepared = Path(marker["prepared"])
    try:
        same = (prepared / MANIFEST_NAME).read_bytes() == (Path(view) / MANIFEST_NAME).read_bytes()
    except OSError:
        same = False
    if not same:
        return []
    return _snapshot_roots(prepared)


def extra_trusted_roots(roots: Iterable[str | os.PathLike]) -> list[str]:
    """Roots the operator names (a knob, ``--trusted-root``), with their HF blobs."""
    roots = [str(r) for r in roots if str(r)]
    return roots + [str(b) for b in [hf_blobs_root(Path(r)) for r in roots] if b is not None]


def engine_trusted_roots(engine: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """The roots the engine's ``TRUSTED_ROOTS`` knob names in ``environ`` (default: this process's), with their HF
    blobs: what that engine's server trusts, for the commands that check its sidecar beside it."""
    from ..knobs import knob

    env = os.environ if environ is None else environ
    return extra_trusted_roots(knob(engine, "TRUSTED_ROOTS").read(env) or ())


def load_sidecar(path: str | os.PathLike, *, extra_roots: Iterable[str | os.PathLike] = (),
                 check_files: bool = True) -> SidecarManifest:
    """The one loader of a sidecar manifest for both engines and the CLI: the artifact itself (and its HF
    blobs), the roots the operator names (``extra_roots``) and, for a model view, the prepared snapshot
    it was built from, table for table: each of the view's tables must resolve to the very file the
    snapshot's manifest names (for a view served in place, the dense snapshot, region for region: the file
    its index maps the region's tensor to). Symlink loops, FIFOs, devices and directories are refused by
    :func:`load_manifest` without opening them for reading."""
    from .errors import SidecarPathEscape
    from .format import load_manifest

    root = Path(path) if Path(path).is_dir() else Path(path).parent
    granted = view_trusted_roots(root)
    manifest = load_manifest(path, trusted_roots=[*granted, *extra_roots], check_files=check_files)
    if not granted:
        return manifest
    marker = read_marker(root)
    dense_map = _dense_weight_map(marker)
    source = Path(marker["dense"] if dense_map is not None else marker["prepared"])
    for r in (r for t in manifest.tables for r in t.regions):  # a copied table is one region: its file
        if dense_map is not None and (r.tensor is None or dense_map.get(r.tensor) != r.path):
            raise SidecarPathEscape(
                f"{root}: view region {r.path} ({r.tensor}) is not where the dense snapshot's index "
                f"{source / INDEX_NAME} maps that tensor ({dense_map.get(r.tensor or '')}); refusing the view",
                path=str(r.file), actual=r.path, expected=dense_map.get(r.tensor or ""))
        want = os.path.realpath(source / r.path)
        if os.path.realpath(r.file) != want:
            what = "dense" if dense_map is not None else "prepared"
            raise SidecarPathEscape(
                f"{root}: view table {r.path} resolves to {os.path.realpath(r.file)}, not to the {what} "
                f"snapshot's {want}; refusing the view", path=str(r.file), actual=os.path.realpath(r.file),
                expected=want)
    return manifest
