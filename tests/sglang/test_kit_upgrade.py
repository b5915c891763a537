"""A kit upgrade over sglang 0.5.23's real files, patched by a real earlier kit.

The earlier kit is this repository at EARLIER_KIT (the series up to 0005, with an older 0001, before
0006-request-limits and 0007-bounded-request-body), taken from git history and run as it was: its own
CLI applies its own patches. Then this kit's apply must upgrade the runtime in place. The files are
copied from the venv (never written); both CLIs run on the copy with --site-packages.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tarfile
from io import BytesIO
from pathlib import Path

import pytest

from sglang_ssd_stream.patching.engines import ENGINES
from sglang_ssd_stream.patching.manifest import load_manifest, manifest_path

from ..engine import REPO

EARLIER_KIT = "08dbfe8"  # main before 2026-12-04's 0001 change and patches 0006, 0007


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def site(sglang, tmp_path) -> Path:
    out = subprocess.run([sglang.python, "-c", "import sglang, os; print(os.path.dirname(os.path.dirname("
                          "sglang.__file__)))"], capture_output=True, text=True, env=sglang.env(), timeout=300,
                         check=True).stdout
    venv_site = Path(out.strip().splitlines()[-1])
    manifest = load_manifest(manifest_path(ENGINES["sglang"], ENGINES["sglang"].pinned))
    site = tmp_path / "site"
    for f in manifest.files:
        dst = site / f.path
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(venv_site / f.path, dst)
        assert _sha(dst.read_bytes()) == f.pristine, f"{f.path} in the venv is not pristine"
    dist = site / f"sglang-{manifest.release}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {manifest.release}\n")
    return site


def _cli(sglang, site: Path, verb: str, *extra: str, kit: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sglang.python, "-m", "sglang_ssd_stream", "patch", verb, "--site-packages", str(site),
                           *extra], capture_output=True, text=True, env=sglang.env({"PYTHONPATH": str(kit)}),
                          cwd=kit, timeout=600)


def _tree(site: Path, manifest) -> dict[str, bytes]:
    return {f.path: (site / f.path).read_bytes() for f in manifest.files}


@pytest.fixture
def earlier_kit(tmp_path) -> Path:
    r = subprocess.run(["git", "-C", str(REPO), "archive", EARLIER_KIT, "sglang_ssd_stream", "patches", "hashes"],
                       capture_output=True, timeout=120)
    if r.returncode != 0:
        pytest.skip(f"no git history with {EARLIER_KIT} here (not a clone, or a shallow one): {r.stderr[-200:]!r}")
    out = tmp_path / "earlier-kit"
    with tarfile.open(fileobj=BytesIO(r.stdout)) as tar:
        tar.extractall(out, filter="tar")
    return out


def test_an_earlier_kits_runtime_is_upgraded_in_place(sglang, site, earlier_kit, tmp_path):
    manifest = load_manifest(manifest_path(ENGINES["sglang"], ENGINES["sglang"].pinned))
    pristine = _tree(site, manifest)
    fresh = tmp_path / "fresh"
    shutil.copytree(site, fresh)
    assert _cli(sglang, fresh, "apply").returncode == 0
    patched = _tree(fresh, manifest)

    r = _cli(sglang, site, "apply", kit=earlier_kit)
    assert r.returncode == 0, r.stdout + r.stderr
    r = _cli(sglang, site, "status", "--json")
    assert r.returncode == 0, r.stdout + r.stderr  # before the manifest listed earlier states: 2, unknown
    states = {f["path"]: f["state"] for f in json.loads(r.stdout)["files"]}
    new = {"0006-request-limits", "0007-bounded-request-body"}  # patches the earlier kit did not have
    changed = {"sglang/srt/managers/tokenizer_manager.py", "sglang/srt/managers/tp_worker.py"}  # older 0001
    assert states == {f.path: "outdated" if f.path in changed else "pristine" if set(f.patches) <= new
                      else "patched" for f in manifest.files}
    assert _cli(sglang, site, "verify").returncode == 1  # not the current kit's files: the guard refuses them

    r = _cli(sglang, site, "apply")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "replacing an earlier kit's 0001-page-safe-truncation, 0005-prompt-token-ids-in-vocab" in r.stdout
    assert _tree(site, manifest) == patched  # byte for byte what a fresh apply writes
    assert _cli(sglang, site, "verify").returncode == 0
    assert _cli(sglang, site, "revert").returncode == 0
    assert _tree(site, manifest) == pristine
