"""Issue 29 item 11: the patch tool's adversarial cases on vLLM 0.33.0's real files.

The synthetic-kit tests (tests/patching/test_reporting_never_writes.py) pin each behaviour; these run the
same cases on the real engine file, copied from the venv into a temp site-packages (the venv is never
written), with the kit's real patch and manifest. Each case checks the exit code, the message, that no
traceback is printed and that the whole temp site (the ``.sglang-ssd-stream`` state dir included) is
byte-, mode- and entry-identical afterwards, unless the case is one that must write. vLLM's series patches
one file, so no journal can name part of a group: case 1 is a whole journal, reported and then recovered.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from sglang_ssd_stream.errors import EXIT_CHANGED, EXIT_OK, EXIT_PENDING, EXIT_REFUSED
from sglang_ssd_stream.patching.engines import ENGINES
from sglang_ssd_stream.patching.manifest import load_manifest, manifest_path

from ..engine import REPO
from ..patching.conftest import snapshot
from ..real_site import (
    assert_lock_dir_refused,
    assert_nul_in_patch_refused,
    copy_of,
    kit_cli,
    write_dist_info,
    write_journal,
)

ENGINE = ENGINES["vllm"]
MANIFEST = load_manifest(manifest_path(ENGINE, ENGINE.pinned))
(TARGET,) = MANIFEST.files  # vllm/models/qwen4_exp/nvidia/ops/qsa.py
PATCH = "0001-qsa-quantized-tile-smem-guard"
STATE = Path(".sglang-ssd-stream", "vllm")
ODD_DIR = str(Path(TARGET.path).parent)


@pytest.fixture(scope="module")
def pristine_site(vllm, tmp_path_factory) -> Path:
    out = subprocess.run([vllm.python, "-c", "import importlib.util as u; print(u.find_spec('vllm').origin)"],
                         capture_output=True, text=True, env=vllm.env(), timeout=300, check=True).stdout
    venv_site = Path(out.strip().splitlines()[-1]).parent.parent
    site = tmp_path_factory.mktemp("pristine") / "site"
    (site / TARGET.path).parent.mkdir(parents=True)
    shutil.copyfile(venv_site / TARGET.path, site / TARGET.path)
    # vllm/__init__.py: the venv's, after a line that resolves every module the copy lacks in the venv's
    # package, so the doctor (which imports vllm.platforms) runs on a vllm whose package dir is the copy.
    init = (venv_site / "vllm" / "__init__.py").read_text()
    (site / "vllm" / "__init__.py").write_text(f"__path__.append({str(venv_site / 'vllm')!r})\n{init}")
    assert hashlib.sha256((site / TARGET.path).read_bytes()).hexdigest() == TARGET.pristine
    write_dist_info(site, "vllm", MANIFEST.release)
    return site


@pytest.fixture(scope="module")
def patched_site(vllm, pristine_site, tmp_path_factory) -> Path:
    site = copy_of(pristine_site, tmp_path_factory.mktemp("patched"))
    r = kit_cli(vllm, site, "apply")
    assert r.returncode == EXIT_OK, r.stdout + r.stderr
    return site


@pytest.fixture
def patched(patched_site, tmp_path) -> Path:
    """A fresh copy of the patched tree, with the apply's backup in its state dir."""
    return copy_of(patched_site, tmp_path)


@pytest.fixture
def pristine(pristine_site, tmp_path) -> Path:
    return copy_of(pristine_site, tmp_path)


def _journal(site: Path) -> None:
    write_journal(site, MANIFEST, [TARGET.path])


def _sha(site: Path) -> str:
    return hashlib.sha256((site / TARGET.path).read_bytes()).hexdigest()


def _guard(site: Path):
    from sglang_ssd_stream.patching.guard import verdict

    return verdict("vllm", site_packages=site)


# 1 -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("verb", ["status", "verify", "guard"])
def test_a_pending_journal_is_reported_and_nothing_is_written(vllm, patched, verb):
    _journal(patched)
    before = snapshot(patched)
    if verb == "guard":
        v = _guard(patched)
        assert v.state == "pending" and TARGET.path in v.listing, v
    else:
        r = kit_cli(vllm, patched, verb)
        assert "Traceback" not in r.stdout + r.stderr, r.stderr
        assert r.returncode == EXIT_PENDING, (r.returncode, r.stdout, r.stderr)
        assert "PENDING" in r.stdout and TARGET.path in r.stdout and "patch recover" in r.stdout, r.stdout
    assert snapshot(patched) == before


