#!/usr/bin/env python3
"""Run the test suites two at a time, each on its own private copy of its engine venv (scripts/test.sh).

    scripts/suites.py [--jobs N] [--durations N] [suite ...] [-- pytest args]

A test path among the pytest args (``tests/e2e/test_5_mtp.py``, ``path::test``) runs in the suite that holds it,
in place of that suite's own paths; suites that hold none of the named paths do not run.

Why this shape (docs/testing.md "Where the time goes"): each suite is one pytest process whose tests mostly
run one thread at a time (engine checks, servers with OMP_NUM_THREADS=1, the Triton interpreter), so on CI's 2
cores two suites side by side do more work per minute than one (measured: the whole run 0.71x the serial one;
each suite 1.2-1.5x its time alone, as servers' and checks' processes add to the load). Longest first.
Every suite gets its own copy of its engine venv (``scripts/engine-venv.sh --private``: hard links, seconds), so
suites that patch their engine in place (RED/GREEN, the e2e scenarios) never write a venv another suite or
another run on this box uses. Each suite's lines are printed as they come, prefixed with its name; a table of
the stages (venv builds, suites, their test counts) follows, and with ``--durations N`` the N slowest tests of
all suites (from each suite's JUnit XML: setup + call + teardown, so a scenario's server start is charged to
the first test that needs it).

Exit status: 0 when every suite passed, 1 when any test failed or a suite could not start, 64 on usage.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / "scripts" / "engine-venv.sh"


@dataclass
class Suite:
    name: str
    group: str  # what scripts/test.sh names: sglang, vllm, e2e, e2e-vllm (sglang runs as two parts)
    engine: str
    args: list[str]  # pytest arguments (paths and marker)
    expected_minutes: float  # measured (docs/testing.md): the start order, longest first
    env_var: str = ""  # the variable that hands the venv's python to the tests
    overlays: bool = False  # also private copies of the engine's other releases (sglang's RED/GREEN on them)
    wheelhouse: bool = False  # the install test builds install.sh's runtime from the venv's own wheels
    # filled in while it runs
    seconds: float = 0.0
    rc: int | None = None
    counts: dict = field(default_factory=dict)
    cases: list = field(default_factory=list)  # (seconds, nodeid)


SGLANG_ONLY = "not vllm and not e2e"
# The sglang group is the one pytest selection ``tests -m SGLANG_ONLY`` cut in three by path: the real-engine
# tests of tests/sglang (RED/GREEN on three releases, the engine's processes), operations with install.sh, and
# everything else (the kit's core, the sidecar, patching). The measured run had the last two as one part, which
# ran alone for its last 9 minutes with one core idle; two halves let both lanes finish together.
SUITES = {s.name: s for s in (
    Suite("sglang-engine", "sglang", "sglang", ["tests/sglang", "-m", SGLANG_ONLY], 19.0,
          "SSD_STREAM_SGLANG_PYTHON", overlays=True),
    Suite("e2e", "e2e", "sglang", ["tests/e2e", "-m", "e2e"], 15.0, "SSD_STREAM_SGLANG_PYTHON"),
    Suite("vllm", "vllm", "vllm", ["tests/vllm", "tests/test_wheel_architectures.py", "-m", "vllm"], 13.0,
          "SSD_STREAM_VLLM_PYTHON"),
    Suite("e2e-vllm", "e2e-vllm", "vllm", ["tests/e2e_vllm", "-m", "e2e_vllm"], 12.0, "SSD_STREAM_VLLM_PYTHON"),
    Suite("sglang-ops", "sglang", "sglang", ["tests/operate", "tests/test_install_sh.py", "-m", SGLANG_ONLY], 5.5,
          "SSD_STREAM_SGLANG_PYTHON", wheelhouse=True),
    # the folders of the other suites are ignored too (the marker deselects their tests anyway): a path the user
    # names there is then theirs alone
    Suite("sglang-core", "sglang", "sglang", ["tests", "--ignore=tests/sglang", "--ignore=tests/operate",
                                             "--ignore=tests/test_install_sh.py", "--ignore=tests/e2e",
                                             "--ignore=tests/e2e_vllm", "--ignore=tests/vllm", "-m", SGLANG_ONLY],
          5.0, "SSD_STREAM_SGLANG_PYTHON"),
)}
GROUPS = tuple(dict.fromkeys(s.group for s in SUITES.values()))

_VALUED = {"-k", "-m", "-p", "-o", "-c", "--rootdir", "--basetemp", "--deselect", "--ignore", "--durations",
           "--maxfail", "--junitxml", "--tb", "-W"}  # pytest options whose value is the next argument


def _paths(args: list[str]) -> tuple[list[str], list[str]]:
    """``args``' test paths (a file, a folder or a node id ``path::name`` that exists in the repository, not an
    option's value) and the rest, in order."""
    paths, rest = [], []
    for i, a in enumerate(args):
        value = i > 0 and args[i - 1] in _VALUED
        (paths if not value and not a.startswith("-") and (REPO / a.split("::")[0]).exists() else rest).append(a)
    return paths, rest


