"""Host work as a CUDA stream operation (``cuLaunchHostFunc``), capturable into CUDA graphs.

A host function runs on a CUDA driver thread when the stream reaches it; inside stream capture
it becomes a graph *host node* that runs at every replay. It must not call CUDA. Only native
functions are launched here (:mod:`.native_read`): a Python one cannot keep that rule, since a
garbage collection inside it may free a CUDA tensor (on the H200 that aborted the process with
"operation not permitted"), and it waits for the GIL behind any thread that runs Python.
"""

from __future__ import annotations

import ctypes
import threading

_lib = None
_lock = threading.Lock()


def _libcuda():
    global _lib
    with _lock:
        if _lib is None:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            lib.cuLaunchHostFunc.restype = ctypes.c_int
            _lib = lib
        return _lib


def launch_native_host_func(stream: object, read: object) -> None:
    """Enqueue the native read ``read`` (a :class:`.native_read.NativeRead`, which the caller keeps
    alive for as long as a graph that captured it may replay) on ``stream`` (a ``torch.cuda.Stream``)."""
    rc = _libcuda().cuLaunchHostFunc(ctypes.c_void_p(stream.cuda_stream), ctypes.c_void_p(read.function),
                                     ctypes.c_void_p(read.argument))
    if rc != 0:
        raise RuntimeError(f"cuLaunchHostFunc for the native PLE sidecar read failed: CUDA driver error {rc}")
