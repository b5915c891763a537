"""Checks run before ``serve`` execs the engine: our own file checks, then the adapter's doctor.

Our own checks are cheap and certain (files exist, the sidecar manifest loads with the right
sizes; no 47 GiB hash pass, the plugin does that with its cache). The engine's checks come from
the adapter (``side.preflight``) as findings; a refusal stops the launch, warnings are printed.
"""

from __future__ import annotations

import os
import sys

from ..findings import WARNING, refusal_text
from .errors import ServeRefused


def _need_config(kind: str, path: str | None) -> None:
    if path is None or not os.path.isfile(os.path.join(path, "config.json")):
        raise ServeRefused(f"{kind} directory {path!r} has no config.json")


def check_files(profile, model: str, draft: str | None) -> None:
    _need_config("model", model)
    if profile.needs_draft:
        _need_config("draft (MTP)", draft)
    if profile.needs_sidecar:
        from ..sidecar.format import load_manifest

        load_manifest(model, trusted_roots=[os.path.realpath(model)])  # raises Sidecar* (BadKitData) errors


def run_doctor(side, profile, model: str, draft: str | None, env: dict, argv: list[str]) -> list:
    """The adapter's doctor sees the whole launch line (profile flags and extras); returns its findings."""
    return list(side.preflight(profile=profile.name, model=model, draft=draft, env=env, argv=argv) or [])


def preflight(side, profile, model: str, draft: str | None, env: dict, argv: list[str] = ()) -> list[str]:
    """Raise on anything that must stop the launch; return warnings (printed on stderr by serve)."""
    check_files(profile, model, draft)
    findings = run_doctor(side, profile, model, draft, env, list(argv))
    refusal = refusal_text(findings, "doctor refused the launch:")
    if refusal:
        raise ServeRefused(refusal)
    warnings = [f"{f.check}: {f.message}" + (f" (fix: {f.fix})" if f.fix else "") for f in findings
                if f.level == WARNING]
    for w in warnings:
        print(f"preflight: warning: {w}", file=sys.stderr)
    return warnings
