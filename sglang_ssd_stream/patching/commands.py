"""status / verify / apply / revert / recover over one engine install, as data (the CLI renders it).

status and verify only read: a journal left by an interrupted command is reported (exit 6), never
acted on. Recovery runs only in apply, revert and recover, under the lock. Refusals are decided
before anything is created: apply and revert first plan from a read-only survey (no lock, no state
directory), and only a plan with writes takes the lock, re-surveys under it and commits through the
Transaction (which rolls back on any fault or signal). Past the commit point nothing is reported as
unchanged: a failed final check raises ChangedButUnfinished (exit 7).
"""

from __future__ import annotations

import re
import stat
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import (
    EXIT_NOT_VERIFIED,
    EXIT_OK,
    EXIT_PENDING,
    BadKitData,
    ChangedButUnfinished,
    KitError,
    RefusedSourceState,
    UnsupportedRelease,
)
from .diff import apply_file, load_patch, upstream_status
from .journal import StateView
from .manifest import Manifest, known_manifests
from .state import MISSING, OUTDATED, PATCHED, PRISTINE, UNKNOWN, FileState, sha256_bytes, survey
from .target import Target
from .transaction import ROLLED_BACK, Transaction, Write


@dataclass
class Report:
    command: str
    target: Target
    manifest: Manifest | None
    files: list[FileState] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)
    pending_recovery: bool = False  # a journal of an interrupted command is there (status/verify: exit 6)
    pending_reason: str = ""
    leftovers: list[str] = field(default_factory=list)  # temps of ours; the next apply/revert/recover removes them
    committed: bool = False  # a change was written (past the commit point)
    dry_run: bool = False
    exit_code: int = EXIT_OK
    upstream: dict[str, str] = field(default_factory=dict)  # patch id -> status, from its DEP-3 header
    wheel: object = None  # wheels.WheelOrigin (status/verify from the CLI)
    record_mismatches: list[str] | None = None  # --deep

    def as_json(self) -> dict:
        return {
            "command": self.command,
            "engine": self.target.engine.name,
            "site_packages": str(self.target.site_packages),
            "installed_release": self.target.release,
            "manifest_release": self.manifest.release if self.manifest else None,
            "patches": [p.id for p in self.manifest.patches] if self.manifest else [],
            "upstream": self.upstream,
            "files": [f.as_json() for f in self.files],
            "actions": self.actions,
            "recovered": self.recovered,
            "pending_recovery": self.pending_recovery,
            "pending_reason": self.pending_reason,
            "leftovers": self.leftovers,
            "committed": self.committed,
            "wheel": self.wheel.as_json() if self.wheel is not None else None,
            "record_mismatches": self.record_mismatches,
            "dry_run": self.dry_run,
            "exit_code": self.exit_code,
        }


def public_release(release: str) -> str:
    """``0.33.0+cu129`` -> ``0.33.0``: a local build label of a known release selects that release's
    manifest; its files are then judged by their hashes like any other install (a build whose files
    differ is refused as unknown). Anything else (rc, post, dev, unparsable) is compared as written."""
    from packaging.version import InvalidVersion, Version

    try:
        version = Version(release)
    except InvalidVersion:
        return release
    return version.public if version.local else release


def select_manifest(target: Target, root: Path | None = None) -> tuple[Manifest, list[Manifest]]:
    """The manifest of the installed release, refusing a release we do not know.

    A manifest that does not load breaks only its own release (exit 3 there); the others still serve.
    """
    broken: dict[str, BadKitData] = {}
    manifests = known_manifests(target.engine, root, broken=broken)
    releases = [m.release for m in manifests]
    if target.release is None:
        raise UnsupportedRelease(
            f"cannot tell which {target.engine.name} release is in {target.site_packages} (no "
            f"{target.engine.distribution}-*.dist-info); known releases: {', '.join(releases) or 'none'}")
    for m in manifests:
        if m.release == public_release(target.release):
            return m, manifests
    own = broken.get(f"{target.engine.name}-{public_release(target.release)}.json")
    if own is not None:
        raise own
    raise UnsupportedRelease(
        f"{target.engine.name} {target.release} is installed in {target.site_packages}, which this kit does not "
        f"know; known releases: {', '.join(releases) or 'none'}. Nothing was changed.")