def _under(path: str, root: str) -> bool:
    p, r = (REPO / path.split("::")[0]).resolve(), (REPO / root).resolve()
    return p == r or r in p.parents


def narrowed(suite: Suite, pytest_args: list[str]) -> list[str] | None:
    """The suite's pytest arguments with the user's: where the user names test paths, only those inside the
    suite's own selection (its paths less its ``--ignore``s) replace its paths, and a suite holding none of them
    does not run (None); pytest given both a folder and a file in it would run the whole folder."""
    wanted, rest = _paths(pytest_args)
    if not wanted:
        return [*suite.args, *pytest_args]
    own, options = _paths(suite.args)
    ignored = [a.split("=", 1)[1] for a in options if a.startswith("--ignore=")]
    mine = [w for w in wanted if any(_under(w, o) for o in own) and not any(_under(w, i) for i in ignored)]
    return [*mine, *options, *rest] if mine else None


_print_lock = threading.Lock()


def say(line: str) -> None:
    with _print_lock:
        sys.stdout.write(line if line.endswith("\n") else line + "\n")
        sys.stdout.flush()


def cache_dir() -> Path:
    return Path(os.environ["SSD_STREAM_CACHE"])


def venv_python(engine: str, *extra: str, private: Path | None = None, flag: str | None = None) -> str:
    """engine-venv.sh's answer: the cached venv's python (built once; the script serializes builds per engine),
    with ``private`` a private copy of it under that directory, with ``flag="--wheelhouse"`` its wheels."""
    opts = ["--private", str(private)] if private else [flag] if flag else []
    cmd = ["sh", str(VENV), *opts, engine, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr}")
    return r.stdout.strip().splitlines()[-1]


def other_releases(engine: str) -> list[str]:
    pinned = subprocess.run([sys.executable, str(REPO / "sglang_ssd_stream/patching/engines.py"), engine],
                            capture_output=True, text=True, check=True).stdout.strip()
    return sorted(p.name[len(engine) + 1:-len(".json")] for p in (REPO / "hashes").glob(f"{engine}-*.json")
                  if p.name != f"{engine}-{pinned}.json")


class Builds:
    """The cached venv of each engine, built in the background (download-bound: both engines at once)."""

    def __init__(self, engines: list[str]):
        self.seconds: dict[str, float] = {}
        self.errors: dict[str, str] = {}
        self._done = {e: threading.Event() for e in engines}
        for e in engines:
            threading.Thread(target=self._build, args=(e,), daemon=True).start()

    def _build(self, engine: str) -> None:
        t0 = time.monotonic()
        try:
            venv_python(engine)
            if engine == "sglang":  # the overlays (other releases) are hard-link copies: seconds
                for release in other_releases(engine):
                    venv_python(engine, release)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            self.errors[engine] = str(exc)
        self.seconds[engine] = time.monotonic() - t0
        self._done[engine].set()

    def wait(self, engine: str) -> None:
        self._done[engine].wait()
        if engine in self.errors:
            raise RuntimeError(f"the {engine} venv could not be built:\n{self.errors[engine]}")


