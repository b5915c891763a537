"""Every fault at every write step of apply and revert rolls back in the same process.

Faults enter through the transaction's seam (Transaction._checkpoint, called before each write
step): an OSError with the errno the real fault gives (EIO; ENOSPC, a full disk; EPERM, an
immutable file; EROFS, a read-only mount), or a real SIGINT/SIGTERM sent to this process. One
test per (command x step x fault). test_real_faults.py provokes the same faults for real.

After the failed command returns, before any other command runs, the tree is exactly as before
(bytes, modes, entries: the state directory an apply created is gone again), the exit is 4 naming
the step's file and errno, or 130/143. A fault that lasts (it also hits the rollback) keeps the
journal once one exists; status and verify then say so with exit 4, and once the fault is gone
`status` rolls every file back to pristine.
"""

from __future__ import annotations

import errno
import os
import signal

import pytest

from sglang_ssd_stream.errors import EXIT_CHANGED, EXIT_ENVIRONMENT, EXIT_OK, EXIT_PENDING
from sglang_ssd_stream.patching.transaction import Transaction

from .conftest import record_steps, run_cli, snapshot, write_kit

APPLY, REVERT = record_steps("apply"), record_steps("revert")
STEPS = {"apply": APPLY, "revert": REVERT}
AFTER_COMMIT = "fsync-dir state (after the commit point)"
ERRNO = {"EIO": errno.EIO, "ENOSPC": errno.ENOSPC, "EPERM": errno.EPERM, "EROFS": errno.EROFS}
SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM}
CASES = [(command, step) for command, steps in STEPS.items() for step in steps if step != AFTER_COMMIT]


def _id(case):
    return f"{case[0]}:{case[1]}".replace(" ", "_") if isinstance(case, tuple) else str(case)


def inject(monkeypatch, at: str, fault: str, *, sticky: bool = False) -> dict:
    """Fault at step ``at`` (and, sticky, at every step after it, the rollback's included)."""
    state = {"hit": 0}

    def checkpoint(self, step):
        if step == at or (sticky and state["hit"]):
            state["hit"] += 1
            if fault in ERRNO:
                raise OSError(ERRNO[fault], os.strerror(ERRNO[fault]))
            if state["hit"] == 1:
                os.kill(os.getpid(), SIGNALS[fault])

    monkeypatch.setattr(Transaction, "_checkpoint", checkpoint)
    return state


def _kit(tmp_path, command):
    kit = write_kit(tmp_path)
    if command == "revert":
        assert run_cli(kit, "apply")[0] == EXIT_OK
    return kit


def _states(kit):
    return {rel: ("pristine" if kit.path(rel).read_text() == p else "patched" if kit.path(rel).read_text() == q
                  else "other") for rel, (p, q) in kit.files.items()}


def _leftovers(kit):
    return [p for p in kit.site.rglob("*") if p.name.endswith((".sglang-ssd-stream-tmp", ".sglang-ssd-stream-orig"))]


def test_the_seam_sees_every_write():
    """The step lists the parametrisation runs over cover each kind of write of each file."""
    for command, steps in STEPS.items():
        for rel in ("sglang/srt/a.py", "sglang/srt/managers/b.py"):
            for verb in ("create", "write", "chmod", "fsync", "link", "rename", "fsync-dir"):
                assert f"{verb} {rel}" in steps, (command, verb, rel)
            assert f"unlink {rel}.sglang-ssd-stream-orig" in steps
        for verb in ("create", "write", "chmod", "fsync", "rename", "fsync-dir"):
            assert f"{verb} journal" in steps
        assert steps[-2:] == ["unlink journal", AFTER_COMMIT]
    assert sum(s.startswith("rename backup") for s in APPLY) == 2 and APPLY[:4] == [
        "mkdir .sglang-ssd-stream", "mkdir .sglang-ssd-stream/sglang", "mkdir .sglang-ssd-stream/sglang/backups",
        "create .sglang-ssd-stream/sglang/lock"]
    assert len(CASES) == len(APPLY) + len(REVERT) - 2


