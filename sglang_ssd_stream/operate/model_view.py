"""``model build-view`` / ``model check-view``: a serving directory that stores no large weight twice.

The write-up's step 3, automated. A *view* combines

- from the **dense** snapshot: ``config.json`` and the other small top-level files, and every
  safetensors shard its index references that it holds (the dense NVFP4 shards);
- from the **prepared** (SSD-stream) snapshot: the shards the index references that the dense
  snapshot lacks (routed experts), ``mtp/``, the PLE tables named by ``ssd-stream.json`` and
  ``model-plefp8-scale.safetensors``; ``ssd-stream.json`` itself is *copied* (the engine's
  verify cache is written next to it, and it must not be written into the prepared snapshot);
- ``model.safetensors.index.json`` rewritten without the PLE shard mappings
  (``…ngram_embedding.shard_N.weight``; the ``weight_scale`` mappings stay), the original kept
  as ``model.safetensors.index.with-ple.json``.

With ``in_place`` the PLE tables come from the **dense** snapshot's own shards instead, with no copy: the
shards its index maps the PLE tensors to are linked, and ``sidecar build --in-place``'s builder writes the
view's ``ssd-stream.json`` naming regions of them (one hashing pass; a rebuild over the same dense snapshot
keeps the manifest and its verified cache). The prepared snapshot's own sidecar is not used (it need not
be there). The marker's ``"ple": "in-place"`` binds the view to the dense snapshot region for region
(:mod:`sglang_ssd_stream.sidecar.view`).

Everything else is a symlink. ``.ssd-stream-view.json`` records what the builder made, so a
rebuild replaces only its own entries and refuses a directory holding anything else (the
engine's ``.ssd-stream-verified.json`` excepted). A view is built in a temporary sibling and
renamed into place, so a failed build leaves nothing half-made. ``check_view`` is the
completeness check (no dangling links, every indexed shard present, required files present).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import EXIT_OK, BadKitData, EnvironmentProblem, KitError, RefusedSourceState
from ..sidecar.build import SHARD_TENSOR
from ..sidecar.format import INDEX_NAME, MANIFEST_NAME, SCALE_FILE_NAME, hf_blobs_root
from ..sidecar.verify import CACHE_NAME
from ..sidecar.view import MARKER_FORMAT, MARKER_NAME, PLE_IN_PLACE, ForeignView, load_sidecar
from ..sidecar.view import read_marker as _read_marker

BACKUP_NAME = "model.safetensors.index.with-ple.json"
MTP_DIR = "mtp"
# Written into a view by others, by design: the sidecar verify cache.
ALLOWED_FOREIGN = frozenset({CACHE_NAME})
# Top-level files of the dense snapshot that are not copied as links (rewritten or unwanted).
_SKIP_DENSE = frozenset({INDEX_NAME, BACKUP_NAME, MARKER_NAME, MANIFEST_NAME, CACHE_NAME})


class ModelViewError(BadKitData):
    """The inputs cannot make a complete view, or a view is incomplete."""


class ForeignViewDirectory(RefusedSourceState):
    """The output directory holds files the view builder did not make; nothing was changed."""


@dataclass(frozen=True)
class ViewReport:
    path: str
    mappings: int
    shards: int
    removed_ple_mappings: int
    links: int
    tables: tuple[str, ...]

    def to_json(self) -> dict:
        return {"path": self.path, "mappings": self.mappings, "shards": self.shards,
                "removed_ple_mappings": self.removed_ple_mappings, "links": self.links, "tables": list(self.tables)}


def _read_index(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelViewError(f"{path}: missing (a safetensors index is required)") from None
    except (OSError, ValueError) as exc:
        raise ModelViewError(f"{path}: unreadable safetensors index ({exc})") from exc
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise ModelViewError(f"{path}: expected an object with a 'weight_map' of tensor name -> file name")
    for fname in set(wm.values()):
        p = Path(fname)
        if p.is_absolute() or ".." in p.parts or len(p.parts) != 1:
            raise ModelViewError(f"{path}: shard file {fname!r} is not a plain file name in the snapshot")
    return doc


def _trusted_roots(prepared: Path) -> list[str]:
    roots = [os.path.realpath(prepared)]
    blobs = hf_blobs_root(prepared)
    if blobs is not None:
        roots.append(os.path.realpath(blobs))
    return roots


def read_marker(view: str | os.PathLike) -> dict | None:
    """The builder's record of a view (None when ``view`` has none); a foreign marker is refused."""
    try:
        return _read_marker(view)
    except ForeignView as exc:
        raise ForeignViewDirectory(exc.message) from exc


