"""SGLang general plugin (entry point ``sglang.srt.plugins: ssd_stream``).

SGLang's ``load_plugins()`` runs ``register()`` in the launcher and in every scheduler process,
and only *logs* an ordinary exception. Every failure here therefore becomes ``SystemExit``: an
engine that runs without our patches or knobs is worse than one that refuses to start.
Module top level is stdlib-only for the same reason (an import error would be logged and ignored).
"""

from __future__ import annotations

import os
import sys

ALLOW_UNPATCHED_ENV = "SGLANG_SSD_STREAM_ALLOW_UNPATCHED"

_registered = False


def _fatal(message: str) -> "NoReturn":  # noqa: F821
    print(f"sglang-ssd-stream plugin: {message}", file=sys.stderr, flush=True)
    raise SystemExit(f"sglang-ssd-stream plugin: {message}")


def register() -> None:
    """Called by sglang.srt.plugins.load_plugins(); idempotent within a process."""
    global _registered
    if _registered:
        return
    try:
        _guard_source_state()
        from . import knobs
        from .ple import hooks as ple_hooks

        knobs.apply_all()
        ple_hooks.install()  # PLE sidecar streaming; its hooks must land or the worker stops
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure must stop the worker, see module docstring
        _fatal(f"{type(exc).__name__}: {exc}")
    _registered = True


def _guard_source_state() -> None:
    """Refuse to run on an sglang whose patched files are in an unknown or half-patched state."""
    from .errors import KitError
    from .patching import commands
    from .patching.engines import ENGINES
    from .patching.state import PATCHED, PRISTINE
    from .patching.target import from_this_process

    try:
        report = commands.status(from_this_process(ENGINES["sglang"]))
    except KitError as exc:
        _fatal(f"{exc.message}")
    states = {f.state for f in report.files}
    if states == {PATCHED}:
        return
    listing = ", ".join(f"{f.entry.path}={f.state}" for f in report.files)
    if states == {PRISTINE} and os.environ.get(ALLOW_UNPATCHED_ENV) == "1":
        print(f"sglang-ssd-stream plugin: running on UNPATCHED sglang ({ALLOW_UNPATCHED_ENV}=1)", file=sys.stderr)
        return
    _fatal(f"sglang source is not in the patched state ({listing}). Run `sglang-ssd-stream patch apply` "
           f"(or set {ALLOW_UNPATCHED_ENV}=1 to run on a pristine sglang).")
