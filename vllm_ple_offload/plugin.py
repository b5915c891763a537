"""vLLM general plugin (entry point ``vllm.general_plugins: ple_offload``).

vLLM runs ``register()`` in every process it starts (CLI/API server, engine core, each worker,
the model-inspection subprocess), before the worker builds the model. Its loader only *logs* an
exception raised while importing this module, so the top level is stdlib-only; an exception
raised inside ``register()`` propagates, and every failure here becomes ``SystemExit`` so the
process stops instead of serving without the configured PLE backend.

The refusal is printed once, by whoever ends the process: the interpreter for the CLI/API
server process, Python's ``multiprocessing`` bootstrap for the engine-core and worker processes
(both re-raise ``SystemExit``; the bootstrap writes a string code to stderr). So ``_fatal`` raises
and never prints itself.

With ``VLLM_PLE_CPU_OFFLOAD`` unset (or 0) and no other ``VLLM_PLE_*`` variable, ``register()``
returns before importing anything: vLLM behaves exactly as upstream.
"""

from __future__ import annotations

_registered = False


def _fatal(message: str) -> NoReturn:  # noqa: F821
    raise SystemExit(f"vllm-ple-offload plugin: {message}")


def register() -> None:
    """Called by ``vllm.plugins.load_general_plugins()``; idempotent within a process."""
    global _registered
    if _registered:
        return
    try:
        from .env import read_settings

        settings = read_settings()
        if settings is not None:
            from .activate import activate

            activate(settings)
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure must stop the process, see the docstring
        _fatal(f"{type(exc).__name__}: {getattr(exc, 'message', exc)}")
    _registered = True
