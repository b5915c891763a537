"""``vllm-ple-offload patch status`` on synthetic site-packages holding vLLM 0.33.0's real files (copied
from the venv; the venv itself is never written): exit codes, local version labels, stale dist-infos.

Decision (README): a local build label of a known release (``0.33.0+cu129``) selects that release's
manifest; the file hashes then decide, as for any install, so a build whose files differ is refused
as unknown. Several dist-info records of the engine with different versions are refused naming all.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from sglang_ssd_stream.patching.engines import data_root

MANIFEST = json.loads((data_root() / "hashes" / "vllm-0.33.0.json").read_text())


@pytest.fixture(scope="module")
def venv_site(vllm) -> Path:
    out = subprocess.run([vllm.python, "-c", "import vllm, os; print(os.path.dirname(os.path.dirname(vllm.__file__)))"],
                         capture_output=True, text=True, env=vllm.env(), timeout=300, check=True).stdout
    return Path(out.strip().splitlines()[-1])


def site_with(tmp_path: Path, venv_site: Path, *versions: str) -> Path:
    site = tmp_path / "site"
    for f in MANIFEST["files"]:
        dst = site / f["path"]
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(venv_site / f["path"], dst)
        assert hashlib.sha256(dst.read_bytes()).hexdigest() == f["pristine"]
    for v in versions:
        d = site / f"vllm-{v}.dist-info"
        d.mkdir()
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {v}\n")
    return site


def status(vllm, site: Path, *extra):
    return subprocess.run([vllm.python, "-m", "vllm_ple_offload.cli", "patch", "status", "--site-packages", str(site),
                           *extra], capture_output=True, text=True, env=vllm.env(), timeout=300)


def test_pristine_status_exits_0(vllm, venv_site, tmp_path):
    r = status(vllm, site_with(tmp_path, venv_site, "0.33.0"))
    assert r.returncode == 0, r.stderr
    assert "pristine" in r.stdout


@pytest.mark.parametrize("damage", ["unknown", "missing"])
def test_status_exits_2_on_unknown_or_missing_files(vllm, venv_site, tmp_path, damage):
    site = site_with(tmp_path, venv_site, "0.33.0")
    target = site / MANIFEST["files"][0]["path"]
    if damage == "unknown":
        target.write_bytes(target.read_bytes() + b"\n# edited\n")
    else:
        target.unlink()
    r = status(vllm, site, "--json")
    assert r.returncode == 2, (r.stdout, r.stderr)  # it was 0
    doc = json.loads(r.stdout)
    assert doc["exit_code"] == 2 and {f["state"] for f in doc["files"]} == {damage}


def test_local_label_of_a_known_release_is_judged_by_its_hashes(vllm, venv_site, tmp_path):
    site = site_with(tmp_path, venv_site, "0.33.0+cu129")
    r = status(vllm, site, "--json")
    assert r.returncode == 0, r.stderr  # it was refused as an unknown release
    doc = json.loads(r.stdout)
    assert (doc["installed_release"], doc["manifest_release"]) == ("0.33.0+cu129", "0.33.0")
    target = site / MANIFEST["files"][0]["path"]
    target.write_bytes(target.read_bytes() + b"\n# another build\n")
    r = status(vllm, site)
    assert r.returncode == 2 and "unknown" in r.stdout  # different files: refused like any unknown state


@pytest.mark.parametrize("version", ["0.33.1+cu129", "0.33.0.post1", "0.33.0rc1"])
def test_other_public_releases_stay_unknown(vllm, venv_site, tmp_path, version):
    r = status(vllm, site_with(tmp_path, venv_site, version))
    assert (r.returncode == 2 and f"vllm {version} is installed" in r.stderr
            and "which this kit does not know" in r.stderr)


def test_two_dist_infos_are_refused_naming_both(vllm, venv_site, tmp_path):
    r = status(vllm, site_with(tmp_path, venv_site, "0.32.0", "0.33.0"))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "records several vllm releases (0.32.0, 0.33.0)" in r.stderr and "stale" in r.stderr
    same = status(vllm, site_with(tmp_path / "dup", venv_site, "0.33.0", "0.33.0+cu129"))
    assert same.returncode == 2 and "(0.33.0, 0.33.0+cu129)" in same.stderr
