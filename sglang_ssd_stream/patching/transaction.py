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

A process killed outright (SIGKILL, power loss) also leaves the journal, handled the same way. A
journal is trusted only after it is checked against the release's manifest (schema, safe paths,
known files and hashes) and only when rolling its files back leaves every patch group whole (each
patch held by all of its files or by none); backups are looked up by content hash only and re-hashed when read.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import stat
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadKitData, ChangedButUnfinished, EnvironmentProblem, KitError, LockHeld, RefusedSourceState
from .files import NotAFile, errno_text, open_parent, parse_json, read_at
from .manifest import FileEntry, Manifest, safe_relative_path
from .state import open_site, sha256_bytes

STATE_DIR = ".sglang-ssd-stream"
TMP_SUFFIX = ".sglang-ssd-stream-tmp"
ORIG_SUFFIX = ".sglang-ssd-stream-orig"
JOURNAL = "journal.json"
JOURNAL_VERSION = 1
MAX_JOURNAL_BYTES = 1 << 20
O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
O_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
SIGNALS = (signal.SIGINT, signal.SIGTERM)
ROLLED_BACK = "rolled back: every file is as it was. Nothing was changed."


# A write command's signals, recorded for its whole run (the CLI's deferred_signals): one received before
# a Transaction starts stops it at its first step; one after the commit point is handed back here.
_deferred: dict = {"on": False, "signum": None}


@contextmanager
def deferred_signals():
    """SIGINT/SIGTERM recorded instead of raised while a write command runs (main thread only);
    yields a callable returning the signal received (None if none)."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return

    def record(signum, frame):
        if _deferred["signum"] is None:
            _deferred["signum"] = signum

    previous = {s: signal.signal(s, record) for s in SIGNALS}
    _deferred.update(on=True, signum=None)
    try:
        yield lambda: _deferred["signum"]
    finally:
        _deferred["on"] = False
        for s, h in previous.items():
            signal.signal(s, h)


class Interrupted(KitError):
    """SIGINT or SIGTERM stopped a patch command; the exit code is the shell's 128 + signal."""

    def __init__(self, message: str, signum: int = int(signal.SIGINT)):
        super().__init__(message)
        self.signum = int(signum)
        self.exit_code = 128 + self.signum

    def __reduce__(self):
        return self.__class__, (self.message, self.signum)


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


