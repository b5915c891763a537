"""Per-file states, decided by SHA-256 alone: pristine, patched, unknown or missing."""

from __future__ import annotations

import ast
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BadKitData, EnvironmentProblem
from .manifest import FileEntry, Manifest

PRISTINE, PATCHED, UNKNOWN, MISSING = "pristine", "patched", "unknown", "missing"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def function_sha256(source: bytes, qualname: str) -> str | None:
    """SHA-256 of a function's exact source segment (``Class.method`` or ``function``); None if absent."""
    text = source.decode("utf-8")
    tree = ast.parse(text)
    scope: list[ast.AST] = [tree]
    node = None
    for part in qualname.split("."):
        node = next((n for s in scope for n in ast.iter_child_nodes(s)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part), None)
        if node is None:
            return None
        scope = [node]
    segment = ast.get_source_segment(text, node)
    return hashlib.sha256(segment.encode()).hexdigest() if segment is not None else None


def resolve_inside(site_packages: Path, package: str, rel: str) -> Path:
    """The real path of ``rel``; refuses one whose symlinks lead out of the package."""
    root = (site_packages / package).resolve()
    path = site_packages / rel
    real = path.resolve()
    if real != root and root not in real.parents:
        raise BadKitData(f"{rel} resolves to {real}, outside {root}; refusing to follow a symlink out of the package")
    return path


@dataclass
class FileState:
    entry: FileEntry
    path: Path
    state: str
    sha256: str | None
    matches: list[str] = field(default_factory=list)  # e.g. ["sglang 0.5.22 pristine"] for unknown files

    def as_json(self) -> dict:
        return {"path": self.entry.path, "state": self.state, "sha256": self.sha256,
                "pristine": self.entry.pristine, "patched": self.entry.patched,
                "patches": list(self.entry.patches), "matches": self.matches}


def classify(entry: FileEntry, site_packages: Path, manifest: Manifest,
             others: list[Manifest] = ()) -> FileState:
    path = resolve_inside(site_packages, manifest.engine.package, entry.path)
    try:
        digest = sha256_file(path)
    except FileNotFoundError:
        return FileState(entry, path, MISSING, None)
    except OSError as exc:
        raise EnvironmentProblem(f"cannot read {path}: {exc.strerror or exc}") from None
    if digest == entry.pristine:
        return FileState(entry, path, PRISTINE, digest)
    if digest == entry.patched:
        return FileState(entry, path, PATCHED, digest)
    matches = []
    for other in others:
        try:
            o = other.file(entry.path)
        except KeyError:
            continue
        if digest == o.pristine:
            matches.append(f"{other.engine.name} {other.release} pristine")
        elif digest == o.patched:
            matches.append(f"{other.engine.name} {other.release} patched")
    return FileState(entry, path, UNKNOWN, digest, matches)


def survey(manifest: Manifest, site_packages: Path, others: list[Manifest] = ()) -> list[FileState]:
    return [classify(f, site_packages, manifest, [o for o in others if o is not manifest]) for f in manifest.files]


def writable_problems(paths: list[Path]) -> list[str]:
    """Targets (or their directories) we could not replace; checked before any write."""
    problems = []
    for p in paths:
        if not os.access(p.parent, os.W_OK | os.X_OK):
            problems.append(f"{p.parent} is not writable")
        elif p.exists() and not os.access(p, os.R_OK):
            problems.append(f"{p} is not readable")
    return problems
