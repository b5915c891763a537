"""All-or-nothing, fault-proof multi-file writes into an engine's site-packages.

State lives in ``<site-packages>/.sglang-ssd-stream/<engine>/``: ``lock``, ``backups/<sha256>``
(pristine files, content-addressed) and, while a change is under way, ``journal.json``. Every path
is reached by descriptor from site-packages without following a symlink, so nothing outside the
engine package (and our state directory beside it) is ever opened for writing.

One apply or revert (``commit``):

1. take ``lock`` (flock, non-blocking: a second installer gets LockHeld at once);
2. apply only: store every original in ``backups/<sha256>`` (atomic);
3. write ``journal.json``: op, engine, release and per file its path, before/after/pristine hash;
4. per file: write ``<file>.sglang-ssd-stream-tmp`` (mode, owner, fsync), hard-link the current
   file to ``<file>.sglang-ssd-stream-orig``, rename the temp over the file, fsync the directory;
5. unlink the ``-orig`` links, then the journal (the commit point), fsync.

Faults. An OSError at any step, or SIGINT/SIGTERM (recorded by a handler and raised at the next
step boundary, never in the middle of one), rolls back in the same process: each ``-orig`` link is
renamed back over its file (no data is written, so a full disk cannot stop it; the file gets its
own inode back), temps are removed, and so are the backups, lock and directories this transaction
created. The command then fails with exit 4 naming the file and errno, or 130/143 for a signal.
Only when the rollback itself fails does the journal stay; status and verify then report it (exit 6,
writing nothing) and apply, revert or recover roll the files back to pristine from the backups.
Past the commit point nothing is rolled back: a signal there is honoured once the command has
reported the change (exit 7).

A process killed outright (SIGKILL, power loss) also leaves the journal, handled the same way.

The rooms of this floor: ``journal`` (the state directory read-only: layout, backups, leftovers, the
journal and its trust rules), ``lock``, ``signals``, ``recovery`` (rolling a journal back), and this
module, the write transaction that combines them.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

from ..errors import ChangedButUnfinished, EnvironmentProblem, KitError, RefusedSourceState
from .files import NotAFile, errno_text, read_at
from .journal import JOURNAL, JOURNAL_VERSION, O_DIR, O_NEW, ORIG_SUFFIX, TMP_SUFFIX, StateView, _regular_or_link
from .lock import Locking
from .manifest import Manifest
from .recovery import Recovery
from .signals import SIGNALS, Interrupted, _deferred
from .state import open_site, sha256_bytes

ROLLED_BACK = "rolled back: every file is as it was. Nothing was changed."


@dataclass(frozen=True)
class Write:
    rel: str  # path relative to site-packages (a manifest path)
    before: str  # sha256 now
    after: str  # sha256 after the write
    pristine: str  # sha256 of the pristine file (what recovery restores)
    data: bytes  # new contents
    original: bytes  # current contents (what an in-process rollback restores)
    mode: int
    uid: int
    gid: int


class Transaction(Locking, Recovery, StateView):
    """The lock, backups, journal and writes of one engine install (a context manager)."""

    def __init__(self, site_packages: Path, manifest: Manifest, *, create: bool = False):
        super().__init__(site_packages, manifest)
        self.create = create
        self._lock_fd: int | None = None
        self._created: list[tuple[int, str, bool]] = []  # (parent fd, name, is_dir) this transaction made
        self._created_backups: list[str] = []
        self._signal: int | None = None
        self._handlers: dict = {}
        self._step_name = ""
        self._rolling_back = False
        self._deferring = False  # recovery: signals wait until every journal file is pristine again
        self.committed = False  # past the commit point: what follows never rolls back
        self.warnings: list[str] = []

    # --- test seam: called before every write step; fault tests kill, raise or signal here
    def _checkpoint(self, step: str) -> None:
        pass

    def _step(self, step: str) -> None:
        """Before a write step: the seam, then any signal received since the last step."""
        if self._rolling_back:
            step = f"rollback: {step}"
        self._step_name = step
        self._checkpoint(step)
        if self._signal is not None and not self._rolling_back and not self._deferring:
            raise Interrupted(f"interrupted by {signal.Signals(self._signal).name} before {step}", self._signal)

    # --- signals: recorded, raised at the next step (never half-way through a system call's effects)
    def _on_signal(self, signum, frame) -> None:
        if self._signal is None:
            self._signal = signum

    def _install_signals(self) -> None:
        if _deferred["on"] and _deferred["signum"] is not None:
            self._signal = _deferred["signum"]  # arrived before this transaction: stop at its first step
        if threading.current_thread() is not threading.main_thread():
            return
        for s in SIGNALS:
            self._handlers[s] = signal.signal(s, self._on_signal)

    def _restore_signals(self) -> None:
        for s, h in self._handlers.items():
            signal.signal(s, h)
        self._handlers.clear()

    # --- enter/exit
    def __enter__(self):
        self._install_signals()
        try:
            self._site_fd = open_site(self.site)
            self._open_state(create=self.create)
            if len(self._state_fds) < 3:
                raise EnvironmentProblem(f"no state directory {self.dir}")
            self._lock()
            if self._signal is not None:
                self._step("start")
        except BaseException as exc:
            failed_step = self._step_name
            self._rolling_back = True
            self._undo_created()
            self._rolling_back = False
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
            self._close()
            self._restore_signals()
            if isinstance(exc, KitError):
                if isinstance(exc, Interrupted):
                    raise Interrupted(f"{exc.message}; {ROLLED_BACK}", exc.signum) from None
                raise
            if isinstance(exc, OSError):
                raise EnvironmentProblem(f"cannot {failed_step}: {errno_text(exc)}; {ROLLED_BACK}") from None
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        signum = self._signal
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
        self._close()
        self._restore_signals()
        if exc_type is None and signum is not None:
            if _deferred["on"]:
                _deferred["signum"] = signum  # the command reports what it did, then honours it
                return
            if self.committed:
                raise ChangedButUnfinished(f"interrupted by {signal.Signals(signum).name} after the commit point: "
                                           f"the change was made; every file is in the state it reports")
            raise Interrupted(f"interrupted by {signal.Signals(signum).name} after the command had finished its "
                              f"work; nothing was changed", signum)

    def _mkdir(self, parent: int, name: str, label: str) -> None:
        self._step(f"mkdir {label}")
        os.mkdir(name, 0o755, dir_fd=parent)
        self._created.append((parent, name, True))

    def _undo_created(self) -> list[str]:
        """Remove what this transaction created in the state directory (newest first)."""
        problems = []
        for parent, name, is_dir in reversed(self._created):
            try:
                self._step(f"remove {name}")
                if is_dir:
                    os.rmdir(name, dir_fd=parent)
                else:
                    os.unlink(name, dir_fd=parent)
            except FileNotFoundError:
                pass
            except OSError as exc:
                if not (is_dir and exc.errno == errno.ENOTEMPTY):
                    problems.append(f"{name}: {errno_text(exc)}")
        self._created.clear()
        return problems

    # --- primitive writes
    def _atomic(self, dir_fd: int, name: str, label: str, data: bytes, mode: int, uid: int, gid: int, *,
                side_link: bool = False) -> None:
        """Replace ``name`` in ``dir_fd`` by ``data`` via a temp and rename; ``side_link`` first keeps the
        current file reachable as ``<name>-orig`` (what a rollback renames back)."""
        tmp = name + TMP_SUFFIX
        self._step(f"create {label}")
        fd = os.open(tmp, O_NEW, 0o600, dir_fd=dir_fd)
        try:
            self._step(f"write {label}")
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            self._step(f"chmod {label}")
            os.fchmod(fd, mode)
            if (uid, gid) != (os.geteuid(), os.getegid()):
                self._step(f"chown {label}")
                try:
                    os.fchown(fd, uid, gid)
                except PermissionError:
                    pass  # not ours to give away; the file stays ours with the same mode
            self._step(f"fsync {label}")
            os.fsync(fd)
        finally:
            os.close(fd)
        if side_link:
            self._step(f"link {label}")
            os.link(name, name + ORIG_SUFFIX, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        self._step(f"rename {label}")
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        self._step(f"fsync-dir {label}")
        os.fsync(dir_fd)

    def _unlink(self, dir_fd: int, name: str, label: str) -> None:
        self._step(f"unlink {label}")
        os.unlink(name, dir_fd=dir_fd)

    def _drop_bytecode(self, rel: str) -> None:
        """Best effort (Python revalidates by mtime and size anyway); not a step of the transaction."""
        dir_fd, name = self._target_dir(rel)
        stem = name[:-3] if name.endswith(".py") else name
        try:
            cache = os.open("__pycache__", O_DIR, dir_fd=dir_fd)
        except OSError:
            return
        try:
            for pyc in os.listdir(cache):
                if pyc.startswith(stem + ".") and pyc.endswith(".pyc") and _regular_or_link(cache, pyc):
                    try:
                        os.unlink(pyc, dir_fd=cache)
                    except OSError:
                        pass
        finally:
            os.close(cache)

    # --- backups
    def store_backup(self, data: bytes, mode: int, uid: int, gid: int) -> None:
        sha = sha256_bytes(data)
        if self.has_backup(sha):
            return
        if not _regular_or_link(self._backups_fd, sha):  # a new name: a rollback removes it again
            self._created_backups.append(sha)
        self._atomic(self._backups_fd, sha, f"backup {sha[:12]}", data, mode, uid, gid)

    # --- the journalled write
    def commit(self, writes: list[Write], op: str) -> None:
        if not writes:
            return
        try:
            if op == "apply":
                for w in writes:
                    if w.before == w.pristine:  # an earlier kit's state is rewritten from the backup it stored
                        self.store_backup(w.original, w.mode, w.uid, w.gid)
            record = {"version": JOURNAL_VERSION, "op": op, "engine": self.engine.name,
                      "release": self.manifest.release,
                      "files": [{"path": w.rel, "before": w.before, "after": w.after, "pristine": w.pristine}
                                for w in writes]}
            self._atomic(self._engine_fd, JOURNAL, "journal", json.dumps(record, indent=1).encode(), 0o644,
                         os.geteuid(), os.getegid())
            for w in writes:
                dir_fd, name = self._target_dir(w.rel)
                self._atomic(dir_fd, name, w.rel, w.data, w.mode, w.uid, w.gid, side_link=True)
            for w in writes:
                self._drop_bytecode(w.rel)
            for w in writes:
                dir_fd, name = self._target_dir(w.rel)
                self._unlink(dir_fd, name + ORIG_SUFFIX, w.rel + ORIG_SUFFIX)
            self._unlink(self._engine_fd, JOURNAL, "journal")  # the commit point
        except BaseException as exc:
            self._abort(exc, writes, op)
        self.committed = True
        self._sync_after_commit()

    def _sync_after_commit(self) -> None:
        """Make the journal's removal durable. Past the commit point nothing is rolled back: a failure here
        only means a crash could bring the journal back, and then the next command rolls every file back
        to pristine (never to a mix). A signal now is reported when the transaction ends."""
        try:
            self._checkpoint("fsync-dir state (after the commit point)")
            os.fsync(self._engine_fd)
        except OSError as exc:
            self.warnings.append(f"warning: could not fsync {self.dir} after the change ({errno_text(exc)}); if "
                                 f"the machine crashes before it is written, the next patch command rolls every "
                                 f"file back to pristine")

    def _abort(self, exc: BaseException, writes: list[Write], op: str):
        step = self._step_name
        self._rolling_back = True
        try:
            problems = self._rollback(writes)
        finally:
            self._rolling_back = False
        if isinstance(exc, Interrupted):
            cause = exc.message
        elif isinstance(exc, OSError):
            cause = f"cannot {step}: {errno_text(exc)}"
        elif isinstance(exc, KitError):
            cause = exc.message
        else:
            cause = f"{type(exc).__name__} at {step}"
        if problems:
            journal = self.journal_exists() if self._engine_fd is not None else False
            if journal:
                raise EnvironmentProblem(
                    f"{cause}. The rollback failed too ({'; '.join(problems)}): the journal {self.journal} is kept "
                    f"and the files may be mixed, which every command refuses to use. Once the fault is gone, run "
                    f"`{self.engine.tool} patch recover` with write access: it rolls every file back to pristine."
                ) from None
            raise EnvironmentProblem(f"{cause}. Nothing was changed, but a temporary file could not be removed "
                                     f"({'; '.join(problems)}); the next patch command removes it.") from None
        done = f"{cause}; {ROLLED_BACK}"
        if isinstance(exc, Interrupted):
            raise Interrupted(done, exc.signum) from None
        if isinstance(exc, OSError):
            raise EnvironmentProblem(done) from None
        if isinstance(exc, KitError):
            exc.message = done
            exc.args = (done,)
        raise exc

    def _rollback(self, writes: list[Write]) -> list[str]:
        """Undo a failed commit from what is on disk; returns the problems (empty: fully undone)."""
        problems = []
        for w in reversed(writes):
            try:
                self._undo(w)
            except (OSError, NotAFile) as exc:
                problems.append(f"{w.rel}: {errno_text(exc) if isinstance(exc, OSError) else exc}")
            except RefusedSourceState as exc:
                problems.append(exc.message)
        for fd, name, label in ((self._engine_fd, JOURNAL + TMP_SUFFIX, "journal temp"),
                                *((self._backups_fd, sha + TMP_SUFFIX, f"backup temp {sha[:12]}")
                                  for sha in {sha256_bytes(w.original) for w in writes})):
            try:
                if _regular_or_link(fd, name):
                    self._unlink(fd, name, label)
            except OSError as exc:
                problems.append(f"{label}: {errno_text(exc)}")
        if problems:
            return problems  # keep the journal and the backups the recovery needs
        try:
            if self.journal_exists():
                self._unlink(self._engine_fd, JOURNAL, "journal")
                self._step("fsync-dir state")
                os.fsync(self._engine_fd)
        except OSError as exc:
            return [f"journal: {errno_text(exc)}"]
        for sha in reversed(self._created_backups):
            try:
                self._unlink(self._backups_fd, sha, f"backup {sha[:12]}")
            except FileNotFoundError:
                pass
            except OSError as exc:
                problems.append(f"backup {sha[:12]}: {errno_text(exc)}")
        self._created_backups.clear()
        if not problems and self._created:
            # Unlinking the lock while holding it is safe: a new locker checks the name still is its inode.
            problems += self._undo_created()
        return problems

    def _undo(self, w: Write) -> None:
        dir_fd, name = self._target_dir(w.rel)
        if _regular_or_link(dir_fd, name + TMP_SUFFIX):
            self._unlink(dir_fd, name + TMP_SUFFIX, w.rel + TMP_SUFFIX)
        try:
            orig = os.stat(name + ORIG_SUFFIX, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            orig = None
        if orig is not None:
            try:
                cur = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                cur = None
            if cur is not None and (cur.st_dev, cur.st_ino) == (orig.st_dev, orig.st_ino):
                self._unlink(dir_fd, name + ORIG_SUFFIX, w.rel + ORIG_SUFFIX)  # never replaced
            else:
                self._step(f"rename {w.rel + ORIG_SUFFIX}")
                os.rename(name + ORIG_SUFFIX, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                self._step(f"fsync-dir {w.rel}")
                os.fsync(dir_fd)
            return
        data, _ = read_at(dir_fd, name, what=w.rel)
        now = sha256_bytes(data)
        if now == w.before:
            return
        if now != w.after:
            raise RefusedSourceState(f"{w.rel} changed during the rollback (SHA-256 {now}); left as it is")
        self._atomic(dir_fd, name, w.rel, w.original, w.mode, w.uid, w.gid)
