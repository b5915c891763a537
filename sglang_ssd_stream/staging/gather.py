"""Staged PLE gather: ids → sidecar rows in fixed pinned host memory → bf16 rows on the GPU.

One :class:`SidecarGather` per PLE embedding (per TP rank). Eager protocol, as SGLang's
``Qwen4ExpPLELayer.start_prefetch`` drives it for layer i+1 while layer i runs:

1. ``begin(ids, out, stream)`` (on the prefetch side stream, which already waits for the ids'
   producer): async D2H copy of the ids into a pinned buffer + event; a worker thread then waits
   for that event, reads the rows with :class:`~sglang_ssd_stream.sidecar.reader.SidecarReader`
   straight into the pinned staging slot (``preadv`` releases the GIL) and launches the
   conversion on ``stream``: mode ``uva`` reads the pinned slot from the kernel (zero-copy);
   mode ``h2d`` copies it to a device slot first and converts from there.
2. ``wait()`` before anyone waits on ``stream`` (the consumer); it re-raises reader errors.

The slot is reused only after the previous conversion finished on the GPU (an event), so the
working set is fixed: ``capacity_rows × (row_bytes + 8)`` pinned bytes, the same again for the
graph slot when graphs are on (+ device copies for ``h2d``), plus the reader's buffer. Addresses
never change (CUDA-graph safe).

CUDA graphs (sglang captures its decode steps, the PLE gather included): inside capture,
``capture(ids, out, stream)`` records the same pipeline as graph nodes on ``stream``: a D2H copy of
the ids into pinned memory, a *host node* (``cuLaunchHostFunc``) that reads the rows into a
separate pinned graph slot when a replay reaches it, and the conversion kernel. The ids are
computed inside the graph, so nothing has to run before a replay. The host node is native code
(:mod:`.native_read`): a host node must not call CUDA nor wait for the GIL, and Python in one did
both. A read that fails inside a replay cannot raise into the graph: the host node prints the
error and ends the process (the rows of that step would be wrong). ``capture_wait``/``launch_for_replay`` remain for graphs whose
ids are known on the host before replay.

On a CPU-only machine (tests) ``begin`` runs synchronously, with the same staging and kernel
(``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np
import torch

from ..sidecar.reader import SidecarReader
from .kernels import convert_staged_rows

MODES = ("uva", "h2d")


class StagingCapacityError(ValueError):
    """A lookup needs more rows than the fixed staging holds."""


class SidecarGather:
    def __init__(self, reader: SidecarReader, *, columns: int, is_fp8: bool, capacity_rows: int,
                 device: torch.device | str, mode: str = "uva", graph_rows: int = 0):
        if mode not in MODES:
            raise ValueError(f"PLE gather mode {mode!r}: expected one of {MODES}")
        if reader.row_bytes != columns * (1 if is_fp8 else 2):
            raise ValueError(f"reader rows are {reader.row_bytes} B, expected {columns} {'fp8' if is_fp8 else 'bf16'} columns")
        self.reader, self.columns, self.is_fp8, self.mode = reader, int(columns), bool(is_fp8), mode
        self.capacity_rows = int(capacity_rows)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        pin = self.cuda
        self.ids_host = torch.empty(self.capacity_rows, dtype=torch.int64, pin_memory=pin)
        self.rows_host = torch.zeros((self.capacity_rows, reader.row_bytes), dtype=torch.uint8, pin_memory=pin)
        self._ids_np = self.ids_host.numpy()
        self._rows_np = self.rows_host.numpy()
        self.rows_device = (torch.empty((self.capacity_rows, reader.row_bytes), dtype=torch.uint8, device=self.device)
                            if self.cuda and mode == "h2d" else None)
        # A separate slot for captured graphs: a replay's host node writes it in stream order, with
        # no event the eager path could wait for.
        self.graph_rows = int(graph_rows) if self.cuda else 0
        self.graph_ids = torch.empty(self.graph_rows, dtype=torch.int64, pin_memory=pin)
        self.graph_rows_host = torch.zeros((self.graph_rows, reader.row_bytes), dtype=torch.uint8, pin_memory=pin)
        self.graph_rows_device = (torch.empty((self.graph_rows, reader.row_bytes), dtype=torch.uint8, device=self.device)
                                  if self.cuda and mode == "h2d" else None)
        if int(graph_rows) > 0:
            from .native_read import load

            load()  # compile/load the host-node library now: at startup, not at the first capture
        self._host_nodes: list = []  # native reads referenced by captured graphs: keep them alive
        self._pending: concurrent.futures.Future | None = None
        self._lock = threading.Lock()
        if self.cuda:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"ple-stage-L{reader.table.layer}")
            self._ids_ready = torch.cuda.Event()
            self._slot_free = torch.cuda.Event()
            self._slot_used = False

    @property
    def pinned_bytes(self) -> int:
        return (self.ids_host.numel() + self.graph_ids.numel()) * 8 + self.rows_host.numel() + self.graph_rows_host.numel()

    @property
    def working_set_bytes(self) -> int:
        """Fixed host memory: pinned staging plus the reader's working set."""
        return self.pinned_bytes + self.reader.working_set_bytes

    def _check(self, n: int, out: torch.Tensor) -> None:
        if n > self.capacity_rows:
            raise StagingCapacityError(
                f"PLE lookup needs {n} rows but the sidecar staging holds {self.capacity_rows} "
                f"(sized from chunked_prefill_size × 16); raise SGLANG_SSD_STREAM_PLE_MAX_TOKENS or lower the chunk size")
        self._check_out(n, out)

    def _check_out(self, n: int, out: torch.Tensor) -> None:
        if tuple(out.shape) != (n, self.columns) or out.dtype != torch.bfloat16 or not out.is_contiguous():
            raise ValueError(f"PLE output must be contiguous bf16 [{n}, {self.columns}], got {out.dtype} {tuple(out.shape)}")

    def _stage_and_convert(self, n: int, out: torch.Tensor) -> None:
        self.reader.read_rows(self._ids_np[:n], self._rows_np[:n])
        src = self.rows_host[:n]
        if self.rows_device is not None:
            self.rows_device[:n].copy_(src, non_blocking=True)
            src = self.rows_device[:n]
        convert_staged_rows(src, out, is_fp8=self.is_fp8)

    # ------------------------------------------------------------------ eager

    def begin(self, ids: torch.Tensor, out: torch.Tensor, stream: "torch.cuda.Stream | None" = None) -> None:
        """Start gathering rows ``ids`` (1-D int64 on ``self.device``) into ``out`` on ``stream``."""
        n = ids.numel()
        self._check(n, out)
        self.wait()
        if not self.cuda:
            self._ids_np[:n] = ids.reshape(-1).numpy()
            self._stage_and_convert(n, out)
            return
        if n == 0:
            return
        stream = stream or torch.cuda.current_stream(self.device)
        if self._slot_used:
            self._slot_free.synchronize()  # the GPU may still read the slot from the last lookup
        with torch.cuda.stream(stream):
            self.ids_host[:n].copy_(ids.reshape(-1), non_blocking=True)
            self._ids_ready.record(stream)
        self._slot_used = True
        self._pending = self._executor.submit(self._work, n, out, stream)

    def _work(self, n: int, out: torch.Tensor, stream) -> None:
        self._ids_ready.synchronize()
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            self._stage_and_convert(n, out)
            self._slot_free.record(stream)

    def wait(self) -> None:
        """Block until the last ``begin`` has launched its GPU work; re-raises its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    # ------------------------------------------------------------------ CUDA graphs

    def capture(self, ids: torch.Tensor, out: torch.Tensor, stream) -> None:
        """Inside CUDA-graph capture on ``stream``: D2H of ``ids`` -> host node reading the rows ->
        conversion into ``out``, all replayed by the graph (see the module docstring)."""
        from .hostfunc import launch_native_host_func
        from .native_read import NativeRead, keep_for_graphs

        n = ids.numel()
        if n > self.graph_rows:
            raise StagingCapacityError(
                f"a captured PLE lookup needs {n} rows but the graph slot holds {self.graph_rows} "
                f"(sized from the chunk: SGLANG_SSD_STREAM_PLE_MAX_TOKENS × 16)")
        self._check_out(n, out)
        if n == 0:
            return
        ids_np, rows_np, reader = self.graph_ids.numpy()[:n], self.graph_rows_host.numpy()[:n], self.reader
        what = f"PLE layer {reader.table.layer} sidecar read"

        node = keep_for_graphs(NativeRead(reader, ids_np, rows_np, what=what))
        with torch.cuda.stream(stream):
            self.graph_ids[:n].copy_(ids.reshape(-1), non_blocking=True)
            launch_native_host_func(stream, node)
            self._host_nodes.append(node)
            src = self.graph_rows_host[:n]
            if self.graph_rows_device is not None:
                self.graph_rows_device[:n].copy_(src, non_blocking=True)
                src = self.graph_rows_device[:n]
            convert_staged_rows(src, out, is_fp8=self.is_fp8)

    @staticmethod
    def capture_wait(event: "torch.cuda.Event", stream=None) -> None:
        """Inside capture: make the graph wait for an event recorded before each replay."""
        (stream or torch.cuda.current_stream()).wait_event(event)

    def launch_for_replay(self, ids_host: np.ndarray, out: torch.Tensor, stream, event: "torch.cuda.Event") -> None:
        """Outside capture, before replay: fill ``out`` (the graph's fixed buffer) and record ``event``."""
        n = len(ids_host)
        self._check(n, out)
        self.wait()
        if self._slot_used:
            self._slot_free.synchronize()
        self._ids_np[:n] = ids_host
        with torch.cuda.stream(stream):
            self._stage_and_convert(n, out)
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
