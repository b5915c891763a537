"""The sidecar a process serves, judged the same way for both engines.

Loaded by the one loader and trust rule (:func:`sglang_ssd_stream.sidecar.view.load_sidecar`: sizes checked,
links resolve only where the artifact and the operator allow), its tables' SHA-256 checked once per process
(:func:`sglang_ssd_stream.sidecar.verify.verify_sidecar` and its verified cache: a start that finds every table
unchanged since a success re-reads nothing). Both plugins load through :func:`load_verified` as
:data:`~sglang_ssd_stream.sidecar.verify.SERVE`, which records successes in that cache; both doctors report through
:func:`load_finding` and :func:`sha_finding` as the default
:data:`~sglang_ssd_stream.sidecar.verify.REPORT`, which reads it and writes nothing
(:func:`~sglang_ssd_stream.sidecar.verify.may_record` decides). The caller passes its engine's opt-out knob name for
the messages; this module reads no variable.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import KitError
from ..findings import ERROR, OK, WARNING, Finding

REPORT = "report"  # sidecar.verify.REPORT, without importing the sidecar package here (numpy) before it is used

SIDECAR_FIX = ("rebuild or re-download the sidecar (sglang-ssd-stream model fetch verifies every file; "
               "sglang-ssd-stream sidecar verify <dir> re-checks one)")


@dataclass(frozen=True)
class Verified:
    manifest: object  # sidecar.format.SidecarManifest
    report: object  # sidecar.verify.VerifyReport


_lock = threading.Lock()
_verified: dict[tuple, Verified] = {}
_sha_findings: dict[tuple, Finding] = {}


def _key(path: str | os.PathLike, extra_roots: Iterable[str], no_verify: bool, caller: str) -> tuple:
    from ..sidecar.verify import may_record

    # a report's result does not stand in for a serving load's, which must record it
    return os.path.realpath(path), tuple(str(r) for r in extra_roots), bool(no_verify), may_record(caller)


def load_verified(path: str | os.PathLike, *, extra_roots: Iterable[str] = (), no_verify: bool = False,
                  progress: bool = True, caller: str = REPORT) -> Verified:
    """The sidecar at ``path`` (``ssd-stream.json`` or its directory), loaded and SHA-256-verified once per
    process (``no_verify``: the hashing skipped, the report says so); ``caller``: who asks, for the verified
    cache's rule (a plugin passes ``SERVE``). Raises KitError on any refusal."""
    from ..sidecar.verify import verify_sidecar
    from ..sidecar.view import load_sidecar

    extra_roots = tuple(extra_roots)
    key = _key(path, extra_roots, no_verify, caller)
    with _lock:
        if key not in _verified:
            manifest = load_sidecar(path, extra_roots=extra_roots)
            report = verify_sidecar(manifest, caller=caller, no_verify=no_verify, progress=progress)
            _verified[key] = Verified(manifest, report)
        return _verified[key]


def load_finding(path: str | os.PathLike, *, extra_roots: Iterable[str] = ()) -> tuple[Finding, object | None]:
    """The sidecar loads with full-size tables (no hashing): the finding, and the manifest when it loaded."""
    from ..sidecar.view import load_sidecar

    try:
        manifest = load_sidecar(path, extra_roots=tuple(extra_roots))
    except KitError as exc:
        return Finding(ERROR, "sidecar", exc.message, SIDECAR_FIX), None
    return Finding(OK, "sidecar", f"{path}: {len(manifest.tables)} table(s), sizes as the manifest says; "
                   f"{disk_use(manifest)}"), manifest


def disk_use(manifest) -> str:
    """What the sidecar's kind costs on disk: in place, the manifest alone (the tables are the checkpoint's own
    shard bytes); copied, the table files."""
    from ..staging.host_memory import fmt_bytes

    tables = sum(t.bytes for t in manifest.tables)
    if all(t.in_place for t in manifest.tables):
        shards = len({r.file for t in manifest.tables for r in t.regions})
        return (f"in place: {fmt_bytes(os.path.getsize(manifest.path))} on disk (the manifest; the "
                f"{fmt_bytes(tables)} of tables are regions of {shards} checkpoint shard file(s))")
    return f"copied: {fmt_bytes(tables)} of table files on disk"


def sha_finding(path: str | os.PathLike, *, knob: str, no_verify: bool = False, extra_roots: Iterable[str] = (),
                progress: bool = True, caller: str = REPORT) -> Finding:
    """The tables' SHA-256 against the manifest, once per process (the result is kept, a failure too);
    ``knob`` is the engine's opt-out variable, named in the messages; ``caller`` as for :func:`load_verified`."""
    if no_verify:
        return Finding(WARNING, "sidecar_sha", f"{knob}=1: the tables' SHA-256 is not checked, so a corrupted row "
                       "would be served",
                       f"unset {knob} (the check runs once; its result is cached until a table changes)")
    key = (*_key(path, extra_roots, no_verify, caller), knob)
    with _lock:
        if key in _sha_findings:
            return _sha_findings[key]
    try:
        report = load_verified(path, extra_roots=extra_roots, progress=progress, caller=caller).report
    except KitError as exc:
        found = Finding(ERROR, "sidecar_sha", exc.message, f"{SIDECAR_FIX}; never serve it with {knob}=1")
    else:
        cached = sum(t.status == "cached" for t in report.tables)
        source = f"{cached} from the verified cache {report.cache_file}" if report.cache_file else "no verified cache"
        found = Finding(OK, "sidecar_sha", f"{len(report.tables)} table(s) match the manifest's SHA-256 ({source})")
    with _lock:
        return _sha_findings.setdefault(key, found)


def forget() -> None:
    """Drop this process's results (tests: what a new process would see; the verified cache on disk stays)."""
    with _lock:
        _verified.clear()
        _sha_findings.clear()
