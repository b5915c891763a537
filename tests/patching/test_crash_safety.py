"""Kill the installer (os._exit, like SIGKILL) at every write step; files must never end mixed.

A killed process cannot roll back: ``status`` then reports the journal and writes nothing (exit 6);
``recover`` (or apply/revert, which recover first) rolls it back from the journal and the
content-addressed backups.
"""

from __future__ import annotations

import pytest

from sglang_ssd_stream.errors import EXIT_OK, EXIT_PENDING

from .conftest import record_steps, run_cli, snapshot

# Runs the real CLI with Transaction._checkpoint replaced by a counter that dies at step KILL_AT.
WRAPPER = """
import os, sys
from sglang_ssd_stream.patching import transaction
kill_at = int(os.environ["KILL_AT"]); seen = []
def checkpoint(self, step):
    seen.append(step)
    if len(seen) == kill_at:
        print("killed at", step, flush=True)
        os._exit(137)
transaction.Transaction._checkpoint = checkpoint
from sglang_ssd_stream.cli import main
sys.exit(main(sys.argv[1:]))
"""

APPLY, REVERT = record_steps("apply"), record_steps("revert")
# 1-based kill points: a kill *at* step k stops before k runs.
APPLY_COMMITTED_AFTER = APPLY.index("unlink journal") + 1  # killed later: the apply is complete
REVERT_JOURNAL_FROM = REVERT.index("rename journal") + 2  # killed at or after this: a journal exists


def _states(kit):
    return {rel: ("pristine" if kit.path(rel).read_text() == p else "patched" if kit.path(rel).read_text() == q
                  else "other") for rel, (p, q) in kit.files.items()}


def _no_leftovers(kit):
    return not [p for p in kit.site.rglob("*") if p.name.endswith((".sglang-ssd-stream-tmp",
                                                                  ".sglang-ssd-stream-orig"))]


def _status_reports_without_writing(kit):
    """status and verify after a kill: not a byte of the site changes; a journal means exit 6 naming it."""
    journal = kit.site / ".sglang-ssd-stream" / "sglang" / "journal.json"
    before = snapshot(kit.site)
    for verb in ("status", "verify"):
        rc, out, err = run_cli(kit, verb)
        if journal.exists():
            assert rc == EXIT_PENDING and "journal" in out and "patch recover" in out, (verb, rc, out, err)
        assert snapshot(kit.site) == before, verb


@pytest.mark.parametrize("kill_at", range(1, len(APPLY) + 1), ids=lambda k: f"{k}-{APPLY[k - 1]}")
def test_apply_killed_at_every_step(kit, kill_at):
    r = kit.cli("apply", wrapper=WRAPPER, env_extra={"KILL_AT": str(kill_at)})
    assert r.returncode == 137 and "killed at" in r.stdout, (r.returncode, r.stdout, r.stderr)
    _status_reports_without_writing(kit)
    rc, out, err = run_cli(kit, "recover")  # takes the lock and rolls the journal back
    assert rc == EXIT_OK, err
    expected = {"pristine"} if kill_at <= APPLY_COMMITTED_AFTER else {"patched"}
    assert set(_states(kit).values()) == expected, _states(kit)
    assert "unknown" not in out
    assert _no_leftovers(kit) and not (kit.site / ".sglang-ssd-stream" / "sglang" / "journal.json").exists()
    assert run_cli(kit, "apply")[0] == EXIT_OK
    assert set(_states(kit).values()) == {"patched"}


@pytest.mark.parametrize("kill_at", range(1, len(REVERT) + 1), ids=lambda k: f"{k}-{REVERT[k - 1]}")
def test_revert_killed_at_every_step(kit, kill_at):
    assert run_cli(kit, "apply")[0] == EXIT_OK
    r = kit.cli("revert", wrapper=WRAPPER, env_extra={"KILL_AT": str(kill_at)})
    assert r.returncode == 137, (r.returncode, r.stdout, r.stderr)
    _status_reports_without_writing(kit)
    assert run_cli(kit, "recover")[0] == EXIT_OK  # rolls an interrupted revert forward to pristine
    # Killed before the journal exists, nothing was written; after it, recovery finishes at pristine.
    expected = {"patched"} if kill_at < REVERT_JOURNAL_FROM else {"pristine"}
    assert set(_states(kit).values()) == expected, _states(kit)
    assert _no_leftovers(kit)


def test_step_counts_are_exact(kit):
    """The kill points above cover every step: one past the last step, the command completes."""
    r = kit.cli("apply", wrapper=WRAPPER, env_extra={"KILL_AT": str(len(APPLY) + 1)})
    assert r.returncode == EXIT_OK and set(_states(kit).values()) == {"patched"}
    r = kit.cli("revert", wrapper=WRAPPER, env_extra={"KILL_AT": str(len(REVERT) + 1)})
    assert r.returncode == EXIT_OK and set(_states(kit).values()) == {"pristine"}