def _refusal(fs: FileState, manifests: list[Manifest]) -> str:
    known = []
    for m in manifests:
        try:
            e = m.file(fs.entry.path)
        except KeyError:
            continue
        known.append(f"{m.release}={e.pristine}/{e.patched}")
    found = ("is missing" if fs.state == MISSING else f"{fs.detail} (an engine file is a plain regular file)"
             if fs.detail else f"has SHA-256 {fs.sha256}")
    hint = f" (it matches {', '.join(fs.matches)})" if fs.matches else ""
    engine = manifests[0].engine.name
    return (f"Refusing to patch an unknown {engine} source state: {fs.entry.path} {found}{hint}; "
            f"known: {', '.join(known)}")


def _patched_bytes(manifest: Manifest, entry, pristine: bytes) -> bytes:
    """Apply, in series order, every patch that touches ``entry`` and check the patched hash."""
    data = pristine
    for patch in manifest.patches:
        if patch.id not in entry.patches:
            continue
        parsed = load_patch(manifest.diff_path(patch), patch.id)
        if entry.path not in parsed.files:
            raise BadKitData(f"patch {patch.id}: its diff does not touch {entry.path}, but the manifest says it does")
        # Exact context, no fuzz; a hunk may sit at another offset in another release (one diff serves
        # several releases). The pristine hash before and the patched hash after make the result exact.
        data, _ = apply_file(data, parsed.files[entry.path], path=entry.path, find_offsets=True)
    got = sha256_bytes(data)
    if got != entry.patched:
        raise BadKitData(f"applying {', '.join(entry.patches)} to {entry.path} gives SHA-256 {got}, but the "
                         f"manifest expects {entry.patched}; the diff or manifest is corrupt. Nothing was changed.")
    return data


def _check_diff_coverage(manifest: Manifest) -> None:
    """Every file a diff touches must be listed for that patch (a diff cannot smuggle in a target)."""
    for patch in manifest.patches:
        parsed = load_patch(manifest.diff_path(patch), patch.id)
        listed = {f.path for f in manifest.files if patch.id in f.patches}
        extra = set(parsed.files) - listed
        if extra:
            raise BadKitData(f"patch {patch.id} touches {sorted(extra)}, which {manifest.source.name} does not list")


def upstream_of(manifest: Manifest) -> dict[str, str]:
    return {p.id: upstream_status(load_patch(p.diff, p.id).header) for p in manifest.patches}


def status(target: Target, root: Path | None = None, command: str = "status", *,
           provenance: bool = False, deep: bool = False) -> Report:
    """Per-file states; writes nothing. A pending journal (checked against the manifest first) is
    reported with its files and the command that finishes it: exit 6."""
    manifest, manifests = select_manifest(target, root)
    report = Report(command, target, manifest)
    with StateView(target.site_packages, manifest) as view:
        record = view.load_journal()  # a journal we did not write is refused here (exit 2)
        report.leftovers = [label for _fd, _name, label in view.leftovers()]
    if record is not None:
        op, entries = record
        report.pending_recovery = True
        report.pending_reason = (
            f"an interrupted `patch {op}` left its journal {view.journal} for "
            f"{', '.join(e.path for e, _b, _a in entries)}; the files may be mixed. "
            f"`{manifest.engine.tool} patch recover` rolls them back to pristine (apply and revert do it first)")
        report.exit_code = EXIT_PENDING
    report.files = survey(manifest, target.site_packages, manifests)
    if provenance:
        from .wheels import check_record_files, installed_origin

        report.upstream = upstream_of(manifest)
        report.wheel = installed_origin(target.site_packages, manifest)
        if deep and report.wheel.rows:
            report.record_mismatches = check_record_files(
                target.site_packages, report.wheel, {f.entry.path for f in report.files if f.state == PATCHED})
    return report


def verify(target: Target, root: Path | None = None, **kw) -> Report:
    report = status(target, root, command="verify", **kw)
    if report.pending_recovery:
        report.exit_code = EXIT_PENDING
    elif any(f.state != PATCHED for f in report.files) or report.record_mismatches:
        report.exit_code = EXIT_NOT_VERIFIED
    return report


