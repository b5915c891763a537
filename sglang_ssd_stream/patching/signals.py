"""SIGINT/SIGTERM during a write command: recorded, never raised half-way through a step."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..errors import KitError

SIGNALS = (signal.SIGINT, signal.SIGTERM)

# A write command's signals, recorded for its whole run (the CLI's deferred_signals): one received before
# a Transaction starts stops it at its first step; one after the commit point is handed back here.
_deferred: dict = {"on": False, "signum": None}


@contextmanager
def deferred_signals() -> Iterator[Callable[[], int | None]]:
    """SIGINT/SIGTERM recorded instead of raised while a write command runs (main thread only);
    yields a callable returning the signal received (None if none)."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return

    def record(signum: int, frame: object) -> None:
        if _deferred["signum"] is None:
            _deferred["signum"] = signum

    previous = {s: signal.signal(s, record) for s in SIGNALS}
    _deferred.update(on=True, signum=None)
    try:
        yield lambda: _deferred["signum"]
    finally:
        _deferred["on"] = False
        for s, h in previous.items():
            signal.signal(s, h)


class Interrupted(KitError):
    """SIGINT or SIGTERM stopped a patch command; the exit code is the shell's 128 + signal."""

    def __init__(self, message: str, signum: int = int(signal.SIGINT)):
        super().__init__(message)
        self.signum = int(signum)
        self.exit_code = 128 + self.signum

    def __reduce__(self):
        return self.__class__, (self.message, self.signum)
