"""Every ``VLLM_PLE_*`` variable, parsed and validated in this one place (stdlib only).

``VLLM_PLE_CPU_OFFLOAD`` is the switch. Unset (or ``0``) the plugin does nothing at all and vLLM
runs exactly as upstream; then no other ``VLLM_PLE_*`` variable may be set, because a half
configuration would otherwise be ignored silently. ``1`` selects a backend:

``pinned``   the rank's table in page-aligned host memory registered with CUDA (no power-of-two
             rounding), read by vLLM's own UVA lookup kernel; filled from the checkpoint.
``mmap``     the table is the sidecar file, mapped read-only; rows are gathered on the CPU by a
             worker pool from the page cache, staged in pinned memory and copied to the GPU.
``pread``    like ``mmap``, but rows are read with the shared sidecar reader (``preadv``, fixed
             working set) instead of page faults: SGLang's ``SGLANG_SSD_STREAM_IO=pread``.
             (Called ``sidecar`` before; that name is refused with the new one.)

With a streamed backend, ``VLLM_PLE_ROW_CACHE_MB`` (default 1024, 0 = off) is the byte budget of the row
cache (:mod:`sglang_ssd_stream.sidecar.row_cache`) for all PLE layers of a process together, split
evenly per layer, and ``VLLM_PLE_PREFETCH_CHUNKS`` (default 1) the prompt-ahead prefetch window in
prefill chunks beyond the one being computed (:mod:`sglang_ssd_stream.sidecar.prefetch`); prefetch
fills the cache, so it is only set with a cache.

Any unknown ``VLLM_PLE_*`` name is refused (a typo would otherwise be ignored). Numbers and
switches follow one strict rule: ASCII digits only (no sign, space, ``_`` or other scripts' digits).

The plugin (every vLLM process), ``vllm-ple-offload doctor`` and ``serve``'s preflight all parse
with :func:`read_settings`, so the doctor checks exactly the configuration the plugin sees.
vLLM only runs the plugin when its ``VLLM_PLUGINS`` allowlist is unset or names
:data:`PLUGIN_NAME`; :func:`plugin_excluded` reads that list exactly as vLLM 0.33 does
(``os.environ["VLLM_PLUGINS"].split(",")``, nothing stripped).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sglang_ssd_stream.knobs import PREFIX as _PREFIXES
from sglang_ssd_stream.knobs import VLLM, VLLM_KNOBS, KnobError, knob

from .errors import PleSettingsError

# Names, defaults and bounds are declared once, with SGLang's, in sglang_ssd_stream/knobs.py (stdlib only).
PREFIX = _PREFIXES[VLLM]
CPU_OFFLOAD = knob(VLLM, "CPU_OFFLOAD").name
BACKEND = knob(VLLM, "OFFLOAD_BACKEND").name
SIDECAR = knob(VLLM, "SIDECAR").name
FETCH_WORKERS = knob(VLLM, "FETCH_WORKERS").name
ROWS_PER_TASK = knob(VLLM, "ROWS_PER_TASK").name
STATS_INTERVAL = knob(VLLM, "STATS_INTERVAL").name
NO_VERIFY = knob(VLLM, "NO_VERIFY").name  # "1": skip the sidecar's one-time SHA-256 check (explicit opt-out)
TRUSTED_ROOTS = knob(VLLM, "TRUSTED_ROOTS").name  # extra roots a sidecar's table links may resolve into
ALLOW_UNPATCHED = knob(VLLM, "ALLOW_UNPATCHED").name
ROW_CACHE_MB = knob(VLLM, "ROW_CACHE_MB").name
PREFETCH_CHUNKS = knob(VLLM, "PREFETCH_CHUNKS").name
PREFETCH_DRAFTS = knob(VLLM, "PREFETCH_DRAFTS").name
HOT_SHARE_PCT = knob(VLLM, "HOT_SHARE_PCT").name
HOT_INTERVAL_S = knob(VLLM, "HOT_INTERVAL_S").name
KNOWN = tuple(VLLM_KNOBS)
STREAMING_ONLY = (SIDECAR, TRUSTED_ROOTS, FETCH_WORKERS, ROWS_PER_TASK, STATS_INTERVAL, NO_VERIFY, ROW_CACHE_MB,
                  PREFETCH_CHUNKS, PREFETCH_DRAFTS, HOT_SHARE_PCT, HOT_INTERVAL_S)

# vLLM's plugin allowlist and our entry point's name in it (pyproject: vllm.general_plugins).
PLUGINS_ENV = "VLLM_PLUGINS"
PLUGIN_NAME = "ple_offload"

# vLLM's own bound (seconds) on a stop: how long the API server waits for the engine core to end before it kills
# the engine's process tree (SIGKILL), and how long the engine core waits for its workers. vLLM 0.33's default
# (``--shutdown-timeout 0``, this variable unset) waits no time at all, so a worker never reaches its exit, where
# the hot file is written; with the hot file on and the variable unset, the plugin sets STOP_GRACE_S
# (activate.allow_stop_write). A wait ends as soon as the process does: a stop is slower only by the write.
STOP_GRACE_ENV = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"
STOP_GRACE_S = 30  # a whole 1 GiB cache writes in a few seconds; a write cut short leaves the old file

PINNED, MMAP, PREAD = VLLM_KNOBS[BACKEND].choices
BACKENDS = (PINNED, MMAP, PREAD)
STREAMING_BACKENDS = (MMAP, PREAD)
# Streamed backends whose lookups may be captured in FULL CUDA graphs (vLLM 0.33's default is
# FULL_AND_PIECEWISE): bit-exact for both on the H200, but only mmap's captured reads stay hidden behind a
# decode layer; pread's expose 0.2-0.9 ms per PLE layer at 256-1,024 rows (benchmarks/vllm_ple/README.md).
FULL_GRAPH_BACKENDS = (MMAP,)
RENAMED_BACKENDS = {"sidecar": PREAD}  # old name -> new: refused with the new name
DEFAULT_BACKEND = VLLM_KNOBS[BACKEND].default

DEFAULT_FETCH_WORKERS = VLLM_KNOBS[FETCH_WORKERS].default
DEFAULT_ROWS_PER_TASK = VLLM_KNOBS[ROWS_PER_TASK].default
MAX_FETCH_WORKERS = VLLM_KNOBS[FETCH_WORKERS].hi
DEFAULT_ROW_CACHE_MB = VLLM_KNOBS[ROW_CACHE_MB].default  # all PLE layers of a process together
DEFAULT_PREFETCH_CHUNKS = VLLM_KNOBS[PREFETCH_CHUNKS].default
# One fetch round is FETCH_WORKERS x ROWS_PER_TASK rows of one table; the pread backend's page
# buffer holds a whole round (and the mmap backend's index arrays scale with it), per table and
# process. 256 MiB is 34x the Thor default (24 x 2,048 x 160 B = 7.5 MiB).
MAX_FETCH_ROUND_BYTES = 256 << 20


@dataclass(frozen=True)
class PleSettings:
    """The validated configuration; ``None`` from :func:`read_settings` means "plugin off"."""

    backend: str
    sidecar: Path | None  # ssd-stream.json or its directory (mmap/sidecar only)
    fetch_workers: int
    rows_per_task: int
    stats_interval: int  # lookups between timing log lines; 0 = never
    allow_unpatched: bool
    no_verify: bool = False  # skip the sidecar's SHA-256 check (streaming backends only)
    row_cache_mb: int = 0  # row cache budget for all PLE layers of the process (streaming only; 0 = off)
    prefetch_chunks: int = DEFAULT_PREFETCH_CHUNKS  # prompt-ahead window (with a row cache only)
    prefetch_drafts: bool = False  # with MTP: a verify step's rows read as soon as its drafts exist
    hot_share_pct: int = 0  # the hot file's part of each row cache (0: none; with a row cache only, default 100)
    hot_interval_s: int = 600  # seconds between hot-file writes (0: only at a clean shutdown)
    trusted_roots: tuple[str, ...] = ()  # extra roots the sidecar's table links may resolve into

    @property
    def row_cache_bytes(self) -> int:
        return self.row_cache_mb << 20 if self.streaming else 0

    @property
    def prefetch(self) -> bool:
        """Prompt-ahead prefetch runs (it fills the row cache, so only with one)."""
        return self.row_cache_bytes > 0

    @property
    def streaming(self) -> bool:
        return self.backend in STREAMING_BACKENDS

    def describe(self) -> str:
        if not self.streaming:
            return f"backend={self.backend}"
        cache = (f"row_cache={self.row_cache_mb} MiB prefetch_chunks={self.prefetch_chunks}" if self.row_cache_mb
                 else "row_cache=off")
        return (f"backend={self.backend} sidecar={self.sidecar} fetch_workers={self.fetch_workers} "
                f"rows_per_task={self.rows_per_task} {cache}" + (" sha256_check=off" if self.no_verify else ""))


def _read(environ: Mapping[str, str], name: str):
    """The declared knob's value (its default when unset); PleSettingsError naming the knob otherwise."""
    try:
        return VLLM_KNOBS[name].read(environ)
    except KnobError as exc:
        raise PleSettingsError(str(exc)) from None


