"""A temp site-packages holding an engine's real target files (copied from its venv, which is never written),
and the kit's CLI run on it: what the real-file patch tests share."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from .engine import REPO, EngineVenv

TOOL = {"sglang": "sglang_ssd_stream", "vllm": "vllm_ple_offload.cli"}


def write_dist_info(site: Path, engine: str, release: str) -> None:
    dist = site / f"{engine}-{release}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {engine}\nVersion: {release}\n")


def kit_cli(eng: EngineVenv, site: Path, verb: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([eng.python, "-m", TOOL[eng.name], "patch", verb, "--site-packages", str(site), *extra],
                          capture_output=True, text=True, env=eng.env(), cwd=REPO, timeout=600)


def copy_of(site: Path, where: Path) -> Path:
    """A fresh copy of ``site`` (its state dir and backups included) under ``where``."""
    shutil.copytree(site, where / "site", symlinks=True)
    return where / "site"


def write_journal(site: Path, manifest, paths: list[str]) -> None:
    """A well-formed journal (pristine -> patched) naming ``paths``, as a killed apply leaves it."""
    entries = [{"path": f.path, "before": f.pristine, "after": f.patched, "pristine": f.pristine}
               for f in manifest.files if f.path in paths]
    doc = {"version": 1, "op": "apply", "engine": manifest.engine.name, "release": manifest.release,
           "files": entries}
    (site / ".sglang-ssd-stream" / manifest.engine.name / "journal.json").write_text(json.dumps(doc))


def assert_lock_dir_refused(eng: EngineVenv, site: Path, verb: str, snapshot) -> None:
    """The install's lock path is a directory: a named refusal, no empty step name, nothing written."""
    lock = site / ".sglang-ssd-stream" / eng.name / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.unlink(missing_ok=True)
    lock.mkdir()
    before = snapshot(site)
    r = kit_cli(eng, site, verb)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "lock" in r.stderr and "not a regular file" in r.stderr, r.stderr
    assert "cannot :" not in r.stderr and "Traceback" not in r.stdout + r.stderr, r.stderr
    assert snapshot(site) == before


def assert_nul_in_patch_refused(eng: EngineVenv, site: Path, tmp_path: Path, patch_id: str, extra, snapshot) -> None:
    """A NUL byte appended to a copy of the kit's real .patch: kit data refused (exit 3), nothing written."""
    from sglang_ssd_stream.patching.engines import data_root

    data = tmp_path / "kitdata"
    for part in ("patches", "hashes"):
        shutil.copytree(data_root() / part, data / part)
    diff = data / "patches" / eng.name / f"{patch_id}.patch"
    diff.write_bytes(diff.read_bytes() + b"\0")
    before = snapshot(site)
    r = kit_cli(eng, site, "apply", "--data-dir", str(data), *extra)
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)
    assert "contains a NUL byte" in r.stderr and patch_id in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert snapshot(site) == before
