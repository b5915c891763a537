"""The engine checks' fork server (tests/forkserver.py, tests/zygote.py) on a stand-in engine: this Python, a
package named ``sglang`` that points a cache under $HOME (as the real one does) before it imports a dependency
that reads it at import. The real engine's zygote is tested in tests/sglang/test_forkserver_real.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from . import forkserver
from .engine import junit_outcomes

ENGINE = """
import os
os.environ.setdefault("FAKE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "fake"))
import fakedep
"""
DEP = """
import os
CACHE = os.environ.get("FAKE_CACHE")  # read at import, like FlashInfer's workspace
SEEN_KNOB = os.environ.get("SGLANG_READ_BY_A_DEPENDENCY")
os.makedirs(os.path.join(os.path.expanduser("~"), ".dep"), exist_ok=True)  # imports write under HOME too
"""
CHECK = """
import os, subprocess, sys

import pytest


def test_started_like_python_m_pytest():
    assert sys.argv[0].endswith(os.path.join("pytest", "__main__.py"))
    assert sys.path[0] == os.getcwd()
    assert sys.modules["__main__"].__spec__.name == "pytest.__main__"


def test_engine_and_dependency():
    import sglang  # first, as the real checks import the engine (what the zygote replays: see forkserver.py)
    import fakedep

    assert fakedep.CACHE == os.path.join(os.environ["HOME"], ".cache", "fake") == os.environ["FAKE_CACHE"]
    assert sorted(os.listdir(os.environ["HOME"])) == [".dep"]  # what the imports left there, nothing more


def test_home_is_fresh_and_the_environment_is_the_checks():
    assert not os.path.exists(os.path.join(os.environ["HOME"], "left-by-a-check"))
    assert "LEFT_BY_A_CHECK" not in os.environ
    assert os.environ.get("SGLANG_KNOB") == os.environ.get("EXPECT_KNOB")
    open(os.path.join(os.environ["HOME"], "left-by-a-check"), "w").close()
    os.environ["LEFT_BY_A_CHECK"] = "1"
    with open(os.environ["QSA_CHECK_OUT"], "a") as f:
        f.write(f"{os.getpid()} {os.getppid()} {os.getsid(0) == os.getpid()}\\n")


def test_fails_when_asked():
    assert os.environ.get("EXPECT") != "fail"


@pytest.mark.skip(reason="a skipped outcome must come back from a fork as from a new process")
def test_skipped_outcome():
    pass


def test_sleeps_with_a_grandchild():  # selected by the timeout test alone (``_run``'s ``select``)
    child = subprocess.Popen(["sleep", "300"])
    with open(os.environ["QSA_CHECK_OUT"], "w") as f:
        f.write(str(child.pid))
    import time
    time.sleep(300)
"""


@pytest.fixture
def stand_in(tmp_path):
    site = tmp_path / "site"
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text(ENGINE)
    (site / "fakedep").mkdir()
    (site / "fakedep" / "__init__.py").write_text(DEP)
    work = tmp_path / "work"
    work.mkdir()
    (work / "check_stand_in.py").write_text(textwrap.dedent(CHECK))
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update({"HOME": str(home), "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1"})
    zygote = forkserver.Zygote(sys.executable, "sglang", env, home, entries=["sglang"], cwd=work)
    yield zygote, env, work, tmp_path
    zygote.close()


def _run(zygote, env, work, tmp, name, extra=None, fork=True, timeout=120, select="not sleeps"):
    xml, out, err = tmp / f"{name}.xml", tmp / f"{name}.out", tmp / f"{name}.err"
    args = ["-q", "-p", "no:cacheprovider", f"--junitxml={xml}", "--rootdir", str(work), "-k", select,
            "check_stand_in.py"]
    env = {**env, "QSA_CHECK_OUT": str(tmp / "pids"), **(extra or {})}
    if fork:
        code = zygote.run(args, env, work, timeout, out, err)
    else:
        fresh_home = tmp / f"{name}-home"
        fresh_home.mkdir()
        code = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=work, env={**env, "HOME": str(fresh_home)},
                              capture_output=True, timeout=timeout).returncode
    return code, junit_outcomes(xml), (out.read_text() if out.exists() else "")


def test_a_checks_outcomes_equal_the_fresh_processs(stand_in):
    zygote, env, work, tmp = stand_in
    ready = zygote.wait_ready(120)
    assert ready is not None, zygote.failed
    for i, extra in enumerate(({}, {"EXPECT": "fail", "SGLANG_KNOB": "7", "EXPECT_KNOB": "7"})):
        fresh = _run(zygote, env, work, tmp, f"fresh{i}", extra, fork=False)
        forked = _run(zygote, env, work, tmp, f"forked{i}", extra)
        assert forked[:2] == fresh[:2], forked[2]
    assert forked[0] == 1 and forked[1]["test_fails_when_asked"] == "failed"
    assert set(forked[1].values()) == {"passed", "failed", "skipped"}


def test_the_zygote_imports_dependencies_never_the_engine(stand_in):
    zygote, *_ = stand_in
    ready = zygote.wait_ready(120)
    assert "fakedep" in ready["modules"] and "pytest" not in ready["modules"]
    assert not [m for m in ready["modules"] if m.split(".")[0] in forkserver.EXCLUDED]
    assert ready["replayed"] == ["FAKE_CACHE"]  # the engine's write the dependency read at import
    assert ready["threads"] == 1
    assert "SGLANG_READ_BY_A_DEPENDENCY" in ready["observed"]


def test_checks_do_not_see_each_others_home_or_environment(stand_in):
    zygote, env, work, tmp = stand_in
    zygote.wait_ready(120)
    for _ in range(2):
        code, outcomes, out = _run(zygote, env, work, tmp, "iso", {"SGLANG_KNOB": "x", "EXPECT_KNOB": "x"})
        assert outcomes["test_home_is_fresh_and_the_environment_is_the_checks"] == "passed", out
    code, outcomes, out = _run(zygote, env, work, tmp, "iso", {})  # the knob gone again
    assert outcomes["test_home_is_fresh_and_the_environment_is_the_checks"] == "passed", out
    pids = [line.split() for line in (tmp / "pids").read_text().splitlines()]
    assert len({p for p, _, _ in pids}) == 3 and {pp for _, pp, _ in pids} == {str(zygote.proc.pid)}  # its forks
    assert {leader for _, _, leader in pids} == {"True"}  # each in its own session


def test_a_timeout_kills_the_checks_process_group(stand_in):
    zygote, env, work, tmp = stand_in
    zygote.wait_ready(120)
    with pytest.raises(subprocess.TimeoutExpired):
        _run(zygote, env, work, tmp, "slow", timeout=8, select="sleeps")
    grandchild = int((tmp / "pids").read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)
    code, outcomes, out = _run(zygote, env, work, tmp, "after", {})  # the zygote serves the next check
    assert outcomes["test_engine_and_dependency"] == "passed", out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_the_zygote_dies_with_its_parent(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(Path(__file__).parents[1])!r})
        from tests import forkserver
        env = dict(os.environ, HOME={str(tmp_path)!r})
        z = forkserver.Zygote(sys.executable, "sglang", env, forkserver.Path({str(tmp_path)!r}), entries=[])
        assert z.wait_ready(60) is not None, z.failed
        print(z.proc.pid, flush=True)
        time.sleep(300)
    """)], stdout=subprocess.PIPE, text=True)
    zygote_pid = int(parent.stdout.readline())
    assert _alive(zygote_pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(zygote_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(zygote_pid)


READY = {"observed": ["SGLANG_READ", "HOME"], "scans": ["fsspec.config", "sglang.srt.environ"]}


@pytest.mark.parametrize("change, why", [
    ({}, None),
    ({"SGLANG_PLUGINS": "ssd_stream", "VLLM_PLE_CPU_OFFLOAD": "1", "QSA_CHECK_OUT": "/x", "EXPECT": "refuse",
      "EXPECT_MESSAGE": "m", "FAIL_PLE_HOOKS": "1"}, None),
    ({"TRITON_INTERPRET": "0"}, "TRITON_INTERPRET differs and is not a knob"),
    ({"CUDA_VISIBLE_DEVICES": ""}, "CUDA_VISIBLE_DEVICES differs and is not a knob"),
    ({"PYTHONPATH": "/elsewhere"}, "PYTHONPATH differs and is not a knob"),
    ({"HOME": "/another/home"}, "HOME differs and is not a knob"),
    ({"SGLANG_READ": "1"}, "SGLANG_READ was read while the zygote imported"),
    ({"FSSPEC_X": "1"}, "FSSPEC_X differs and is not a knob"),
    ({"VLLM_TARGET_DEVICE": None}, "VLLM_TARGET_DEVICE differs and is not a knob"),
])
def test_the_fallback_rule(change, why):
    base = {"HOME": "/h", "TRITON_INTERPRET": "1", "VLLM_TARGET_DEVICE": "cpu", "PATH": "/bin"}
    env = {**base, **change}
    env = {k: v for k, v in env.items() if v is not None}
    assert forkserver.differences(base, env, READY) == ([why] if why else [])


def test_a_knob_an_unknown_scan_could_see_falls_back():
    base = {"HOME": "/h"}
    ready = {"observed": [], "scans": ["somelib.config"]}
    assert forkserver.differences(base, {**base, "SGLANG_X": "1"}, ready) == [
        "SGLANG_X differs and the zygote's imports scanned the environment (somelib.config)"]
    assert forkserver.differences(base, base, ready) == []
    prefixed = {"observed": [], "scans": ["sglang.srt.environ"]}  # the engine's scan looks for SGL_
    assert forkserver.differences(base, {**base, "SGLANG_X": "1"}, prefixed) == []


def test_the_off_switch(monkeypatch):
    monkeypatch.setenv(forkserver.OFF_SWITCH, "0")
    assert not forkserver.enabled()
    from .engine import EngineVenv

    assert EngineVenv("sglang", sys.executable)._forked(["--version"], None, 10, Path("/nonexistent")) is None
    assert forkserver.known_zygote(sys.executable) is None


def test_a_check_no_zygote_may_run_starts_none(monkeypatch):
    monkeypatch.delenv(forkserver.OFF_SWITCH, raising=False)
    from .engine import EngineVenv

    eng = EngineVenv("sglang", sys.executable)
    assert eng._forked(["--version"], {"TRITON_INTERPRET": "0"}, 10, Path("/nonexistent")) is None
    assert forkserver.known_zygote(sys.executable) is None


SCRIPTS = {  # python SCRIPT ARGS as a check's probe runs it (EngineVenv.run_script): each must end the same forked
    "plain": "import sys\nprint('args', sys.argv[1:])\nprint('to stderr', file=sys.stderr)\n",
    "exit-message": "import sys\nprint('before')\nsys.exit('KnobError: BUDGET=abc is not an integer')\n",
    "exit-code": "raise SystemExit(3)\n",
    "exception": "def f():\n    raise ValueError('boom')\nf()\n",
    "thread-and-atexit": ("import atexit, threading, time\natexit.register(lambda: print('atexit ran', flush=True))\n"
                          "def late():\n    time.sleep(0.3)\n    print('thread finished', flush=True)\n"
                          "threading.Thread(target=late).start()\nprint('main done')\n"),
    "engine-fresh": ("import os, sys\nprint('sglang' in sys.modules, sys.path[0] == os.path.dirname(__file__))\n"
                     "import sglang\nprint(os.environ['SGLANG_KNOB'])\n"),
}


def test_a_script_ends_as_python_script_does(stand_in):
    zygote, env, work, tmp = stand_in
    assert zygote.wait_ready(120) is not None, zygote.failed
    env = {**env, "SGLANG_KNOB": "on"}
    got = {}
    for name, text in SCRIPTS.items():
        script = work / f"{name}.py"
        script.write_text(text)
        out, err = tmp / f"{name}.out", tmp / f"{name}.err"
        code = zygote.run(["arg1", "arg 2"], env, work, 60, out, err, script=str(script))
        forked = (code, out.read_text(), err.read_text())
        r = subprocess.run([sys.executable, str(script), "arg1", "arg 2"], cwd=work, env=env, capture_output=True,
                           text=True, timeout=60)
        fresh = (r.returncode, r.stdout, r.stderr)
        if name == "exception":  # the forked traceback starts in the zygote: compare from the script's frames on
            assert forked[0] == fresh[0] == 1 and forked[1] == fresh[1] == ""
            assert forked[2].startswith("Traceback") and fresh[2].startswith("Traceback")
            tail = fresh[2].split(f'File "{script}"', 1)[1]
            assert forked[2].endswith(tail), forked[2]
        else:
            assert forked == fresh, name
        got[name] = forked
    assert got["plain"] == (0, "args ['arg1', 'arg 2']\n", "to stderr\n")
    assert got["exit-message"] == (1, "before\n", "KnobError: BUDGET=abc is not an integer\n")
    assert got["exit-code"][0] == 3
    assert got["thread-and-atexit"] == (0, "main done\nthread finished\natexit ran\n", "")
    assert got["engine-fresh"] == (0, "False True\non\n", "")  # the engine imported in the script, not before
