"""Hostile-file-safe reads: never follow a symlink we were not told to, never block on a FIFO,
never open a device, never read an unbounded document.

Engine files are reached from a site-packages directory descriptor one component at a time with
``O_NOFOLLOW`` (``open_parent``), so a symlinked directory cannot lead a root process outside the
tree it was pointed at. Every read ``lstat``s first (a FIFO, socket or device node is never opened),
then opens ``O_NONBLOCK | O_NOFOLLOW`` and ``fstat``s the descriptor to check it is the same regular
file. Kit data (manifests, series, journals) is read with a size cap and strict JSON (duplicate
keys, NaN and nesting beyond Python's stack are refused, not crashed on).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .. import strict_json
from ..errors import BadKitData, EnvironmentProblem, KitError

O_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

MAX_SOURCE_BYTES = 64 << 20  # the largest engine source file we patch is ~200 KiB
MAX_KIT_DOC_BYTES = 4 << 20  # manifests, series, patches (the largest is ~100 KiB)


class NotAFile(Exception):
    """A path that exists but is not a plain regular file we may read or replace."""

    def __init__(self, what: str, kind: str):
        super().__init__(f"{what} is {kind}")
        self.what, self.kind = what, kind


def kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


def errno_text(exc: OSError) -> str:
    """``EIO (Input/output error)``: the errno by name, for messages that must name it."""
    name = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno else type(exc).__name__
    return f"{name} ({exc.strerror or exc})"


def _read_fd(fd: int, limit: int, what: str) -> bytes:
    chunks, total = [], 0
    while True:
        block = os.read(fd, min(1 << 20, limit + 1 - total))
        if not block:
            return b"".join(chunks)
        chunks.append(block)
        total += len(block)
        if total > limit:
            raise NotAFile(what, f"larger than {limit} bytes")


def read_at(dir_fd: int, name: str, *, what: str, limit: int = MAX_SOURCE_BYTES) -> tuple[bytes, os.stat_result]:
    """Bytes and stat of the regular file ``name`` in ``dir_fd``; never follows a symlink.

    FileNotFoundError when absent; NotAFile for anything but a plain regular file; OSError otherwise.
    """
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        raise NotAFile(what, kind_of(st.st_mode))
    try:
        fd = os.open(name, O_READ | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # swapped for a symlink since the lstat
            raise NotAFile(what, "a symlink") from None
        raise
    try:
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode) or (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            raise NotAFile(what, "replaced while being read")
        if fst.st_size > limit:
            raise NotAFile(what, f"larger than {limit} bytes")
        return _read_fd(fd, limit, what), fst
    finally:
        os.close(fd)


def open_parent(root_fd: int, rel: str, *, what: str) -> tuple[int, str]:
    """(descriptor of the directory holding ``rel``, its last component), walking from ``root_fd``
    without following symlinks. The caller closes the descriptor.

    FileNotFoundError when a directory is missing; NotAFile when one is a symlink or not a directory.
    """
    parts = rel.split("/")
    fd = os.dup(root_fd)
    try:
        for i, part in enumerate(parts[:-1]):
            try:
                nxt = os.open(part, O_DIR, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    sub = "/".join(parts[:i + 1])
                    try:
                        kind = kind_of(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode)
                    except OSError:
                        kind = "not a directory"
                    raise NotAFile(what, f"under {sub}, which is {kind}") from None
                raise
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


def read_kit_file(path: Path, what: str, limit: int = MAX_KIT_DOC_BYTES) -> bytes:
    """A kit data file (may be reached through symlinks: data/ links into the checkout), refusing
    anything that is not a regular file, and anything larger than ``limit``."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise BadKitData(f"{what} {path} is {kind_of(st.st_mode)}, not a regular file")
        fd = os.open(path, O_READ)
        try:
            fst = os.fstat(fd)
            if not stat.S_ISREG(fst.st_mode) or (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
                raise BadKitData(f"{what} {path} was replaced while being read")
            return _read_fd(fd, limit, what)
        finally:
            os.close(fd)
    except NotAFile:
        raise BadKitData(f"{what} {path} is larger than {limit} bytes") from None
    except FileNotFoundError:
        raise BadKitData(f"{what} {path} does not exist") from None
    except OSError as exc:  # the data may be fine; the machine cannot read it (EIO, EACCES): exit 4, not 3
        raise EnvironmentProblem(f"cannot read {what} {path}: {errno_text(exc)}; nothing was changed") from None


def parse_json(raw: bytes, what: str, error: type[KitError] = BadKitData) -> object:
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity; deep nesting is an error, not a crash."""
    try:
        return strict_json.loads(raw)
    except strict_json.NestedTooDeeply:
        raise error(f"{what} is nested too deeply to be a document of ours") from None
    except ValueError as exc:
        raise error(f"{what} is not valid JSON: {exc}") from None
