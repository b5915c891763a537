"""``serve`` runs the engine as a child (issue 43 item 5): a launcher that exits 0 after its engine died (vLLM's
API server when its engine core is killed) is a non-zero exit of ``serve``, which the unit restarts; a stop signal
reaches the engine's whole process group once and its own status is passed on; nothing of the old server
outlives ``serve``. Real processes throughout: a stand-in launcher that behaves as each case needs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sglang_ssd_stream.errors import EXIT_ENGINE_ENDED

REPO = Path(__file__).resolve().parents[2]


def _launcher(tmp_path: Path, body: str) -> Path:
    """An executable stand-in for the engine's launcher: it starts a worker in its process group that ignores
    SIGTERM for a while (as vLLM's lingering worker), writes both pids, then runs ``body``."""
    script = tmp_path / "launcher"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import os, signal, subprocess, sys, time
        worker = subprocess.Popen([sys.executable, "-c", "import signal, time\\n"
                                   "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\ntime.sleep(600)"])
        open({str(tmp_path / "pids")!r}, "w").write(f"{{os.getpid()}} {{worker.pid}}")
        """) + textwrap.dedent(body))
    script.chmod(0o755)
    return script


def _serve(tmp_path: Path, launcher: Path) -> subprocess.Popen:
    code = ("import os, sys\nfrom sglang_ssd_stream.operate.supervise import supervise\n"
            f"sys.exit(supervise({str(launcher)!r}, [{str(launcher)!r}], dict(os.environ), grace_s=2.0))")
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def _pids(tmp_path: Path) -> list[int]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            text = (tmp_path / "pids").read_text()
            if text:
                return [int(p) for p in text.split()]
        except FileNotFoundError:
            pass
        time.sleep(0.1)
    raise AssertionError("the stand-in launcher never started")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("status,expected", [(0, EXIT_ENGINE_ENDED), (3, 3)])
def test_an_engine_that_ends_by_itself_is_a_non_zero_exit_and_leaves_nothing(tmp_path, status, expected):
    serve = _serve(tmp_path, _launcher(tmp_path, f"time.sleep(0.5)\nsys.exit({status})\n"))
    launcher, worker = _pids(tmp_path)
    _, err = serve.communicate(timeout=60)
    assert serve.returncode == expected, err
    assert f"serve: the engine (launcher) ended by itself (status {status}); nothing asked it to stop" in err, err
    assert ("exiting non-zero so a service manager restarts it" in err) == (status == 0), err
    assert not _alive(worker), "the engine's worker outlived serve"


def test_a_launcher_killed_by_a_signal_passes_the_signal_on(tmp_path):
    serve = _serve(tmp_path, _launcher(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)\n"))
    _, worker = _pids(tmp_path)
    _, err = serve.communicate(timeout=60)
    assert serve.returncode == 128 + signal.SIGKILL and "ended by itself (signal SIGKILL)" in err, err
    assert not _alive(worker)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGQUIT])
def test_a_stop_reaches_the_engines_group_once_and_its_status_is_passed_on(tmp_path, sig):
    marks = tmp_path / "signals"
    body = f"""\
        def stop(signum, frame):
            with open({str(marks)!r}, "a") as f:
                f.write(f"{{signum}}\\n")
            time.sleep(0.5)  # a second forward would land here
            sys.exit(0)
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
            signal.signal(s, stop)
        time.sleep(600)
        """
    serve = _serve(tmp_path, _launcher(tmp_path, body))
    launcher, worker = _pids(tmp_path)
    time.sleep(0.5)
    serve.send_signal(sig)
    _, err = serve.communicate(timeout=60)
    assert serve.returncode == 0, err  # the engine's own clean stop
    assert marks.read_text() == f"{int(sig)}\n"  # once
    assert "ended by itself" not in err
    assert not _alive(launcher) and not _alive(worker)


def test_a_serve_killed_outright_takes_its_engine_along(tmp_path):
    """A SIGKILL (the OOM killer) leaves serve no chance to forward anything: the engine, in its own session, is
    sent SIGTERM by the kernel when its parent dies (PR_SET_PDEATHSIG), and its own stop ends its group."""
    marks = tmp_path / "signals"
    body = f"""\
        def stop(signum, frame):
            open({str(marks)!r}, "a").write(f"{{signum}}\\n")
            worker.kill()
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        time.sleep(600)
        """
    serve = _serve(tmp_path, _launcher(tmp_path, body))
    launcher, worker = _pids(tmp_path)
    time.sleep(0.5)
    serve.kill()
    serve.wait(30)
    deadline = time.monotonic() + 30
    while _alive(launcher) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(launcher), "the engine outlived a serve killed by SIGKILL"
    assert marks.read_text() == f"{int(signal.SIGTERM)}\n"


def test_serve_runs_the_engine_under_supervise(monkeypatch):
    """``cmd_serve`` hands the launch to :func:`supervise` (no exec): its status is serve's."""
    import sglang_ssd_stream.operate.serve_cli as serve_cli
    import sglang_ssd_stream.operate.supervise as sup

    calls = []
    monkeypatch.setattr(sup, "supervise", lambda file, argv, env: calls.append(argv) or 42)
    monkeypatch.setattr("sglang_ssd_stream.operate.preflight.preflight", lambda *a: None)
    src = Path(serve_cli.__file__).read_text()
    assert "os.execvpe" not in src
    args = _serve_args()
    assert serve_cli.cmd_serve(args) == 42 and calls and calls[0] == _launch_argv(args)


def _serve_args():
    import argparse

    from sglang_ssd_stream.operate import add_operate_commands

    from .conftest import SIDES

    p = argparse.ArgumentParser()
    add_operate_commands(p.add_subparsers(dest="command", required=True), SIDES["sglang"])
    return p.parse_args(["serve", "--profile", "thor", "--model", "/m"])


def _launch_argv(args) -> list[str]:
    calls = []
    import sglang_ssd_stream.operate.serve_cli as serve_cli

    serve_cli.cmd_serve(args, exec_fn=lambda f, argv, env: calls.append(argv))
    return calls[0]
