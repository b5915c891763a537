"""``<tool> patch status|verify|apply|revert|recover``: argparse wiring and rendering, shared by both CLIs."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

from ..errors import EXIT_CHANGED, EXIT_ENVIRONMENT, EXIT_OK, EXIT_REFUSED, KitError
from . import commands
from .engines import ENGINES
from .signals import Interrupted, deferred_signals
from .state import MISSING, OUTDATED, PATCHED, PRISTINE, UNKNOWN
from .target import from_python, from_site_packages

EXIT_CODES_HELP = """exit codes:
  0  success (verify: every file is patched)
  1  verify: some file is not patched
  2  refused: unknown, missing, odd (FIFO, symlink, ...) or half-patched source state, an unknown engine
     release, or a journal this kit did not write
  3  kit data invalid: corrupt diff, series or manifest, unsafe path
  4  environment: engine not found, permission denied, I/O error (the file and errno are named); a
     failed apply/revert was rolled back, or a rollback could not finish (`patch recover` once the
     fault is gone)
  5  another installer holds the lock
  6  status/verify: an interrupted apply/revert left its journal; the files may be mixed (run
     `patch recover`; apply and revert also recover first)
  7  the change WAS made, then a signal, an unwritable stdout or the final check failed (run
     `patch verify`)
 64  usage error