def _regular_or_link(dir_fd: int, name: str) -> bool:
    """True when ``name`` exists as something we may unlink as a leftover of ours."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)


class StateView:
    """Read-only view of one install's state directory (no lock; creates nothing)."""

    def __init__(self, site_packages: Path, manifest: Manifest):
        self.site = site_packages
        self.manifest = manifest
        self.engine = manifest.engine
        self.dir = site_packages / STATE_DIR / self.engine.name
        self.journal = self.dir / JOURNAL
        self.backups = self.dir / "backups"
        self._site_fd: int | None = None
        self._state_fds: list[int] = []  # .sglang-ssd-stream, <engine>, backups (as far as they exist)
        self._target_dirs: dict[str, tuple[int, str]] = {}

    # --- descriptors
    def __enter__(self):
        self._site_fd = open_site(self.site)
        try:
            self._open_state(create=False)
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._close()

    def _close(self) -> None:
        for fd, _ in self._target_dirs.values():
            os.close(fd)
        self._target_dirs.clear()
        for fd in self._state_fds:
            os.close(fd)
        self._state_fds.clear()
        if self._site_fd is not None:
            os.close(self._site_fd)
            self._site_fd = None

    def _state_names(self) -> tuple[str, ...]:
        return STATE_DIR, self.engine.name, "backups"

    def _open_state(self, create: bool) -> None:
        parent = self._site_fd
        for depth, name in enumerate(self._state_names()):
            label = "/".join(self._state_names()[:depth + 1])
            try:
                fd = os.open(name, O_DIR, dir_fd=parent)
            except FileNotFoundError:
                if not create:
                    return
                self._mkdir(parent, name, label)
                fd = os.open(name, O_DIR, dir_fd=parent)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise RefusedSourceState(
                        f"{self.site / label} is not a directory of ours (a symlink or a file); refusing to "
                        f"read or write through it. Nothing was changed.") from None
                raise EnvironmentProblem(f"cannot open {self.site / label}: {errno_text(exc)}. "
                                         f"Nothing was changed.") from None
            self._state_fds.append(fd)
            parent = fd

    def _mkdir(self, parent: int, name: str, label: str) -> None:
        raise AssertionError("read-only view")

    @property
    def _engine_fd(self) -> int | None:
        return self._state_fds[1] if len(self._state_fds) > 1 else None

    @property
    def _backups_fd(self) -> int | None:
        return self._state_fds[2] if len(self._state_fds) > 2 else None

    def _target_dir(self, rel: str) -> tuple[int, str]:
        """(directory descriptor, file name) of a manifest path, walked without following symlinks."""
        if rel not in self._target_dirs:
            self._target_dirs[rel] = open_parent(self._site_fd, rel, what=rel)
        return self._target_dirs[rel]

    # --- what is there
    def journal_exists(self) -> bool:
        fd = self._engine_fd
        if fd is None:
            return False
        try:
            os.stat(JOURNAL, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def leftovers(self) -> list[tuple[int, str, str]]:
        """Temps and side links an interrupted command left: (dir fd, name, label)."""
        out = []
        for fd, label in ((self._engine_fd, f"{STATE_DIR}/{self.engine.name}"),
                          (self._backups_fd, f"{STATE_DIR}/{self.engine.name}/backups")):
            if fd is None:
                continue
            for name in os.listdir(fd):
                if name.endswith(TMP_SUFFIX) and _regular_or_link(fd, name):
                    out.append((fd, name, f"{label}/{name}"))
        for entry in self.manifest.files:
            try:
                fd, name = self._target_dir(entry.path)
            except (OSError, NotAFile):
                continue  # the survey reports a missing or odd directory
            for suffix in (TMP_SUFFIX, ORIG_SUFFIX):
                if _regular_or_link(fd, name + suffix):
                    out.append((fd, name + suffix, entry.path + suffix))
        return out

    def read_backup(self, sha: str, rel: str) -> bytes:
        fd = self._backups_fd
        try:
            if fd is None:
                raise FileNotFoundError
            data, _ = read_at(fd, sha, what=f"backup {sha}")
        except FileNotFoundError:
            raise RefusedSourceState(
                f"no backup of the pristine {rel} (SHA-256 {sha}) in {self.backups}; restore the engine with "
                f"pip install --force-reinstall --no-deps {self.engine.distribution}=={self.manifest.release}"
            ) from None
        except NotAFile as exc:
            raise RefusedSourceState(f"backup {self.backups / sha} of {rel} {exc}; refusing it") from None
        except OSError as exc:
            raise EnvironmentProblem(f"cannot read backup {self.backups / sha}: {errno_text(exc)}") from None
        if sha256_bytes(data) != sha:
            raise RefusedSourceState(f"backup {self.backups / sha} of {rel} is corrupt (SHA-256 "
                                     f"{sha256_bytes(data)}, expected {sha})")
        return data

    def has_backup(self, sha: str) -> bool:
        try:
            self.read_backup(sha, sha)
        except RefusedSourceState:
            return False
        return True

    # --- the journal, trusted only after it is checked against the manifest
    def load_journal(self) -> tuple[str, list[tuple[FileEntry, str, str]]] | None:
        """(op, [(manifest entry, before, after)]) of a pending journal; None when there is none."""
        fd = self._engine_fd
        if fd is None:
            return None
        try:
            raw, _ = read_at(fd, JOURNAL, what=str(self.journal), limit=MAX_JOURNAL_BYTES)
        except FileNotFoundError:
            return None
        except NotAFile as exc:
            self._bad_journal(f"it {exc}")
        except OSError as exc:
            raise EnvironmentProblem(f"cannot read {self.journal}: {errno_text(exc)}") from None
        doc = parse_json(raw, f"journal {self.journal}", error=RefusedSourceState)
        keys = {"version", "op", "engine", "release", "files"}
        if not isinstance(doc, dict) or set(doc) != keys:
            self._bad_journal(f"expected an object with exactly {sorted(keys)}")
        if doc["version"] != JOURNAL_VERSION or type(doc["version"]) is not int:
            self._bad_journal(f"version {doc['version']!r}, this kit writes {JOURNAL_VERSION}")
        if doc["op"] not in ("apply", "revert"):
            self._bad_journal(f"op {doc['op']!r}")
        if doc["engine"] != self.engine.name or doc["release"] != self.manifest.release:
            self._bad_journal(f"it is for {doc['engine']!r} {doc['release']!r}, not {self.engine.name} "
                              f"{self.manifest.release}")
        files = doc["files"]
        if not isinstance(files, list) or not files or len(files) > len(self.manifest.files):
            self._bad_journal("files must be a non-empty list no longer than the manifest's")
        out, seen = [], set()
        for i, f in enumerate(files):
            where = f"files[{i}]"
            if not isinstance(f, dict) or set(f) != {"path", "before", "after", "pristine"}:
                self._bad_journal(f"{where} must have exactly path, before, after, pristine")
            try:
                rel = safe_relative_path(f["path"], package=self.engine.package, where=where)
            except BadKitData as exc:
                self._bad_journal(exc.message)
            try:
                entry = self.manifest.file(rel)
            except KeyError:
                self._bad_journal(f"{where}: {rel!r} is not a file of the {self.manifest.release} manifest")
            known = (entry.pristine, entry.patched)  # what a command writes; it may start from an earlier state
            if f["pristine"] != entry.pristine or f["after"] not in known or f["before"] == f["after"] \
                    or (f["before"] not in known and entry.earlier_state(f["before"]) is None) or rel in seen:
                self._bad_journal(f"{where}: the hashes of {rel} are not the manifest's (or it is listed twice)")
            seen.add(rel)
            out.append((entry, f["before"], f["after"]))
        return doc["op"], out

    def _bad_journal(self, why: str):
        raise RefusedSourceState(
            f"refusing the interrupted-transaction journal {self.journal}: {why}. This kit did not write it "
            f"(or wrote it for other kit data); nothing was changed. If no patch command was interrupted, delete "
            f"it; otherwise reinstall the engine (pip install --force-reinstall --no-deps "
            f"{self.engine.distribution}=={self.manifest.release}) and apply again.")


class Transaction(StateView):
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
                raise RefusedSourceState(f"{self.dir / 'lock'} is not a regular file; refusing it. Nothing was changed.")
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

    # --- recovery of a journal left by a killed process or a failed rollback
    def recover(self) -> list[str]:
        """Roll an interrupted apply/revert back to pristine; returns what was restored.

        Without a journal, only removes leftover temps and side links of ours.
        """
        record = self.load_journal()
        try:
            return self._recover(record)
        except OSError as exc:
            what = (f"the journal {self.journal} is kept, and the files may be mixed, which every command refuses "
                    f"to use" if record is not None else "nothing was changed")
            raise EnvironmentProblem(
                f"cannot finish the rollback of an interrupted patch command: cannot {self._step_name}: "
                f"{errno_text(exc)}; {what}. Once the fault is gone, run `{self.engine.tool} patch recover` with "
                f"write access: it rolls every file back to pristine.") from None

    def _recover(self, record) -> list[str]:
        for fd, name, label in self.leftovers():
            self._unlink(fd, name, f"leftover {label}")
        if record is None:
            return []
        _op, entries = record
        plan = []  # (entry, dir fd, name, stat) of each file to roll back
        for entry, before, after in entries:
            current, st = self._current(entry)
            if current == entry.pristine:
                continue
            if current not in (before, after):
                raise RefusedSourceState(f"{entry.path} changed since an interrupted transaction (SHA-256 "
                                         f"{current}); refusing to recover over it. Nothing was changed.")
            plan.append(entry)
        self._refuse_mixed_groups({e.path for e, _b, _a in entries})
        restored = []
        # A roll forward to pristine: a signal now waits until every file is back (then the next step, or the
        # command's end, honours it), so an interruption never leaves fewer files pristine than it found.
        self._deferring = True
        try:
            for entry in plan:
                dir_fd, name = self._target_dir(entry.path)
                _current, st = self._current(entry)
                pristine = self.read_backup(entry.pristine, entry.path)
                self._atomic(dir_fd, name, entry.path, pristine, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
                self._drop_bytecode(entry.path)
                restored.append(entry.path)
            self._unlink(self._engine_fd, JOURNAL, "journal")
        finally:
            self._deferring = False
        self.committed = True
        self._sync_after_commit()
        return restored

    def _current(self, entry: FileEntry) -> tuple[str | None, os.stat_result | None]:
        """SHA-256 and stat of a target now (None, None when missing); an odd file or path is refused."""
        try:
            dir_fd, name = self._target_dir(entry.path)
            data, st = read_at(dir_fd, name, what=entry.path)
        except FileNotFoundError:
            return None, None
        except NotAFile as exc:
            raise RefusedSourceState(f"{exc} since an interrupted transaction; refusing to recover over it. "
                                     f"Nothing was changed.") from None
        return sha256_bytes(data), st

    def _refuse_mixed_groups(self, rolled_back: set[str]) -> None:
        """A recovery must leave every patch group whole (each file holding the patch, or none): the
        journal's files end pristine, every other file keeps its state. A journal that would split a
        group is refused."""
        ends = {}
        for entry in self.manifest.files:
            ends[entry.path] = entry.pristine if entry.path in rolled_back else self._current(entry)[0]
        def word(e: FileEntry) -> str:
            sha = ends[e.path]
            return ("pristine" if sha == e.pristine else "patched" if sha == e.patched
                    else "outdated" if e.earlier_state(sha) else "unknown")

        for patch in self.manifest.patches:
            group = [e for e in self.manifest.files if patch.id in e.patches]
            held = {e.path: e.holds(ends[e.path], patch.id) for e in group}
            if len(set(held.values())) > 1:
                raise RefusedSourceState(
                    f"refusing the journal {self.journal}: rolling back its files would leave patch group "
                    f"{patch.id} mixed ({', '.join(f'{e.path} {word(e)}' for e in group)}). A journal this "
                    f"kit writes lists every file its command changes. Nothing was changed; reinstall the engine (pip install "
                    f"--force-reinstall --no-deps {self.engine.distribution}=={self.manifest.release}), delete the "
                    f"journal, and apply again.")
