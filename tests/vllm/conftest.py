"""vLLM suite: every test here needs the cached vllm venv (``scripts/test.sh vllm`` provides it).

The cached venv is shared; tests that patch vLLM work on a private hardlink copy of it
(``vllm_private``). The patch engine replaces files by rename, so the shared venv's inodes are
never written.
"""

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from ..engine import EngineVenv, engine_venv


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/vllm/" in str(item.fspath):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def vllm():
    """The shared cached venv: import and run only, never patch."""
    return engine_venv("vllm")


@pytest.fixture(scope="session")
def vllm_private(vllm):
    """A private hardlink copy of the venv, pristine at start, for patch apply/revert."""
    root = Path(vllm.python).parent.parent  # <venv>/bin/python, symlinks not followed
    tmp = Path(tempfile.mkdtemp(prefix="vllm-private-"))
    subprocess.run(["cp", "-al", str(root), str(tmp / "venv")], check=True)
    eng = EngineVenv("vllm", str(tmp / "venv" / "bin" / "python"))
    eng.ensure_pristine()
    yield eng
    shutil.rmtree(tmp, ignore_errors=True)
