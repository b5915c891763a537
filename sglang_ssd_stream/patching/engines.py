"""The engines we patch and where this kit keeps its data (patches/, hashes/)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Engine:
    name: str  # key used in file names: hashes/<name>-<release>.json, patches/<name>/
    distribution: str  # the name pip knows it by
    package: str  # the top-level import package inside site-packages


ENGINES = {
    "sglang": Engine(name="sglang", distribution="sglang", package="sglang"),
    "vllm": Engine(name="vllm", distribution="vllm", package="vllm"),
}


def data_root() -> Path:
    """Directory holding ``patches/`` and ``hashes/``.

    In a checkout ``sglang_ssd_stream/data`` links to the repo's top-level folders; in a wheel
    they are copied there. ``SSD_STREAM_DATA_DIR`` overrides it (maintainers, tests).
    """
    override = os.environ.get("SSD_STREAM_DATA_DIR")
    if override:
        return Path(override)
    return Path(__file__).resolve().parent.parent / "data"