def _check_output(out: Path) -> dict | None:
    """Refuse an output directory that holds anything the builder did not make."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ForeignViewDirectory(f"{out} exists and is not a directory; refusing to replace it")
    if not out.exists():
        return None
    present = set(os.listdir(out))
    marker = read_marker(out)
    if marker is None:
        if present:
            raise ForeignViewDirectory(
                f"{out} is not empty and was not made by `model build-view` (no {MARKER_NAME}); "
                f"found {sorted(present)[:5]}. Nothing was changed.")
        return None
    ours = set(marker["entries"]) | {MARKER_NAME} | ALLOWED_FOREIGN
    foreign = sorted(present - ours)
    if foreign:
        raise ForeignViewDirectory(
            f"{out} holds files the view builder did not make: {foreign[:5]}"
            f"{' …' if len(foreign) > 5 else ''}. Move them away; nothing was changed.")
    return marker


def _link(target: Path, at: Path) -> None:
    at.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.abspath(target), at)


def build_view(dense: str | os.PathLike, prepared: str | os.PathLike, out: str | os.PathLike, *,
               in_place: bool = False, progress: bool = False) -> ViewReport:
    """Build (or rebuild) the view ``out``; returns the completeness report. ``in_place``: serve the PLE
    tables from the dense snapshot's own shards (module docstring); ``progress``: its hashing pass's bars.

    Raises:
        ModelViewError: an input is missing or incomplete (a shard the index needs exists in
            neither snapshot, a dangling link, no sidecar).
        ForeignViewDirectory: ``out`` holds files this builder did not make.
        EnvironmentProblem: ``out``'s parent is not writable (read-only filesystem, permissions).
    """
    dense, prepared, out = Path(os.path.abspath(dense)), Path(os.path.abspath(prepared)), Path(os.path.abspath(out))
    for name, d in (("dense", dense), ("prepared", prepared)):
        if not d.is_dir():
            raise ModelViewError(f"{name} snapshot {d} is not a directory")
    if out in (dense, prepared) or dense in out.parents or prepared in out.parents:
        raise ModelViewError(f"the view {out} must not be inside (or be) a source snapshot")
    if not (dense / "config.json").is_file():
        raise ModelViewError(f"dense snapshot {dense} has no config.json")
    # recorded in the marker for people; it grants nothing (sidecar/view.py)
    trusted = _trusted_roots(dense if in_place else prepared)
    manifest = None if in_place else load_sidecar(prepared)  # sizes checked; sha256 is the engine's job
    old_marker = _check_output(out)

    if not (dense / INDEX_NAME).exists() and (dense / "model.safetensors").is_file():
        raise ModelViewError(
            f"{dense} is a single-file checkpoint (model.safetensors, no {INDEX_NAME}): a view leaves the PLE shards "
            f"out of an index, and there is none. Serve {dense} itself with the sidecar instead "
            f"(SGLANG_SSD_STREAM_SIDECAR={prepared}, or VLLM_PLE_SIDECAR for vLLM: the plugin binds the PLE layers to "
            f"it), or save the checkpoint sharded with an index (transformers: save_pretrained(max_shard_size=...)) "
            f"and build the view from that")
    index = _read_index(dense / INDEX_NAME)
    wm = index["weight_map"]
    kept = {n: f for n, f in wm.items() if not SHARD_TENSOR.search(n)}

    plan: dict[str, Path] = {}  # view entry (relative path) -> link target
    for fname in sorted(set(kept.values())):
        src = dense / fname if (dense / fname).is_file() else prepared / fname
        if not src.is_file():
            dangling = [str(p) for p in (dense / fname, prepared / fname) if p.is_symlink()]
            why = f" (dangling link: {', '.join(dangling)})" if dangling else ""
            raise ModelViewError(f"shard {fname} listed in {dense / INDEX_NAME} is in neither snapshot{why}")
        plan[fname] = src
    for entry in sorted(os.listdir(dense)):
        p = dense / entry
        if entry in _SKIP_DENSE or entry in plan or entry.startswith(".") or entry.endswith(".safetensors"):
            continue
        if p.is_file():
            plan[entry] = p
        elif p.is_symlink():
            raise ModelViewError(f"dense snapshot file {p} is a dangling link")
    if in_place:
        for fname in sorted({f for n, f in wm.items() if SHARD_TENSOR.search(n) and "mtp" not in n}):
            if not (dense / fname).is_file():
                raise ModelViewError(f"PLE shard {fname}, mapped in {dense / INDEX_NAME}, is not in the dense "
                                     f"snapshot; an in-place view reads the PLE rows from the dense snapshot's own "
                                     f"shards (`model fetch --in-place` downloads them)")
            plan[fname] = dense / fname
    else:
        for path in dict.fromkeys(r.path for t in manifest.tables for r in t.regions):  # copied: its file; in
            plan[path] = prepared / path  # place: each shard holding its regions (the index leaves them out)
        if (prepared / SCALE_FILE_NAME).is_file():
            plan[SCALE_FILE_NAME] = prepared / SCALE_FILE_NAME
        elif any(SCALE_FILE_NAME == f for f in kept.values()):
            raise ModelViewError(f"{SCALE_FILE_NAME} is indexed but missing from {prepared}")
    if (prepared / MTP_DIR).is_dir():
        plan[MTP_DIR] = prepared / MTP_DIR
    elif (dense / MTP_DIR).is_dir():  # a checkpoint of one's own: its draft sits beside its shards
        plan[MTP_DIR] = dense / MTP_DIR

    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=parent))
    except OSError as exc:
        raise EnvironmentProblem(f"cannot create the view next to {out}: {exc.strerror or exc}. "
                                 f"Nothing was changed.") from exc
    try:
        for rel, src in plan.items():
            _link(src, tmp / rel)
        top = sorted({Path(rel).parts[0] for rel in plan} | {MANIFEST_NAME, BACKUP_NAME, INDEX_NAME})
        marker = {"format": MARKER_FORMAT, "version": 1, "dense": str(dense), "prepared": str(prepared),
                  "trusted_roots": trusted, "entries": top, **({"ple": PLE_IN_PLACE} if in_place else {})}
        (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=1), encoding="utf-8")
        if in_place:
            _in_place_manifest(tmp, out, dense, old_marker, index, progress)
        else:
            shutil.copyfile(manifest.path, tmp / MANIFEST_NAME)
            if old_marker is not None and (out / CACHE_NAME).is_file():
                shutil.copy2(out / CACHE_NAME, tmp / CACHE_NAME)  # keep the engine's verify record
        (tmp / BACKUP_NAME).write_text(json.dumps(index, ensure_ascii=False), encoding="utf-8")
        (tmp / INDEX_NAME).write_text(json.dumps({**index, "weight_map": kept}, ensure_ascii=False), encoding="utf-8")
        report = check_view(tmp, _display=out)
        os.chmod(tmp, 0o755)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=parent))
            os.rename(out, old / "view")
            os.rename(tmp, out)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and not isinstance(exc, EnvironmentProblem):
            raise EnvironmentProblem(f"cannot write the view {out}: {exc.strerror or exc}") from exc
        raise
    return report


def _in_place_manifest(tmp: Path, out: Path, dense: Path, old_marker: dict | None, index: dict,
                       progress: bool) -> None:
    """Give the view being built in ``tmp`` its in-place ``ssd-stream.json``: the old view's, with its verified
    cache, when that was built in place over the same dense snapshot and still loads (a snapshot directory is
    one commit: its files do not change), else a new one from one hashing pass over the linked PLE shards."""
    from ..sidecar.in_place import build_in_place

    if (old_marker is not None and old_marker.get("ple") == PLE_IN_PLACE
            and old_marker.get("dense") == str(dense)
            and (out / MANIFEST_NAME).is_file()):
        shutil.copyfile(out / MANIFEST_NAME, tmp / MANIFEST_NAME)
        if (out / CACHE_NAME).is_file():
            shutil.copy2(out / CACHE_NAME, tmp / CACHE_NAME)
        try:
            load_sidecar(tmp)
            return
        except KitError:  # moved or refused: built again below, from the bytes themselves
            (tmp / MANIFEST_NAME).unlink()
            (tmp / CACHE_NAME).unlink(missing_ok=True)
    # the builder finds the PLE tensors through the full index; the served one without them is written after
    (tmp / INDEX_NAME).write_text(json.dumps(index, ensure_ascii=False), encoding="utf-8")
    build_in_place(tmp, progress=progress)  # the marker, already there, lets it read the dense shards


def check_view(view: str | os.PathLike, *, _display: Path | None = None) -> ViewReport:
    """Completeness check of a view (or any model directory with a sidecar).

    Raises :class:`ModelViewError` on a dangling link, a shard the index lists but the
    directory lacks, a missing required file, or a sidecar that fails ``load_manifest``.
    """
    view = Path(os.path.abspath(view))
    shown = _display or view
    dangling = []
    for dirpath, dirnames, filenames in os.walk(view, followlinks=True):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if p.is_symlink() and not p.exists():
                dangling.append(str(shown / p.relative_to(view)))
    if dangling:
        raise ModelViewError(f"{shown}: dangling link(s): {', '.join(sorted(dangling)[:5])}")
    for name in ("config.json", INDEX_NAME, MANIFEST_NAME):
        if not (view / name).is_file():
            raise ModelViewError(f"{shown}: required file {name} is missing")
    wm = _read_index(view / INDEX_NAME)["weight_map"]
    ple = sorted(n for n in wm if SHARD_TENSOR.search(n))
    if ple:
        raise ModelViewError(f"{shown}/{INDEX_NAME} still maps {len(ple)} PLE shard tensor(s), e.g. {ple[0]}")
    shards = set(wm.values())
    missing = sorted(f for f in shards if not (view / f).is_file())
    if missing:
        raise ModelViewError(f"{shown}: {len(missing)} indexed shard(s) missing: {', '.join(missing[:5])}")
    manifest = load_sidecar(view)
    marker = read_marker(view)
    backup = _read_index(view / BACKUP_NAME)["weight_map"] if (view / BACKUP_NAME).is_file() else wm
    links = sum(1 for e in os.listdir(view) if (view / e).is_symlink())
    links += sum(1 for path in dict.fromkeys(r.path for t in manifest.tables for r in t.regions)
                 if (view / path).is_symlink() and "/" in path)
    return ViewReport(str(shown), len(wm), len(shards), len(backup) - len(wm) if marker else 0, links,
                      tuple(t.path for t in manifest.tables))


# ----------------------------------------------------------------------------- CLI


def _print(report: ViewReport, as_json: bool, verb: str) -> None:
    if as_json:
        json.dump(report.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    print(f"{verb} {report.path}")
    print(f"weights: {report.mappings} mappings, shards: {report.shards}"
          f" (removed {report.removed_ple_mappings} PLE shard mappings)")
    print(f"sidecar tables: {', '.join(report.tables)}")
    print("model view is complete")


def cmd_build_view(args: argparse.Namespace) -> int:
    _print(build_view(args.dense, args.prepared, args.output, in_place=args.in_place, progress=not args.json),
           args.json, "built")
    return EXIT_OK


def cmd_check_view(args: argparse.Namespace) -> int:
    _print(check_view(args.view), args.json, "checked")
    return EXIT_OK


def add_model_view_commands(subparsers) -> dict[str, argparse.ArgumentParser]:
    """Add ``build-view`` and ``check-view`` to an argparse ``subparsers`` object
    (``set_defaults(func=handler)``, ``handler(args) -> int``); returns the parsers by name."""
    b = subparsers.add_parser(
        "build-view", allow_abbrev=False,
        help="combine a dense snapshot and a prepared SSD-stream snapshot into a serving directory",
        description="Link the dense snapshot's config and shards, the prepared snapshot's expert shards, MTP, "
        "PLE sidecar and scale; copy ssd-stream.json; rewrite the index without PLE shard mappings "
        "(original kept as " + BACKUP_NAME + "); then check completeness. Idempotent.")
    b.add_argument("--dense", required=True, help="snapshot with config.json, the index and the dense shards")
    b.add_argument("--prepared", required=True,
                   help="prepared SSD-stream snapshot (ssd-stream.json, ple/, experts, mtp/)")
    b.add_argument("-o", "--out", "--output", dest="output", required=True, help="view directory to create or refresh")
    b.add_argument("--in-place", action="store_true",
                   help="serve the PLE tables in place from the dense snapshot's own shards (no copy; one hashing "
                        "pass writes the view's ssd-stream.json); the prepared snapshot's sidecar is not used")
    b.add_argument("--json", action="store_true", help="print the report as JSON")
    b.set_defaults(func=cmd_build_view)
    c = subparsers.add_parser("check-view", allow_abbrev=False, help="check that a model view is complete",
                              description="No dangling links, every indexed shard present, required files present.")
    c.add_argument("view", help="the view directory")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(func=cmd_check_view)
    return {"build-view": b, "check-view": c}