def junit_results(path: Path) -> tuple[dict, list]:
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    cases = []
    try:
        tree = ET.parse(path)
    except (OSError, ET.ParseError):  # pytest stopped before writing it whole: the suite's rc tells
        return counts, cases
    for case in tree.iter("testcase"):
        kinds = {child.tag for child in case}
        kind = ("failed" if "failure" in kinds else "error" if "error" in kinds
                else "skipped" if "skipped" in kinds else "passed")
        counts[kind] += 1
        nodeid = f"{case.get('classname', '').replace('.', '/')}::{case.get('name')}"
        cases.append((float(case.get("time") or 0.0), nodeid))
    return counts, cases


def run_suite(suite: Suite, builds: Builds, run_dir: Path, test_home: Path, pytest_args: list[str]) -> None:
    """One suite: its private venv copies, then its pytest, every line prefixed with its name."""
    t0 = time.monotonic()
    tag = f"[{suite.name}] "
    own = run_dir / suite.name
    try:
        builds.wait(suite.engine)
        py = venv_python(suite.engine, private=own)
        env = {**os.environ, "HOME": str(test_home / suite.name), suite.env_var: py, "PYTHONUNBUFFERED": "1"}
        (test_home / suite.name).mkdir(parents=True)
        if suite.wheelhouse:
            env["SSD_STREAM_SGLANG_WHEELHOUSE"] = venv_python(suite.engine, flag="--wheelhouse")
        if suite.overlays:
            env["SSD_STREAM_SGLANG_RELEASES"] = " ".join(
                f"{r}={venv_python(suite.engine, r, private=own / r)}" for r in other_releases(suite.engine))
        say(f"{tag}== {suite.name} suite on {py} (a private copy; {time.monotonic() - t0:.0f} s to here)")
        junit = own / "junit.xml"
        cmd = [py, "-m", "pytest", *narrowed(suite, pytest_args), f"--junitxml={junit}", "-o", "junit_family=xunit1"]
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        _running.append(proc)
        for raw in proc.stdout:
            say(tag + raw.decode(errors="replace").rstrip("\n"))
        suite.rc = proc.wait()
        suite.counts, suite.cases = junit_results(junit)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        say(f"{tag}could not run: {exc}")
        suite.rc = 1
    finally:
        suite.seconds = time.monotonic() - t0
        say(f"{tag}== finished: rc {suite.rc} in {suite.seconds / 60:.1f} min")


_running: list[subprocess.Popen] = []


def _stop(signum, frame):
    """A stop of this runner stops its suites (each pytest stops its own servers on SIGTERM) before it goes."""
    for proc in _running:
        if proc.poll() is None:
            proc.terminate()
    for proc in _running:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    raise SystemExit(128 + signum)


