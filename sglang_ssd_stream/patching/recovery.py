"""Rolling back what an interrupted apply/revert left (its journal): every listed file to pristine.

Refused, writing nothing, when a listed file changed since (neither its before nor its after state),
or when rolling the listed files back would leave a patch group mixed (some files holding the patch,
some not): a journal this kit writes lists every file its command changes.
"""

from __future__ import annotations

import os
import stat

from ..errors import EnvironmentProblem, RefusedSourceState
from .files import NotAFile, errno_text, read_at
from .journal import JOURNAL
from .manifest import FileEntry
from .state import sha256_bytes


class Recovery:
    """Mixed into :class:`~.transaction.Transaction`: uses its journal, backups and primitive writes."""

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
                    f"kit writes lists every file its command changes. Nothing was changed; reinstall the engine "
                    f"(pip install --force-reinstall --no-deps {self.engine.distribution}=={self.manifest.release}), "
                    f"delete the journal, and apply again.")
