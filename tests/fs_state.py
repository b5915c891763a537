"""What a command could have written under some directories: every entry, with the facts a write changes."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def tree_state(*roots: Path) -> dict[str, tuple]:
    """Each of ``roots`` and every entry under it (keyed by its full path): kind, size, mtime_ns and mode; links by
    their target. Two states compare equal only when nothing was created, removed, written, renamed or chmod'ed
    (a directory's mtime moves when an entry comes and goes: a temporary file removed again shows too)."""
    out = {}
    for root in roots:
        out[str(root)] = _entry(Path(root))
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                out[str(Path(dirpath) / name)] = _entry(Path(dirpath) / name)
    return out


def _entry(p: Path) -> tuple:
    s = os.lstat(p)
    if stat.S_ISLNK(s.st_mode):
        return "link", os.readlink(p)
    return stat.S_IFMT(s.st_mode), s.st_size, s.st_mtime_ns, stat.S_IMODE(s.st_mode)
