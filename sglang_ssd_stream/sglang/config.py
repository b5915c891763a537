"""Which sidecar serves this process, loaded and SHA-256-verified once per process.

The sidecar is used when ``SGLANG_SSD_STREAM_SIDECAR`` names one (its ``ssd-stream.json`` or
directory), else when the model directory (``--model-path``) holds ``ssd-stream.json``.
``SGLANG_SSD_STREAM_SIDECAR=off`` turns the hooks off entirely. The knobs of how rows are read live
here too (validated at plugin start by :func:`validate_env`).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from ..env_numbers import knob_int
from ..sidecar.format import MANIFEST_NAME, SidecarManifest, WeightScale, find_weight_scales
from ..sidecar.prefetch import DEFAULT_WINDOW as DEFAULT_PREFETCH_CHUNKS
from ..sidecar.prefetch import SGLANG_WINDOW_ENV as PREFETCH_ENV
from ..sidecar.row_cache import DEFAULT_BUDGET_MB as DEFAULT_ROW_CACHE_MB
from ..sidecar.row_cache import SGLANG_BUDGET_ENV as ROW_CACHE_ENV
from ..sidecar.verify import VerifyReport, verify_sidecar
from ..sidecar.view import TRUSTED_ROOTS_ENV, env_trusted_roots, load_sidecar  # noqa: F401 - TRUSTED_ROOTS_ENV is a knob

log = logging.getLogger(__name__)

SIDECAR_ENV = "SGLANG_SSD_STREAM_SIDECAR"
NO_VERIFY_ENV = "SGLANG_SSD_STREAM_NO_VERIFY"  # "1": skip the SHA-256 pass (explicit opt-out)
GATHER_MODE_ENV = "SGLANG_SSD_STREAM_PLE_GATHER"  # h2d (default) | uva
# h2d: a copy-engine H2D, then a device kernel; it hid a warm 2,048-token chunk behind a layer to 8-9 % of the
# gather on the H200, where uva (the kernel reads pinned memory, competing with the layer for SMs) left 25-27 %
# (benchmarks/sidecar/ple_adaptive*_h200.json).
DEFAULT_GATHER_MODE = "h2d"
WORKERS_ENV = "SGLANG_SSD_STREAM_READ_WORKERS"
IO_ENV = "SGLANG_SSD_STREAM_IO"  # mmap (default) | pread
# Knobs of earlier versions: refused at start, so nobody believes they still act.
RETIRED_ENV = {
    "SGLANG_SSD_STREAM_SWITCH_INTERVAL_US": "reads captured in CUDA graphs are native host nodes now and need no GIL",
}
MAX_TOKENS_ENV = "SGLANG_SSD_STREAM_PLE_MAX_TOKENS"  # staging size in tokens (default: chunked_prefill_size)
DEFAULT_MAX_TOKENS = 8192
DEFAULT_WORKERS = 16
MAX_WORKERS = 256  # reads in flight per table; 100000 spawned thousands of threads on one cold lookup
MAX_MAX_TOKENS = 1 << 20  # tokens per lookup; far beyond any prefill chunk
# The PLE row cache (sidecar/row_cache.py), ROW_CACHE_ENV: MiB of host memory for ALL PLE layers of this
# process together (rows + metadata + read buffers), split evenly over the layers it binds; 0 turns the cache
# and the prompt-ahead prefetch off (the mapped/pread readers serve, as before). Unset: DEFAULT_ROW_CACHE_MB.
# PREFETCH_ENV: prefill chunks read ahead of the one being computed (sidecar/prefetch.py).


@dataclass(frozen=True)
class Sidecar:
    manifest: SidecarManifest
    scales: dict[int, WeightScale]
    verify: VerifyReport


_lock = threading.Lock()
_loaded: dict[str, Sidecar] = {}


def disabled() -> bool:
    return os.environ.get(SIDECAR_ENV, "").strip().lower() == "off"


def server_model_path() -> str | None:
    """``--model-path`` of this sglang process (None before server args are published)."""
    from sglang.srt.runtime_context import get_context

    try:
        return get_context().server_args.model_path
    except ValueError:  # "Global server args is not set yet!"
        return None


def manifest_path(model_path: str | None) -> Path | None:
    """The sidecar to use, or None when none is configured."""
    if disabled():
        return None
    env = os.environ.get(SIDECAR_ENV)
    if env:
        return Path(env)  # load_manifest refuses a path that does not hold one
    if model_path and (Path(model_path) / MANIFEST_NAME).is_file():
        return Path(model_path) / MANIFEST_NAME
    return None


def load(path: Path) -> Sidecar:
    """Load, check and verify the sidecar at ``path`` (once per process)."""
    key = os.path.abspath(path)
    with _lock:
        if key in _loaded:
            return _loaded[key]
        manifest = load_sidecar(key, extra_roots=env_trusted_roots())
        report = verify_sidecar(manifest, no_verify=os.environ.get(NO_VERIFY_ENV) == "1")
        scales = find_weight_scales(manifest.root)
        sidecar = _loaded[key] = Sidecar(manifest, scales, report)
        log.info("PLE sidecar %s: %d table(s), sha256 %s", manifest.path, len(manifest.tables),
                 ", ".join(f"L{t.layer}={t.status}" for t in report.tables))
        return sidecar


def active() -> Sidecar | None:
    """The sidecar of this process's model, or None."""
    path = manifest_path(server_model_path())
    return None if path is None else load(path)