@pytest.mark.parametrize("fault", [*ERRNO, *SIGNALS])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fault_rolls_back_in_the_same_process(tmp_path, monkeypatch, case, fault):
    command, step = case
    kit = _kit(tmp_path, command)
    before = snapshot(kit.site)
    hit = inject(monkeypatch, step, fault)
    rc, out, err = run_cli(kit, command)
    assert hit["hit"] == 1
    if fault in ERRNO:
        assert rc == EXIT_ENVIRONMENT, (rc, err)
        assert f"cannot {step}: {fault} ({os.strerror(ERRNO[fault])})" in err, err
    else:
        assert rc == 128 + SIGNALS[fault], (rc, err)
        assert f"interrupted by {fault} before {step}" in err, err
    assert "rolled back: every file is as it was" in err and "Traceback" not in err
    assert snapshot(kit.site) == before  # bytes, modes, entries: no journal, temp, side link or new state dir


@pytest.mark.parametrize("fault", list(ERRNO))
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_lasting_fault_keeps_the_journal_until_it_is_gone(tmp_path, monkeypatch, case, fault):
    command, step = case
    steps = STEPS[command]
    kit = _kit(tmp_path, command)
    start = _states(kit)
    inject(monkeypatch, step, fault, sticky=True)
    rc, out, err = run_cli(kit, command)
    assert rc == EXIT_ENVIRONMENT and "Traceback" not in err, (rc, err)
    assert f"cannot {step}: {fault}" in err
    journal = kit.site / ".sglang-ssd-stream" / "sglang" / "journal.json"
    journal_written = steps.index("rename journal") < steps.index(step)
    assert journal.exists() == journal_written, err
    if journal_written:
        assert f"the journal {journal} is kept" in err and "patch recover` with write access" in err
        kept = snapshot(kit.site)
        for verb in ("status", "verify"):  # exit 6, said plainly, no traceback, and not a byte written
            rc, out, err = run_cli(kit, verb)
            assert rc == EXIT_PENDING and "PENDING" in out and "Traceback" not in err, (verb, rc, out, err)
            assert snapshot(kit.site) == kept
        rc, out, err = run_cli(kit, "recover")  # while the fault lasts: exit 4, journal still kept
        assert rc == EXIT_ENVIRONMENT and journal.exists() and "Traceback" not in err, (rc, out, err)
    else:
        assert _states(kit) == start and "Nothing was changed" in err
    monkeypatch.setattr(Transaction, "_checkpoint", lambda self, step: None)  # the fault is gone
    rc, out, err = run_cli(kit, "recover")
    assert rc == EXIT_OK, err
    assert set(_states(kit).values()) == ({"pristine"} if journal_written else set(start.values()))
    assert not journal.exists() and not _leftovers(kit)
    assert run_cli(kit, "apply")[0] == EXIT_OK and set(_states(kit).values()) == {"patched"}


@pytest.mark.parametrize("fault", [*ERRNO, *SIGNALS])
@pytest.mark.parametrize("command", ["apply", "revert"])
def test_fault_after_the_commit_point_keeps_the_finished_change(tmp_path, monkeypatch, command, fault):
    """Past the journal's removal nothing is rolled back: an fsync error is a warning (a crash could only
    bring back the journal, whose recovery gives pristine, never a mix); a signal is reported as late."""
    kit = _kit(tmp_path, command)
    inject(monkeypatch, AFTER_COMMIT, fault)
    rc, out, err = run_cli(kit, command)
    done = {"apply": "patched", "revert": "pristine"}[command]
    assert set(_states(kit).values()) == {done}
    if fault in ERRNO:
        assert rc == EXIT_OK and "warning: could not fsync" in out and fault in out
    else:  # honoured after the report, which says the change was made: never 130/143 ("rolled back")
        assert rc == EXIT_CHANGED and "arrived after the commit point: the change above WAS made" in err, (rc, err)
        assert "rolled back" not in out + err
    assert not _leftovers(kit) and not (kit.site / ".sglang-ssd-stream" / "sglang" / "journal.json").exists()


@pytest.mark.parametrize("fault", list(ERRNO))
def test_recovery_fault_then_recovery(tmp_path, monkeypatch, fault):
    """A journal left by a killed process: recovery under a lasting fault says pending (exit 4), then finishes."""
    kit = write_kit(tmp_path)
    inject(monkeypatch, "unlink sglang/srt/a.py.sglang-ssd-stream-orig", "EIO", sticky=True)
    assert run_cli(kit, "apply")[0] == EXIT_ENVIRONMENT  # journal kept, files may be patched
    inject(monkeypatch, "create sglang/srt/a.py", fault, sticky=True)
    for verb in ("status", "verify", "apply", "revert", "recover"):
        rc, out, err = run_cli(kit, verb)
        want = EXIT_PENDING if verb in ("status", "verify") else EXIT_ENVIRONMENT  # status/verify never write
        assert rc == want and "Traceback" not in err, (verb, rc, out, err)
    monkeypatch.setattr(Transaction, "_checkpoint", lambda self, step: None)
    assert run_cli(kit, "status")[0] == EXIT_PENDING  # still: status does not recover
    assert run_cli(kit, "recover")[0] == EXIT_OK
    assert set(_states(kit).values()) == {"pristine"} and not _leftovers(kit)


