"""Per-file states, decided by SHA-256 alone: pristine, patched, outdated (a state an earlier kit
wrote, listed in the manifest), unknown or missing."""

from __future__ import annotations

import ast
import hashlib
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import EnvironmentProblem
from .files import NotAFile, errno_text, open_parent, read_at
from .manifest import FileEntry, Manifest

PRISTINE, PATCHED, OUTDATED, UNKNOWN, MISSING = "pristine", "patched", "outdated", "unknown", "missing"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def function_node(tree: ast.Module, qualname: str) -> ast.AST | None:
    """The ``def``/``class`` node of ``qualname`` (``Class.method`` or ``function``) in ``tree``; None if absent."""
    scope: list[ast.AST] = [tree]
    node = None
    for part in qualname.split("."):
        node = next((n for s in scope for n in ast.iter_child_nodes(s)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part), None)
        if node is None:
            return None
        scope = [node]
    return node


# A line and its end (\r\n, \n or \r; form feeds stay inside): the split ast.get_source_segment makes
# (CPython 3.12's pattern; 3.11 splits the same way, one character at a time).
_LINE = re.compile(r"(.*?(?:\r\n|\n|\r|$))")


class SourceFunctions:
    """One source file, parsed once: the SHA-256 of any function's exact source segment in it.

    Several functions of one file are watched (eight of sglang's ``qwen4_exp.py``); hashing each through
    ``ast.parse`` and ``ast.get_source_segment`` parsed and split the whole file again per function, in every
    engine process the guard runs in."""

    def __init__(self, source: bytes, tree: ast.Module | None = None):
        self.text = source.decode("utf-8")
        self.tree = ast.parse(self.text) if tree is None else tree  # a caller's own parse of ``source``
        self._lines: list[str] | None = None

    def segment(self, node: ast.AST) -> str | None:
        """``ast.get_source_segment(text, node)``, with the file split into lines once."""
        end_lineno, end_col = getattr(node, "end_lineno", None), getattr(node, "end_col_offset", None)
        if end_lineno is None or end_col is None:
            return None
        if self._lines is None:
            self._lines = [m[0] for m in _LINE.finditer(self.text)]
        first, last, col = node.lineno - 1, end_lineno - 1, node.col_offset
        lines = self._lines
        if first == last:
            return lines[first].encode()[col:end_col].decode()
        return "".join([lines[first].encode()[col:].decode(), *lines[first + 1:last],
                        lines[last].encode()[:end_col].decode()])

    def sha256(self, qualname: str) -> str | None:
        """SHA-256 of ``qualname``'s source segment (``Class.method`` or ``function``); None if absent."""
        node = function_node(self.tree, qualname)
        segment = None if node is None else self.segment(node)
        return hashlib.sha256(segment.encode()).hexdigest() if segment is not None else None


def function_sha256(source: bytes, qualname: str) -> str | None:
    """SHA-256 of a function's exact source segment (``Class.method`` or ``function``); None if absent."""
    return SourceFunctions(source).sha256(qualname)


@dataclass
class FileState:
    entry: FileEntry
    path: Path
    state: str
    sha256: str | None
    matches: list[str] = field(default_factory=list)  # e.g. ["sglang 0.5.22 pristine"] for unknown files
    detail: str = ""  # why a file is unknown although no hash was read: "is a FIFO", "is a symlink", ...
    data: bytes | None = field(default=None, repr=False)  # the bytes hashed (apply/revert plan from them)
    stat: os.stat_result | None = field(default=None, repr=False)

    def holds(self, patch_id: str) -> bool | None:
        return self.entry.holds(self.sha256, patch_id)

    def as_json(self) -> dict:
        return {"path": self.entry.path, "state": self.state, "sha256": self.sha256,
                "pristine": self.entry.pristine, "patched": self.entry.patched,
                "patches": list(self.entry.patches), "matches": self.matches, "detail": self.detail}


def read_target(site_fd: int, rel: str) -> tuple[bytes, os.stat_result]:
    """An engine file's bytes, reached from site-packages without following any symlink.

    FileNotFoundError when it (or a directory above it) is missing; NotAFile when it is not a plain
    regular file readable by its owner; EnvironmentProblem for any other error (naming the errno).
    """
    try:
        dir_fd, name = open_parent(site_fd, rel, what=rel)
        try:
            data, st = read_at(dir_fd, name, what=rel)
        finally:
            os.close(dir_fd)
    except (FileNotFoundError, NotAFile):
        raise
    except OSError as exc:
        raise EnvironmentProblem(f"cannot read {rel}: {errno_text(exc)}; nothing was changed") from None
    if not st.st_mode & stat.S_IRUSR:
        # pip never installs such a file; root could read it anyway, so refuse by policy
        raise NotAFile(rel, f"mode {stat.S_IMODE(st.st_mode):03o}, unreadable by its owner")
    return data, st


def open_site(site_packages: Path) -> int:
    try:
        return os.open(site_packages, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise EnvironmentProblem(f"cannot open {site_packages}: {errno_text(exc)}") from None


def classify(entry: FileEntry, site_fd: int, site_packages: Path, others: list[Manifest] = ()) -> FileState:
    path = site_packages / entry.path
    try:
        data, st = read_target(site_fd, entry.path)
    except FileNotFoundError:
        return FileState(entry, path, MISSING, None)
    except NotAFile as exc:
        return FileState(entry, path, UNKNOWN, None, detail=f"is {exc.kind}")
    digest = sha256_bytes(data)
    if digest == entry.pristine:
        return FileState(entry, path, PRISTINE, digest, data=data, stat=st)
    if digest == entry.patched:
        return FileState(entry, path, PATCHED, digest, data=data, stat=st)
    if entry.earlier_state(digest) is not None:
        return FileState(entry, path, OUTDATED, digest, data=data, stat=st)
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
    return FileState(entry, path, UNKNOWN, digest, matches, data=data, stat=st)


def survey(manifest: Manifest, site_packages: Path, others: list[Manifest] = ()) -> list[FileState]:
    site_fd = open_site(site_packages)
    try:
        return [classify(f, site_fd, site_packages, [o for o in others if o is not manifest])
                for f in manifest.files]
    finally:
        os.close(site_fd)
