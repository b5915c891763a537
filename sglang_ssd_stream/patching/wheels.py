"""Engine wheels fetched without installing (``pip download --no-deps``), read as zip files.

Used to check that one manifest serves both architectures and, later, for drift reports
over new releases. Downloads go to a cache directory and are reused.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from ..errors import EnvironmentProblem
from .engines import Engine

# pip matches --platform tags exactly, so name each manylinux level the engines publish
# (sglang: manylinux_2_34; vllm: manylinux_2_28, cp38-abi3).
MANYLINUX = ("manylinux_2_34", "manylinux_2_28", "manylinux_2_17", "manylinux2014")
PLATFORMS = {arch: [f"{tag}_{arch}" for tag in MANYLINUX] for arch in ("x86_64", "aarch64")}


def fetch_wheel(engine: Engine, release: str, arch: str, cache: Path, python: str = "3.11") -> Path:
    """Download (once) the ``engine==release`` wheel for ``arch``; returns its path."""
    dest = cache / "wheels" / f"{engine.name}-{release}-{arch}-py{python}"
    found = sorted(dest.glob("*.whl"))
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", *(a for tag in PLATFORMS[arch] for a in ("--platform", tag)), "--python-version", python,
           "--implementation", "cp",
           "-d", str(dest), f"{engine.distribution}=={release}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob("*.whl"))
    if r.returncode != 0 or not found:
        raise EnvironmentProblem(f"could not download {engine.distribution}=={release} for {arch}: "
                                 f"{(r.stderr or r.stdout).strip()[-500:]}")
    return found[0]


def wheel_file_bytes(wheel: Path, rel: str) -> bytes | None:
    """Contents of ``rel`` (a site-packages-relative path) inside ``wheel``; None when absent."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            return zf.read(rel)
        except KeyError:
            return None
