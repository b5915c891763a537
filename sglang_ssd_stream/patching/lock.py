"""The install's lock: one flock on ``<state dir>/lock``, taken without blocking (a second installer
gets LockHeld at once), refused when the name is a symlink, a directory or any other odd file."""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from ..errors import LockHeld, RefusedSourceState
from .journal import STATE_DIR


class Locking:
    """Mixed into :class:`~.transaction.Transaction`: uses its ``_step``, ``_engine_fd`` and ``_created``."""

    def _lock(self) -> None:
        fd_dir = self._engine_fd
        label = f"{STATE_DIR}/{self.engine.name}/lock"
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        for _ in range(3):
            created = False
            self._step_name = f"open {label}"  # named in the error when the open itself fails
            try:
                try:
                    fd = os.open("lock", flags, dir_fd=fd_dir)
                except FileNotFoundError:
                    self._step(f"create {label}")
                    try:
                        fd = os.open("lock", flags | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=fd_dir)
                        created = True
                    except FileExistsError:
                        continue  # another installer made it just now: open that one
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise RefusedSourceState(f"{self.dir / 'lock'} is a symlink; refusing to open it. "
                                             f"Nothing was changed.") from None
                if exc.errno == errno.EISDIR:
                    raise RefusedSourceState(f"{self.dir / 'lock'} is not a regular file (a directory); refusing "
                                             f"it. Nothing was changed.") from None
                raise
            if created:
                self._created.append((fd_dir, "lock", False))
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                raise RefusedSourceState(f"{self.dir / 'lock'} is not a regular file; refusing it. "
                                         f"Nothing was changed.")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise LockHeld(f"another installer holds {self.dir / 'lock'}; wait for it to finish") from None
            # A rolled-back installer removes a lock file it created: make sure ours is still the named one.
            try:
                now = os.stat("lock", dir_fd=fd_dir, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                self._lock_fd = fd
                return
            os.close(fd)
        raise LockHeld(f"the lock {self.dir / 'lock'} keeps being replaced; is another installer running?")
