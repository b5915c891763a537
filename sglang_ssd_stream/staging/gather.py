"""Staged PLE gather: ids on the device → sidecar rows in fixed pinned host memory → rows on the device.

One :class:`SidecarGather` per PLE table and rank; both engines drive it. What it delivers
(``output``):

- ``"bf16"`` (SGLang): rows converted to BF16 by :mod:`.kernels`; ``mode`` ``uva`` reads the
  pinned slot from the kernel (zero-copy), ``h2d`` copies it to a device slot first;
- ``"raw"`` (vLLM): the rows' bytes as they are (FP8 or BF16, the engine's lookup dtype; other
  ranks' rows zero for its ETP all-reduce), copied by an H2D copy straight into the caller's
  buffer (``mode`` must be ``h2d``: no kernel is involved).

Eager protocol (SGLang's ``Qwen4ExpPLELayer.start_prefetch`` and vLLM's ``start_prefetch`` for
layer i+1 while layer i runs):

1. ``begin(ids, out, stream)`` (on the prefetch stream, which already waits for the ids'
   producer): async D2H copy of the ids into pinned memory + an event, nothing else; a worker
   thread waits for that event (and for the previous lookup's delivery to have left the slot),
   reads the rows with the row source straight into the pinned slot (``preadv``/``memcpy``
   release the GIL) and enqueues the delivery on ``stream``. ``begin`` never waits for the GPU.
2. ``wait()`` before anyone waits on ``stream`` (the consumer); it re-raises the worker's error
   (an id outside the table, a failed read): the delivery was then never enqueued, so ``out`` is
   untouched.

CUDA graphs: inside capture, ``capture(ids, out, stream)`` records the same pipeline as graph
nodes on ``stream``: a D2H copy of the ids into a pinned graph slot, a *host node*
(``cuLaunchHostFunc``) that reads the rows when a replay reaches it, and the delivery (conversion
kernel, or H2D copy). The ids are computed inside the graph, so nothing runs on the host before a
replay. The host node is native code (:mod:`.native_read`): a host node must not call CUDA nor
wait for the GIL, and Python in one did both. A read that fails inside a replay cannot raise into
the graph: the host node prints the error and ends the process (the rows of that step would be
wrong). ``capture_wait``/``launch_for_replay`` remain for graphs whose ids are known on the host
before replay.

Row sources: ``reader`` is anything with the readers' contract (``read_rows(ids, out)`` for any
order and duplicates, other ranks' rows zero, ids outside the table refused before anything is
written; ``row_bytes``, ``table``, ``working_set_bytes``, ``close()``):
:func:`~sglang_ssd_stream.sidecar.open_reader` gives the mapped or the ``pread`` reader. The
captured read is made by ``host_read(reader, ids, rows, what=...)`` (default:
:func:`.native_read.captured_read` for those two readers), so another source (a row cache) brings
its own host function without touching the gather.

Memory: the slots are fixed at construction (addresses never change: CUDA-graph safe) in one
page-aligned CUDA-registered allocation (:mod:`.host_memory`, exact size, in the process's PLE
account): ``capacity_rows × (row_bytes + 8)`` for eager lookups, the same for ``graph_rows``
(+ device slots for ``h2d`` BF16), plus the reader's working set.

On a CPU-only machine (tests) ``begin`` runs synchronously, with the same staging, checks and
delivery (the conversion kernel under ``TRITON_INTERPRET=1``); ``capture`` runs there too when
the test stands in for ``cuLaunchHostFunc`` (:mod:`.hostfunc`) by running the host node at once.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from . import LOGGER_NAME
from .kernels import convert_staged_rows

MODES = ("uva", "h2d")
OUTPUTS = ("bf16", "raw")

log = logging.getLogger(LOGGER_NAME)


class StagingCapacityError(ValueError):
    """A lookup needs more rows than the fixed staging holds."""


@dataclass
class GatherStats:
    """Eager lookups (host side) and captured reads of one gather."""

    lookups: int = 0
    rows: int = 0
    ids_wait_s: float = 0.0  # worker: from begin() until the ids (and the slot) were ready
    read_s: float = 0.0  # worker: the row source's read
    captured: int = 0  # reads captured into CUDA graphs

    def line(self) -> str:
        n = max(self.lookups, 1)
        return (f"{self.lookups} eager lookups, {self.rows / n:.0f} rows each; per lookup: ids wait "
                f"{self.ids_wait_s / n * 1e3:.3f} ms, read {self.read_s / n * 1e3:.3f} ms "
                f"({self.read_s / max(self.rows, 1) * 1e6:.2f} us/row); {self.captured} captured reads")


def _capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is being captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_ids(ids: torch.Tensor) -> torch.Tensor:
    """``ids`` flattened, if they are int64: other dtypes are refused (a copy into the int64 staging
    would truncate floating-point ids silently)."""
    if ids.dtype != torch.int64:
        why = " (floating-point ids are refused, not truncated)" if ids.dtype.is_floating_point else ""
        raise TypeError(f"PLE row ids must be int64, got {ids.dtype}{why}")
    return ids.reshape(-1)


class SidecarGather:
    """Stages the rows of one PLE table for one rank (see the module docstring).

    Args:
        reader: the row source (this rank's range, ``read_rows`` contract).
        columns, is_fp8: the table's element type and width (the BF16 conversion needs them).
        capacity_rows: the most rows one eager lookup may carry; graph_rows: one captured lookup
            (0: no graph slot).
        device: where ids arrive and rows are delivered.
        mode, output: how rows reach the device (module docstring).
        host_read: ``host_read(reader, ids, rows, what=...)`` makes the captured read (a host node
            with ``function``, ``argument``, ``close()``); default the native read.
        capacity_hint: appended to capacity refusals (the engine's knob for a larger staging).
    """

    def __init__(self, reader, *, columns: int, is_fp8: bool, capacity_rows: int,
                 device: torch.device | str, mode: str = "uva", graph_rows: int = 0, output: str = "bf16",
                 host_read=None, capacity_hint: str = ""):
        if mode not in MODES:
            raise ValueError(f"PLE gather mode {mode!r}: expected one of {MODES}")
        if output not in OUTPUTS:
            raise ValueError(f"PLE gather output {output!r}: expected one of {OUTPUTS}")
        if output == "raw" and mode != "h2d":
            raise ValueError("raw PLE rows are delivered by an H2D copy: use mode 'h2d'")
        if reader.row_bytes != columns * (1 if is_fp8 else 2):
            raise ValueError(f"reader rows are {reader.row_bytes} B, expected {columns} "
                             f"{'fp8' if is_fp8 else 'bf16'} columns")
        self.reader, self.columns, self.is_fp8, self.mode, self.output = (
            reader, int(columns), bool(is_fp8), mode, output)
        self.row_bytes = int(reader.row_bytes)
        self.capacity_rows = int(capacity_rows)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())  # compared with tensors' devices
        self.capacity_hint = capacity_hint  # the engine's knob for a larger staging, named in refusals
        self.graph_rows = int(graph_rows)  # a CPU box has no graphs, but tests drive capture() there
        self.layer = getattr(getattr(reader, "table", None), "layer", "?")
        self.stats = GatherStats()
        # read(seconds), waited(seconds), refused(exc) of each eager lookup: the kit's metrics
        # (:class:`..ple_metrics.publish.LayerPublisher`); None: nothing is told
        self.observer = None
        self._host_read = host_read
        self._host_nodes: list = []  # captured reads referenced by graphs: keep them alive

        # One host allocation, int64 areas first (8-byte aligned views whatever the row width):
        # eager ids | graph ids | eager rows | graph rows.
        cap, gr, rb = self.capacity_rows, self.graph_rows, self.row_bytes
        nbytes = (cap + gr) * (8 + rb)
        if self.cuda:
            from .host_memory import account, allocate_registered, startup_line

            raw = allocate_registered(nbytes, label=f"PLE layer {self.layer} staging")
            snap = account(staging_bytes=nbytes)
            integrated = torch.cuda.get_device_properties(self.device).is_integrated
            log.info("%s", startup_line(f"layer {self.layer} staging", nbytes,
                                        f"registered host staging ({cap} + {gr} graph rows x {rb} B)", snap,
                                        integrated))
        else:
            raw = torch.zeros(nbytes, dtype=torch.uint8)
        self._host = raw  # keeps the registration alive
        self.ids_host = raw[: cap * 8].view(torch.int64)
        self.graph_ids = raw[cap * 8: (cap + gr) * 8].view(torch.int64)
        rows_at = (cap + gr) * 8
        self.rows_host = raw[rows_at: rows_at + cap * rb].view(cap, rb)
        self.graph_rows_host = raw[rows_at + cap * rb: rows_at + (cap + gr) * rb].view(gr, rb)
        self._ids_np = self.ids_host.numpy()
        self._rows_np = self.rows_host.numpy()
        device_slot = self.cuda and mode == "h2d" and output == "bf16"  # raw rows go straight into `out`
        self.rows_device = torch.empty((cap, rb), dtype=torch.uint8, device=self.device) if device_slot else None
        self.graph_rows_device = torch.empty((gr, rb), dtype=torch.uint8, device=self.device) if device_slot else None
        if self.graph_rows > 0 and host_read is None:
            from .native_read import load

            load()  # compile/load the host-node library now: at startup (a broken compiler stops the model load)
        self._pending: concurrent.futures.Future | None = None
        if self.cuda:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"ple-stage-L{self.layer}")
            self._ids_ready = torch.cuda.Event()
            self._slot_free = torch.cuda.Event()
            self._slot_used = False

    @property
    def pinned_bytes(self) -> int:
        return self._host.numel()

    @property
    def working_set_bytes(self) -> int:
        """Fixed host memory: pinned staging plus the reader's working set."""
        return self.pinned_bytes + self.reader.working_set_bytes

    # ------------------------------------------------------------------ checks

    def _check(self, n: int, out: torch.Tensor) -> None:
        if n > self.capacity_rows:
            raise StagingCapacityError(
                f"PLE lookup needs {n} rows but the sidecar staging holds {self.capacity_rows} "
                f"(sized from the largest batch × 16 rows per token){self.capacity_hint}")
        self._check_out(n, out)

    def _check_out(self, n: int, out: torch.Tensor) -> None:
        if self.output == "raw":
            shape, dtype = (n, self.row_bytes), torch.uint8
        else:
            shape, dtype = (n, self.columns), torch.bfloat16
        if tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous() or out.device != self.device:
            raise ValueError(f"PLE output must be contiguous {dtype} {list(shape)} on {self.device}, "
                             f"got {out.dtype} {list(out.shape)} on {out.device}")

    # ------------------------------------------------------------------ delivery

    def _deliver(self, src: torch.Tensor, device_slot: torch.Tensor | None, out: torch.Tensor) -> None:
        """Staged rows ``src`` (pinned) → ``out``, on the current stream."""
        n = out.shape[0]
        if self.output == "raw":
            out.copy_(src, non_blocking=self.cuda)
            return
        if device_slot is not None:
            device_slot[:n].copy_(src, non_blocking=True)
            src = device_slot[:n]
        convert_staged_rows(src, out, is_fp8=self.is_fp8)

    def _stage_and_deliver(self, n: int, out: torch.Tensor) -> float:
        t = time.perf_counter()
        self.reader.read_rows(self._ids_np[:n], self._rows_np[:n])
        seconds = time.perf_counter() - t
        self.stats.read_s += seconds
        if self.observer is not None:
            self.observer.read(seconds)
        self._deliver(self.rows_host[:n], self.rows_device, out)
        return seconds

    # ------------------------------------------------------------------ eager

    def begin(self, ids: torch.Tensor, out: torch.Tensor, stream: torch.cuda.Stream | None = None) -> None:
        """Start gathering rows ``ids`` (int64 on ``self.device``) into ``out`` on ``stream``."""
        ids = check_ids(ids)
        n = ids.numel()
        self._check(n, out)
        self.wait()
        self.stats.lookups += 1
        self.stats.rows += n
        if not self.cuda:
            self._ids_np[:n] = ids.numpy()
            try:
                seconds = self._stage_and_deliver(n, out)
            except Exception as exc:
                self._refused(exc)
                raise
            if self.observer is not None:  # synchronous here: the forward waited for the whole read
                self.observer.waited(seconds)
            return
        if n == 0:
            return
        stream = stream or torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            self.ids_host[:n].copy_(ids, non_blocking=True)
            self._ids_ready.record(stream)
        self._slot_busy, self._begun = self._slot_used, time.perf_counter()  # for _work: one lookup at a time
        self._pending = self._executor.submit(self._work, n, out, stream)
        self._slot_used = True

    def _work(self, n: int, out: torch.Tensor, stream) -> None:
        self._ids_ready.synchronize()
        if self._slot_busy:
            self._slot_free.synchronize()  # the previous delivery may still read the slot
        self.stats.ids_wait_s += time.perf_counter() - self._begun
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            self._stage_and_deliver(n, out)
            self._slot_free.record(stream)

    def wait(self) -> None:
        """Block until the last ``begin`` has enqueued its delivery; re-raises its error."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        t = time.perf_counter()
        try:
            pending.result()
        except Exception as exc:
            self._refused(exc)
            raise
        if self.observer is not None:
            self.observer.waited(time.perf_counter() - t)

    def _refused(self, exc: BaseException) -> None:
        if self.observer is not None:
            self.observer.refused(exc)

    # ------------------------------------------------------------------ a prefetch on a side stream

    def prefetch(self, ids: torch.Tensor, out: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        """Start a lookup on the prefetch ``stream`` (None on a CPU box), which first waits for the
        current stream (the ids' producer): :meth:`capture` when the current stream is being captured
        into a CUDA graph, else :meth:`begin`. :meth:`join` ends it. vLLM's streamed backends use
        this pair; the GPU proof (``scripts/gpu/vllm_ple_stream_h200.py``) runs the same two calls."""
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            ids.record_stream(stream)  # the D2H copy on `stream` still reads the ids
        if _capturing(self.device):
            self.capture(ids, out, stream)
        else:
            self.begin(ids, out, stream)

    def join(self, stream: torch.cuda.Stream | None) -> None:
        """End a :meth:`prefetch`: its delivery is enqueued (or its error raised) and the current
        stream waits for ``stream``. Inside a capture both are graph dependencies only."""
        self.wait()
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)

    # ------------------------------------------------------------------ CUDA graphs

    def capture(self, ids: torch.Tensor, out: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """Inside CUDA-graph capture on ``stream``: D2H of ``ids`` -> host node reading the rows ->
        delivery into ``out``, all replayed by the graph (see the module docstring)."""
        from .hostfunc import launch_native_host_func

        ids = check_ids(ids)
        n = ids.numel()
        if n > self.graph_rows:
            raise StagingCapacityError(
                f"a captured PLE lookup needs {n} rows but the graph slot holds {self.graph_rows} "
                f"(sized from the largest captured batch × 16 rows per token){self.capacity_hint}")
        self._check_out(n, out)
        if n == 0:
            return
        host_read = self._host_read
        if host_read is None:
            from .native_read import captured_read as host_read
        node = host_read(self.reader, self.graph_ids.numpy()[:n], self.graph_rows_host.numpy()[:n],
                         what=f"PLE layer {self.layer} sidecar read")
        with torch.cuda.stream(stream):
            self.graph_ids[:n].copy_(ids, non_blocking=True)
            launch_native_host_func(stream, node)
            self._host_nodes.append(node)
            self._deliver(self.graph_rows_host[:n], self.graph_rows_device, out)
        self.stats.captured += 1

    @staticmethod
    def capture_wait(event: torch.cuda.Event, stream: torch.cuda.Stream | None = None) -> None:
        """Inside capture: make the graph wait for an event recorded before each replay."""
        (stream or torch.cuda.current_stream()).wait_event(event)

    def launch_for_replay(self, ids_host: np.ndarray, out: torch.Tensor, stream: torch.cuda.Stream,
                          event: torch.cuda.Event) -> None:
        """Outside capture, before replay: fill ``out`` (the graph's fixed buffer) and record ``event``."""
        n = len(ids_host)
        self._check(n, out)
        self.wait()
        if self._slot_used:
            self._slot_free.synchronize()
        self._ids_np[:n] = ids_host
        with torch.cuda.stream(stream):
            self._stage_and_deliver(n, out)
            self._slot_free.record(stream)
            event.record(stream)
        self._slot_used = True

    def close(self) -> None:
        try:
            self.wait()
        finally:
            for node in self._host_nodes:  # a replay after this ends the process with a message
                node.close()
            if self.cuda:
                self._executor.shutdown(wait=True)
            self.reader.close()
