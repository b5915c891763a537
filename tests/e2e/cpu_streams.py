"""TEST-ONLY, never shipped: CUDA streams and events on a CPU, for both engines' e2e stand-ins.

The engines' PLE paths order their lookups with side streams and events; on a CPU every op runs in program
order, so every wait is already satisfied. ``install(ran, marker=...)`` swaps ``torch.cuda.Stream``/``Event``/
``current_stream``/``stream``/``is_current_stream_capturing`` and ``Tensor.record_stream`` (for these streams)
once per process; ``ran(name)`` is the calling stand-in's own "ran <name>" log line.
"""

from __future__ import annotations

import contextlib
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


def install(ran, *, marker: str) -> None:
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
