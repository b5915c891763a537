"""The faults of test_faults.py, provoked for real: an immutable file (chattr +i), a full tmpfs, a
read-only bind mount and real SIGINT/SIGTERM from another process. Each fails mid-commit (after
other files were already replaced) and must leave the tree exactly as it was."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sglang_ssd_stream.errors import EXIT_ENVIRONMENT, EXIT_OK

from .conftest import REPO, run_cli, snapshot

B = "sglang/srt/managers/b.py"


def _prepare(kit, command):
    if command == "revert":
        assert run_cli(kit, "apply")[0] == EXIT_OK


def _chattr(flag: str, path: Path) -> None:
    r = subprocess.run(["chattr", flag, str(path)], capture_output=True, text=True)
    assert r.returncode == 0, f"chattr {flag} {path} failed (this test needs root on ext4/tmpfs): {r.stderr}"


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_immutable_last_target(kit, command):
    """Issue 15's case: b.py (replaced last) is immutable; a.py was already replaced when it fails."""
    _prepare(kit, command)
    before = snapshot(kit.site)
    _chattr("+i", kit.path(B))
    try:
        rc, out, err = run_cli(kit, command)
        after = snapshot(kit.site)
    finally:
        _chattr("-i", kit.path(B))
    assert rc == EXIT_ENVIRONMENT, err
    assert f"cannot link {B}: EPERM (Operation not permitted)" in err and "rolled back" in err
    assert after == before


# Runs inside a user + mount namespace: mounts a small tmpfs, builds the kit there, leaves FREE pages,
# runs the CLI in-process and prints what happened (the tmpfs vanishes with the namespace).
TMPFS_SCRIPT = r"""
import json, os, sys
sys.path[:0] = [sys.argv[2], sys.argv[2] + "/tests/patching/.."]
from pathlib import Path
from tests.patching.conftest import run_cli, snapshot, write_kit
mnt, command, free_pages = Path(sys.argv[1]), sys.argv[3], int(sys.argv[4])
kit = write_kit(mnt)
if command == "revert":
    assert run_cli(kit, "apply")[0] == 0
st = os.statvfs(mnt)
filler = st.f_bavail * st.f_frsize - free_pages * 4096
with open(mnt / "filler", "wb") as f:
    f.write(b"\0" * filler)
before = snapshot(kit.site)
rc, out, err = run_cli(kit, command)
print(json.dumps({"rc": rc, "err": err, "same": snapshot(kit.site) == before,
                  "free": os.statvfs(mnt).f_bavail}))
"""


@pytest.mark.parametrize("command,free_pages", [("apply", 4), ("revert", 2)])
def test_full_disk_mid_commit(tmp_path, command, free_pages):
    """A tmpfs with room for the backups, the journal and a.py's new copy, but not b.py's: ENOSPC at b.py."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cmd = ["unshare", "-Urm", "sh", "-c", 'mount -t tmpfs -o size=128k tmpfs "$0" && exec "$@"', str(mnt),
           sys.executable, "-c", TMPFS_SCRIPT, str(mnt), str(REPO), command, str(free_pages)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["rc"] == EXIT_ENVIRONMENT, res
    assert f"cannot write {B}: ENOSPC (No space left on device)" in res["err"], res
    assert "rolled back" in res["err"] and res["same"], res


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_read_only_mount_mid_commit(kit, command):
    """b.py's directory is a read-only bind mount; a.py's is not."""
    _prepare(kit, command)
    before = snapshot(kit.site)
    managers = kit.path(B).parent
    ro = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    r = kit.cli(command, prefix=["unshare", "-Urm", "sh", "-c", ro, str(managers)])
    assert r.returncode == EXIT_ENVIRONMENT, r.stderr
    assert f"cannot create {B}: EROFS (Read-only file system)" in r.stderr and "rolled back" in r.stderr
    assert snapshot(kit.site) == before


# The CLI pauses at STEP until a signal has arrived, so the test can send a real one from outside.
PAUSE = """
import os, sys, time
from pathlib import Path
from sglang_ssd_stream.patching import transaction
def checkpoint(self, step):
    if step == os.environ["STEP"]:
        Path(os.environ["READY"]).write_text(step)
        deadline = time.monotonic() + 60
        while self._signal is None and time.monotonic() < deadline:
            time.sleep(0.01)
transaction.Transaction._checkpoint = checkpoint
from sglang_ssd_stream.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("command,step", [("apply", f"rename {B}"), ("apply", "write journal"),
                                          ("revert", f"unlink {B}.sglang-ssd-stream-orig")])
def test_real_signal_from_another_process(kit, command, step, signame):
    _prepare(kit, command)
    before = snapshot(kit.site)
    ready = kit.site.parent / "ready"
    env = {**os.environ, "PYTHONPATH": str(REPO), "STEP": step, "READY": str(ready)}
    proc = subprocess.Popen([sys.executable, "-c", PAUSE, "patch", command, "--site-packages", str(kit.site),
                             "--data-dir", str(kit.data)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 60
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ready.exists(), proc.communicate()
    proc.send_signal(getattr(signal, signame))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + getattr(signal, signame), (proc.returncode, err)
    assert f"interrupted by {signame}" in err and "rolled back" in err and "Traceback" not in err
    assert snapshot(kit.site) == before