def env_int(name: str, default: int, lo: int, hi: int) -> int:
    raw = os.environ.get(name)
    return default if raw is None else parse_int(name, raw, lo, hi)


parse_int = knob_int  # the kit's one rule for numeric knobs (env_numbers)


def read_workers() -> int:
    """Reader threads per table (reads in flight on a cold table)."""
    return env_int(WORKERS_ENV, DEFAULT_WORKERS, 1, MAX_WORKERS)


def max_tokens() -> int:
    """Tokens per PLE lookup the staging is sized for."""
    if os.environ.get(MAX_TOKENS_ENV):
        return env_int(MAX_TOKENS_ENV, DEFAULT_MAX_TOKENS, 1, MAX_MAX_TOKENS)
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
    from ..sidecar import IO_MODES

    mode = os.environ.get(IO_ENV, "mmap")
    if mode not in IO_MODES:
        raise ValueError(f"{IO_ENV}={mode!r}: expected one of {', '.join(IO_MODES)}")
    return mode


def row_cache_mb(env=None) -> int:
    """The row cache budget in MiB for all PLE layers of the process (0: off)."""
    from ..sidecar.row_cache import parse_budget_mb

    env = os.environ if env is None else env
    return parse_budget_mb(ROW_CACHE_ENV, env.get(ROW_CACHE_ENV), DEFAULT_ROW_CACHE_MB)


def prefetch_chunks(env=None) -> int:
    """Prefill chunks the prompt-ahead prefetch reads beyond the one being computed."""
    from ..sidecar.prefetch import parse_window

    env = os.environ if env is None else env
    return parse_window(PREFETCH_ENV, env.get(PREFETCH_ENV), DEFAULT_PREFETCH_CHUNKS)


def validate_env() -> None:
    """Refuse bad knob values when the plugin starts rather than at the first model load."""
    for name, why in RETIRED_ENV.items():
        if name in os.environ:
            raise ValueError(f"{name} is no longer used ({why}); unset it")
    io_mode()
    gather_mode()
    read_workers()
    if os.environ.get(MAX_TOKENS_ENV):
        env_int(MAX_TOKENS_ENV, DEFAULT_MAX_TOKENS, 1, MAX_MAX_TOKENS)
    row_cache_mb()
    prefetch_chunks()


def gather_mode() -> str:
    mode = os.environ.get(GATHER_MODE_ENV, DEFAULT_GATHER_MODE)
    if mode not in ("uva", "h2d"):
        raise ValueError(f"{GATHER_MODE_ENV}={mode!r}: expected uva or h2d")
    return mode