130/143  interrupted by SIGINT/SIGTERM before the commit point: rolled back
Refusals (2, 3, 5) change nothing; 4, 130 and 143 leave every file as it was. status and verify
never write."""


CHANGE_VERBS = ("patch ", "restore ")  # report actions that write (commands.py words them so)

def add_patch_commands(subparsers: argparse._SubParsersAction, engine_name: str) -> None:
    engine = ENGINES[engine_name]
    patch = subparsers.add_parser(
        "patch", help=f"apply, verify or revert this kit's {engine.name} source patches",
        description=f"Hash-verified source patches for {engine.name}.", epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = patch.add_subparsers(dest="verb", required=True, metavar="{status,verify,apply,revert,recover,drift}")
    helps = {
        "status": "per file: pristine / patched / outdated / unknown / missing (writes nothing)",
        "verify": "exit 0 only when every file is in the patched state (writes nothing)",
        "apply": "apply the patch series (no-op when already patched)",
        "revert": "restore the pristine files byte for byte from our backups",
        "recover": "roll back what an interrupted apply/revert left (its journal) to pristine",
    }
    for verb, text in helps.items():
        p = verbs.add_parser(verb, help=text, description=text, epilog=EXIT_CODES_HELP,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        where = p.add_mutually_exclusive_group()
        where.add_argument("--python", metavar="PATH", help=f"patch the {engine.name} that this interpreter imports")
        where.add_argument("--site-packages", metavar="DIR", help=f"patch the {engine.name} installed in DIR")
        p.add_argument("--json", action="store_true", help="print a JSON report on stdout")
        if verb in ("status", "verify"):
            p.add_argument("--deep", action="store_true",
                           help="also hash every file the engine's RECORD lists against it (slow)")
        if verb in ("apply", "revert"):
            p.add_argument("--dry-run", action="store_true", help="check and show what would change; write nothing")
        p.add_argument("--data-dir", metavar="DIR", help=argparse.SUPPRESS)  # maintainers/tests: other hashes/
        p.set_defaults(func=lambda args, _e=engine.name: run_patch_command(args, _e))

    d = verbs.add_parser(
        "drift", help="classify each patch on other releases: identical / moved / upstream / conflict",
        description="Fetch engine wheels without installing them and report, per patch and release, whether the "
                    "patch still holds. Writes drift.md, drift.json and unreviewed candidate manifests to --out.")
    d.add_argument("--release", action="append", default=[], metavar="X.Y.Z",
                   help="release to check (repeatable); default: the pinned release and every newer one offered")
    d.add_argument("--wheel", action="append", default=[], metavar="FILE", help="also check a local wheel file")
    d.add_argument("--out", default="drift-report", metavar="DIR", help="report directory (default: drift-report)")
    d.add_argument("--cache", metavar="DIR", help="wheel cache (default: ~/.cache/sglang-ssd-stream)")
    d.add_argument("--json", action="store_true", help="print the JSON report on stdout")
    d.add_argument("--data-dir", metavar="DIR", help=argparse.SUPPRESS)
    d.set_defaults(func=lambda args, _e=engine.name: run_drift_command(args, _e))


def run_drift_command(args: argparse.Namespace, engine_name: str) -> int:
    import os

    from packaging.version import Version

    from .drift import drift_report, registry_releases
    from .manifest import known_manifests

    engine = ENGINES[engine_name]
    root = Path(args.data_dir) if args.data_dir else None
    try:
        broken: dict = {}
        manifest = next((m for m in known_manifests(engine, root, broken=broken) if m.release == engine.pinned), None)
        if f"{engine.name}-{engine.pinned}.json" in broken:
            raise broken[f"{engine.name}-{engine.pinned}.json"]
        if manifest is None:
            print(f"{engine.name}: no manifest for the pinned release {engine.pinned}", file=sys.stderr)
            return 3
        releases = list(args.release)
        if not releases and not args.wheel:
            try:
                offered = registry_releases(engine.distribution)
            except KitError as exc:
                print(f"drift: SKIPPED, the package index is unreachable ({exc.message})")
                return EXIT_OK
            releases = sorted((r for r in offered if Version(r) >= Version(engine.pinned)), key=Version)
        cache = Path(args.cache or os.environ.get("SSD_STREAM_CACHE")
                     or Path.home() / ".cache" / "sglang-ssd-stream")
        drift_report(manifest, releases, cache, Path(args.out), [Path(w) for w in args.wheel])
    except KitError as exc:
        print(f"{engine.name}: {exc.message}", file=sys.stderr)
        return exc.exit_code
    if args.json:
        print((Path(args.out) / "drift.json").read_text())
    else:
        print((Path(args.out) / "drift.md").read_text())
        print(f"report written to {args.out}/")
    return EXIT_OK


WRITE_VERBS = ("apply", "revert", "recover")


def run_patch_command(args: argparse.Namespace, engine_name: str) -> int:
    engine = ENGINES[engine_name]
    root = Path(args.data_dir) if args.data_dir else None
    hold = deferred_signals() if args.verb in WRITE_VERBS else contextlib.nullcontext(lambda: None)
    report = exc = None
    with hold as late_signal:
        try:
            target = (from_site_packages(engine, args.site_packages) if args.site_packages
                      else from_python(engine, args.python))
            if args.verb == "status":
                report = commands.status(target, root, provenance=True, deep=args.deep)
            elif args.verb == "verify":
                report = commands.verify(target, root, provenance=True, deep=args.deep)
            elif args.verb == "apply":
                report = commands.apply(target, root, dry_run=args.dry_run)
            elif args.verb == "revert":
                report = commands.revert(target, root, dry_run=args.dry_run)
            else:
                report = commands.recover(target, root)
        except KeyboardInterrupt:  # status/verify only (they never write); write verbs record signals
            exc = Interrupted("interrupted by SIGINT; nothing was changed")
        except KitError as exc_:
            exc = exc_
        signum = late_signal()
        code = _report(args, engine, report, exc, signum)
        if signum is None and late_signal() is not None:  # one that came while the report printed
            code = _signal_while_reporting(engine, report, late_signal(), code)
    return code


def _signal_while_reporting(engine, report, signum: int, code: int) -> int:
    """The exit for a SIGINT/SIGTERM recorded while the outcome was printed: 7 once the change was made
    (as for one that came before the report), 128 + signal when the command had changed nothing."""
    name = signal.Signals(signum).name
    if report is not None and report.committed:
        _stderr(f"{engine.name}: {name} arrived after the commit point, while the report was printed: the "
                f"change WAS made and is kept; run `{engine.tool} patch verify` (exit {EXIT_CHANGED})")
        return EXIT_CHANGED
    if code == EXIT_OK:
        _stderr(f"{engine.name}: interrupted by {name}; nothing was changed")
        return 128 + signum
    return code  # already a failure's exit, which says more than the signal


def _report(args, engine, report, exc, signum) -> int:
    """Print the outcome; its exit code. A signal or an unwritable stdout after a committed change
    never hides that the change was made (exit 7, said on stderr)."""
    if exc is not None:
        code = exc.exit_code
        lines = [f"{engine.name}: {exc.message}"]
        if signum is not None and code == EXIT_OK:
            code = 128 + signum
        _emit(args, {"command": args.verb, "engine": engine.name, "error": type(exc).__name__,
                     "message": exc.message, "exit_code": code} if args.json else None, None, lines)
        return code
    if args.verb == "status" and report.exit_code == EXIT_OK \
            and any(f.state in (UNKNOWN, MISSING) for f in report.files):
        report.exit_code = EXIT_REFUSED  # the README's "2: unknown or missing source state", for status too
    late = []
    if signum is not None:
        name = signal.Signals(signum).name
        if report.committed:
            report.exit_code = EXIT_CHANGED
            late.append(f"{engine.name}: {name} arrived after the commit point: the change above WAS made and is "
                        f"kept; stopping now (exit {EXIT_CHANGED})")
        else:
            report.exit_code = 128 + signum
            late.append(f"{engine.name}: interrupted by {name}; nothing was changed")
    written = _emit(args, report.as_json() if args.json else None, report if not args.json else None, late)
    if not written:
        if report.committed:
            _stderr(f"{engine.name}: the {args.verb} WAS made, but its report could not be written to stdout; "
                    f"run `{engine.tool} patch verify` (exit {EXIT_CHANGED})")
            return EXIT_CHANGED
        _stderr(f"{engine.name}: the report could not be written to stdout; nothing was changed")
        return EXIT_ENVIRONMENT if report.exit_code == EXIT_OK else report.exit_code
    return report.exit_code


def _emit(args, doc, report, stderr_lines) -> bool:
    """Write the JSON document or the rendered report to stdout; False when stdout cannot take it."""
    for line in stderr_lines:
        _stderr(line)
    try:
        if doc is not None:
            print(json.dumps(doc, indent=1))
        elif report is not None:
            render(report)
        sys.stdout.flush()
    except OSError:
        # keep the interpreter's exit flush from failing again (and printing a traceback)
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return False
    return True


def _stderr(line: str) -> None:
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr, flush=True)


def render(report: commands.Report) -> None:
    m = report.manifest
    print(f"{report.target.describe()}; manifest {m.source.name}; patches (series order): "
          f"{', '.join(p.id for p in m.patches)}")
    for pid, status in report.upstream.items():
        print(f"  upstream    {pid}: {status}")
    if report.wheel is not None:
        print(f"  wheel       {report.wheel.message}")
    for path in report.recovered:
        print(f"  recovered   {path} (an interrupted transaction was rolled back to pristine)")
    if report.pending_recovery:
        print(f"  PENDING: {report.pending_reason}. Until then every file below may be mixed and the engine must "
              f"not be used.")
    for label in report.leftovers:
        print(f"  leftover    {label} (of an interrupted command; apply, revert or recover removes it)")
    width = max(len(f.entry.path) for f in report.files)
    for f in report.files:
        extra = f"  ({', '.join(f.matches)})" if f.matches else f"  ({f.detail})" if f.detail else ""
        sha = f.sha256 or "-"
        print(f"  {f.state:<9} {f.entry.path:<{width}}  {sha}{extra}")
    if any(f.state == OUTDATED for f in report.files) and report.command in ("status", "verify"):
        print(f"  outdated: patched by an earlier version of this kit; `{m.engine.tool} patch apply` rewrites it "
              f"from the pristine backup")
    if report.record_mismatches is not None:
        if report.record_mismatches:
            print(f"  RECORD: {len(report.record_mismatches)} file(s) differ from the engine's RECORD:")
            for line in report.record_mismatches[:20]:
                print(f"    {line}")
        else:
            print("  RECORD: every other file matches the engine's RECORD")
    for action in report.actions:  # a dry run says "would" of what it would change, not of "already patched"
        changes = action.startswith(CHANGE_VERBS)
        print(f"  {'would ' if report.dry_run and changes else ''}{action}")
    if report.command == "verify":
        states = {f.state for f in report.files}
        if report.exit_code == EXIT_OK:
            print("verified: every file is patched")
        elif report.pending_recovery:
            print("NOT VERIFIED: an interrupted transaction is pending")
        elif states == {PRISTINE}:
            print("not patched: every file is pristine (run `patch apply`)")
        else:
            print("NOT VERIFIED: " + ", ".join(f"{f.entry.path} is {f.state}" for f in report.files
                                               if f.state != PATCHED)
                  + (f"; {len(report.record_mismatches)} file(s) differ from RECORD" if report.record_mismatches
                     else ""))
