"""Host work as a CUDA stream operation (``cuLaunchHostFunc``), capturable into CUDA graphs.

A host function runs on a CUDA driver thread when the stream reaches it; inside stream capture
it becomes a graph *host node* that runs at every replay. It must not call CUDA. A Python host
function (:func:`launch_host_func`) runs through a ctypes callback, which takes the GIL: every
thread that waits for this stream must release the GIL while it waits (PyTorch's synchronize,
``item()``, ``.cpu()`` do), and a busy engine thread delays it by up to a switch interval. A
native one (:func:`launch_native_host_func`, :mod:`.native_read`) needs no GIL.

An exception cannot travel back through the driver. Our host work serves rows a kernel consumes
next, so a failure ends the process after printing what failed: continuing would hand the model
rows that were never read.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import traceback

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_lib = None
_lock = threading.Lock()
EXIT_CODE = 70  # EX_SOFTWARE


def _libcuda():
    global _lib
    with _lock:
        if _lib is None:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            lib.cuLaunchHostFunc.restype = ctypes.c_int
            _lib = lib
        return _lib


def fail_closed(fn, *, what: str):
    """``fn`` wrapped for a host node: an exception prints what failed and ends the process."""

    def run(_user_data) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - nothing can receive it; see the module docstring
            print(f"sglang-ssd-stream: {what} failed inside a CUDA stream/graph: {type(exc).__name__}: {exc}\n"
                  f"{traceback.format_exc()}stopping this process: the step's rows were not read.",
                  file=sys.stderr, flush=True)
            os._exit(EXIT_CODE)

    return run


def launch_host_func(stream, fn, *, what: str):
    """Enqueue ``fn()`` on ``stream`` (a ``torch.cuda.Stream``). Returns the ctypes callback,
    which the caller must keep alive for as long as a graph that captured it may replay."""
    callback = _HOST_FN(fail_closed(fn, what=what))
    _launch(stream, ctypes.cast(callback, ctypes.c_void_p).value, None, what)
    return callback


def launch_native_host_func(stream, read) -> None:
    """Enqueue the native read ``read`` (a :class:`.native_read.NativeRead`, which the caller keeps
    alive for as long as a graph that captured it may replay) on ``stream``."""
    _launch(stream, read.function, read.argument, "the native PLE sidecar read")


def _launch(stream, fn: int, arg: int | None, what: str) -> None:
    rc = _libcuda().cuLaunchHostFunc(ctypes.c_void_p(stream.cuda_stream), ctypes.c_void_p(fn), ctypes.c_void_p(arg))
    if rc != 0:
        raise RuntimeError(f"cuLaunchHostFunc for {what} failed: CUDA driver error {rc}")
