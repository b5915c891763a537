"""``serve``'s engine as a child process, not an exec: its end is ours to judge.

Why: vLLM's launcher exits 0 after its engine core is killed (the API server goes; a worker lingers 15 s or more),
so an exec'd launcher tells a service manager "clean stop" for an engine death. Here the engine runs in its own
process group; a stop signal to ``serve`` reaches that whole group once (as a terminal's or systemd's would), and
when the engine ends by itself ``serve`` exits non-zero, whatever the engine's status, after ending what is left of
its group. Standard library only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ..errors import EXIT_ENGINE_ENDED

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)  # SIGQUIT: a terminal's Ctrl-\
PR_SET_PDEATHSIG = 1  # linux/prctl.h
LEFTOVER_GRACE_S = 10.0  # what is left of the engine's group after it ended gets SIGTERM, then SIGKILL after this


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _end_group(pgid: int, grace_s: float) -> bool:
    """SIGTERM to what is left of the group, SIGKILL after ``grace_s``; whether anything was left."""
    if not _group_alive(pgid):
        return False
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return True


def _end_with_parent() -> None:
    """In the child before exec: SIGTERM when ``serve`` dies (a SIGKILL, the OOM killer), so an engine in its own
    session is never left running without the process a service manager watches."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def supervise(file: str, argv: list[str], env: dict[str, str], *, grace_s: float = LEFTOVER_GRACE_S) -> int:
    """Run ``argv`` (``file`` looked up on ``env``'s PATH, as ``os.execvpe`` would) and return ``serve``'s exit
    status: after a stop signal, the engine's own (128 + N when a signal N ended it); when it ended by itself, its
    own non-zero status, 128 + N for a signal, and :data:`EXIT_ENGINE_ENDED` for a 0."""
    asked: list[int] = []
    proc = subprocess.Popen([file, *argv[1:]], env=env, start_new_session=True, preexec_fn=_end_with_parent)

    def forward(signum, frame):
        asked.append(signum)
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        rc = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    left = _end_group(proc.pid, grace_s)
    status = rc if rc >= 0 else 128 - rc
    if asked:
        return status
    what = f"status {rc}" if rc >= 0 else f"signal {signal.Signals(-rc).name}"
    print(f"serve: the engine ({os.path.basename(file)}) ended by itself ({what}); nothing asked it to stop"
          + (", and the processes it left were ended" if left else "")
          + (": exiting non-zero so a service manager restarts it" if rc == 0 else ""), file=sys.stderr)
    return status if status else EXIT_ENGINE_ENDED
