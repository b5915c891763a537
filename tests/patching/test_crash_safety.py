"""Kill the installer (os._exit, like SIGKILL) at every durable step; files must never end mixed."""

from __future__ import annotations

import pytest

from sglang_ssd_stream.errors import EXIT_OK

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

# apply: 2 backups, journal, (write, rename) x 2 files, clear journal = 8 steps; revert has no backups: 6.
APPLY_STEPS, REVERT_STEPS = 8, 6


def _states(kit):
    return {rel: ("pristine" if kit.path(rel).read_text() == p else "patched" if kit.path(rel).read_text() == q
                  else "other") for rel, (p, q) in kit.files.items()}


@pytest.mark.parametrize("kill_at", range(1, APPLY_STEPS + 1))
def test_apply_killed_at_every_step(kit, kill_at):
    r = kit.cli("apply", wrapper=WRAPPER, env_extra={"KILL_AT": str(kill_at)})
    assert r.returncode == 137 and "killed at" in r.stdout, (r.returncode, r.stdout, r.stderr)
    status = kit.cli("status")  # takes the lock and rolls the journal back
    assert status.returncode == EXIT_OK, status.stderr
    assert set(_states(kit).values()) == {"pristine"}, _states(kit)
    assert "unknown" not in status.stdout
    assert not list(kit.site.rglob("*.sglang-ssd-stream-tmp"))
    assert kit.cli("apply").returncode == EXIT_OK
    assert set(_states(kit).values()) == {"patched"}


@pytest.mark.parametrize("kill_at", range(1, REVERT_STEPS + 1))
def test_revert_killed_at_every_step(kit, kill_at):
    assert kit.cli("apply").returncode == EXIT_OK
    r = kit.cli("revert", wrapper=WRAPPER, env_extra={"KILL_AT": str(kill_at)})
    assert r.returncode == 137, (r.returncode, r.stdout, r.stderr)
    assert kit.cli("status").returncode == EXIT_OK  # rolls an interrupted revert forward to pristine
    # Killed before the journal exists, nothing was written; after it, recovery finishes at pristine.
    assert set(_states(kit).values()) == ({"patched"} if kill_at == 1 else {"pristine"}), _states(kit)
    assert not list(kit.site.rglob("*.sglang-ssd-stream-tmp"))


def test_step_counts_are_exact(kit):
    """The kill points above cover every step: one past the last step, the command completes."""
    r = kit.cli("apply", wrapper=WRAPPER, env_extra={"KILL_AT": str(APPLY_STEPS + 1)})
    assert r.returncode == EXIT_OK and set(_states(kit).values()) == {"patched"}
    r = kit.cli("revert", wrapper=WRAPPER, env_extra={"KILL_AT": str(REVERT_STEPS + 1)})
    assert r.returncode == EXIT_OK and set(_states(kit).values()) == {"pristine"}
