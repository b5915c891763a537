"""The read-only side of an install's state directory: its layout, backups, leftovers and the journal.

State lives in ``<site-packages>/.sglang-ssd-stream/<engine>/``: ``lock``, ``backups/<sha256>``
(pristine files, content-addressed) and, while a change is under way, ``journal.json``. Every path
is reached by descriptor from site-packages without following a symlink. A journal is trusted only
after it is checked against the release's manifest (schema, safe paths, known files and hashes);
backups are looked up by content hash only and re-hashed when read. Nothing here writes: status,
verify and the start-up guard read through :class:`StateView`.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ..errors import BadKitData, EnvironmentProblem, RefusedSourceState
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