def _write(f: FileState, after: str, data: bytes) -> Write:
    st = f.stat
    return Write(f.entry.path, f.sha256, after, f.entry.pristine, data, f.data, stat.S_IMODE(st.st_mode),
                 st.st_uid, st.st_gid)


def _pending(target: Target, manifest: Manifest) -> bool:
    with StateView(target.site_packages, manifest) as view:
        return view.load_journal() is not None or bool(view.leftovers())


def apply(target: Target, root: Path | None = None, dry_run: bool = False) -> Report:
    manifest, manifests = select_manifest(target, root)
    _check_diff_coverage(manifest)
    report = Report("apply", target, manifest, dry_run=dry_run)
    pending = _pending(target, manifest)
    files = survey(manifest, target.site_packages, manifests)
    if dry_run or not pending:
        with StateView(target.site_packages, manifest) as view:
            writes = _plan_apply(report, manifest, manifests, files, view)  # refusals here create nothing
        if dry_run or not writes:
            report.files = files
            return report
        report.actions.clear()  # planned again below on the files the transaction holds: each said once
    with Transaction(target.site_packages, manifest, create=True) as txn:
        _recover_first(report, txn)
        with _after_recovery(report):
            files = survey(manifest, target.site_packages, manifests)
            writes = _plan_apply(report, manifest, manifests, files, txn)
            txn.commit(writes, "apply")
        report.committed = bool(writes) or bool(report.recovered)
        report.actions += txn.warnings
    return _final_check(report, manifests, PATCHED)


def _plan_apply(report: Report, manifest: Manifest, manifests: list[Manifest], files: list[FileState],
                view: StateView) -> list[Write]:
    bad = [f for f in files if f.state in (UNKNOWN, MISSING)]
    if bad:
        raise RefusedSourceState("\n".join(_refusal(f, manifests) for f in bad) + "\nNothing was changed.")
    if {f.state for f in files} == {PATCHED}:
        report.actions.append("already patched: nothing to do")
        return []
    # A patch that some of its files hold and others lack is a half-applied group: refuse. Files an
    # earlier kit patched (fewer patches, or an older version of one) are known states: each is
    # rewritten from its pristine backup, so the groups end whole whatever the earlier kit held.
    for patch in manifest.patches:
        group = [f for f in files if patch.id in f.entry.patches]
        if len({f.holds(patch.id) for f in group}) > 1:
            raise RefusedSourceState(
                f"half-patched group {patch.id}: " + ", ".join(
                    f"{f.entry.path} {'holds' if f.holds(patch.id) else 'lacks'} it ({f.state})" for f in group)
                + ". Run `patch revert` first, then `patch apply`. Nothing was changed.")
    writes = []
    for f in files:
        if f.state == PATCHED:
            report.actions.append(f"keep {f.entry.path} (already patched)")
    for f in files:
        if f.state == PRISTINE:
            data = _patched_bytes(manifest, f.entry, f.data)
            report.actions.append(f"patch {f.entry.path} ({', '.join(f.entry.patches)})")
        elif f.state == OUTDATED:
            held = f.entry.earlier_state(f.sha256).patches
            data = _patched_bytes(manifest, f.entry, view.read_backup(f.entry.pristine, f.entry.path))
            report.actions.append(f"patch {f.entry.path} ({', '.join(f.entry.patches)}) from its pristine backup, "
                                  f"replacing an earlier kit's {', '.join(held)}")
        else:
            continue
        writes.append(_write(f, f.entry.patched, data))
    return writes


def revert(target: Target, root: Path | None = None, dry_run: bool = False) -> Report:
    manifest, manifests = select_manifest(target, root)
    report = Report("revert", target, manifest, dry_run=dry_run)
    pending = _pending(target, manifest)
    files = survey(manifest, target.site_packages, manifests)
    if dry_run or not pending:
        with StateView(target.site_packages, manifest) as view:
            writes = _plan_revert(report, manifests, files, view)
        if dry_run or not writes:
            report.files = files
            return report
        report.actions.clear()  # planned again below on the files the transaction holds: each said once
    with Transaction(target.site_packages, manifest) as txn:
        _recover_first(report, txn)
        with _after_recovery(report):
            files = survey(manifest, target.site_packages, manifests)
            writes = _plan_revert(report, manifests, files, txn)
            txn.commit(writes, "revert")
        report.committed = bool(writes) or bool(report.recovered)
        report.actions += txn.warnings
    return _final_check(report, manifests, PRISTINE)


