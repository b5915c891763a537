"""The kit's one way to write a file whole or not at all (stdlib only).

A temp file beside the target is written, fsync'd and renamed over it only when the writer finishes cleanly;
any failure (an exception, a signal turned into one) removes the temp file and leaves the old file as it was.
With ``durable`` the directory is fsync'd too, so the rename itself survives a power cut.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


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
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(p.parent)


def write_atomic(path: str | os.PathLike, data: bytes | str, *, durable: bool = True) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` whole or not at all."""
    with replacing(path, durable=durable) as f:
        f.write(data.encode() if isinstance(data, str) else data)
