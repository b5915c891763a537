"""Where the kit keeps its own files on a machine."""

from __future__ import annotations

import os
from pathlib import Path

from .knobs import SGLANG, knob

HOME_ENV = knob(SGLANG, "HOME").name  # the kit's data directory, for both engines


def data_dir() -> Path:
    """``$SGLANG_SSD_STREAM_HOME``, default ``~/.cache/sglang-ssd-stream``: model snapshots and
    their state (``update-model``), the native host-node library (``ple.native_read``).

    A value the OS cannot name is refused here, naming the knob: each caller would otherwise stop on an
    ENAMETOOLONG that says nothing of where the path came from (a vLLM worker's plugin load included)."""
    raw = os.environ.get(HOME_ENV)
    if raw:
        too_long = name_too_long(raw)
        if too_long:
            from .errors import EnvironmentProblem

            raise EnvironmentProblem(f"{HOME_ENV}={raw[:80]}{'…' if len(raw) > 80 else ''}: {too_long}; set it to "
                                     f"a shorter path (or unset it for ~/.cache/sglang-ssd-stream)")
        return Path(raw)
    return Path.home() / ".cache" / "sglang-ssd-stream"


def name_too_long(path: str | os.PathLike) -> str | None:
    """Why the OS cannot name ``path`` (a component over NAME_MAX or the whole over PATH_MAX), else None.
    The limits are the root file system's: a mount with shorter names still answers ENAMETOOLONG itself."""
    text = os.fsencode(path)
    name_max, path_max = os.pathconf("/", "PC_NAME_MAX"), os.pathconf("/", "PC_PATH_MAX")
    if len(text) >= path_max:
        return f"the path is {len(text)} bytes, over the OS limit of {path_max - 1}"
    longest = max(text.split(b"/"), key=len)
    if len(longest) > name_max:
        return f"a name in it is {len(longest)} bytes, over the OS limit of {name_max}"
    return None
