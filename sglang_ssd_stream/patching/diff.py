"""Strict unified-diff application in memory, on top of the ``unidiff`` parser.

Strict means: every hunk's context and removed lines must match the file exactly at the line
the hunk names (no fuzz, no offset). ``find_offsets=True`` lets the drift check ask where a
hunk would match instead; the installer never uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import unidiff
from unidiff.constants import LINE_TYPE_ADDED, LINE_TYPE_CONTEXT, LINE_TYPE_NO_NEWLINE, LINE_TYPE_REMOVED

from ..errors import BadKitData

HEADER_FIELDS_REQUIRED = ("Description", "Origin", "Forwarded", "Test")


@dataclass(frozen=True)
class ParsedPatch:
    id: str
    header: dict[str, str]
    files: dict[str, unidiff.PatchedFile]  # target path (relative to site-packages) -> file diff


class HunkMismatch(BadKitData):
    """A hunk's context does not match the file; carries where, for drift reports."""

    def __init__(self, message: str, path: str = "", hunk: int = 0, text: str = ""):
        super().__init__(message)
        self.path, self.hunk, self.text = path, hunk, text

    def __reduce__(self):
        return self.__class__, (self.message, self.path, self.hunk, self.text)


def parse_header(text: str, where: str) -> dict[str, str]:
    """DEP-3-style ``Key: value`` lines (indented continuation lines) before the first ``---``."""
    header: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if line.startswith(("--- ", "diff ")):
            break
        if not line.strip():
            key = None
            continue
        if line[0] in " \t" and key:
            header[key] += "\n" + line.strip()
        elif ":" in line:
            key, _, value = line.partition(":")
            key = key.strip()
            header[key] = value.strip()
    missing = [f for f in HEADER_FIELDS_REQUIRED if not header.get(f)]
    if missing:
        raise BadKitData(f"{where}: patch header lacks {missing}")
    return header


def load_patch(path: Path, patch_id: str) -> ParsedPatch:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadKitData(f"patch {patch_id}: diff file {path} is missing") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadKitData(f"patch {patch_id}: diff file {path} is unreadable: {exc}") from None
    header = parse_header(text, f"patch {patch_id} ({path})")
    try:
        patch_set = unidiff.PatchSet(text)
    except unidiff.UnidiffParseError as exc:
        raise BadKitData(f"patch {patch_id}: {path} is not a valid unified diff: {exc}") from None
    files: dict[str, unidiff.PatchedFile] = {}
    for pf in patch_set:
        if pf.is_added_file or pf.is_removed_file or pf.is_rename or pf.is_binary_file:
            raise BadKitData(f"patch {patch_id}: only in-place text edits are supported ({pf.path})")
        src, tgt = pf.source_file, pf.target_file
        if not (src.startswith("a/") and tgt.startswith("b/") and src[2:] == tgt[2:]):
            raise BadKitData(f"patch {patch_id}: expected a/<path> b/<path> names, got {src!r} {tgt!r}")
        if not len(pf):
            raise BadKitData(f"patch {patch_id}: {pf.path} has no hunks")
        files[tgt[2:]] = pf
    if not files:
        raise BadKitData(f"patch {patch_id}: {path} contains no file diffs (empty or truncated)")
    return ParsedPatch(patch_id, header, files)


def _hunk_sides(hunk: unidiff.Hunk) -> tuple[list[str], list[str]]:
    """(old lines, new lines) of a hunk, honouring '\\ No newline at end of file' markers."""
    old: list[str] = []
    new: list[str] = []
    last_kinds: tuple = ()
    for line in hunk:
        t = line.line_type
        if t == LINE_TYPE_NO_NEWLINE:
            for side in last_kinds:
                side[-1] = side[-1].rstrip("\n")
            continue
        if t == LINE_TYPE_CONTEXT:
            old.append(line.value)
            new.append(line.value)
            last_kinds = (old, new)
        elif t == LINE_TYPE_REMOVED:
            old.append(line.value)
            last_kinds = (old,)
        elif t == LINE_TYPE_ADDED:
            new.append(line.value)
            last_kinds = (new,)
    if len(old) != hunk.source_length or len(new) != hunk.target_length:
        raise BadKitData(f"hunk @@ -{hunk.source_start},{hunk.source_length} is truncated or malformed")
    return old, new


def apply_file(data: bytes, pf: unidiff.PatchedFile, *, path: str, reverse: bool = False,
               find_offsets: bool = False) -> tuple[bytes, list[int]]:
    """Apply one file's hunks to ``data``; return (new bytes, per-hunk line offsets).

    Raises HunkMismatch naming the first hunk whose context differs.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HunkMismatch(f"{path}: not UTF-8 text ({exc})", path) from None
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    pos = 0
    offsets: list[int] = []
    for i, hunk in enumerate(pf, start=1):
        old, new = _hunk_sides(hunk)
        start_line = hunk.target_start if reverse else hunk.source_start
        if reverse:
            old, new = new, old
        expected = max(start_line - 1, 0) if old else start_line
        at = expected if lines[expected:expected + len(old)] == old else None
        if at is None and find_offsets:
            candidates = [j for j in range(pos, len(lines) - len(old) + 1) if lines[j:j + len(old)] == old]
            if candidates:
                at = min(candidates, key=lambda j: abs(j - expected))
        if at is None or at < pos:
            shown = "".join(("-" if reverse else " ") + s for s in old[:8])
            raise HunkMismatch(
                f"{path}: hunk #{i} (@@ -{hunk.source_start},{hunk.source_length} +{hunk.target_start},"
                f"{hunk.target_length} @@) does not match at line {expected + 1}", path, i, shown)
        offsets.append(at - expected)
        out.extend(lines[pos:at])
        out.extend(new)
        pos = at + len(old)
    out.extend(lines[pos:])
    return "".join(out).encode("utf-8"), offsets
