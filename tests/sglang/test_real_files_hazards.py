"""Issue 29 item 11: the patch tool's adversarial cases on sglang 0.5.23's real files.

The synthetic-kit tests (tests/patching/test_reporting_never_writes.py) pin each behaviour; these run the
same cases on the real engine files, copied from the venv into a temp site-packages (the venv is never
written), with the kit's real patches and manifest. Each case checks the exit code, the message, that no
traceback is printed and that the whole temp site (the ``.sglang-ssd-stream`` state dir included) is
byte-, mode- and entry-identical afterwards, unless the case is one that must write.
"""

from __future__ import annotations

import hashlib
import json
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

ENGINE = ENGINES["sglang"]
MANIFEST = load_manifest(manifest_path(ENGINE, ENGINE.pinned))
STATE = Path(".sglang-ssd-stream", "sglang")
GROUP = "0001-page-safe-truncation"  # scheduler.py, tokenizer_manager.py, tp_worker.py
ONE = "sglang/srt/managers/tp_worker.py"
ODD_DIR = "sglang/srt/managers"  # the parent of four targets


@pytest.fixture(scope="module")
def pristine_site(sglang, tmp_path_factory) -> Path:
    out = subprocess.run([sglang.python, "-c", "import sglang, os; print(os.path.dirname(os.path.dirname("
                          "sglang.__file__)))"], capture_output=True, text=True, env=sglang.env(), timeout=300,
                         check=True).stdout
    venv_site = Path(out.strip().splitlines()[-1])
    site = tmp_path_factory.mktemp("pristine") / "site"
    for rel in [f.path for f in MANIFEST.files] + ["sglang/__init__.py"]:  # __init__: a Python finds the copy
        dst = site / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(venv_site / rel, dst)
    for f in MANIFEST.files:
        assert hashlib.sha256((site / f.path).read_bytes()).hexdigest() == f.pristine, f"{f.path} is not pristine"
    write_dist_info(site, "sglang", MANIFEST.release)
    return site


@pytest.fixture(scope="module")
def patched_site(sglang, pristine_site, tmp_path_factory) -> Path:
    site = copy_of(pristine_site, tmp_path_factory.mktemp("patched"))
    r = kit_cli(sglang, site, "apply")
    assert r.returncode == EXIT_OK, r.stdout + r.stderr
    return site


@pytest.fixture
def patched(patched_site, tmp_path) -> Path:
    """A fresh copy of the fully patched tree, with the apply's backups in its state dir."""
    return copy_of(patched_site, tmp_path)


@pytest.fixture
def pristine(pristine_site, tmp_path) -> Path:
    return copy_of(pristine_site, tmp_path)


def _journal(site: Path, paths: list[str]) -> None:
    write_journal(site, MANIFEST, paths)


def _states(sglang, site: Path) -> set[str]:
    r = kit_cli(sglang, site, "status", "--json")
    return {f["state"] for f in json.loads(r.stdout)["files"]}


def _guard(site: Path):
    from sglang_ssd_stream.patching.guard import verdict

    return verdict("sglang", site_packages=site)


# 1 -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("verb", ["status", "verify", "guard", "recover", "apply", "revert"])
def test_a_journal_naming_one_file_of_a_group_is_reported_and_refused(sglang, patched, verb):
    """A fully patched tree and a journal listing only tp_worker.py of 0001: recovering it would leave the group
    mixed. Reporting says PENDING and writes nothing; every write verb refuses, naming the group."""
    _journal(patched, [ONE])
    before = snapshot(patched)
    if verb == "guard":
        v = _guard(patched)
        assert v.state == "pending" and ONE in v.listing, v
    else:
        r = kit_cli(sglang, patched, verb)
        assert "Traceback" not in r.stdout + r.stderr, r.stderr
        if verb in ("status", "verify"):
            assert r.returncode == EXIT_PENDING, (r.returncode, r.stdout, r.stderr)
            assert "PENDING" in r.stdout and ONE in r.stdout and "patch recover" in r.stdout, r.stdout
        else:
            assert r.returncode == EXIT_REFUSED, (r.returncode, r.stdout, r.stderr)
            assert f"patch group {GROUP} mixed" in r.stderr and "Nothing was changed" in r.stderr, r.stderr
    assert snapshot(patched) == before


