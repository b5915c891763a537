"""The SGLang side's knobs, parsed once into a frozen :class:`Settings` (as vLLM's ``PleSettings``).

Names, defaults and bounds come from the one declaration (:mod:`sglang_ssd_stream.knobs`). The plugin parses
at start in every process and stops on the first refusal, naming the knob; the hooks read :func:`current`,
which parses again only when the process's ``SGLANG_SSD_STREAM_*`` / ``SGLANG_QSA_*`` variables changed (tests
and an embedding application may set them after import). A ``SGLANG_SSD_STREAM_*`` name that is not declared is
refused, as vLLM's plugin refuses an unknown ``VLLM_PLE_*``: a typo would otherwise be ignored.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from .. import knobs
from ..knobs import PREFIX, SGLANG, KnobError

K = knobs.SGLANG_KNOBS
_k = knobs.knob
SIDECAR = _k(SGLANG, "SIDECAR")
NO_VERIFY = _k(SGLANG, "NO_VERIFY")
IO = _k(SGLANG, "IO")
READ_WORKERS = _k(SGLANG, "READ_WORKERS")
PLE_MAX_TOKENS = _k(SGLANG, "PLE_MAX_TOKENS")
PLE_GATHER = _k(SGLANG, "PLE_GATHER")
ROW_CACHE_MB = _k(SGLANG, "ROW_CACHE_MB")
PREFETCH_CHUNKS = _k(SGLANG, "PREFETCH_CHUNKS")
PREFETCH_DRAFTS = _k(SGLANG, "PREFETCH_DRAFTS")
HOT_SHARE_PCT = _k(SGLANG, "HOT_SHARE_PCT")
HOT_INTERVAL_S = _k(SGLANG, "HOT_INTERVAL_S")
TRUSTED_ROOTS = _k(SGLANG, "TRUSTED_ROOTS")
ALLOW_UNPATCHED = _k(SGLANG, "ALLOW_UNPATCHED")
QSA_BUDGET = K["SGLANG_QSA_PREFILL_LOGITS_BUDGET_MB"]
_PREFIXES = (PREFIX[SGLANG], "SGLANG_QSA_")


@dataclass(frozen=True)
class Settings:
    sidecar: str | None  # the variable's path (None: the model directory's ssd-stream.json, if any)
    sidecar_off: bool  # SGLANG_SSD_STREAM_SIDECAR=off: the PLE hooks stay off
    no_verify: bool
    io: str  # mmap | pread
    read_workers: int
    ple_max_tokens: int | None  # None: the prefill chunk size
    gather: str  # h2d | uva
    row_cache_mb: int  # 0: no row cache and no prefetch
    prefetch_chunks: int
    prefetch_drafts: bool  # with MTP: a verify step's rows read as soon as its drafts exist
    hot_share_pct: int  # 0: no hot file
    hot_interval_s: int
    trusted_roots: tuple[str, ...]
    allow_unpatched: bool
    qsa_budget_mb: int | None  # None: upstream's budget kept


def refusals(environ: Mapping[str, str]) -> list[str]:
    """Every refused value, unknown name and retired knob in ``environ`` (the doctor lists them all)."""
    # only the kit's own namespace: SGLANG_QSA_* is sglang's too, and a later release may add its own there
    unknown = sorted(n for n in environ if n.startswith(PREFIX[SGLANG]) and n not in K
                     and n not in {r.name for r in knobs.RETIRED[SGLANG]})
    out = [f"unknown variable(s) {', '.join(unknown)}; known: {', '.join(K)}"] if unknown else []
    return out + knobs.refusals(SGLANG, environ)


def read_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Parse the SGLang side's knobs. Raises KnobError naming the first refused one."""
    env = os.environ if environ is None else environ
    bad = refusals(env)
    if bad:
        raise KnobError(bad[0])
    raw_sidecar = env.get(SIDECAR.name)
    off = (raw_sidecar or "").strip().lower() == "off"
    return Settings(
        sidecar=None if off or not raw_sidecar else raw_sidecar, sidecar_off=off,
        no_verify=NO_VERIFY.read(env), io=IO.read(env), read_workers=READ_WORKERS.read(env),
        ple_max_tokens=PLE_MAX_TOKENS.read(env),
        gather=PLE_GATHER.read(env), row_cache_mb=ROW_CACHE_MB.read(env), prefetch_chunks=PREFETCH_CHUNKS.read(env),
        prefetch_drafts=PREFETCH_DRAFTS.read(env),
        hot_share_pct=HOT_SHARE_PCT.read(env), hot_interval_s=HOT_INTERVAL_S.read(env),
        trusted_roots=TRUSTED_ROOTS.read(env) or (), allow_unpatched=ALLOW_UNPATCHED.read(env),
        qsa_budget_mb=QSA_BUDGET.read(env))


_lock = threading.Lock()
_cached: tuple[tuple, Settings] | None = None


def current() -> Settings:
    """This process's settings, parsed once per set of values."""
    global _cached
    key = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_PREFIXES)))
    with _lock:
        if _cached is None or _cached[0] != key:
            _cached = (key, read_settings(dict(key)))
        return _cached[1]
