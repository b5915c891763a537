"""The kit's one way to write a file whole or not at all (stdlib only).

A temp file beside the target is written, fsync'd and renamed over it only when the writer finishes cleanly;
any failure (an exception, a signal turned into one) removes the temp file and leaves the old file as it was.
With ``durable`` the directory is fsync'd too, so the rename itself survives a power cut.

A writer holds an ``flock`` on its temp file from its creation until after the rename, so
:func:`remove_stale_temporaries` can tell the temporary of a writer that is gone (a SIGKILL cut it short) from
one still being written by another process or thread: it removes only those whose lock it can take.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

TEMP_SUFFIX = ".tmp"
TEMP_TRIES = 8  # new temp files tried when a cleaner removed each before its writer locked it (a race of moments)
# flock refused by the filesystem (some FUSE and network ones): a writer goes on unlocked, a cleaner leaves the file
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _temp_prefix(p: Path) -> str:
    return f".{p.name}."


def _lock(fd: int, *, wait: bool) -> bool | None:
    """Take an exclusive ``flock`` on ``fd``: True; False when another open file holds it (``wait=False``);
    None when the filesystem has no flock. Per open file, not per process: two threads' files exclude each other."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in _NO_FLOCK:
            return None
        raise
    return True


def _locked_temp(p: Path) -> tuple[int, str]:
    """A new temp file beside ``p``, locked. A cleaner that took the lock between the file's creation and ours
    may have removed it (then its link count is 0): a new one is made."""
    for _ in range(TEMP_TRIES):
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(p), suffix=TEMP_SUFFIX, dir=p.parent)
        try:
            if _lock(fd, wait=True) is None or os.fstat(fd).st_nlink:
                return fd, tmp
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
    raise OSError(errno.EAGAIN, f"every temporary file beside {p} was removed before it could be locked")


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory (best effort: some filesystems refuse it, and the rename stands either way)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path: str | os.PathLike, *, durable: bool = True, mode: int | None = None) -> Iterator[BinaryIO]:
    """``with replacing(p) as f: f.write(...)``: ``p`` is replaced by what was written when the block ends
    cleanly (a writer that does not use ``f`` may write to ``f.fileno()`` directly). ``mode``: the file's permissions
    (a temp file is created 0600)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _locked_temp(p)
    try:  # the descriptor, and so the lock, is held until the temp file has its final name
        try:
            with os.fdopen(fd, "wb", closefd=False) as f:
                yield f
                f.flush()
                if durable:
                    os.fsync(fd)
            if mode is not None:
                os.chmod(tmp, mode)
            os.replace(tmp, p)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    finally:
        os.close(fd)
    if durable:
        fsync_dir(p.parent)


def remove_stale_temporaries(path: str | os.PathLike) -> int:
    """Remove the temp files that writes of ``path`` cut short left beside it (a SIGKILL skips the cleanup
    above), and only those: a temp file whose writer still holds its lock, anything not a regular file (a
    directory named like one) and a symlink are left, and each is judged alone. Returns how many were removed."""
    p = Path(path)
    pattern = glob.escape(str(p.parent / _temp_prefix(p))) + "*" + glob.escape(TEMP_SUFFIX)
    return sum(_remove_if_stale(tmp) for tmp in glob.glob(pattern))  # a leading dot in it matches hidden names


def _remove_if_stale(tmp: str) -> bool:
    try:
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False  # gone meanwhile, a symlink, unreadable
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or _lock(fd, wait=False) is not True:
            return False  # not a writer's file, or its writer is alive (or the lock cannot tell: left alone)
        now = os.lstat(tmp)  # under the lock: a writer that had it has renamed its file, never to this name again
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False
        os.unlink(tmp)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, data: bytes | str, *, durable: bool = True) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` whole or not at all."""
    with replacing(path, durable=durable) as f:
        f.write(data.encode() if isinstance(data, str) else data)
