"""status / verify / apply / revert over one engine install, as data (the CLI renders it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import (EXIT_NOT_VERIFIED, EXIT_OK, BadKitData, EnvironmentProblem, RefusedSourceState,
                      UnsupportedRelease)
from .diff import apply_file, load_patch
from .manifest import Manifest, known_manifests
from .state import MISSING, PATCHED, PRISTINE, UNKNOWN, FileState, sha256_bytes, survey, writable_problems
from .target import Target
from .transaction import Transaction, Write


@dataclass
class Report:
    command: str
    target: Target
    manifest: Manifest | None
    files: list[FileState] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)
    pending_recovery: bool = False
    dry_run: bool = False
    exit_code: int = EXIT_OK

    def as_json(self) -> dict:
        return {
            "command": self.command,
            "engine": self.target.engine.name,
            "site_packages": str(self.target.site_packages),
            "installed_release": self.target.release,
            "manifest_release": self.manifest.release if self.manifest else None,
            "patches": [p.id for p in self.manifest.patches] if self.manifest else [],
            "files": [f.as_json() for f in self.files],
            "actions": self.actions,
            "recovered": self.recovered,
            "pending_recovery": self.pending_recovery,
            "dry_run": self.dry_run,
            "exit_code": self.exit_code,
        }


def select_manifest(target: Target, root: Path | None = None) -> tuple[Manifest, list[Manifest]]:
    """The manifest of the installed release, refusing a release we do not know."""
    manifests = known_manifests(target.engine, root)
    releases = [m.release for m in manifests]
    if target.release is None:
        raise UnsupportedRelease(
            f"cannot tell which {target.engine.name} release is in {target.site_packages} (no "
            f"{target.engine.distribution}-*.dist-info); known releases: {', '.join(releases) or 'none'}")
    for m in manifests:
        if m.release == target.release:
            return m, manifests
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
    found = "is missing" if fs.state == MISSING else f"has SHA-256 {fs.sha256}"
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


def status(target: Target, root: Path | None = None, command: str = "status") -> Report:
    manifest, manifests = select_manifest(target, root)
    report = Report(command, target, manifest)
    txn = Transaction(target.site_packages, target.engine.name)
    if txn.journal.exists():
        try:
            with txn:
                report.recovered = txn.recover()
        except EnvironmentProblem:
            report.pending_recovery = True  # read-only: report the mixed state as it is
    report.files = survey(manifest, target.site_packages, manifests)
    return report


def verify(target: Target, root: Path | None = None) -> Report:
    report = status(target, root, command="verify")
    if report.pending_recovery or any(f.state != PATCHED for f in report.files):
        report.exit_code = EXIT_NOT_VERIFIED
    return report


def apply(target: Target, root: Path | None = None, dry_run: bool = False) -> Report:
    manifest, manifests = select_manifest(target, root)
    _check_diff_coverage(manifest)
    report = Report("apply", target, manifest, dry_run=dry_run)
    if dry_run:
        files = survey(manifest, target.site_packages, manifests)
        _plan_apply(report, manifest, manifests, files, None)
        report.files = files
        return report
    with Transaction(target.site_packages, target.engine.name) as txn:
        report.recovered = txn.recover()
        files = survey(manifest, target.site_packages, manifests)
        writes = _plan_apply(report, manifest, manifests, files, txn)
        if writes:
            for w in writes:
                txn.store_backup(w.original, like=w.path)
            txn.commit(writes, "apply")
        report.files = survey(manifest, target.site_packages, manifests)
    if any(f.state != PATCHED for f in report.files):
        raise RefusedSourceState("apply finished but not every file verifies as patched: "
                                 + ", ".join(f"{f.entry.path}={f.state}" for f in report.files))
    return report


def _plan_apply(report: Report, manifest: Manifest, manifests: list[Manifest], files: list[FileState],
                txn: Transaction | None) -> list[Write]:
    bad = [f for f in files if f.state in (UNKNOWN, MISSING)]
    if bad:
        raise RefusedSourceState("\n".join(_refusal(f, manifests) for f in bad) + "\nNothing was changed.")
    if {f.state for f in files} == {PATCHED}:
        report.actions.append("already patched: nothing to do")
        return []
    # A patch whose files are partly patched is a half-applied group: refuse. Whole patches already
    # applied (a runtime patched by an older kit that had fewer patches) are kept; the rest is applied.
    for patch in manifest.patches:
        group = [f for f in files if patch.id in f.entry.patches]
        if len({f.state for f in group}) > 1:
            raise RefusedSourceState(
                f"half-patched group {patch.id}: " + ", ".join(f"{f.entry.path} is {f.state}" for f in group)
                + ". Run `patch revert` first, then `patch apply`. Nothing was changed.")
    todo = [f for f in files if f.state == PRISTINE]
    for f in files:
        if f.state == PATCHED:
            report.actions.append(f"keep {f.entry.path} (already patched)")
    problems = writable_problems([f.path for f in todo])
    if problems:
        raise EnvironmentProblem("cannot patch: " + "; ".join(problems) + ". Nothing was changed.")
    writes = []
    for f in todo:
        original = f.path.read_bytes()
        if sha256_bytes(original) != f.entry.pristine:
            raise RefusedSourceState(f"{f.entry.path} changed while being planned; nothing was changed")
        data = _patched_bytes(manifest, f.entry, original)
        writes.append(Write(f.path, f.entry.path, f.sha256, f.entry.patched, f.entry.pristine, data, original))
        report.actions.append(f"patch {f.entry.path} ({', '.join(f.entry.patches)})")
    return writes


def revert(target: Target, root: Path | None = None, dry_run: bool = False) -> Report:
    manifest, manifests = select_manifest(target, root)
    report = Report("revert", target, manifest, dry_run=dry_run)
    txn = Transaction(target.site_packages, target.engine.name)
    if dry_run:
        files = survey(manifest, target.site_packages, manifests)
        _plan_revert(report, manifests, files, txn, read=False)
        report.files = files
        return report
    with txn:
        report.recovered = txn.recover()
        files = survey(manifest, target.site_packages, manifests)
        writes = _plan_revert(report, manifests, files, txn, read=True)
        txn.commit(writes, "revert")
        report.files = survey(manifest, target.site_packages, manifests)
    if any(f.state != PRISTINE for f in report.files):
        raise RefusedSourceState("revert finished but not every file is pristine: "
                                 + ", ".join(f"{f.entry.path}={f.state}" for f in report.files))
    return report


def _plan_revert(report: Report, manifests: list[Manifest], files: list[FileState], txn: Transaction,
                 read: bool) -> list[Write]:
    bad = [f for f in files if f.state in (UNKNOWN, MISSING)]
    if bad:
        raise RefusedSourceState("\n".join(_refusal(f, manifests).replace("to patch", "to revert", 1) for f in bad)
                                 + "\nNothing was changed.")
    todo = [f for f in files if f.state == PATCHED]
    if not todo:
        report.actions.append("already pristine: nothing to do")
        return []
    problems = writable_problems([f.path for f in todo])
    if problems:
        raise EnvironmentProblem("cannot revert: " + "; ".join(problems) + ". Nothing was changed.")
    writes = []
    for f in todo:
        if read:
            data = txn.read_backup(f.entry.pristine, f.entry.path)
        elif not txn.has_backup(f.entry.pristine):
            raise RefusedSourceState(f"no backup of the pristine {f.entry.path} in {txn.backups}")
        else:
            data = b""
        writes.append(Write(f.path, f.entry.path, f.sha256, f.entry.pristine, f.entry.pristine, data, b""))
        report.actions.append(f"restore {f.entry.path} from backup {f.entry.pristine[:12]}…")
    return writes