def claim_run_dir() -> tuple[Path, int]:
    """This run's directory for its private venv copies, beside the cache (hard links need one filesystem),
    held by an flock while the run lives. Directories of runs that died without cleaning up (their lock is
    free) are removed first: each holds private copies of every engine package."""
    for old in cache_dir().glob("run-*"):
        try:
            fd = os.open(old / ".lock", os.O_RDONLY)
        except OSError:
            continue  # being made or removed by its own run
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # its run is alive
        shutil.rmtree(old, ignore_errors=True)
        os.close(fd)
    # locked under another name first, so no cleanup above can find it unlocked
    made = Path(tempfile.mkdtemp(prefix="new-run-", dir=cache_dir()))
    fd = os.open(made / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    run_dir = made.with_name(made.name[len("new-"):])
    made.rename(run_dir)
    return run_dir, fd


NO_TESTS = 5  # pytest's exit status when nothing was selected


def passed(suite: Suite, pytest_args: list[str]) -> bool:
    """A suite passed, or a filter the user passed on (``-- -k name``) selected none of its tests; a suite that
    selects nothing by itself has lost its tests and fails."""
    return suite.rc == 0 or (suite.rc == NO_TESTS and bool(pytest_args))


def table(suites: list[Suite], builds: Builds, total: float, pytest_args: list[str]) -> str:
    lines = ["stage                 minutes   passed failed errors skipped"]
    for engine, s in sorted(builds.seconds.items()):
        lines.append(f"{engine + ' venv':<20} {s / 60:8.1f}")
    for s in suites:
        c = s.counts
        lines.append(f"{s.name + ' suite':<20} {s.seconds / 60:8.1f} {c.get('passed', 0):8} {c.get('failed', 0):6} "
                     f"{c.get('error', 0):6} {c.get('skipped', 0):7}" + (
                         "" if s.rc == 0 else "   (the filter selects none)" if passed(s, pytest_args)
                         else f"   rc {s.rc}"))
    lines.append(f"{'tests, wall':<20} {total / 60:8.1f}")
    return "\n".join(lines)


def slowest(suites: list[Suite], n: int) -> str:
    cases = sorted(((sec, s.name, node) for s in suites for sec, node in s.cases), reverse=True)[:n]
    lines = [f"the {len(cases)} slowest tests (seconds: setup + call + teardown)"]
    lines += [f"{sec:8.1f}  {name:<9} {node}" for sec, name, node in cases]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if "--" in argv:
        i = argv.index("--")
        argv, pytest_args = argv[:i], argv[i + 1:]
    else:
        pytest_args = []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=int(os.environ.get("SSD_STREAM_TEST_JOBS", "2")),
                    help="suites at once (default 2, CI's cores; SSD_STREAM_TEST_JOBS)")
    ap.add_argument("--durations", type=int, default=0, metavar="N", help="print the N slowest tests at the end")
    ap.add_argument("suites", nargs="*", help=f"any of {', '.join(GROUPS)} (default: all)")
    opts = ap.parse_args(argv)
    unknown = [s for s in opts.suites if s not in GROUPS]
    if unknown or opts.jobs < 1:
        print(f"unknown suite: {' '.join(unknown)} (expected {', '.join(GROUPS)})" if unknown
              else "--jobs must be at least 1", file=sys.stderr)
        return 64
    chosen = set(opts.suites or GROUPS)
    suites = sorted((s for s in SUITES.values() if s.group in chosen), key=lambda s: -s.expected_minutes)
    if _paths(pytest_args)[0]:  # only the suites that hold a path the user named
        suites = [s for s in suites if narrowed(s, pytest_args) is not None]
        if not suites:
            print(f"no suite{' of ' + ' '.join(opts.suites) if opts.suites else ''} holds "
                  f"{' '.join(_paths(pytest_args)[0])}", file=sys.stderr)
            return 64
    if any(s.name == "e2e" for s in suites) and not shutil.which("cc"):
        print("e2e needs a C compiler (cc) for the stub driver", file=sys.stderr)
        return 1

    cache_dir().mkdir(parents=True, exist_ok=True)
    run_dir, _held = claim_run_dir()  # removed at the end
    test_home = Path(tempfile.mkdtemp(prefix="ssd-stream-test-home-"))
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    t0 = time.monotonic()
    try:
        builds = Builds(sorted({s.engine for s in suites}))
        todo: queue.Queue = queue.Queue()
        for s in suites:
            todo.put(s)

        def lane():
            while True:
                try:
                    s = todo.get_nowait()
                except queue.Empty:
                    return
                run_suite(s, builds, run_dir, test_home, pytest_args)

        lanes = [threading.Thread(target=lane) for _ in range(min(opts.jobs, len(suites)))]
        for t in lanes:
            t.start()
        for t in lanes:
            t.join()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(test_home, ignore_errors=True)
    total = time.monotonic() - t0
    say("== test stages\n" + table(suites, builds, total, pytest_args))
    if opts.durations:
        say("== " + slowest(suites, opts.durations))
    return 0 if all(passed(s, pytest_args) for s in suites) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
