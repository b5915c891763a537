"""The engine's Prometheus multiprocess directory (``PROMETHEUS_MULTIPROC_DIR``) for one start.

Both engines merge their processes' metrics through files in that directory, and both use an exported one as it
is. vLLM 0.33.0 makes its own only with ``--api-server-count`` > 1 (``v1/metrics/prometheus.py``:
``setup_multiprocess_prometheus``, a TemporaryDirectory removed at exit) and warns that a directory the user set
"must be wiped between vLLM runs"; without one, the worker's values (the kit's ``ssd_stream_*`` series among them)
never reach ``/metrics``. So for a side with ``fresh_metrics_dir`` serve makes a new private directory per start
and removes it after the engine ended. sglang 0.5.23 with ``--enable-metrics`` makes a fresh one itself
(``srt/utils/common.py:set_prometheus_multiproc_dir``), but with one exported it writes into that one as it is.

An exported directory is kept (it is what both engines honour), unless it would mislead: a ``*.db`` file there
is an earlier run's values, which ``MultiProcessCollector`` (it reads ``*.db``) adds to this run's counters.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile

from ..findings import ERROR, OK, Finding
from ..ple_metrics.publish import MULTIPROC_ENV

CHECK = "metrics_dir"
PREFIX = "prometheus-multiproc-"


def exported_dir_finding(side, env: dict) -> Finding | None:
    """The verdict on a ``PROMETHEUS_MULTIPROC_DIR`` in the launch's environment (None: none exported)."""
    path = env.get(MULTIPROC_ENV)
    if path is None:
        return None
    unset = (f"unset {MULTIPROC_ENV}: serve makes a fresh private one per start" if side.fresh_metrics_dir
             else f"unset {MULTIPROC_ENV}: {side.display} makes a fresh one per start with --enable-metrics")
    if not path or not os.path.isdir(path):
        return Finding(ERROR, CHECK, f"{MULTIPROC_ENV}={path!r} is not a directory: the engine's /metrics would fail",
                       unset)
    stale = sorted(os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(path), "*.db")))
    if stale:
        return Finding(ERROR, CHECK, f"{MULTIPROC_ENV}={path} holds {len(stale)} metrics file(s) of an earlier run "
                       f"({', '.join(stale[:3])}{', ...' if len(stale) > 3 else ''}): their values would be added "
                       f"to this run's counters", f"{unset}, or empty it before each start")
    return Finding(OK, CHECK, f"{MULTIPROC_ENV}={path} (exported, no earlier run's files): kept")


def needs_fresh_dir(side, env: dict) -> bool:
    return bool(side.fresh_metrics_dir) and MULTIPROC_ENV not in env


@contextlib.contextmanager
def fresh_dir(env: dict):
    """``env`` with ``PROMETHEUS_MULTIPROC_DIR`` set to a new empty directory (mode 0700, in the system's temporary
    directory), removed when the block ends: the engine has ended by then (serve waits for its process group)."""
    path = tempfile.mkdtemp(prefix=PREFIX)
    try:
        yield {**env, MULTIPROC_ENV: path}
    finally:
        shutil.rmtree(path, ignore_errors=True)
