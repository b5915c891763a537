"""Streamed PLE lookup: ids on the device -> rows on the device, through host staging.

Engine-neutral (torch + numpy); the vLLM embedding class in :mod:`.backends` drives it.

``start(ids)``  enqueues a non-blocking D2H copy of the ids into registered host staging and an
                event, and hands the rest to a background thread; it never waits for the GPU.
                The thread waits for the event, deduplicates and sorts the ids on the host
                (``numpy.unique``; the inverse index goes to staging too), refuses ids outside
                the table, and gathers this rank's unique rows from the row source into staging;
                rows of other tensor-parallel ranks are zero.
``finish(out)`` waits for that thread, copies the unique rows and the inverse index to the device
                (non-blocking H2D on the current stream) and expands them in caller order with
                ``index_select`` into ``out``. The engine's all-reduce over the tensor-parallel
                group then assembles full rows.

Staging is reused by the next lookup only after this lookup's H2D has completed (an event the
background thread waits for), so the host never overwrites rows the GPU is still copying.

Timing is split into D2H (from ``start`` until the ids are on the host), gather (the row source,
in the background thread) and H2D (copy + expand; CUDA events on a GPU).

Without CUDA (tests on a CPU machine) staging is ordinary memory, "device" tensors are CPU
tensors and H2D is a host copy; :class:`StreamingGather` logs this once, loudly, because it is
a test mode and not a way to serve.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from sglang_ssd_stream.sidecar.errors import SidecarRowOutOfRange

from . import LOGGER_NAME
from sglang_ssd_stream.staging.host_memory import account, allocate_registered, fmt_bytes, startup_line

log = logging.getLogger(LOGGER_NAME)

_scratch_lock = threading.Lock()
_scratch: dict[tuple, object] = {}


def device_scratch(device, nbytes: int):
    """One device buffer per device for the inverse index and unique rows between H2D and expand.

    Shared by all layers: each layer's H2D and expand run back to back on the same stream, so
    stream order already serialises them. Allocated eagerly (the profile run precedes CUDA-graph
    capture); a larger request replaces it, which is refused while a graph is being captured.
    """
    import torch

    key = str(device)
    with _scratch_lock:
        buf = _scratch.get(key)
        if buf is None or buf.numel() < nbytes:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("PLE device scratch must be allocated before CUDA-graph capture")
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            _scratch[key] = buf
        return buf


@dataclass
class GatherStats:
    lookups: int = 0
    ids: int = 0
    unique: int = 0
    owned: int = 0
    d2h_s: float = 0.0
    gather_s: float = 0.0
    h2d_s: float = 0.0
    h2d_pending: list = field(default_factory=list)  # CUDA (start, end) event pairs not yet read

    def line(self) -> str:
        n = max(self.lookups, 1)
        per_row = self.gather_s / max(self.owned, 1) * 1e6
        return (f"{self.lookups} lookups, {self.ids / n:.0f} ids/lookup, {self.unique / max(self.ids, 1):.1%} unique, "
                f"{self.owned / max(self.unique, 1):.1%} owned; D2H {self.d2h_s / n * 1e3:.3f} ms, gather "
                f"{self.gather_s / n * 1e3:.3f} ms ({per_row:.1f} us/row), H2D {self.h2d_s / n * 1e3:.3f} ms per lookup")


class StreamingGather:
    """Host-staged lookup of one PLE table for one rank (see the module docstring).

    Args:
        source: a row source (:mod:`.row_sources`) for this rank's rows.
        row_bytes: bytes per row.
        max_ids: the most ids one lookup may carry (sizes the staging memory).
        device: where ids arrive and rows are delivered.
        label: for log lines.
        stats_interval: log the timing split every this many lookups (0: never).
    """

    def __init__(self, source, *, row_bytes: int, max_ids: int, device, label: str, stats_interval: int = 0,
                 cuda_host=None):
        import torch

        self.source = source
        self.row_bytes = int(row_bytes)
        self.max_ids = int(max_ids)
        self.device = torch.device(device)
        self.label = label
        self.stats_interval = int(stats_interval)
        self.cuda = self.device.type == "cuda"
        self.stats = GatherStats()
        staging = self.max_ids * (self.row_bytes + 16)
        if self.cuda:
            raw = allocate_registered(staging, label=f"{label} staging", cuda=cuda_host)
            kind = "registered host staging"
        else:
            raw = torch.empty(staging, dtype=torch.uint8)
            kind = "host staging (NOT pinned)"
            log.warning("PLE %s: CUDA is not in use (device %s): staging is ordinary memory and the H2D step is a "
                        "host copy. This is the CPU test mode, not a way to serve.", label, self.device)
        # int64 areas first: their views need 8-byte aligned offsets, which rows of any width keep after them.
        m = self.max_ids
        self._stage_ids = raw[: m * 8].view(torch.int64)  # D2H target: the lookup's ids, caller order
        self._stage_inverse = raw[m * 8: m * 16].view(torch.int64)  # H2D source: position -> unique row
        self._stage_rows = raw[m * 16:].view(m, self.row_bytes)  # H2D source: the unique rows
        self._np_rows = self._stage_rows.numpy()
        self._np_ids = self._stage_ids.numpy()
        self._np_inverse = self._stage_inverse.numpy()
        snap = account(staging_bytes=staging)
        integrated = self.cuda and torch.cuda.get_device_properties(self.device).is_integrated
        log.info("%s; row source %s, working set %s", startup_line(
            label, staging, f"{kind} ({self.max_ids} ids x {self.row_bytes} B)", snap, integrated),
            getattr(source, "kind", type(source).__name__), fmt_bytes(getattr(source, "working_set_bytes", 0)))
        self._driver = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"ple-gather-{label}")
        self._pending = None  # (future, id count) between start() and finish()
        self._staging_free = None  # CUDA event: the last H2D out of staging has completed

    # ------------------------------------------------------------------ lookup

    def start(self, ids) -> None:
        """Begin a lookup of the flat int64 ``ids`` (on ``device``); returns without waiting for the GPU."""
        import torch

        if self._pending is not None:
            raise RuntimeError(f"PLE {self.label}: start() called twice without finish()")
        n = ids.numel()
        if n > self.max_ids:
            raise ValueError(f"PLE {self.label}: a lookup of {n} ids exceeds the staging capacity of {self.max_ids}")
        t0 = time.perf_counter()
        ids_ready = None
        if n:
            # Stream order puts this copy after the previous lookup's H2D, which reads other areas.
            self._stage_ids[:n].copy_(ids.reshape(-1), non_blocking=self.cuda)
            if self.cuda:
                ids_ready = torch.cuda.Event()
                ids_ready.record()
        self.stats.lookups += 1
        self.stats.ids += n
        future = self._driver.submit(self._gather, n, t0, ids_ready, self._staging_free)
        self._pending = (future, n)

    def _gather(self, n: int, t0: float, ids_ready, staging_free) -> int:
        """Background thread: ids -> unique rows + inverse index in staging; returns the unique count."""
        if ids_ready is not None:
            ids_ready.synchronize()
        t1 = time.perf_counter()
        self.stats.d2h_s += t1 - t0
        host_ids = self._np_ids[:n]
        if n and (int(host_ids.min()) < 0 or int(host_ids.max()) >= self.source.total_rows):
            bad = int(host_ids[(host_ids < 0) | (host_ids >= self.source.total_rows)][0])
            raise SidecarRowOutOfRange(
                f"PLE {self.label}: row id {bad} is outside the table, expected 0 <= id < {self.source.total_rows}",
                actual=bad, expected=(0, self.source.total_rows))
        unique, inverse = np.unique(host_ids, return_inverse=True)
        u = unique.size
        lo, hi = (int(x) for x in np.searchsorted(unique, [self.source.vocab_start, self.source.vocab_end]))
        if staging_free is not None:
            staging_free.synchronize()  # the previous lookup's H2D may still read the rows and inverse
        rows = self._np_rows
        rows[:lo] = 0  # other ranks own these rows; the all-reduce adds their bytes
        rows[hi:u] = 0
        if hi > lo:
            self.source.read(unique[lo:hi], rows[lo:hi])
        self._np_inverse[:n] = inverse.reshape(-1)
        self.stats.unique += u
        self.stats.owned += hi - lo
        self.stats.gather_s += time.perf_counter() - t1
        return u

    def finish(self, out) -> None:
        """Deliver the rows of the pending lookup into ``out`` (uint8 ``[n, row_bytes]`` on ``device``)."""
        import torch

        if self._pending is None:
            raise RuntimeError(f"PLE {self.label}: finish() without a pending start()")
        future, n = self._pending
        self._pending = None
        u = future.result()  # re-raises a refused id or a failed read: the lookup fails closed
        if tuple(out.shape) != (n, self.row_bytes) or out.dtype != torch.uint8:
            raise ValueError(f"PLE {self.label}: output must be uint8 [{n}, {self.row_bytes}], "
                             f"got {out.dtype} {tuple(out.shape)}")
        if n == 0:
            return
        scratch = device_scratch(self.device, self.max_ids * (self.row_bytes + 8))
        inverse = scratch[: n * 8].view(torch.int64)
        rows = scratch[self.max_ids * 8: self.max_ids * 8 + u * self.row_bytes].view(u, self.row_bytes)
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            rows.copy_(self._stage_rows[:u], non_blocking=True)
            inverse.copy_(self._stage_inverse[:n], non_blocking=True)
            torch.index_select(rows, 0, inverse, out=out)
            end.record()
            self._staging_free = end
            self.stats.h2d_pending.append((begin, end))
            self._collect_events()
        else:
            t0 = time.perf_counter()
            rows.copy_(self._stage_rows[:u])
            inverse.copy_(self._stage_inverse[:n])
            torch.index_select(rows, 0, inverse, out=out)
            self.stats.h2d_s += time.perf_counter() - t0
        if self.stats_interval and self.stats.lookups % self.stats_interval == 0:
            log.info("PLE %s: %s", self.label, self.stats.line())

    def _collect_events(self) -> None:
        keep = []
        for begin, end in self.stats.h2d_pending:
            if end.query():
                self.stats.h2d_s += begin.elapsed_time(end) / 1e3
            else:
                keep.append((begin, end))
        self.stats.h2d_pending = keep

    def close(self) -> None:
        self._driver.shutdown(wait=True)
        self.source.close()