# 2 -----------------------------------------------------------------------------------------------------------
def _odd_managers(site: Path, tmp_path: Path, odd: str) -> Path:
    """sglang/srt/managers moved away and replaced by a symlink to it, or by a plain file."""
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
def test_an_odd_directory_under_a_pending_journal_is_a_refusal(sglang, patched, tmp_path, odd, verb, json_flag):
    _journal(patched, [f.path for f in MANIFEST.files])
    elsewhere = _odd_managers(patched, tmp_path, odd)
    before, outside = snapshot(patched), snapshot(elsewhere)
    r = kit_cli(sglang, patched, verb, *json_flag)
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    assert r.returncode == (EXIT_PENDING if verb == "status" else EXIT_REFUSED), (r.returncode, r.stdout, r.stderr)
    assert ODD_DIR in r.stdout + r.stderr
    assert snapshot(patched) == before and snapshot(elsewhere) == outside


@pytest.mark.parametrize("odd", ["symlink", "file"])
def test_the_guard_names_an_odd_directory_under_a_pending_journal(patched, tmp_path, odd):
    _journal(patched, [f.path for f in MANIFEST.files])
    elsewhere = _odd_managers(patched, tmp_path, odd)
    before, outside = snapshot(patched), snapshot(elsewhere)
    v = _guard(patched)
    assert v.state in ("unknown", "pending") and ODD_DIR in v.listing, v
    assert snapshot(patched) == before and snapshot(elsewhere) == outside


# 3 -----------------------------------------------------------------------------------------------------------
def test_apply_to_an_unwritable_stdout_says_the_change_was_made(sglang, pristine, patched_site):
    r = subprocess.run(f'"{sglang.python}" -m sglang_ssd_stream patch apply --site-packages "{pristine}" > /dev/full',
                       shell=True, capture_output=True, text=True, env=sglang.env(), cwd=REPO, timeout=600)
    assert r.returncode == EXIT_CHANGED, (r.returncode, r.stderr)
    assert "the apply WAS made" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert {f.path: (pristine / f.path).read_bytes() for f in MANIFEST.files} == \
        {f.path: (patched_site / f.path).read_bytes() for f in MANIFEST.files}
    assert _states(sglang, pristine) == {"patched"}


# 4 -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("verb", ["apply", "revert"])
def test_a_lock_path_that_is_a_directory_is_a_named_refusal(sglang, request, verb):
    """apply on the pristine tree, revert on the patched one (whose apply left a lock file: replaced)."""
    site = request.getfixturevalue("pristine" if verb == "apply" else "patched")
    assert_lock_dir_refused(sglang, site, verb, snapshot)


# 5 -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [(), ("--dry-run",)], ids=["apply", "dry-run"])
def test_a_nul_byte_in_a_real_patch_is_refused(sglang, pristine, tmp_path, extra):
    assert_nul_in_patch_refused(sglang, pristine, tmp_path, GROUP, extra, snapshot)


# 6 -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["doctor", "serve-dry-run"])
def test_doctor_and_serve_dry_run_write_nothing_under_a_pending_journal(sglang, patched, tmp_path, command):
    """Both find sglang through a Python: a wrapper whose PYTHONPATH puts the temp site first (the doctor's
    --python), or this process's own path (serve's preflight asks sys.executable)."""
    _journal(patched, [f.path for f in MANIFEST.files])
    before = snapshot(patched)
    if command == "doctor":
        wrapper = tmp_path / "python"
        wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{patched}" exec "{sglang.python}" "$@"\n')
        wrapper.chmod(0o755)
        argv, env = ["doctor", "--python", str(wrapper)], None
    else:
        model = tmp_path / "model"
        model.mkdir()
        argv = ["serve", "--profile", "thor", "--model", str(model), "--dry-run"]
        env = {"PYTHONPATH": f"{REPO}{os.pathsep}{patched}"}
    r = subprocess.run([sglang.python, "-m", "sglang_ssd_stream", *argv], capture_output=True, text=True,
                       env=sglang.env(env), cwd=REPO, timeout=600)
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    assert r.returncode == (EXIT_REFUSED if command == "doctor" else EXIT_OK), (r.returncode, r.stdout, r.stderr)
    assert "interrupted patch command left its journal" in r.stdout, r.stdout
    assert "patch recover" in r.stdout
    assert snapshot(patched) == before