def recover(target: Target, root: Path | None = None) -> Report:
    """Finish what an interrupted apply/revert left: roll its files back to pristine (refused when that
    would leave a patch group mixed), remove leftover temps. Nothing to do is exit 0."""
    manifest, manifests = select_manifest(target, root)
    report = Report("recover", target, manifest)
    if not _pending(target, manifest):
        report.actions.append("nothing to recover: no journal and no leftovers of an interrupted command")
        report.files = survey(manifest, target.site_packages, manifests)
        return report
    with Transaction(target.site_packages, manifest) as txn:
        _recover_first(report, txn)
        report.committed = bool(report.recovered)
        report.actions += txn.warnings
    if not report.recovered:
        report.actions.append("removed leftovers of an interrupted command; no file needed a rollback")
    return _final_check(report, manifests, None)


def _recover_first(report: Report, txn: Transaction) -> None:
    record = txn.load_journal()
    report.recovered = txn.recover()
    if record is not None:
        report.actions.append(f"an interrupted `patch {record[0]}` had left its files mixed: rolled "
                              f"{len(report.recovered)} file(s) back to pristine first")


_NOTHING_CHANGED = re.compile(r"[;.]?\s*nothing was changed\b[.,;]?", re.IGNORECASE)


def _cause(message: str) -> str:
    """An error's message as the cause of a failure that came after a change was made: without its own
    "nothing was changed" (true of the step that failed, false of the command)."""
    return _NOTHING_CHANGED.sub("", message).strip()


@contextmanager
def _after_recovery(report: Report):
    """A failure after the recovery step rolled files back must not claim that nothing was changed."""
    try:
        yield
    except KitError as exc:
        if not report.recovered:
            raise
        raise ChangedButUnfinished(
            f"an interrupted command's files were first rolled back to pristine ({', '.join(report.recovered)}); "
            f"then the {report.command} failed: "
            f"{_cause(exc.message.replace(ROLLED_BACK, 'its own writes were undone'))}. "
            f"Run `{report.manifest.engine.tool} patch "
            f"{report.command}` again once the cause is gone") from None


def _final_check(report: Report, manifests: list[Manifest], want: str | None) -> Report:
    """The survey after a commit: whatever fails here, the change was made, and the error says so."""
    changed = report.committed
    try:
        report.files = survey(report.manifest, report.target.site_packages, manifests)
    except KitError as exc:
        if not changed:
            raise
        raise ChangedButUnfinished(f"the {report.command} was made (committed), but the final check failed: "
                                   f"{_cause(exc.message)}. Run `{report.manifest.engine.tool} patch verify`."
                                   ) from None
    if want is not None and any(f.state != want for f in report.files):
        listing = ", ".join(f"{f.entry.path}={f.state}" for f in report.files)
        if changed:
            raise ChangedButUnfinished(f"the {report.command} was made (committed), but not every file is "
                                       f"{want} now: {listing}; another process changed them meanwhile?")
        raise RefusedSourceState(f"{report.command}: not every file is {want}: {listing}")
    return report


def _plan_revert(report: Report, manifests: list[Manifest], files: list[FileState], view: StateView) -> list[Write]:
    bad = [f for f in files if f.state in (UNKNOWN, MISSING)]
    if bad:
        raise RefusedSourceState("\n".join(_refusal(f, manifests).replace("to patch", "to revert", 1) for f in bad)
                                 + "\nNothing was changed.")
    todo = [f for f in files if f.state in (PATCHED, OUTDATED)]
    if not todo:
        report.actions.append("already pristine: nothing to do")
        return []
    writes = []
    for f in todo:
        data = view.read_backup(f.entry.pristine, f.entry.path)
        writes.append(_write(f, f.entry.pristine, data))
        report.actions.append(f"restore {f.entry.path} from backup {f.entry.pristine[:12]}…")
    return writes
