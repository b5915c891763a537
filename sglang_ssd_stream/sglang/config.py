"""Which sidecar serves this process, loaded and SHA-256-verified once per process.

The sidecar is used when ``SGLANG_SSD_STREAM_SIDECAR`` names one (its ``ssd-stream.json`` or
directory), else when the model directory (``--model-path``) holds ``ssd-stream.json``.
``SGLANG_SSD_STREAM_SIDECAR=off`` turns the hooks off entirely. The knobs of how rows are read live
here too (validated at plugin start by :func:`validate_env`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ..checks.sidecar import load_verified
from ..sidecar.format import MANIFEST_NAME, SidecarManifest, WeightScale, find_weight_scales
from ..sidecar.verify import SERVE, VerifyReport
from ..sidecar.view import extra_trusted_roots
from . import settings

log = logging.getLogger(__name__)

# The knobs' names, for messages (declared in sglang_ssd_stream/knobs.py).
SIDECAR_ENV = settings.SIDECAR.name
NO_VERIFY_ENV = settings.NO_VERIFY.name
GATHER_MODE_ENV = settings.PLE_GATHER.name
WORKERS_ENV = settings.READ_WORKERS.name
IO_ENV = settings.IO.name
MAX_TOKENS_ENV = settings.PLE_MAX_TOKENS.name
ROW_CACHE_ENV = settings.ROW_CACHE_MB.name
PREFETCH_ENV = settings.PREFETCH_CHUNKS.name
DEFAULT_MAX_TOKENS = 8192  # staging tokens without --chunked-prefill-size


@dataclass(frozen=True)
class Sidecar:
    manifest: SidecarManifest
    scales: dict[int, WeightScale]
    verify: VerifyReport


def disabled() -> bool:
    return settings.current().sidecar_off


def server_model_path() -> str | None:
    """``--model-path`` of this sglang process (None before server args are published)."""
    from sglang.srt.runtime_context import get_context

    try:
        return get_context().server_args.model_path
    except ValueError:  # "Global server args is not set yet!"
        return None


def manifest_path(model_path: str | None) -> Path | None:
    """The sidecar to use, or None when none is configured."""
    s = settings.current()
    if s.sidecar_off:
        return None
    if s.sidecar:
        return Path(s.sidecar)  # load_manifest refuses a path that does not hold one
    if model_path and (Path(model_path) / MANIFEST_NAME).is_file():
        return Path(model_path) / MANIFEST_NAME
    return None


def load(path: Path) -> Sidecar:
    """Load, check and verify the sidecar at ``path`` (once per process: the floor's cache, checks/sidecar.py)."""
    s = settings.current()
    verified = load_verified(path, extra_roots=extra_trusted_roots(s.trusted_roots), no_verify=s.no_verify,
                             caller=SERVE)  # the serving load: records a success in the verified cache
    manifest, report = verified.manifest, verified.report
    first = manifest.root not in _scales
    sidecar = Sidecar(manifest, _weight_scales(manifest.root), report)
    if first:
        log.info("PLE sidecar %s: %d table(s), sha256 %s", manifest.path, len(manifest.tables),
                 ", ".join(f"L{t.layer}={t.status}" for t in report.tables))
    return sidecar


_scales: dict = {}


def _weight_scales(root) -> dict[int, WeightScale]:
    if root not in _scales:
        _scales[root] = find_weight_scales(root)
    return _scales[root]


def active() -> Sidecar | None:
    """The sidecar of this process's model, or None."""
    path = manifest_path(server_model_path())
    return None if path is None else load(path)


def read_workers() -> int:
    """Reader threads per table (reads in flight on a cold table)."""
    return settings.current().read_workers


def max_tokens() -> int:
    """Tokens per PLE lookup the staging is sized for."""
    explicit = settings.current().ple_max_tokens
    if explicit is not None:
        return explicit
    from sglang.srt.runtime_context import get_context

    try:
        chunk = get_context().server_args.chunked_prefill_size
    except ValueError:
        chunk = None
    return int(chunk) if chunk and int(chunk) > 0 else DEFAULT_MAX_TOKENS


def chunk_tokens() -> int:
    """sglang's prefill chunk (``--chunked-prefill-size``); without chunking, the staging size."""
    from sglang.srt.runtime_context import get_context

    try:
        chunk = get_context().server_args.chunked_prefill_size
    except ValueError:
        chunk = None
    return int(chunk) if chunk and int(chunk) > 0 else max_tokens()


def graphs_enabled() -> bool:
    """Whether sglang may capture CUDA graphs (decode, or prefill token buckets) in this process.

    The graph slot is then sized like the eager staging (a whole chunk): sglang 0.5.23 resolves
    graph batch sizes per phase and model late, and a captured lookup larger than the slot is
    refused at capture time (startup), never served."""
    from sglang.srt.runtime_context import get_context

    try:
        args = get_context().server_args
    except ValueError:
        return True
    return not getattr(args, "disable_cuda_graph", False)


def io_mode() -> str:
    return settings.current().io


def row_cache_mb() -> int:
    """The row cache budget in MiB for all PLE layers of the process (0: off)."""
    return settings.current().row_cache_mb


def prefetch_chunks() -> int:
    """Prefill chunks the prompt-ahead prefetch reads beyond the one being computed."""
    return settings.current().prefetch_chunks


def validate_env() -> None:
    """Refuse bad knob values when the plugin starts rather than at the first model load."""
    settings.current()


def gather_mode() -> str:
    return settings.current().gather
