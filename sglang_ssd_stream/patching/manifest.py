"""Loading and validating ``hashes/<engine>-<release>.json``: the only reader of hashes.

A manifest says, for one engine release, which patches apply in which order and, for every
target file, its pristine and patched SHA-256. Nothing else in the kit spells a hash.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..errors import BadKitData
from .engines import ENGINES, Engine, data_root

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_PATCH_ID = re.compile(r"^[0-9]{4}-[a-z0-9][a-z0-9-]*$")
_MANIFEST_KEYS = {"engine", "release", "patches", "files"}
_PATCH_KEYS = {"id", "order", "diff", "upstream"}
_FILE_KEYS = {"path", "pristine", "patched", "patches"}
_WATCH_KEYS = {"id", "path", "function", "sha256", "why"}


@dataclass(frozen=True)
class PatchEntry:
    id: str
    order: int
    diff: str  # path relative to the data root, e.g. patches/sglang/0001-….patch
    upstream: str


@dataclass(frozen=True)
class FileEntry:
    path: str  # POSIX path relative to site-packages, e.g. sglang/srt/managers/utils.py
    pristine: str
    patched: str
    patches: tuple[str, ...]


@dataclass(frozen=True)
class WatchEntry:
    """Upstream code we rely on without patching it; drift reports when its source changes."""

    id: str
    path: str
    function: str  # qualified name, e.g. "Scheduler.on_idle"
    sha256: str  # of the function's exact source segment
    why: str


@dataclass(frozen=True)
class Manifest:
    engine: Engine
    release: str
    patches: tuple[PatchEntry, ...]  # sorted by order
    files: tuple[FileEntry, ...]
    source: Path
    watch: tuple[WatchEntry, ...] = ()

    def file(self, path: str) -> FileEntry:
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(path)

    def diff_path(self, patch: PatchEntry) -> Path:
        return self.source.parent.parent / patch.diff


def safe_relative_path(raw: object, *, package: str, where: str) -> str:
    """A manifest path must be relative, normalised, without ``..``, and inside ``package``."""
    if not isinstance(raw, str) or not raw:
        raise BadKitData(f"{where}: path must be a non-empty string, got {raw!r}")
    p = PurePosixPath(raw)
    if p.is_absolute() or raw.startswith("/") or "\\" in raw:
        raise BadKitData(f"{where}: path {raw!r} is absolute; manifest paths are relative to site-packages")
    if any(part in ("..", ".", "") for part in raw.split("/")):
        raise BadKitData(f"{where}: path {raw!r} contains '..' or '.'; refusing a path that can escape the package")
    if p.parts[0] != package or len(p.parts) < 2:
        raise BadKitData(f"{where}: path {raw!r} is outside the {package!r} package")
    return raw


def _require_keys(obj: object, required: set[str], where: str) -> dict:
    if not isinstance(obj, dict):
        raise BadKitData(f"{where}: expected an object, got {type(obj).__name__}")
    missing = required - obj.keys()
    extra = obj.keys() - required
    if missing:
        raise BadKitData(f"{where}: missing field(s) {sorted(missing)}")
    if extra:
        raise BadKitData(f"{where}: unknown field(s) {sorted(extra)}")
    return obj


def _sha(value: object, where: str) -> str:
    if not isinstance(value, str) or not _SHA256.match(value):
        raise BadKitData(f"{where}: {value!r} is not a lowercase hex SHA-256")
    return value


def load_manifest(path: Path) -> Manifest:
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadKitData(f"manifest {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadKitData(f"manifest {path} is unreadable: {exc}") from None
    where = str(path)
    watch_raw = raw.pop("watch", []) if isinstance(raw, dict) else []
    _require_keys(raw, _MANIFEST_KEYS, where)
    engine = ENGINES.get(raw["engine"])
    if engine is None:
        raise BadKitData(f"{where}: unknown engine {raw['engine']!r}; known: {sorted(ENGINES)}")
    release = raw["release"]
    if not isinstance(release, str) or not re.match(r"^[0-9][0-9A-Za-z.+-]*$", release):
        raise BadKitData(f"{where}: bad release {release!r}")
    if Path(path).name != f"{engine.name}-{release}.json":
        raise BadKitData(f"{where}: file name must be {engine.name}-{release}.json")

    patches = []
    for i, p in enumerate(raw["patches"] if isinstance(raw["patches"], list) else [None]):
        pw = f"{where}: patches[{i}]"
        _require_keys(p, _PATCH_KEYS, pw)
        if not isinstance(p["id"], str) or not _PATCH_ID.match(p["id"]):
            raise BadKitData(f"{pw}: bad patch id {p['id']!r} (expected NNNN-name)")
        if not isinstance(p["order"], int) or isinstance(p["order"], bool):
            raise BadKitData(f"{pw}: order must be an integer")
        if p["diff"] != f"patches/{engine.name}/{p['id']}.patch":
            raise BadKitData(f"{pw}: diff must be patches/{engine.name}/{p['id']}.patch, got {p['diff']!r}")
        if not isinstance(p["upstream"], str):
            raise BadKitData(f"{pw}: upstream must be a string")
        patches.append(PatchEntry(p["id"], p["order"], p["diff"], p["upstream"]))
    ids = [p.id for p in patches]
    if len(set(ids)) != len(ids) or len({p.order for p in patches}) != len(patches):
        raise BadKitData(f"{where}: duplicate patch id or order")
    patches.sort(key=lambda p: p.order)

    files = []
    for i, f in enumerate(raw["files"] if isinstance(raw["files"], list) else [None]):
        fw = f"{where}: files[{i}]"
        _require_keys(f, _FILE_KEYS, fw)
        rel = safe_relative_path(f["path"], package=engine.package, where=fw)
        touched = f["patches"]
        if not isinstance(touched, list) or not touched or any(t not in ids for t in touched):
            raise BadKitData(f"{fw}: patches must list ids from this manifest, got {touched!r}")
        pristine, patched = _sha(f["pristine"], fw), _sha(f["patched"], fw)
        if pristine == patched:
            raise BadKitData(f"{fw}: pristine and patched hashes are equal")
        files.append(FileEntry(rel, pristine, patched, tuple(touched)))
    if len({f.path for f in files}) != len(files):
        raise BadKitData(f"{where}: a file is listed twice")
    for p in patches:
        if not any(p.id in f.patches for f in files):
            raise BadKitData(f"{where}: patch {p.id} touches no file")
    watch = []
    for i, w in enumerate(watch_raw if isinstance(watch_raw, list) else [None]):
        ww = f"{where}: watch[{i}]"
        _require_keys(w, _WATCH_KEYS, ww)
        rel = safe_relative_path(w["path"], package=engine.package, where=ww)
        if not all(isinstance(w[k], str) and w[k] for k in ("id", "function", "why")):
            raise BadKitData(f"{ww}: id, function and why must be non-empty strings")
        watch.append(WatchEntry(w["id"], rel, w["function"], _sha(w["sha256"], ww), w["why"]))
    return Manifest(engine, release, tuple(patches), tuple(files), Path(path), tuple(watch))


def manifest_path(engine: Engine, release: str, root: Path | None = None) -> Path:
    return (root or data_root()) / "hashes" / f"{engine.name}-{release}.json"


def known_manifests(engine: Engine, root: Path | None = None) -> list[Manifest]:
    """Every manifest we ship for ``engine``, oldest release first."""
    from packaging.version import Version

    found = sorted((root or data_root()).joinpath("hashes").glob(f"{engine.name}-*.json"))
    manifests = [load_manifest(p) for p in found]
    return sorted(manifests, key=lambda m: Version(m.release))
