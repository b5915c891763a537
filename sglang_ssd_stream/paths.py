"""Where the kit keeps its own files on a machine."""

from __future__ import annotations

import os
from pathlib import Path

from .knobs import SGLANG, knob

HOME_ENV = knob(SGLANG, "HOME").name  # the kit's data directory, for both engines


def data_dir() -> Path:
    """``$SGLANG_SSD_STREAM_HOME``, default ``~/.cache/sglang-ssd-stream``: model snapshots and
    their state (``update-model``), the native host-node library (``ple.native_read``)."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".cache" / "sglang-ssd-stream")
