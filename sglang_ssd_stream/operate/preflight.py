"""Checks run before ``serve`` execs the engine, and the seam to ``sglang_ssd_stream.doctor``.

Our own checks are cheap and certain (files exist, the sidecar manifest loads with the right
sizes; no 47 GiB hash pass, the plugin does that with its cache). The doctor module, when it is
installed, adds host checks through ``doctor.preflight(engine=, profile=, model=, draft=, env=)``:
it raises a KitError to refuse and may return a list of warning strings.
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


def run_doctor(profile, model: str, draft: str | None, env: dict) -> list[str]:
    """Call ``doctor.preflight`` if the doctor module exists; its KitError refuses the launch."""
    try:
        doctor = importlib.import_module(DOCTOR_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != DOCTOR_MODULE:
            raise
        return []
    hook = getattr(doctor, "preflight", None)
    if hook is None:
        return []
    warnings = hook(engine=profile.engine, profile=profile.name, model=model, draft=draft, env=env)
    return list(warnings or [])


def preflight(profile, model: str, draft: str | None, env: dict) -> list[str]:
    """Raise on anything that must stop the launch; return warnings (printed on stderr by serve)."""
    check_files(profile, model, draft)
    warnings = run_doctor(profile, model, draft, env)
    for w in warnings:
        print(f"preflight: warning: {w}", file=sys.stderr)
    return warnings