def test_recover_rolls_a_pending_journal_back_to_pristine(vllm, patched):
    _journal(patched)
    r = kit_cli(vllm, patched, "recover")
    assert r.returncode == EXIT_OK and "Traceback" not in r.stderr, (r.returncode, r.stdout, r.stderr)
    assert f"recovered   {TARGET.path}" in r.stdout, r.stdout
    assert _sha(patched) == TARGET.pristine and not (patched / STATE / "journal.json").exists()
    r = kit_cli(vllm, patched, "recover")
    assert r.returncode == EXIT_OK and "nothing to recover" in r.stdout, r.stdout


# 2 -----------------------------------------------------------------------------------------------------------
def _odd_parent(site: Path, tmp_path: Path, odd: str) -> Path:
    """The target's directory moved away and replaced by a symlink to it, or by a plain file."""
    elsewhere = tmp_path / "elsewhere"
    shutil.move(site / ODD_DIR, elsewhere)
    if odd == "symlink":
        (site / ODD_DIR).symlink_to(elsewhere, target_is_directory=True)
    else:
        (site / ODD_DIR).write_text("not a directory\n")
    return elsewhere


@pytest.mark.parametrize("json_flag", [(), ("--json",)], ids=["text", "json"])
@pytest.mark.parametrize("verb", ["status", "apply", "revert", "recover"])
@pytest.mark.parametrize("odd", ["symlink", "file"])
def test_an_odd_directory_under_a_pending_journal_is_a_refusal(vllm, patched, tmp_path, odd, verb, json_flag):
    _journal(patched)
    elsewhere = _odd_parent(patched, tmp_path, odd)
    before, outside = snapshot(patched), snapshot(elsewhere)
    r = kit_cli(vllm, patched, verb, *json_flag)
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    assert r.returncode == (EXIT_PENDING if verb == "status" else EXIT_REFUSED), (r.returncode, r.stdout, r.stderr)
    assert ODD_DIR in r.stdout + r.stderr
    assert snapshot(patched) == before and snapshot(elsewhere) == outside


@pytest.mark.parametrize("odd", ["symlink", "file"])
def test_the_guard_names_an_odd_directory_under_a_pending_journal(patched, tmp_path, odd):
    _journal(patched)
    elsewhere = _odd_parent(patched, tmp_path, odd)
    before, outside = snapshot(patched), snapshot(elsewhere)
    v = _guard(patched)
    assert v.state in ("unknown", "pending") and ODD_DIR in v.listing, v
    assert snapshot(patched) == before and snapshot(elsewhere) == outside


# 3 -----------------------------------------------------------------------------------------------------------
def test_apply_to_an_unwritable_stdout_says_the_change_was_made(vllm, pristine):
    r = subprocess.run(f'"{vllm.python}" -m vllm_ple_offload.cli patch apply --site-packages "{pristine}" > /dev/full',
                       shell=True, capture_output=True, text=True, env=vllm.env(), cwd=REPO, timeout=600)
    assert r.returncode == EXIT_CHANGED, (r.returncode, r.stderr)
    assert "the apply WAS made" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert _sha(pristine) == TARGET.patched
    assert kit_cli(vllm, pristine, "verify").returncode == EXIT_OK


# 4 -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("verb", ["apply", "revert"])
def test_a_lock_path_that_is_a_directory_is_a_named_refusal(vllm, request, verb):
    """apply on the pristine tree, revert on the patched one (whose apply left a lock file: replaced)."""
    site = request.getfixturevalue("pristine" if verb == "apply" else "patched")
    assert_lock_dir_refused(vllm, site, verb, snapshot)


# 5 -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [(), ("--dry-run",)], ids=["apply", "dry-run"])
def test_a_nul_byte_in_the_real_patch_is_refused(vllm, pristine, tmp_path, extra):
    assert_nul_in_patch_refused(vllm, pristine, tmp_path, PATCH, extra, snapshot)


# 6 -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["doctor"], ["serve", "--profile", "thor", "--dry-run"]], ids=["doctor", "serve"])
def test_doctor_and_serve_dry_run_write_nothing_under_a_pending_journal(vllm, patched, tmp_path, argv):
    """Both judge the vllm this process imports: PYTHONPATH puts the temp site before the venv's."""
    _journal(patched)
    before = snapshot(patched)
    if argv[0] == "serve":
        (tmp_path / "model").mkdir()
        argv = [*argv, "--model", str(tmp_path / "model")]
    r = subprocess.run([vllm.python, "-m", "vllm_ple_offload.cli", *argv], capture_output=True, text=True,
                       env=vllm.env({"PYTHONPATH": f"{REPO}{os.pathsep}{patched}"}), cwd=REPO, timeout=600)
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    assert r.returncode == (EXIT_REFUSED if argv[0] == "doctor" else EXIT_OK), (r.returncode, r.stdout, r.stderr)
    assert "interrupted patch command left its journal" in r.stdout and "patch recover" in r.stdout, r.stdout
    assert snapshot(patched) == before
