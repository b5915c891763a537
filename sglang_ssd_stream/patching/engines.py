"""The engines we patch and where this kit keeps its data (patches/, hashes/)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Engine:
    name: str  # key used in file names: hashes/<name>-<release>.json, patches/<name>/
    distribution: str  # the name pip knows it by
    package: str  # the top-level import package inside site-packages
    pinned: str  # the release install.sh installs and CI proves
    tool: str  # the command line that patches it (named in messages that say what to run)

    @property
    def allow_unpatched_env(self) -> str:
        """=1 lets the plugin start on a pristine engine (a warning, never the default); declared in knobs.py."""
        from ..knobs import knob  # here, not at the top: `python engines.py` runs without the package

        return knob(self.name, "ALLOW_UNPATCHED").name


# The one place the pinned releases are written (install.sh and scripts/ ask this module).
ENGINES = {
    "sglang": Engine(name="sglang", distribution="sglang", package="sglang", pinned="0.5.23", tool="sglang-ssd-stream"),
    "vllm": Engine(name="vllm", distribution="vllm", package="vllm", pinned="0.33.0", tool="vllm-ple-offload"),
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


if __name__ == "__main__":  # `python engines.py sglang` prints the pinned release, for shell scripts
    print(ENGINES[sys.argv[1]].pinned)