def present(environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``VLLM_PLE_*`` names set in ``environ`` (sorted)."""
    env = os.environ if environ is None else environ
    return sorted(k for k in env if k.startswith(PREFIX))


def plugin_excluded(environ: Mapping[str, str] | None = None) -> bool:
    """True when vLLM's ``VLLM_PLUGINS`` allowlist is set and does not name our plugin (vLLM 0.33's parse)."""
    env = os.environ if environ is None else environ
    return PLUGINS_ENV in env and PLUGIN_NAME not in env[PLUGINS_ENV].split(",")


def fetch_round_bytes(settings: PleSettings, row_bytes: int) -> int:
    """Bytes of one fetch round of a table with ``row_bytes`` rows (the pread buffer's size)."""
    return settings.fetch_workers * settings.rows_per_task * int(row_bytes)


def read_settings(environ: Mapping[str, str] | None = None) -> PleSettings | None:
    """Parse the ``VLLM_PLE_*`` variables; ``None`` when the plugin is off.

    Raises:
        PleSettingsError: unknown variable, bad value, or variables that contradict each other.
    """
    env = os.environ if environ is None else environ
    names = present(env)
    unknown = [k for k in names if k not in KNOWN]
    if unknown:
        raise PleSettingsError(f"unknown variable(s) {', '.join(unknown)}; known: {', '.join(KNOWN)}")
    switch = env.get(CPU_OFFLOAD)
    others = [k for k in names if k != CPU_OFFLOAD]
    if not _read(env, CPU_OFFLOAD):
        if others:
            state = "unset" if switch is None else "0"
            raise PleSettingsError(f"{', '.join(others)} set while {CPU_OFFLOAD} is {state}; set "
                                   f"{CPU_OFFLOAD}=1 to use them, or unset them for upstream vLLM behaviour")
        return None

    backend = env.get(BACKEND, DEFAULT_BACKEND)
    if backend in RENAMED_BACKENDS:
        raise PleSettingsError(f"{BACKEND}={backend!r} is now called {RENAMED_BACKENDS[backend]!r} (the same reader "
                               f"SGLang calls SGLANG_SSD_STREAM_IO=pread); set {BACKEND}={RENAMED_BACKENDS[backend]}")
    if backend not in BACKENDS:
        raise PleSettingsError(f"{BACKEND}={backend!r} is not a PLE backend; choose one of {', '.join(BACKENDS)}")
    streaming = backend in STREAMING_BACKENDS
    if not streaming:
        extra = [k for k in STREAMING_ONLY if k in env]
        if extra:
            raise PleSettingsError(f"{', '.join(extra)} only apply to the {' and '.join(STREAMING_BACKENDS)} "
                                   f"backends, not to {BACKEND}={backend}")
    sidecar = env.get(SIDECAR)
    if streaming and not sidecar:
        raise PleSettingsError(f"{BACKEND}={backend} needs {SIDECAR}=<path to ssd-stream.json or its directory>"
                               + (" (it is empty)" if sidecar == "" else ""))
    row_cache_mb = _read(env, ROW_CACHE_MB) if streaming else 0
    if row_cache_mb == 0 and PREFETCH_CHUNKS in env:
        raise PleSettingsError(f"{PREFETCH_CHUNKS} set while {ROW_CACHE_MB}=0: prompt-ahead prefetch reads rows into "
                               f"the row cache, which is off; unset {PREFETCH_CHUNKS}, or give the cache a budget")
    # only "on" is refused: the thor profile sets 1, and an operator who turns the cache off must be able to say 0
    if row_cache_mb == 0 and PREFETCH_DRAFTS in env and _read(env, PREFETCH_DRAFTS):
        raise PleSettingsError(f"{PREFETCH_DRAFTS}=1 while {ROW_CACHE_MB}=0: a verify step's rows are read into the "
                               f"row cache, which is off; set {PREFETCH_DRAFTS}=0 (or unset it), or give the cache a "
                               f"budget")
    hot_share_pct = _read(env, HOT_SHARE_PCT)
    if row_cache_mb == 0 and hot_share_pct and HOT_SHARE_PCT in env:
        raise PleSettingsError(f"{HOT_SHARE_PCT}={hot_share_pct} while {ROW_CACHE_MB}=0: the hot file fills the row "
                               f"cache, which is off; unset {HOT_SHARE_PCT}, or give the cache a budget")
    if row_cache_mb == 0:
        hot_share_pct = 0  # the default share needs a cache to fill
    return PleSettings(
        backend=backend,
        sidecar=Path(sidecar) if sidecar else None,
        fetch_workers=_read(env, FETCH_WORKERS),
        rows_per_task=_read(env, ROWS_PER_TASK),
        stats_interval=_read(env, STATS_INTERVAL),
        allow_unpatched=_read(env, ALLOW_UNPATCHED),
        no_verify=_read(env, NO_VERIFY),
        row_cache_mb=row_cache_mb,
        prefetch_chunks=_read(env, PREFETCH_CHUNKS),
        prefetch_drafts=_read(env, PREFETCH_DRAFTS),
        hot_share_pct=hot_share_pct,
        hot_interval_s=_read(env, HOT_INTERVAL_S),
        trusted_roots=tuple(_read(env, TRUSTED_ROOTS) or ()),
    )
