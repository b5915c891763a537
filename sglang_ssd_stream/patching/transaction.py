"""All-or-nothing, crash-safe multi-file writes into an engine's site-packages.

Protocol (state lives in ``<site-packages>/.sglang-ssd-stream/<engine>/``):

1. take ``lock`` (a second installer gets LockHeld at once);
2. store every original in ``backups/<sha256>`` (content-addressed, written atomically);
3. write ``journal.json`` naming each file with its before/after hash (atomically, fsync'd);
4. replace each file atomically (temp in the same directory, fsync, rename, fsync directory),
   keeping mode and owner, and drop its stale ``__pycache__`` entries;
5. delete the journal.

A process killed anywhere in 3–5 leaves a journal; the next command that takes the lock rolls
every journal file back to its pristine bytes from the backups, so files are never left mixed.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from ..errors import EnvironmentProblem, LockHeld, RefusedSourceState
from .state import sha256_bytes, sha256_file

STATE_DIR = ".sglang-ssd-stream"
TMP_SUFFIX = ".sglang-ssd-stream-tmp"


@dataclass(frozen=True)
class Write:
    path: Path  # target file
    rel: str  # path relative to site-packages, for messages and the journal
    before: str  # sha256 now
    after: str  # sha256 after the write
    pristine: str  # sha256 of the pristine file (recovery target)
    data: bytes  # new contents
    original: bytes  # current contents (backed up before an apply)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, *, like: Path | None = None, before_rename=None) -> None:
    """Replace ``path`` with ``data`` atomically, keeping the mode/owner of ``like`` (or of ``path``)."""
    ref = like if like is not None else path
    try:
        st = os.stat(ref)
        mode, uid, gid = stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid
    except FileNotFoundError:
        mode, uid, gid = 0o644, None, None
    tmp = path.with_name(path.name + TMP_SUFFIX)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, mode)
    if uid is not None and (uid, gid) != (os.geteuid(), os.getegid()):
        try:
            os.chown(tmp, uid, gid)
        except PermissionError:
            pass  # not ours to give away; the file stays ours with the same mode
    if before_rename is not None:
        before_rename()
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _drop_bytecode(path: Path) -> None:
    cache = path.parent / "__pycache__"
    for pyc in cache.glob(f"{path.stem}.*.pyc") if cache.is_dir() else ():
        try:
            pyc.unlink()
        except OSError:
            pass  # Python revalidates by mtime and size anyway


class Transaction:
    """The lock, backups and journal of one engine install."""

    def __init__(self, site_packages: Path, engine_name: str):
        self.site = site_packages
        self.dir = site_packages / STATE_DIR / engine_name
        self.backups = self.dir / "backups"
        self.journal = self.dir / "journal.json"
        self._lock: FileLock | None = None

    # --- test seam: called before every durable step; fault-injection tests kill the process here
    def _checkpoint(self, step: str) -> None:
        pass

    def __enter__(self) -> "Transaction":
        try:
            self.backups.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EnvironmentProblem(f"cannot create {self.dir}: {exc.strerror or exc}; nothing was changed") from None
        self._lock = FileLock(str(self.dir / "lock"), timeout=0)
        try:
            self._lock.acquire()
        except Timeout:
            raise LockHeld(f"another installer holds {self.dir / 'lock'}; wait for it to finish") from None
        except OSError as exc:
            raise EnvironmentProblem(f"cannot lock {self.dir / 'lock'}: {exc.strerror or exc}") from None
        return self

    def __exit__(self, *exc) -> None:
        if self._lock is not None:
            self._lock.release()

    # --- backups
    def backup_path(self, sha: str) -> Path:
        return self.backups / sha

    def has_backup(self, sha: str) -> bool:
        p = self.backup_path(sha)
        return p.is_file() and sha256_file(p) == sha

    def read_backup(self, sha: str, rel: str) -> bytes:
        p = self.backup_path(sha)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            raise RefusedSourceState(
                f"no backup of the pristine {rel} (SHA-256 {sha}) in {self.backups}; restore the engine with "
                f"pip install --force-reinstall --no-deps <engine>==<release>") from None
        if sha256_bytes(data) != sha:
            raise RefusedSourceState(f"backup {p} of {rel} is corrupt (SHA-256 {sha256_bytes(data)}, expected {sha})")
        return data

    def store_backup(self, data: bytes, like: Path) -> None:
        sha = sha256_bytes(data)
        if not self.has_backup(sha):
            self._checkpoint(f"backup {sha[:12]}")
            atomic_write(self.backup_path(sha), data, like=like)

    # --- the journalled write
    def commit(self, writes: list[Write], op: str) -> None:
        if not writes:
            return
        record = {"op": op, "files": [{"path": w.rel, "before": w.before, "after": w.after,
                                       "pristine": w.pristine} for w in writes]}
        self._checkpoint("journal")
        atomic_write(self.journal, json.dumps(record, indent=1).encode(), like=self.dir)
        os.chmod(self.journal, 0o644)
        for w in writes:
            self._checkpoint(f"write {w.rel}")
            atomic_write(w.path, w.data, before_rename=lambda: self._checkpoint(f"rename {w.rel}"))
            _drop_bytecode(w.path)
        self._checkpoint("clear journal")
        self.journal.unlink()
        _fsync_dir(self.dir)

    def recover(self) -> list[str]:
        """Roll an interrupted apply/revert back to pristine; returns what was restored."""
        if not self.journal.exists():
            return []
        try:
            record = json.loads(self.journal.read_text())
            files = record["files"]
        except (OSError, ValueError, KeyError) as exc:
            raise RefusedSourceState(f"interrupted-transaction journal {self.journal} is unreadable ({exc}); "
                                     f"reinstall the engine to get a known state") from None
        restored = []
        for f in files:
            path = self.site / f["path"]
            leftover = path.with_name(path.name + TMP_SUFFIX)
            if leftover.exists():
                leftover.unlink()
            current = sha256_file(path) if path.exists() else None
            if current == f["pristine"]:
                continue
            if current not in (f["before"], f["after"]):
                raise RefusedSourceState(
                    f"{f['path']} changed during an interrupted transaction (SHA-256 {current}); "
                    f"refusing to recover over it")
            self._checkpoint(f"recover {f['path']}")
            atomic_write(path, self.read_backup(f["pristine"], f["path"]))
            _drop_bytecode(path)
            restored.append(f["path"])
        self.journal.unlink()
        _fsync_dir(self.dir)
        return restored
