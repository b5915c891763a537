"""Issue 29: reporting commands never write, a recovery never splits a patch group, an odd path
component is a refusal (never a traceback), and past the commit point no command claims a rollback.

Each case was measured wrong on the code before this change (status recovered a one-file journal into
a half-patched group and exited 0; a symlinked directory under a pending journal raised NotAFile; an
unwritable stdout after apply raised OSError; a failed final survey said "nothing was changed").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sglang_ssd_stream.errors import EXIT_CHANGED, EXIT_OK, EXIT_PENDING, EXIT_REFUSED

from .conftest import A_PRISTINE, REPO, run_cli, sha, snapshot

STATE = (".sglang-ssd-stream", "sglang")


def _journal(kit, files: list[str], op: str = "apply") -> None:
    """A well-formed journal naming ``files`` (before pristine, after patched), as a killed apply leaves it."""
    entries = [{"path": rel, "before": sha(p), "after": sha(q), "pristine": sha(p)}
               for rel, (p, q) in sorted(kit.files.items()) if rel in files]
    path = kit.site.joinpath(*STATE, "journal.json")
    path.write_text(json.dumps({"version": 1, "op": op, "engine": "sglang", "release": "0.5.23", "files": entries}))


def _states(kit) -> set[str]:
    return {("pristine" if kit.path(r).read_text() == p else "patched" if kit.path(r).read_text() == q else "other")
            for r, (p, q) in kit.files.items()}


def test_a_journal_that_would_split_a_group_is_reported_and_refused(kit):
    """The adversary's case: a fully patched tree, a journal listing one file of the group."""
    assert run_cli(kit, "apply")[0] == EXIT_OK
    _journal(kit, ["sglang/srt/a.py"])
    before = snapshot(kit.site)
    for verb in ("status", "verify"):
        rc, out, err = run_cli(kit, verb)
        assert rc == EXIT_PENDING and "PENDING" in out and "sglang/srt/a.py" in out, (verb, rc, out, err)
        assert "patch recover" in out
        assert snapshot(kit.site) == before, f"{verb} wrote"
    for verb in ("recover", "apply", "revert"):
        rc, out, err = run_cli(kit, verb)
        assert rc == EXIT_REFUSED, (verb, rc, out, err)
        assert "patch group 0001-demo mixed" in err and "sglang/srt/managers/b.py patched" in err, err
        assert "Nothing was changed" in err and "Traceback" not in err
        assert snapshot(kit.site) == before, f"{verb} wrote"
    assert _states(kit) == {"patched"}


def test_a_whole_journal_is_recovered_only_by_a_write_command(kit):
    """A journal naming every file of the group (what a killed apply leaves): status reports, recover rolls back."""
    assert run_cli(kit, "apply")[0] == EXIT_OK
    _journal(kit, list(kit.files))
    before = snapshot(kit.site)
    assert run_cli(kit, "status")[0] == EXIT_PENDING and snapshot(kit.site) == before
    rc, out, err = run_cli(kit, "recover")
    assert rc == EXIT_OK, err
    assert "rolled 2 file(s) back to pristine" in out and "recovered   sglang/srt/a.py" in out
    assert _states(kit) == {"pristine"} and not kit.site.joinpath(*STATE, "journal.json").exists()
    rc, out, _ = run_cli(kit, "recover")
    assert rc == EXIT_OK and "nothing to recover" in out


def test_the_guard_never_writes_under_a_pending_journal(kit):
    from sglang_ssd_stream.patching.guard import verdict

    assert run_cli(kit, "apply")[0] == EXIT_OK
    _journal(kit, list(kit.files))
    before = snapshot(kit.site)
    v = verdict("sglang", site_packages=kit.site, root=kit.data)
    assert v.state == "pending" and snapshot(kit.site) == before


@pytest.mark.parametrize("odd", ["symlink", "file"])
@pytest.mark.parametrize("journal", [False, True], ids=["no-journal", "journal"])
def test_an_odd_directory_on_a_target_path_is_a_refusal(kit, tmp_path, odd, journal):
    """sglang/srt/managers replaced by a symlink (to a copy) or a plain file, with or without a pending journal."""
    import shutil

    assert run_cli(kit, "apply")[0] == EXIT_OK
    if journal:
        _journal(kit, list(kit.files))
    managers = kit.site / "sglang" / "srt" / "managers"
    elsewhere = tmp_path / "elsewhere"
    shutil.move(managers, elsewhere)
    if odd == "symlink":
        managers.symlink_to(elsewhere, target_is_directory=True)
    else:
        managers.write_text("not a directory\n")
    before, outside = snapshot(kit.site), snapshot(elsewhere)
    for verb in ("status", "apply", "revert", "recover"):
        for extra in ((), ("--json",)):
            rc, out, err = run_cli(kit, verb, *extra)
            assert "Traceback" not in out + err, (verb, out, err)
            if verb == "recover" and not journal:
                assert rc == EXIT_OK  # nothing to recover; the survey shows the odd file
            elif verb == "status" and journal:
                assert rc == EXIT_PENDING, (verb, extra, rc, out, err)  # the journal is what to act on first
            else:
                assert rc == EXIT_REFUSED, (verb, extra, rc, out, err)
            assert "sglang/srt/managers" in out + err
            assert snapshot(kit.site) == before and snapshot(elsewhere) == outside, verb
    from sglang_ssd_stream.patching.guard import verdict

    v = verdict("sglang", site_packages=kit.site, root=kit.data)
    assert v.state in ("unknown", "pending") and "sglang/srt/managers" in v.listing


