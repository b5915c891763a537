"""TEST-ONLY, never shipped: what both engines' e2e CPU stand-ins share.

- ``install_cuda_streams(ran, marker=...)``: the engines' PLE paths order their lookups with side streams and
  events; on a CPU every op runs in program order, so every wait is already satisfied. It swaps
  ``torch.cuda.Stream``/``Event``/``current_stream``/``stream``/``is_current_stream_capturing`` and
  ``Tensor.record_stream`` (for these streams) once per process; ``ran(name)`` is the calling stand-in's own
  "ran <name>" log line.
- ``arm_import_hooks(before, after, install_ops)``: a meta-path finder that calls ``install_ops()`` before any
  module of ``before`` is found and runs ``after[name](module)`` right after that module executes.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import threading

_ran = [lambda name: None]


class _Stream:
    """A CUDA stream stand-in: CPU work runs in program order, so every wait is already satisfied."""

    def __init__(self, *args, **kwargs):
        _ran[0]("torch.cuda.Stream")

    def wait_stream(self, other):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event if event is not None else _Event()

    def synchronize(self):
        return None

    def query(self):
        return True


class _Event:
    def __init__(self, *args, **kwargs):
        _ran[0]("torch.cuda.Event")

    def record(self, stream=None):
        return None

    def wait(self, stream=None):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True


_current = threading.local()


def _current_stream(device=None):
    s = getattr(_current, "stream", None)
    if s is None:
        s = _current.stream = _Stream()
    return s


@contextlib.contextmanager
def _stream(s):
    prev = getattr(_current, "stream", None)
    _current.stream = s if s is not None else prev
    try:
        yield s
    finally:
        _current.stream = prev


def install_cuda_streams(ran, *, marker: str) -> None:
    """Once per process (``torch.cuda.<marker>`` says it is done); never where a real CUDA device exists."""
    import torch

    if torch.cuda.is_available() or getattr(torch.cuda, marker, False):
        return
    _ran[0] = ran
    torch.cuda.Stream, torch.cuda.Event = _Stream, _Event
    torch.cuda.current_stream, torch.cuda.stream = _current_stream, _stream
    torch.cuda.is_current_stream_capturing = lambda: False
    setattr(torch.cuda, marker, True)
    original = torch.Tensor.record_stream

    def record_stream(self, stream):
        if isinstance(stream, _Stream):
            return None
        return original(self, stream)

    torch.Tensor.record_stream = record_stream


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, after):
        self.inner, self.after = inner, after

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.after(module)

    def __getattr__(self, name):  # get_source, is_package, ... of the real loader
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, before, after, install_ops):
        self.before, self.after, self.install_ops = before, after, install_ops

    def find_spec(self, name, path, target=None):
        if name in self.before:
            self.install_ops()
        after = self.after.get(name)
        if after is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, after)
        return spec


def arm_import_hooks(before, after, install_ops) -> None:
    """Once per process (a second call with the finder in place does nothing)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(before, after, install_ops))
