"""Driving a real engine venv from the outer test run.

The outer pytest never imports an engine: the engine's files change state (pristine/patched)
during the run, so every engine-side check runs in a fresh process of the engine's venv,
as pytest over a ``checks/check_*.py`` module, and reports per-test outcomes through JUnit XML.
That process is a fork of the venv's fork server (tests/forkserver.py: the engine's third-party
dependencies imported once, never the engine, the kit or the tests) where the check's environment
allows it, else a new ``python -m pytest``.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

from . import forkserver

REPO = Path(__file__).resolve().parents[1]
# humming (vLLM's GEMM kernels) starts two Python processes at every import that build its launcher and NVRTC helper
# for a GPU (each imports torch again and compiles): ~7 s of CPU per vLLM process here, about a quarter of the
# e2e-vllm suite's CPU in a profiled run. Its own switch (HUMMING_DISABLE_PARALLEL_BUILD=1) leaves the build to the
# first humming kernel a process runs, which a CPU never does. Set for every engine process the tests start.
HUMMING_NO_BACKGROUND_BUILD = "1"


@dataclass
class EngineVenv:
    name: str
    python: str

    def env(self, extra: dict | None = None, home: str | None = None) -> dict:
        home = home or tempfile.mkdtemp(prefix=f"{self.name}-home-")  # engines write caches under $HOME on import
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        env.update({"HOME": home, "PYTHONDONTWRITEBYTECODE": "1", "TRITON_INTERPRET": "1",
                    "VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": str(REPO),
                    "HUMMING_DISABLE_PARALLEL_BUILD": HUMMING_NO_BACKGROUND_BUILD})
        env.update(extra or {})
        return {k: v for k, v in env.items() if v is not None}  # an extra variable set to None: unset

    def cli(self, *args: str, extra_env: dict | None = None) -> subprocess.CompletedProcess:
        tool = "sglang_ssd_stream" if self.name == "sglang" else "vllm_ple_offload.cli"
        return subprocess.run([self.python, "-m", tool, "patch", *args, "--python", self.python],
                              capture_output=True, text=True, env=self.env(extra_env), timeout=600)

    def status(self) -> dict:
        r = self.cli("status", "--json")
        assert r.returncode in (0, 2), r.stderr  # 2: some file unknown or missing (the JSON still lists them)
        return json.loads(r.stdout)

    def states(self) -> set[str]:
        return {f["state"] for f in self.status()["files"]}

    def ensure_pristine(self) -> None:
        if self.states() != {"pristine"}:
            r = self.cli("revert")
            assert r.returncode == 0, r.stderr
        assert self.states() == {"pristine"}

    def ensure_patched(self) -> None:
        r = self.cli("apply")
        assert r.returncode == 0, r.stderr
        assert self.cli("verify").returncode == 0

    def run_checks(self, *modules: str, extra_env: dict | None = None, timeout: int = 1500) -> dict[str, str]:
        """Run check modules (paths relative to the repo) in the venv; returns {test name: outcome}."""
        with tempfile.TemporaryDirectory() as tmp:
            xml = Path(tmp) / "junit.xml"
            # -p tests.triton_interpreter: the interpreter without its repeated bookkeeping (that module says what)
            args = ["-q", "-p", "no:cacheprovider", "-p", "tests.triton_interpreter", f"--junitxml={xml}",
                    "--rootdir", str(REPO), *modules]
            r = self._forked(args, extra_env, timeout, Path(tmp))
            if r is None:
                r = subprocess.run([self.python, "-m", "pytest", *args], cwd=REPO, capture_output=True, text=True,
                                   env=self.env(extra_env), timeout=timeout)
            if not xml.exists():
                raise AssertionError(f"check run produced no report (rc {r.returncode}):\n{r.stdout}\n{r.stderr}")
            outcomes = junit_outcomes(xml)
            outcomes["__output__"] = r.stdout[-6000:] + r.stderr[-3000:]
            return outcomes


    # seconds the first check waits for the venv's zygote to finish its imports (about two imports of the engine:
    # its probe, then the dependencies), past which it runs in a new process; None: no limit. Waiting costs no
    # more than the new processes would, on a busy box less: a zygote importing beside them slows them down.
    zygote_wait: float | None = 600.0

    def run_script(self, script: str, *args: str, extra_env: dict | None = None,
                   timeout: int = 600) -> subprocess.CompletedProcess:
        """``python SCRIPT ARGS`` in the venv (a path relative to the repo), for a check that needs a process per
        case: a fork of the venv's zygote under the same rule as the checks, else a new process."""
        with tempfile.TemporaryDirectory() as tmp:
            r = self._forked(list(args), extra_env, timeout, Path(tmp), script=str(REPO / script))
        if r is None:
            r = subprocess.run([self.python, str(REPO / script), *args], cwd=REPO, capture_output=True, text=True,
                               env=self.env(extra_env), timeout=timeout)
        return r

    def _forked(self, args: list[str], extra_env: dict | None, timeout: float,
                tmp: Path, script: str | None = None) -> subprocess.CompletedProcess | None:
        """The check run as a fork of the venv's zygote, or None where the rule (tests/forkserver.py) says a
        new process: the server is off, still importing, busy, dead, or the check's environment differs."""
        if not forkserver.enabled():
            return None
        if forkserver.differences(self.env(home="~"), self.env(extra_env, home="~"), {}):
            return None  # a difference no zygote allows: none is started for it
        zygote = forkserver.known_zygote(self.python) or forkserver.zygote_for(self.python, self.name, self.env())
        ready = zygote.wait_ready(self.zygote_wait)
        if ready is None or forkserver.differences(zygote.base_env, self.env(extra_env, home=str(zygote.home)),
                                                   ready):
            return None
        if not zygote.lock.acquire(blocking=False):
            return None
        try:
            out, err = tmp / "stdout", tmp / "stderr"
            code = zygote.run(args, self.env(extra_env, home=str(zygote.home)), REPO, timeout, out, err, script)
        except EOFError as exc:  # the zygote died under this check: a new process runs it again
            zygote.failed = str(exc)
            return None
        finally:
            zygote.lock.release()
        read = lambda p: p.read_text(errors="replace") if p.exists() else ""  # noqa: E731
        return subprocess.CompletedProcess(["zygote", *([script] if script else []), *args], code, read(out), read(err))


