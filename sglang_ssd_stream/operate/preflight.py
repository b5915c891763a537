"""Checks run before ``serve`` execs the engine, and the seam to ``sglang_ssd_stream.doctor``.

Our own checks are cheap and certain (files exist, the sidecar manifest loads with the right
sizes; no 47 GiB hash pass, the plugin does that with its cache). The doctor module, when it is
adds host checks through ``doctor.preflight(engine=, profile=, model=, draft=, env=, argv=)``:
it raises a KitError to refuse and returns a list of warning strings.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from .errors import ServeRefused

DOCTOR_MODULE = "sglang_ssd_stream.doctor"


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


def run_doctor(profile, model: str, draft: str | None, env: dict, argv: list[str]) -> list[str]:
    """``doctor.preflight`` sees the whole launch line (profile flags and extras); its KitError refuses."""
    doctor = importlib.import_module(DOCTOR_MODULE)  # looked up at call time so tests can stand in
    return list(doctor.preflight(engine=profile.engine, profile=profile.name, model=model, draft=draft, env=env,
                                 argv=argv) or [])


def preflight(profile, model: str, draft: str | None, env: dict, argv: list[str] = ()) -> list[str]:
    """Raise on anything that must stop the launch; return warnings (printed on stderr by serve)."""
    check_files(profile, model, draft)
    warnings = run_doctor(profile, model, draft, env, list(argv))
    for w in warnings:
        print(f"preflight: warning: {w}", file=sys.stderr)
    return warnings
