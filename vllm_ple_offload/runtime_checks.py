"""The checks the plugin runs inside vLLM's processes, when the values are known: the sidecar loaded by the one
loader and trust rule, its SHA-256 checked once per process, the locked-memory limit at allocation, the rule on
FULL CUDA graphs. The runtime (activate, embedding) imports these, never the doctor; the doctor reports the same
rules before a launch.
"""

from __future__ import annotations

import os

from sglang_ssd_stream.checks.memory import check_memlock, locked_memory
from sglang_ssd_stream.findings import WARNING, Finding, refusal_text

from . import env
from .errors import PreflightFailed

FULL_GRAPH_MESSAGE = (
    "{backend} PLE backend under FULL CUDA graphs: its captured reads (one pread per row in a CUDA host node) are "
    "not hidden behind a decode layer (0.2-0.9 ms exposed per PLE layer at 256-1,024 rows on an H200); use "
    + env.BACKEND + "=mmap (FULL graphs verified), or start vLLM with --compilation-config "
    "'{{\"cudagraph_mode\": \"PIECEWISE\"}}' (breakable graphs run the lookup eagerly) or --enforce-eager")


def load_sidecar(path: str | os.PathLike, trusted_roots: tuple[str, ...] = ()):
    """The sidecar manifest at ``path`` (``ssd-stream.json`` or its directory), loaded as every vLLM-side
    user loads it (doctor, the plugin's SHA-256 check, the embedding): sizes checked, table links resolving
    only into the artifact, the roots ``VLLM_PLE_TRUSTED_ROOTS`` names (``trusted_roots``) and, for a model
    view, the prepared snapshot it was built from, table for table: the one loader and trust rule of both
    engines (:func:`sglang_ssd_stream.sidecar.view.load_sidecar`)."""
    from sglang_ssd_stream.sidecar.view import extra_trusted_roots
    from sglang_ssd_stream.sidecar.view import load_sidecar as load

    return load(path, extra_roots=extra_trusted_roots(trusted_roots))


def raise_on_errors(findings: list[Finding]) -> None:
    refusal = refusal_text(findings, "PLE preflight failed:")
    if refusal:
        raise PreflightFailed(refusal)


def require_memlock(need_bytes: int, *, what: str) -> None:
    """At allocation time, when the bytes are known: refuse a too-low memlock limit (the floor's check)."""
    raise_on_errors([check_memlock(locked_memory(), need_bytes, what)])


def full_graph_refusal(settings: env.PleSettings, mode) -> str | None:
    """The one rule on CUDA graphs (the embedding's build and the preflight apply it): a streamed
    backend outside :data:`~.env.FULL_GRAPH_BACKENDS` refuses a ``cudagraph_mode`` with FULL graphs.
    ``mode`` is vLLM's ``CUDAGraphMode``."""
    if settings.streaming and settings.backend not in env.FULL_GRAPH_BACKENDS and mode is not None \
            and mode.has_full_cudagraphs():
        return f"cudagraph_mode={mode.name}: " + FULL_GRAPH_MESSAGE.format(backend=settings.backend)
    return None


# ----------------------------------------------------------------------------- sidecar SHA-256


def verify_sidecar_once(settings: env.PleSettings, *, progress: bool = True, caller: str = "report") -> Finding:
    """The sidecar tables' SHA-256, checked once per process by the floor both engines share
    (:func:`sglang_ssd_stream.checks.sidecar.sha_finding`; a later start that finds every table unchanged
    since a success re-reads nothing). ``VLLM_PLE_NO_VERIFY=1`` skips it (a warning). ``caller``: the verified
    cache's rule (:func:`sglang_ssd_stream.sidecar.verify.may_record`): the doctor reports and writes nothing;
    the plugin (:func:`require_verified_sidecar`) serves and records."""
    from sglang_ssd_stream.checks.sidecar import sha_finding
    from sglang_ssd_stream.sidecar.view import extra_trusted_roots

    return sha_finding(settings.sidecar, knob=env.NO_VERIFY, no_verify=settings.no_verify, progress=progress,
                       extra_roots=extra_trusted_roots(settings.trusted_roots), caller=caller)


def require_verified_sidecar(settings: env.PleSettings) -> None:
    """:func:`verify_sidecar_once` as the serving load, raising :class:`PreflightFailed` on a mismatch (the
    plugin's use, where the model is built, before the streamed embedding is swapped in)."""
    import logging

    from sglang_ssd_stream.sidecar.verify import SERVE

    from . import LOGGER_NAME

    found = verify_sidecar_once(settings, caller=SERVE)
    if found.level == WARNING:
        logging.getLogger(LOGGER_NAME).warning("vllm-ple-offload: %s", found.line())
    raise_on_errors([found])