def test_unwritable_stdout_after_apply_says_the_change_was_made(kit):
    r = subprocess.run(f'"{sys.executable}" -m sglang_ssd_stream patch apply --site-packages "{kit.site}" '
                       f'--data-dir "{kit.data}" > /dev/full', shell=True, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert r.returncode == EXIT_CHANGED, (r.returncode, r.stderr)
    assert "the apply WAS made" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert _states(kit) == {"patched"}
    r = subprocess.run(f'"{sys.executable}" -m sglang_ssd_stream patch status --site-packages "{kit.site}" '
                       f'--data-dir "{kit.data}" > /dev/full', shell=True, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert r.returncode == 4 and "nothing was changed" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_a_failed_final_check_after_the_commit_says_the_change_was_made(kit, monkeypatch, command):
    from sglang_ssd_stream.errors import EnvironmentProblem
    from sglang_ssd_stream.patching import commands

    if command == "revert":
        assert run_cli(kit, "apply")[0] == EXIT_OK
    real = commands.survey
    calls = {"n": 0}

    def survey(*a, **kw):  # the plan's survey and the one under the lock work; the final one fails
        calls["n"] += 1
        if calls["n"] == 3:
            raise EnvironmentProblem("cannot read sglang/srt/a.py: EIO (Input/output error); nothing was changed")
        return real(*a, **kw)

    monkeypatch.setattr(commands, "survey", survey)
    rc, out, err = run_cli(kit, command)
    assert calls["n"] == 3
    assert rc == EXIT_CHANGED and f"the {command} was made (committed)" in err and "patch verify" in err, (rc, err)
    assert _states(kit) == {"patched" if command == "apply" else "pristine"}


def test_a_lock_path_that_is_a_directory_is_named(kit):
    state = kit.site.joinpath(*STATE)
    state.mkdir(parents=True)
    (state / "lock").mkdir()
    rc, out, err = run_cli(kit, "apply")
    assert rc == EXIT_REFUSED and "lock" in err and "not a regular file" in err, (rc, err)
    assert "cannot :" not in err and "Traceback" not in err
    assert kit.path("sglang/srt/a.py").read_text() == A_PRISTINE


def test_a_nul_byte_in_a_patch_is_refused(kit):
    diff = kit.diff_file()
    diff.write_bytes(diff.read_bytes() + b"\0")
    rc, out, err = run_cli(kit, "apply")
    assert rc == 3 and "contains a NUL byte" in err, (rc, err)
    assert kit.path("sglang/srt/a.py").read_text() == A_PRISTINE


def test_an_io_error_reading_a_patch_is_the_environment(kit, monkeypatch):
    """EIO reading a kit .patch says the machine cannot read it (exit 4), not that the data is bad (3)."""
    import errno

    from sglang_ssd_stream.patching import files

    real = files._read_fd

    def failing(fd, limit, what):
        if "diff file" in what:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, limit, what)

    monkeypatch.setattr(files, "_read_fd", failing)
    rc, out, err = run_cli(kit, "apply")
    assert rc == 4 and "cannot read patch 0001-demo: diff file" in err and "EIO" in err, (rc, err)
    assert kit.path("sglang/srt/a.py").read_text() == A_PRISTINE


def test_a_signal_during_recovery_is_honoured_after_every_file_is_pristine(kit, monkeypatch):
    """SIGINT while recover rolls the second file back: it finishes the roll back, then says so (exit 7)."""
    import signal

    from sglang_ssd_stream.patching import transaction

    assert run_cli(kit, "apply")[0] == EXIT_OK
    _journal(kit, list(kit.files))
    writes = {"n": 0}

    def checkpoint(self, step):
        if step.startswith("write sglang/srt"):
            writes["n"] += 1
            if writes["n"] == 2:
                os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(transaction.Transaction, "_checkpoint", checkpoint)
    rc, out, err = run_cli(kit, "recover")
    assert writes["n"] == 2
    assert rc == EXIT_CHANGED and "WAS made" in err, (rc, out, err)
    assert _states(kit) == {"pristine"} and not kit.site.joinpath(*STATE, "journal.json").exists()


def test_a_failure_after_the_recovery_step_says_the_recovery_was_made(kit, monkeypatch):
    """apply recovers a journal (patched -> pristine), then its own commit hits ENOSPC: never "nothing changed"."""
    import errno

    from sglang_ssd_stream.patching import transaction

    assert run_cli(kit, "apply")[0] == EXIT_OK
    _journal(kit, list(kit.files))

    def checkpoint(self, step):
        if step == "write journal":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(transaction.Transaction, "_checkpoint", checkpoint)
    rc, out, err = run_cli(kit, "apply")
    assert rc == EXIT_CHANGED, (rc, err)
    assert "first rolled back to pristine" in err and "Nothing was changed" not in err, err
    assert _states(kit) == {"pristine"}


def test_status_keeps_the_pending_exit_when_a_file_is_also_missing(kit):
    assert run_cli(kit, "apply")[0] == EXIT_OK
    _journal(kit, list(kit.files))
    kit.path("sglang/srt/managers/b.py").unlink()
    assert run_cli(kit, "status")[0] == EXIT_PENDING
    assert run_cli(kit, "verify")[0] == EXIT_PENDING