def test_guard_verdict_while_a_rollback_is_pending(tmp_path, monkeypatch):
    """The plugins' and doctors' one verdict: a kept journal is 'pending', an error naming the fault and the fix."""
    from sglang_ssd_stream.findings import ERROR
    from sglang_ssd_stream.patching.guard import verdict

    kit = write_kit(tmp_path)
    inject(monkeypatch, "unlink sglang/srt/a.py.sglang-ssd-stream-orig", "EIO", sticky=True)
    assert run_cli(kit, "apply")[0] == EXIT_ENVIRONMENT
    monkeypatch.setattr(Transaction, "_checkpoint", lambda self, step: None)  # even with write access:
    before = snapshot(kit.site)
    v = verdict("sglang", site_packages=kit.site, root=kit.data)
    assert snapshot(kit.site) == before  # the guard runs in every engine process: it never writes
    assert v.state == "pending" and "journal" in v.listing and "sglang/srt/a.py" in v.listing
    (finding,) = [f for f in v.findings() if f.check == "source"]
    assert finding.level == ERROR and "left its journal" in finding.message
    assert "sglang-ssd-stream patch recover" in finding.fix
    assert run_cli(kit, "recover")[0] == EXIT_OK
    assert verdict("sglang", site_packages=kit.site, root=kit.data).state == "pristine"


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_a_read_fault_after_the_commit_point_does_not_say_nothing_was_changed(tmp_path, monkeypatch, command):
    """Issue 43 item 6: the final check's read error ("...; nothing was changed") was wrapped as is in the
    exit-7 message that says the change was made."""
    from sglang_ssd_stream.patching import state

    kit = _kit(tmp_path, command)
    committed = {"done": False}
    real_commit, real_read = Transaction.commit, state.read_at

    def commit(self, writes, op):
        real_commit(self, writes, op)
        committed["done"] = True

    def read_at(*args, **kwargs):
        if committed["done"]:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_read(*args, **kwargs)

    monkeypatch.setattr(Transaction, "commit", commit)
    monkeypatch.setattr(state, "read_at", read_at)
    rc, _, err = run_cli(kit, command)
    assert rc == EXIT_CHANGED, (rc, err)
    assert "was made" in err and "nothing was changed" not in err.lower(), err
    assert set(_states(kit).values()) == {"patched" if command == "apply" else "pristine"}


@pytest.mark.parametrize("command", ["apply", "revert"])
@pytest.mark.parametrize("fault", sorted(SIGNALS))
def test_a_signal_while_the_committed_report_prints_exits_7(tmp_path, monkeypatch, command, fault):
    """Issue 43 item 6: a signal recorded while the post-commit report printed was dropped (exit 0)."""
    from sglang_ssd_stream.patching import cli

    kit = _kit(tmp_path, command)
    real_render = cli.render

    def render(report):
        os.kill(os.getpid(), SIGNALS[fault])
        real_render(report)

    monkeypatch.setattr(cli, "render", render)
    rc, out, err = run_cli(kit, command)
    assert rc == EXIT_CHANGED, (rc, out, err)
    assert f"{fault} arrived after the commit point" in err and "change WAS made" in err, err
    assert set(_states(kit).values()) == {"patched" if command == "apply" else "pristine"}


@pytest.mark.parametrize("fault", sorted(SIGNALS))
def test_a_signal_while_a_no_op_report_prints_is_the_signals_exit(tmp_path, monkeypatch, fault):
    from sglang_ssd_stream.patching import cli

    kit = _kit(tmp_path, "revert")  # patched: a second apply has nothing to do
    before = snapshot(kit.site)
    real_render = cli.render

    def render(report):
        os.kill(os.getpid(), SIGNALS[fault])
        real_render(report)

    monkeypatch.setattr(cli, "render", render)
    rc, _, err = run_cli(kit, "apply")
    assert rc == 128 + SIGNALS[fault] and "nothing was changed" in err, (rc, err)
    assert snapshot(kit.site) == before
