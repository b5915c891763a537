"""Issue 37 item 3: a test run patches only its own private copy of the engine venv (scripts/engine-venv.sh
--private), never the cached venv another run copies from: patching the copy leaves every file of the cache as
it was (the same bytes, the same inode), and the copy's entry points run the copy's interpreter."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from sglang_ssd_stream.patching.engines import ENGINES
from sglang_ssd_stream.patching.manifest import known_manifests


def _venv_root(python: str) -> Path:
    return Path(python).parent.parent  # not resolved: bin/python is a link to the system interpreter


def _site(venv: Path) -> Path:
    (site,) = venv.glob("lib/python*/site-packages")
    return site


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_patching_the_private_copy_leaves_the_cached_venv_untouched(sglang):
    cache = Path(os.environ["SSD_STREAM_CACHE"])
    copy = _venv_root(sglang.python)
    cached = cache / "venvs" / copy.name  # the copy keeps the cached venv's name, under this run's directory
    assert copy.parent.parent.name.startswith("run-") and copy.parent.parent.parent == cache, copy
    assert cached.is_dir() and (cached / ".complete").is_file(), cached
    # the copy's entry points name the copy's interpreter, not the cache's
    assert (copy / "bin" / "sglang").read_text().splitlines()[0] == f"#!{copy}/bin/python"

    manifest = next(m for m in known_manifests(ENGINES["sglang"]) if m.release == ENGINES["sglang"].pinned)
    targets = [f.path for f in manifest.files]
    before = {t: (_sha(_site(cached) / t), (_site(cached) / t).stat().st_ino) for t in targets}
    sglang.ensure_patched()
    try:
        for t in targets:
            theirs = _site(cached) / t
            assert (_sha(theirs), theirs.stat().st_ino) == before[t], f"the cached venv's {t} changed"
        patched = [t for t in targets if _sha(_site(copy) / t) != before[t][0]]
        assert patched, "nothing was patched in the copy: the test proves nothing"
    finally:
        sglang.ensure_pristine()
