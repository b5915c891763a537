"""Loading and validating ``hashes/<engine>-<release>.json``: the only reader of hashes.

A manifest holds what is particular to one engine release: which patches of the engine's series
apply there (by id; their order is the series', ``patches/<engine>/series``), the pristine and
patched SHA-256 of every target file, the engine functions we rely on unpatched (``watch``), and
the wheels that release was published as (``wheels``: file name, SHA-256, and a digest of the
wheel's RECORD, so an install can be traced to a wheel). Nothing else in the kit spells a hash;
upstream status lives in each patch's DEP-3 header.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from packaging.version import InvalidVersion, Version

from ..errors import BadKitData
from .engines import ENGINES, Engine, data_root
from .files import parse_json, read_kit_file
from .series import PATCH_ID, load_series, patch_path

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_MANIFEST_KEYS = {"engine", "release", "patches", "files"}
_MANIFEST_OPTIONAL = {"watch", "wheels"}
_FILE_KEYS = {"path", "pristine", "patched", "patches"}
_FILE_OPTIONAL = {"earlier"}
_EARLIER_KEYS = {"sha256", "patches"}
_WATCH_KEYS = {"id", "path", "function", "sha256", "why"}
_WHEEL_KEYS = {"file", "sha256", "record"}
MAX_MANIFEST_BYTES = 1 << 20


@dataclass(frozen=True)
class PatchEntry:
    id: str
    diff: Path  # patches/<engine>/<id>.patch under the data root


@dataclass(frozen=True)
class Earlier:
    """A state an earlier kit wrote into this file from the same pristine bytes (an older version of a
    patch, or fewer patches): known, so an upgrade rewrites it from the pristine backup instead of
    refusing it as unknown."""

    sha256: str
    patches: tuple[str, ...]  # the patch ids it held (ids of that kit's series)


@dataclass(frozen=True)
class FileEntry:
    path: str  # POSIX path relative to site-packages, e.g. sglang/srt/managers/utils.py
    pristine: str
    patched: str
    patches: tuple[str, ...]
    earlier: tuple[Earlier, ...] = ()

    def earlier_state(self, sha: str | None) -> Earlier | None:
        return next((e for e in self.earlier if e.sha256 == sha), None)

    def holds(self, sha: str | None, patch_id: str) -> bool | None:
        """Whether the bytes with SHA-256 ``sha`` hold ``patch_id`` (some version of it); None: not a
        state of this file the kit knows."""
        if sha == self.pristine:
            return False
        if sha == self.patched:
            return patch_id in self.patches
        e = self.earlier_state(sha)
        return None if e is None else patch_id in e.patches


@dataclass(frozen=True)
class WatchEntry:
    """Upstream code we rely on without patching it; drift reports when its source changes."""

    id: str
    path: str
    function: str  # qualified name, e.g. "Scheduler.on_idle"
    sha256: str  # of the function's exact source segment
    why: str


@dataclass(frozen=True)
class WheelEntry:
    """One published wheel of this release (scripts/lock.py writes these from the locks)."""

    file: str
    sha256: str  # of the wheel file, as in hashes/locks/
    record: str  # wheels.record_digest of its RECORD: what an install from it leaves in the dist-info


@dataclass(frozen=True)
class Manifest:
    engine: Engine
    release: str
    patches: tuple[PatchEntry, ...]  # in series order
    files: tuple[FileEntry, ...]
    source: Path
    watch: tuple[WatchEntry, ...] = ()
    wheels: tuple[WheelEntry, ...] = ()

    def file(self, path: str) -> FileEntry:
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(path)

    def diff_path(self, patch: PatchEntry) -> Path:
        return patch.diff


def safe_relative_path(raw: object, *, package: str, where: str) -> str:
    """A manifest path must be relative, normalised, without ``..``, and inside ``package``."""
    if not isinstance(raw, str) or not raw:
        raise BadKitData(f"{where}: path must be a non-empty string, got {raw!r}")
    if any(ord(c) < 32 or ord(c) == 127 for c in raw):
        raise BadKitData(f"{where}: path {raw!r} contains a control character (NUL, newline, ...)")
    p = PurePosixPath(raw)
    if p.is_absolute() or raw.startswith("/") or "\\" in raw:
        raise BadKitData(f"{where}: path {raw!r} is absolute; manifest paths are relative to site-packages")
    if any(part in ("..", ".", "") for part in raw.split("/")):
        raise BadKitData(f"{where}: path {raw!r} contains '..' or '.'; refusing a path that can escape the package")
    if p.parts[0] != package or len(p.parts) < 2:
        raise BadKitData(f"{where}: path {raw!r} is outside the {package!r} package")
    return raw


def _require_keys(obj: object, required: set[str], where: str, optional: set[str] = frozenset()) -> dict:
    if not isinstance(obj, dict):
        raise BadKitData(f"{where}: expected an object, got {type(obj).__name__}")
    missing = required - obj.keys()
    extra = obj.keys() - required - optional
    if missing:
        raise BadKitData(f"{where}: missing field(s) {sorted(missing)}")
    if extra:
        raise BadKitData(f"{where}: unknown field(s) {sorted(extra)}")
    return obj


def _sha(value: object, where: str) -> str:
    if not isinstance(value, str) or not _SHA256.match(value):
        raise BadKitData(f"{where}: {value!r} is not a lowercase hex SHA-256")
    return value


def _list(value: object, where: str) -> list:
    if not isinstance(value, list):
        raise BadKitData(f"{where}: expected a list, got {type(value).__name__}")
    return value


def _text(value: object, where: str) -> str:
    if not isinstance(value, str) or not value or any(ord(c) < 32 and c != "\n" for c in value):
        raise BadKitData(f"{where}: expected a non-empty string without control characters, got {value!r}")
    return value


def check_release(release: object, where: str) -> str:
    """A release is a canonical PEP 440 version string ("0.5.23"), or the manifest is refused."""
    if not isinstance(release, str):
        raise BadKitData(f"{where}: release must be a string, got {release!r}")
    try:
        canonical = str(Version(release))
    except InvalidVersion:
        raise BadKitData(f"{where}: release {release!r} is not a version") from None
    if canonical != release:
        raise BadKitData(f"{where}: release {release!r} is not written canonically ({canonical!r})")
    return release


def load_manifest(path: Path) -> Manifest:
    path = Path(path)
    where = str(path)
    raw = parse_json(read_kit_file(path, "manifest", MAX_MANIFEST_BYTES), f"manifest {path}")
    _require_keys(raw, _MANIFEST_KEYS, where, _MANIFEST_OPTIONAL)
    name = raw["engine"]
    engine = ENGINES.get(name) if isinstance(name, str) else None
    if engine is None:
        raise BadKitData(f"{where}: unknown engine {name!r}; known: {sorted(ENGINES)}")
    release = check_release(raw["release"], where)
    if path.name != f"{engine.name}-{release}.json":
        raise BadKitData(f"{where}: file name must be {engine.name}-{release}.json")

    root = path.parent.parent
    series = load_series(root, engine)
    ids = []
    for i, pid in enumerate(_list(raw["patches"], f"{where}: patches")):
        pw = f"{where}: patches[{i}]"
        if not isinstance(pid, str) or not PATCH_ID.match(pid):
            raise BadKitData(f"{pw}: {pid!r} is not a patch id (NNNN-name, the series entry without .patch)")
        if pid not in series:
            raise BadKitData(f"{pw}: {pid} is not in the {engine.name} series ({', '.join(series)})")
        if pid in ids:
            raise BadKitData(f"{pw}: {pid} is listed twice")
        ids.append(pid)
    patches = tuple(PatchEntry(pid, patch_path(root, engine, pid)) for pid in series if pid in ids)

    files = []
    for i, f in enumerate(_list(raw["files"], f"{where}: files")):
        fw = f"{where}: files[{i}]"
        _require_keys(f, _FILE_KEYS, fw, _FILE_OPTIONAL)
        rel = safe_relative_path(f["path"], package=engine.package, where=fw)
        touched = f["patches"]
        if not isinstance(touched, list) or not touched or not all(isinstance(t, str) and t in ids for t in touched) \
                or len(set(touched)) != len(touched):
            raise BadKitData(f"{fw}: patches must list ids from this manifest, got {touched!r}")
        pristine, patched = _sha(f["pristine"], fw), _sha(f["patched"], fw)
        if pristine == patched:
            raise BadKitData(f"{fw}: pristine and patched hashes are equal")
        earlier = []
        for j, e in enumerate(_list(f.get("earlier", []), f"{fw}: earlier")):
            ew = f"{fw}: earlier[{j}]"
            _require_keys(e, _EARLIER_KEYS, ew)
            held = e["patches"]
            if not isinstance(held, list) or not held or not all(isinstance(t, str) and PATCH_ID.match(t)
                                                                 for t in held) or len(set(held)) != len(held):
                raise BadKitData(f"{ew}: patches must list patch ids, got {held!r}")
            earlier.append(Earlier(_sha(e["sha256"], ew), tuple(held)))
        shas = [pristine, patched, *(e.sha256 for e in earlier)]
        if len(set(shas)) != len(shas):
            raise BadKitData(f"{fw}: pristine, patched and earlier hashes must all differ")
        files.append(FileEntry(rel, pristine, patched, tuple(p.id for p in patches if p.id in touched),
                               tuple(earlier)))
    if len({f.path for f in files}) != len(files):
        raise BadKitData(f"{where}: a file is listed twice")
    for p in patches:
        if not any(p.id in f.patches for f in files):
            raise BadKitData(f"{where}: patch {p.id} touches no file")

    watch = []
    for i, w in enumerate(_list(raw.get("watch", []), f"{where}: watch")):
        ww = f"{where}: watch[{i}]"
        _require_keys(w, _WATCH_KEYS, ww)
        rel = safe_relative_path(w["path"], package=engine.package, where=ww)
        watch.append(WatchEntry(_text(w["id"], ww), rel, _text(w["function"], ww), _sha(w["sha256"], ww),
                                _text(w["why"], ww)))
    if len({w.id for w in watch}) != len(watch):
        raise BadKitData(f"{where}: a watch id is listed twice")

    wheels = []
    prefix = f"{engine.distribution.replace('-', '_')}-{release}-"
    for i, w in enumerate(_list(raw.get("wheels", []), f"{where}: wheels")):
        ww = f"{where}: wheels[{i}]"
        _require_keys(w, _WHEEL_KEYS, ww)
        file = w["file"]
        if not isinstance(file, str) or not file.startswith(prefix) or not file.endswith(".whl") \
                or "/" in file or any(ord(c) < 33 for c in file):
            raise BadKitData(f"{ww}: {file!r} is not a {engine.distribution} {release} wheel file name")
        wheels.append(WheelEntry(file, _sha(w["sha256"], ww), _sha(w["record"], ww)))
    return Manifest(engine, release, patches, tuple(files), path, tuple(watch), tuple(wheels))


def manifest_path(engine: Engine, release: str, root: Path | None = None) -> Path:
    return (root or data_root()) / "hashes" / f"{engine.name}-{release}.json"


def known_manifests(engine: Engine, root: Path | None = None, *,
                    broken: dict[str, BadKitData] | None = None) -> list[Manifest]:
    """Every manifest we ship for ``engine``, oldest release first.

    With ``broken`` (a dict), a manifest that does not load is recorded there by file name and
    skipped, so one bad release cannot break the others; without it, the first one raises.
    """
    found = sorted((root or data_root()).joinpath("hashes").glob(f"{engine.name}-*.json"))
    manifests = []
    for p in found:
        try:
            manifests.append(load_manifest(p))
        except BadKitData as exc:
            if broken is None:
                raise
            broken[p.name] = exc
    return sorted(manifests, key=lambda m: Version(m.release))


def dump_manifest(doc: dict) -> str:
    """The house layout of a manifest: one top-level key a line, one list item per line group."""
    lines = ["{"]
    items = list(doc.items())
    for n, (key, value) in enumerate(items):
        end = "," if n < len(items) - 1 else ""
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            lines.append(f" {json.dumps(key)}: [")
            for m, entry in enumerate(value):
                fields = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in entry.items()]
                body = ",\n   ".join(fields)
                lines.append("  {" + body + "}" + ("," if m < len(value) - 1 else ""))
            lines.append(" ]" + end)
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}{end}")
    return "\n".join(lines) + "\n}\n"
