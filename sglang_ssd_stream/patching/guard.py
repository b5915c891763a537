"""The one source-state verdict: may our plugin run on the engine this process (or a Python) imports?

Both plugins (at start-up, in every engine process), both doctors and ``serve``'s preflight ask
this module and nothing else. The verdict combines two questions, both answered from the
release's manifest (the only place a hash is written):

1. The files our patches touch: all ``patched`` is accepted; all ``pristine`` only with the
   engine's explicit escape hatch; ``mixed`` (a half-patched group), ``unknown``/``missing``
   files, a pending interrupted transaction and a release we have no manifest for are refused.
2. Every ``watch`` entry (engine code we rely on without patching it) still has its recorded
   source hash; a changed function means that reliance is unverified there, and is refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import KitError
from ..findings import ERROR, OK, WARNING, Finding
from .engines import ENGINES
from .files import NotAFile
from .state import MISSING, OUTDATED, PATCHED, PRISTINE, UNKNOWN, SourceFunctions, open_site, read_target

# Verdict states, beyond the per-file ones.
MIXED, PENDING, NO_VERDICT = "mixed", "pending", "error"

# Each engine's escape hatch for running on a pristine engine, and the command that patches it.
ALLOW_UNPATCHED_ENV = {name: e.allow_unpatched_env for name, e in ENGINES.items()}
TOOL = {name: e.tool for name, e in ENGINES.items()}


@dataclass(frozen=True)
class Verdict:
    engine: str
    state: str  # patched | pristine | outdated | mixed | unknown | pending | error
    release: str | None
    listing: str  # "path=state, ..." or the reason no verdict could be reached
    files: int = 0
    watch_ok: int = 0
    watch_changed: tuple[str, ...] = field(default_factory=tuple)  # one message per changed function

    def findings(self, *, allow_unpatched: bool = False) -> list[Finding]:
        """The verdict as findings (``source`` and, when the manifest watches code, ``watched_code``)."""
        tool, name = TOOL[self.engine], f"{self.engine} {self.release or ''}".rstrip()
        apply = f"{tool} patch apply (in the runtime that serves)"
        escape = ALLOW_UNPATCHED_ENV[self.engine]
        if self.state == PATCHED:
            out = [Finding(OK, "source", f"{name}: {self.files} file(s) patched" if self.files
                           else f"{name}: no file to patch in this release")]
        elif self.state == PRISTINE and allow_unpatched:
            out = [Finding(WARNING, "source", f"{name} is UNPATCHED ({self.listing}); accepted because {escape}=1",
                           apply)]
        elif self.state == PRISTINE:
            out = [Finding(ERROR, "source", f"{name} is not patched ({self.listing})",
                           f"{apply}; or set {escape}=1 to run on a pristine {self.engine}")]
        elif self.state == OUTDATED:
            out = [Finding(ERROR, "source", f"{name} carries an earlier version of this kit's patches "
                           f"({self.listing}); the kit's code expects its own", f"{apply} (or install.sh) updates "
                           f"them from the pristine backups")]
        elif self.state == MIXED:
            out = [Finding(ERROR, "source", f"{name} is half-patched ({self.listing}); half-patched files are never "
                           f"used", f"{tool} patch apply (it completes or recovers the series)")]
        elif self.state == PENDING:
            out = [Finding(ERROR, "source", f"{name}: an interrupted patch command left its journal; files may be "
                           f"mixed ({self.listing})",
                           f"{tool} patch recover (with write access to the engine's site-packages) rolls them back "
                           f"to pristine; then {tool} patch apply")]
        elif self.state == UNKNOWN:
            out = [Finding(ERROR, "source", f"{name} files match no state this kit knows ({self.listing})",
                           f"reinstall the engine as released (pip install --force-reinstall --no-deps "
                           f"{self.engine}=={self.release or ENGINES[self.engine].pinned}), then {tool} patch apply")]
        else:
            out = [Finding(ERROR, "source", f"cannot tell the {self.engine} source state: {self.listing}",
                           f"install {self.engine}=={ENGINES[self.engine].pinned} (the release this kit pins) in the "
                           f"runtime, or point the check at it with --python")]
        for message in self.watch_changed:
            out.append(Finding(ERROR, "watched_code", message,
                               f"install {self.engine}=={self.release} as released"))
        if self.watch_ok and not self.watch_changed:
            out.append(Finding(OK, "watched_code", f"{self.watch_ok} watched {self.engine} function(s) unchanged"))
        return out


def _file_listing(f, release: str | None) -> str:
    """``path=state``; an unknown file also says what was found and what this kit expects there."""
    if f.state != UNKNOWN:
        return f"{f.entry.path}={f.state}"
    found = f.detail or f"SHA-256 {f.sha256}"
    also = f", matches {', '.join(f.matches)}" if f.matches else ""
    return (f"{f.entry.path}=unknown ({found}{also}; {release} expects pristine {f.entry.pristine} or patched "
            f"{f.entry.patched})")


def verdict(engine_name: str, *, python: str | None = None, site_packages: Path | None = None,
            root: Path | None = None) -> Verdict:
    """The verdict on ``engine_name`` as this process imports it (default), as ``python`` imports it,
    or in ``site_packages``."""
    from . import commands
    from .target import from_python, from_site_packages, from_this_process

    engine = ENGINES[engine_name]
    try:
        if site_packages is not None:
            target = from_site_packages(engine, site_packages)
        elif python is not None:
            target = from_python(engine, python)
        else:
            target = from_this_process(engine)
        report = commands.status(target, root)
    except KitError as exc:
        return Verdict(engine_name, NO_VERDICT, None, exc.message)
    states = {f.state for f in report.files}
    listing = ", ".join(_file_listing(f, report.target.release) for f in report.files)
    if states & {UNKNOWN}:
        from .manifest import known_manifests

        listing += f"; releases this kit knows: {', '.join(m.release for m in known_manifests(engine, root))}"
    if report.pending_recovery:
        state = PENDING
        listing = f"{report.pending_reason}; {listing}"
    elif states <= {PATCHED}:
        state = PATCHED
    elif states == {PRISTINE}:
        state = PRISTINE
    elif OUTDATED in states and states <= {PATCHED, PRISTINE, OUTDATED}:
        state = OUTDATED
    elif states <= {PATCHED, PRISTINE}:
        state = MIXED
    else:
        state = UNKNOWN if states & {UNKNOWN, MISSING} else MIXED
    changed, ok = [], 0
    site_fd = open_site(target.site_packages)
    try:
        sources = {}
        for w in report.manifest.watch:
            if w.path in sources:
                continue
            try:
                sources[w.path] = read_target(site_fd, w.path)[0]
            except (OSError, NotAFile, KitError) as exc:
                sources[w.path] = exc
    finally:
        os.close(site_fd)
    parsed: dict[str, SourceFunctions] = {}  # each watched file parsed once, however many functions it holds
    for w in report.manifest.watch:
        try:
            src = sources[w.path]
            if isinstance(src, Exception):
                raise src
            if w.path not in parsed:
                parsed[w.path] = SourceFunctions(src)
            got = parsed[w.path].sha256(w.function)
        except (OSError, NotAFile, KitError, SyntaxError, UnicodeDecodeError, ValueError) as exc:
            got, detail = None, f"is unreadable ({exc})"
        else:
            detail = "is missing" if got is None else f"has SHA-256 {got}"
        if got == w.sha256:
            ok += 1
        else:
            changed.append(f"{w.path}:{w.function} {detail}, expected {w.sha256}; we rely on it unpatched ({w.why})")
    return Verdict(engine_name, state, report.target.release, listing, len(report.files), ok, tuple(changed))
