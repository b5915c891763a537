"""Strict unified-diff application in memory, on top of the ``unidiff`` parser.

Strict means: every hunk's context and removed lines must match the file exactly at the line
the hunk names (no fuzz, no offset). ``find_offsets=True`` lets the drift check ask where a
hunk would match instead; the installer never uses it.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from pathlib import Path

import unidiff
from unidiff.constants import LINE_TYPE_ADDED, LINE_TYPE_CONTEXT, LINE_TYPE_NO_NEWLINE, LINE_TYPE_REMOVED

from ..errors import BadKitData
from .files import read_kit_file

# DEP-3 fields every patch of ours carries (Test: is the kit's own: the RED/GREEN check of the patch).
# Upstream status lives here and nowhere else: Bug (the upstream issue or pull request, or why there is
# none), Forwarded (whether we sent it), optionally Applied-Upstream (the release that has it).
HEADER_FIELDS_REQUIRED = ("Description", "Origin", "Bug", "Forwarded", "Last-Update", "Test")
HEADER_FIELDS_OPTIONAL = ("Author", "Applied-Upstream", "Reviewed-by")
_URL = re.compile(r"^https?://\S+$")
_ORIGIN = re.compile(r"^(upstream|backport|vendor|other)(, \S.*)?$")
_DATE = re.compile(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$")


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
    """DEP-3 ``Key: value`` lines (indented continuation lines) before the first ``---``/``diff``.

    Every field of HEADER_FIELDS_REQUIRED must be present and well formed; a field given twice is refused.
    """
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
        elif ":" in line and not line[0].isspace():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in header:
                raise BadKitData(f"{where}: patch header gives {key} twice")
            header[key] = value.strip()
    missing = [f for f in HEADER_FIELDS_REQUIRED if not header.get(f)]
    if missing:
        raise BadKitData(f"{where}: patch header lacks {missing}")
    problems = []
    if not (_ORIGIN.match(header["Origin"]) or _URL.match(header["Origin"])):
        problems.append(f"Origin {header['Origin']!r} is neither a URL nor upstream|backport|vendor|other[, URL]")
    if not (_URL.match(header["Bug"]) or header["Bug"].lower().startswith("none")):
        problems.append(f"Bug {header['Bug']!r} is neither a URL nor 'none ...' (say why there is none)")
    if not (header["Forwarded"] in ("no", "not-needed", "yes") or _URL.match(header["Forwarded"])):
        problems.append(f"Forwarded {header['Forwarded']!r} is not no, not-needed, yes or a URL")
    try:
        if not _DATE.match(header["Last-Update"]):
            raise ValueError
        datetime.date.fromisoformat(header["Last-Update"])
    except ValueError:
        problems.append(f"Last-Update {header['Last-Update']!r} is not a YYYY-MM-DD date")
    test = header["Test"]
    if not (test.startswith("tests/") and test.endswith(".py") and ".." not in test.split("/")):
        problems.append(f"Test {test!r} is not a tests/....py path")
    if problems:
        raise BadKitData(f"{where}: " + "; ".join(problems))
    return header


def upstream_status(header: dict[str, str]) -> str:
    """One line for reports: where the change stands upstream (read from the DEP-3 header only)."""
    parts = [f"bug {header['Bug']}", f"forwarded: {header['Forwarded']}"]
    if header.get("Applied-Upstream"):
        parts.append(f"applied upstream: {header['Applied-Upstream']}")
    return "; ".join(parts)


def load_patch(path: Path, patch_id: str) -> ParsedPatch:
    raw = read_kit_file(Path(path), f"patch {patch_id}: diff file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadKitData(f"patch {patch_id}: diff file {path} is not UTF-8: {exc}") from None
    if "\0" in text:  # unidiff would take it as line content
        raise BadKitData(f"patch {patch_id}: diff file {path} contains a NUL byte; not a text diff of ours")
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
