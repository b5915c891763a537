"""SGLang general plugin (entry point ``sglang.srt.plugins: ssd_stream``).

SGLang's ``load_plugins()`` runs ``register()`` in the launcher and in every scheduler process,
and only *logs* an ordinary exception. Every failure here therefore becomes ``SystemExit``: an
engine that runs without our patches or knobs is worse than one that refuses to start.
Module top level is stdlib-only for the same reason (an import error would be logged and ignored).

Each process says on stderr, with its pid, what the guard found and which knobs it applied: the
evidence that the plugin ran in that process (the launcher, each scheduler, the detokenizer).
The PLE hooks are armed for qwen4_exp only (:func:`.hooks.install_for_served_model`): a server of
any other model imports nothing of qwen4_exp on our account.
"""

from __future__ import annotations

import os
import sys

from ..patching.engines import ENGINES  # stdlib-only, like every import at this module's top

ALLOW_UNPATCHED_ENV = ENGINES["sglang"].allow_unpatched_env

_registered = False


def _say(message: str) -> None:
    print(f"sglang-ssd-stream plugin: pid {os.getpid()}: {message}", file=sys.stderr, flush=True)


def _fatal(message: str) -> NoReturn:  # noqa: F821
    # Not printed here: the interpreter (or multiprocessing's bootstrap, in a scheduler process) prints a
    # SystemExit's text once on stderr; printing it too showed every refusal twice.
    raise SystemExit(f"sglang-ssd-stream plugin: {message}")


def register() -> None:
    """Called by sglang.srt.plugins.load_plugins(); idempotent within a process."""
    global _registered
    if _registered:
        return
    try:
        _guard_source_state()
        from . import hooks as ple_hooks
        from . import qsa_budget

        if qsa_budget.apply_qsa_budget() is not None:  # read back from the engine module it set
            module, _, attr = qsa_budget.QSA_BUDGET_TARGET.rpartition(".")
            _say(f"{qsa_budget.QSA_BUDGET_ENV}: {qsa_budget.QSA_BUDGET_TARGET} = "
                 f"{getattr(sys.modules[module], attr) >> 20} MiB")
        if ple_hooks.install_for_served_model():  # PLE sidecar hooks, armed for a qwen4_exp model only
            _say(f"PLE sidecar hooks armed: installed when {ple_hooks.RESOLVE} resolves a qwen4_exp model")
            cfg = ple_hooks.config
            mb = cfg.row_cache_mb()
            _say(f"{cfg.ROW_CACHE_ENV}: {mb} MiB for all PLE layers, prompt-ahead prefetch "
                 f"{cfg.prefetch_chunks()} chunk(s) ahead ({cfg.PREFETCH_ENV})" if mb else
                 f"{cfg.ROW_CACHE_ENV}=0: PLE row cache and prompt-ahead prefetch off")
        else:
            _say(f"PLE sidecar hooks off ({ple_hooks.config.SIDECAR_ENV}=off)")
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure must stop the worker, see module docstring
        _fatal(f"{type(exc).__name__}: {exc}")
    _registered = True


def _guard_source_state() -> None:
    """Refuse to run on an sglang whose patched files are in an unknown or half-patched state."""
    from ..findings import ERROR, refusal_text
    from ..patching.guard import verdict
    from .settings import current

    findings = verdict("sglang").findings(allow_unpatched=current().allow_unpatched)
    for f in findings:
        if f.level != ERROR:
            _say(f.line())
    refusal = refusal_text(findings, "refusing to start:")
    if refusal:
        _fatal(refusal)