def junit_outcomes(xml: Path) -> dict[str, str]:
    outcomes = {}
    for case in ET.parse(xml).iter("testcase"):
        kinds = {child.tag for child in case}
        outcomes[case.get("name")] = ("failed" if "failure" in kinds else "error" if "error" in kinds
                                      else "skipped" if "skipped" in kinds else "passed")
    return outcomes


def engine_venv(name: str) -> EngineVenv:
    var = f"SSD_STREAM_{name.upper()}_PYTHON"
    python = os.environ.get(var)
    if not python:
        pytest.fail(f"{var} is not set: run the tests through scripts/test.sh, which builds the {name} venv")
    return EngineVenv(name, python)


def outcomes_only(results: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in results.items() if k != "__output__"}


def assert_red_green(eng: EngineVenv, check: str, red: set[str], guards: set[str],
                     outputs: Path | None = None) -> None:
    """On the pristine engine exactly ``red`` fails (``guards`` pass); patched, everything passes.

    With ``outputs``, each run writes its result files to ``outputs/pristine`` / ``outputs/patched``
    (``QSA_CHECK_OUT``) for the caller to compare byte for byte."""
    runs = {}
    for state in ("pristine", "patched"):
        (eng.ensure_pristine if state == "pristine" else eng.ensure_patched)()
        env = None
        if outputs is not None:
            (outputs / state).mkdir(parents=True)
            env = {"QSA_CHECK_OUT": str(outputs / state)}
        runs[state] = eng.run_checks(check, extra_env=env)
    eng.ensure_pristine()
    before, after = runs["pristine"], runs["patched"]
    assert outcomes_only(before) == {**{t: "failed" for t in red}, **{t: "passed" for t in guards}}, \
        before["__output__"]
    assert outcomes_only(after) == {t: "passed" for t in red | guards}, after["__output__"]
