"""SGLang general plugin (entry point ``sglang.srt.plugins: ssd_stream``).

SGLang's ``load_plugins()`` runs ``register()`` in the launcher and in every scheduler process,
and only *logs* an ordinary exception. Every failure here therefore becomes ``SystemExit``: an
engine that runs without our patches or knobs is worse than one that refuses to start.
Module top level is stdlib-only for the same reason (an import error would be logged and ignored).
"""

from __future__ import annotations

import os
import sys

from ..patching.guard import ALLOW_UNPATCHED_ENV as _ALLOW

ALLOW_UNPATCHED_ENV = _ALLOW["sglang"]

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
        from . import hooks as ple_hooks
        from . import knobs

        knobs.apply_all()
        ple_hooks.install()  # PLE sidecar streaming; its hooks must land or the worker stops
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure must stop the worker, see module docstring
        _fatal(f"{type(exc).__name__}: {exc}")
    _registered = True


def _guard_source_state() -> None:
    """Refuse to run on an sglang whose patched files are in an unknown or half-patched state."""
    from ..findings import WARNING, refusal_text
    from ..patching.guard import verdict

    findings = verdict("sglang").findings(allow_unpatched=os.environ.get(ALLOW_UNPATCHED_ENV) == "1")
    for f in findings:
        if f.level == WARNING:
            print(f"sglang-ssd-stream plugin: {f.line()}", file=sys.stderr, flush=True)
    refusal = refusal_text(findings, "refusing to start:")
    if refusal:
        _fatal(refusal)
