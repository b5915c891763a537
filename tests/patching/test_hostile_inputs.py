"""Hostile inputs: each refused with a clear message and nothing written (issue 15).

Every case builds the synthetic kit, plants one hostile thing, snapshots the whole tree (the
site-packages, the kit data and an "outside" directory standing for the rest of the machine),
runs the real CLI in a subprocess (a hang is a failure, not a stuck suite) and checks the exit
code, the message and that the snapshot is unchanged: bytes, modes and entries.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from sglang_ssd_stream.errors import EXIT_BAD_KIT_DATA, EXIT_ENVIRONMENT, EXIT_OK, EXIT_REFUSED

from .conftest import REPO, Kit, run_cli, snapshot, write_kit

A, B = "sglang/srt/a.py", "sglang/srt/managers/b.py"
STATE = ".sglang-ssd-stream/sglang"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _state(kit: Kit) -> Path:
    d = kit.site / STATE / "backups"
    d.mkdir(parents=True, exist_ok=True)
    return kit.site / STATE


def _journal(kit: Kit, doc) -> None:
    raw = doc if isinstance(doc, (bytes, str)) else json.dumps(doc)
    (_state(kit) / "journal.json").write_bytes(raw.encode() if isinstance(raw, str) else raw)


def _entry(kit: Kit, rel: str, **over) -> dict:
    m = json.loads(kit.manifest_file().read_text())
    e = next(f for f in m["files"] if f["path"] == rel)
    return {"path": rel, "before": e["pristine"], "after": e["patched"], "pristine": e["pristine"], **over}


def _good_journal(kit: Kit, files) -> dict:
    return {"version": 1, "op": "apply", "engine": "sglang", "release": "0.5.23", "files": files}


def _manifest(kit: Kit, edit) -> None:
    m = json.loads(kit.manifest_file().read_text())
    out = edit(m)
    kit.manifest_file().write_text(out if isinstance(out, str) else json.dumps(m))


# --- journal entries (issue 15, items 2 and 3) ---------------------------------------------------------------
def journal_path_escape(kit, outside):
    victim = outside / "victim.txt"
    victim.write_text("precious\n")
    pristine = kit.files[A][0].encode()
    (_state(kit) / "backups" / _sha(pristine)).write_bytes(pristine)
    _journal(kit, _good_journal(kit, [{"path": "../victim.txt", "before": _sha(b"precious\n"),
                                       "after": _sha(b"x"), "pristine": _sha(pristine)}]))


def journal_absolute_path(kit, outside):
    victim = outside / "victim.txt"
    victim.write_text("precious\n")
    _journal(kit, _good_journal(kit, [{"path": str(victim), "before": _sha(b"precious\n"), "after": _sha(b"x"),
                                       "pristine": _sha(kit.files[A][0].encode())}]))


def journal_wrong_shape(kit, outside):
    _journal(kit, {"op": "apply", "files": [{"path": "sglang/x"}]})


def journal_list(kit, outside):
    _journal(kit, [1, 2])


def journal_files_of_numbers(kit, outside):
    _journal(kit, {"files": [1]})


def journal_unlisted_file(kit, outside):
    other = kit.site / "sglang" / "srt" / "other.py"
    other.write_text("mine\n")
    _journal(kit, _good_journal(kit, [_entry(kit, A, path="sglang/srt/other.py")]))


def journal_foreign_hashes(kit, outside):
    """A known path, but 'before' is the hash of what the attacker put there: never restored over."""
    _journal(kit, _good_journal(kit, [_entry(kit, A, before=_sha(b"attacker"))]))


def journal_symlink(kit, outside):
    real = outside / "journal.json"
    real.write_text(json.dumps(_good_journal(kit, [_entry(kit, A)])))
    (_state(kit) / "journal.json").symlink_to(real)


def journal_fifo(kit, outside):
    os.mkfifo(_state(kit) / "journal.json")


def journal_huge(kit, outside):
    _journal(kit, b" " * (2 << 20) + json.dumps(_good_journal(kit, [_entry(kit, A)])).encode())


def journal_deeply_nested(kit, outside):
    _journal(kit, "[" * 100_000 + "]" * 100_000)


def journal_duplicate_keys(kit, outside):
    good = json.dumps(_good_journal(kit, [_entry(kit, A)]))
    _journal(kit, good[:-1] + ', "op": "revert"}')


# --- kit data (item 4 and the list) ---------------------------------------------------------------------------
def manifest_nul_in_path(kit, outside):
    _manifest(kit, lambda m: m["files"][0].update(path="sglang/srt/a.py\u0000.txt"))


def manifest_engine_list(kit, outside):
    _manifest(kit, lambda m: m.update(engine=["sglang"]))


def manifest_deeply_nested(kit, outside):
    _manifest(kit, lambda m: "[" * 100_000 + "]" * 100_000)


def manifest_duplicate_keys(kit, outside):
    _manifest(kit, lambda m: json.dumps(m)[:-1] + ', "release": "0.5.23"}')


def manifest_unknown_key(kit, outside):
    _manifest(kit, lambda m: m.update(signed_by="me"))


def manifest_wrong_types(kit, outside):
    _manifest(kit, lambda m: m.update(files={"sglang/srt/a.py": 1}))


def manifest_huge(kit, outside):
    _manifest(kit, lambda m: json.dumps(m) + " " * (2 << 20))


def manifest_nan(kit, outside):
    _manifest(kit, lambda m: json.dumps(m)[:-1] + ', "x": NaN}')


def series_with_options(kit, outside):
    (kit.data / "patches" / "sglang" / "series").write_text("0001-demo.patch -p0\n")


def series_fifo(kit, outside):
    series = kit.data / "patches" / "sglang" / "series"
    series.unlink()
    os.mkfifo(series)


# --- targets (items 5 and 6 and the list) ---------------------------------------------------------------------
def target_fifo(kit, outside):
    kit.path(B).unlink()
    os.mkfifo(kit.path(B))


def target_socket(kit, outside):
    kit.path(B).unlink()
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(kit.path(B)))
    s.close()


def target_device(kit, outside):
    kit.path(B).unlink()
    os.mknod(kit.path(B), 0o644 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers


def target_directory(kit, outside):
    kit.path(B).unlink()
    kit.path(B).mkdir()
    (kit.path(B) / "x").write_text("x")


def target_symlink_inside(kit, outside):
    copy = kit.path(B).with_name("b_copy.py")
    copy.write_bytes(kit.path(B).read_bytes())
    kit.path(B).unlink()
    kit.path(B).symlink_to("b_copy.py")


def target_symlink_outside(kit, outside):
    (outside / "b.py").write_bytes(kit.path(B).read_bytes())
    kit.path(B).unlink()
    kit.path(B).symlink_to(outside / "b.py")


def target_directory_symlink(kit, outside):
    managers = kit.path(B).parent
    managers.rename(outside / "managers")
    managers.symlink_to(outside / "managers")


def target_mode_000(kit, outside):
    os.chown(kit.path(B), 65534, 65534)
    os.chmod(kit.path(B), 0)


# --- our own state, planted (item 7 and the threat of item 2) -------------------------------------------------
def state_dir_symlink(kit, outside):
    (outside / "state").mkdir()
    (kit.site / ".sglang-ssd-stream").symlink_to(outside / "state")


def lock_symlink(kit, outside):
    victim = outside / "victim.txt"
    victim.write_text("precious\n")
    (_state(kit) / "lock").symlink_to(victim)


def backup_symlink(kit, outside):
    """Revert reads backups by content hash only, and never through a symlink."""
    assert run_cli(kit, "apply")[0] == EXIT_OK
    pristine = kit.files[A][0].encode()
    backup = kit.site / STATE / "backups" / _sha(pristine)
    (outside / "blob").write_bytes(pristine)
    backup.unlink()
    backup.symlink_to(outside / "blob")


def tampered_never_patched(kit, outside):
    """A refused apply on a site never patched creates no state directory (item 7)."""
    kit.path(B).write_text(kit.path(B).read_text() + "# local edit\n")


def other_release_manifest_broken(kit, outside):
    (kit.data / "hashes" / "sglang-1x.json").write_text(json.dumps({"engine": "sglang", "release": "1x",
                                                                     "patches": [], "files": []}))
    (kit.data / "hashes" / "sglang-0.5.22.json").write_text("{ not json")


CASES = [
    # (setup, command, exit code, text in stderr/stdout)
    (journal_path_escape, "status", EXIT_REFUSED, "'../victim.txt' contains '..'"),
    (journal_absolute_path, "status", EXIT_REFUSED, "is absolute"),
    (journal_wrong_shape, "apply", EXIT_REFUSED, "expected an object with exactly"),
    (journal_list, "status", EXIT_REFUSED, "expected an object with exactly"),
    (journal_files_of_numbers, "verify", EXIT_REFUSED, "expected an object with exactly"),
    (journal_unlisted_file, "revert", EXIT_REFUSED, "'sglang/srt/other.py' is not a file of the 0.5.23 manifest"),
    (journal_foreign_hashes, "status", EXIT_REFUSED, "are not the manifest's"),
    (journal_symlink, "status", EXIT_REFUSED, "is a symlink"),
    (journal_fifo, "status", EXIT_REFUSED, "is a FIFO"),
    (journal_huge, "status", EXIT_REFUSED, "larger than 1048576 bytes"),
    (journal_deeply_nested, "status", EXIT_REFUSED, "nested too deeply"),
    (journal_duplicate_keys, "status", EXIT_REFUSED, "duplicate key 'op'"),
    (manifest_nul_in_path, "apply", EXIT_BAD_KIT_DATA, "contains a control character"),
    (manifest_engine_list, "status", EXIT_BAD_KIT_DATA, "unknown engine ['sglang']"),
    (manifest_deeply_nested, "apply", EXIT_BAD_KIT_DATA, "nested too deeply"),
    (manifest_duplicate_keys, "apply", EXIT_BAD_KIT_DATA, "duplicate key 'release'"),
    (manifest_unknown_key, "apply", EXIT_BAD_KIT_DATA, "unknown field(s) ['signed_by']"),
    (manifest_wrong_types, "apply", EXIT_BAD_KIT_DATA, "files: expected a list, got dict"),
    (manifest_huge, "apply", EXIT_BAD_KIT_DATA, "larger than 1048576 bytes"),
    (manifest_nan, "apply", EXIT_BAD_KIT_DATA, "NaN is not JSON"),
    (series_with_options, "apply", EXIT_BAD_KIT_DATA, "quilt options are not supported"),
    (series_fifo, "apply", EXIT_BAD_KIT_DATA, "is a FIFO, not a regular file"),
    (target_fifo, "apply", EXIT_REFUSED, f"{B} is a FIFO"),
    (target_socket, "apply", EXIT_REFUSED, f"{B} is a socket"),
    (target_device, "apply", EXIT_REFUSED, f"{B} is a character device"),
    (target_directory, "apply", EXIT_REFUSED, f"{B} is a directory"),
    (target_symlink_inside, "apply", EXIT_REFUSED, f"{B} is a symlink"),
    (target_symlink_outside, "apply", EXIT_REFUSED, f"{B} is a symlink"),
    (target_directory_symlink, "apply", EXIT_REFUSED, f"{B} is under sglang/srt/managers, which is a symlink"),
    (target_mode_000, "apply", EXIT_REFUSED, f"{B} is mode 000, unreadable by its owner"),
    (state_dir_symlink, "apply", EXIT_REFUSED, ".sglang-ssd-stream is not a directory of ours"),
    (lock_symlink, "apply", EXIT_REFUSED, "lock is a symlink"),
    (backup_symlink, "revert", EXIT_REFUSED, "is a symlink; refusing it"),
    (tampered_never_patched, "apply", EXIT_REFUSED, "Refusing to patch an unknown sglang source state"),
    (other_release_manifest_broken, "status", EXIT_OK, "pristine  sglang/srt/a.py"),
]


def _cli(kit: Kit, command: str) -> subprocess.CompletedProcess:
    return kit.cli(command)  # subprocess, 120 s timeout: a blocking open of a FIFO fails the test


@pytest.mark.parametrize("setup,command,code,text", CASES, ids=[c[0].__name__ for c in CASES])
def test_hostile_input_is_refused_and_nothing_is_written(tmp_path, setup, command, code, text):
    kit = write_kit(tmp_path / "kit")
    outside = tmp_path / "outside"
    outside.mkdir()
    setup(kit, outside)
    before = snapshot(tmp_path)
    r = _cli(kit, command)
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert text in r.stderr + r.stdout, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert snapshot(tmp_path) == before


def test_case_count():
    """README counts the hostile inputs; this keeps the number honest."""
    assert len(CASES) >= 25
    assert len({c[0].__name__ for c in CASES}) == len(CASES)


def test_broken_manifest_breaks_only_its_release(tmp_path):
    kit = write_kit(tmp_path)
    other_release_manifest_broken(kit, tmp_path)
    assert run_cli(kit, "apply")[0] == EXIT_OK  # 0.5.23 still installs
    dist = next(kit.site.glob("sglang-*.dist-info"))
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.22\n")
    dist.rename(kit.site / "sglang-0.5.22.dist-info")
    rc, out, err = run_cli(kit, "status")
    assert rc == EXIT_BAD_KIT_DATA and "sglang-0.5.22.json is not valid JSON" in err


def test_broken_manifest_of_a_local_build_names_its_own_error(tmp_path):
    """0.5.23+local selects the 0.5.23 manifest; when that one is broken, its own error is reported (exit 3)."""
    kit = write_kit(tmp_path)
    kit.manifest_file().write_text("{ not json")
    dist = next(kit.site.glob("sglang-*.dist-info"))
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.23+local\n")
    dist.rename(kit.site / "sglang-0.5.23+local.dist-info")
    rc, out, err = run_cli(kit, "status")
    assert rc == EXIT_BAD_KIT_DATA and "sglang-0.5.23.json is not valid JSON" in err, err


def test_shared_hard_link_is_never_written_through(tmp_path):
    """A target hard-linked to another file (the kit's own cloned venvs are: cp -al) is replaced by
    rename, so the other name keeps its bytes and inode through apply and revert."""
    kit = write_kit(tmp_path)
    twin = tmp_path / "twin.py"
    os.link(kit.path(B), twin)
    before = (twin.read_bytes(), os.stat(twin).st_ino)
    assert run_cli(kit, "apply")[0] == EXIT_OK
    assert kit.path(B).read_text() == kit.files[B][1]
    assert (twin.read_bytes(), os.stat(twin).st_ino) == before
    assert run_cli(kit, "revert")[0] == EXIT_OK
    assert (twin.read_bytes(), os.stat(twin).st_ino) == before


def test_unreadable_target_as_another_user(tmp_path):
    """Not root: a file we cannot read is an I/O refusal (exit 4) naming the file and errno, nothing written."""
    import tempfile

    tmp_path = Path(tempfile.mkdtemp(prefix="ssd-stream-nobody-"))  # pytest's own tmp is 0700 root
    request_cleanup.append(tmp_path)
    kit = write_kit(tmp_path / "kit")
    os.chmod(tmp_path, 0o755)
    for p in [tmp_path / "kit", *(tmp_path / "kit").rglob("*")]:
        os.chown(p, 65534, 65534, follow_symlinks=False)
    os.chown(kit.path(B), 0, 0)
    os.chmod(kit.path(B), 0)
    # The test venv may live where another user cannot go (CI's is under /root, mode 0700): run the kit with
    # the system interpreter and a copy of the kit's third-party modules that user can read.
    deps = tmp_path / "deps"
    for name in ("packaging", "unidiff", "numpy"):  # the CLI imports the sidecar commands (numpy) too
        src = Path(importlib.util.find_spec(name).submodule_search_locations[0])
        shutil.copytree(src, deps / name)
        if (src.parent / f"{name}.libs").is_dir():  # a manylinux wheel's vendored shared libraries
            shutil.copytree(src.parent / f"{name}.libs", deps / f"{name}.libs")
    python = shutil.which("python3", path="/usr/bin:/usr/local/bin:/bin")
    assert python, "no system python3 another user can run"
    before = snapshot(tmp_path)
    r = kit.cli("apply", prefix=["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"], python=python,
                env_extra={"PYTHONPATH": f"{deps}{os.pathsep}{REPO}"})
    assert r.returncode == EXIT_ENVIRONMENT, (r.returncode, r.stderr)
    assert f"cannot read {B}: EACCES (Permission denied)" in r.stderr
    assert snapshot(tmp_path) == before


request_cleanup: list[Path] = []


@pytest.fixture(autouse=True, scope="module")
def _cleanup():
    yield
    import shutil

    for p in request_cleanup:
        shutil.rmtree(p, ignore_errors=True)


def test_planted_temp_symlink_is_removed_not_followed(tmp_path):
    """A leftover name of ours planted as a symlink: removed as a leftover, never written through."""
    kit = write_kit(tmp_path / "kit")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (_state(kit) / "lock").touch()
    kit.path(A).with_name("a.py.sglang-ssd-stream-tmp").symlink_to(victim)
    assert run_cli(kit, "apply")[0] == EXIT_OK
    assert victim.read_text() == "precious\n"
    assert not kit.path(A).with_name("a.py.sglang-ssd-stream-tmp").exists()
