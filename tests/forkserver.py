"""A fork server per engine venv for the engine-side checks (tests/engine.py ``EngineVenv.run_checks``).

A fresh ``python -m pytest`` in an engine venv spends ~8-10 s importing the engine's third-party dependencies
(torch, transformers, flashinfer, ...). The zygote (tests/zygote.py), one per venv python per outer pytest
process, started at the first check that may use it, imports those once; each check is then a fork of it that
imports the engine, the kit and the tests fresh, as a new process would (their files change state between
checks). It never imports a module of the engine (``sglang``/``vllm``), the kit or the tests.

The rule (``differences``): a check runs in a fork only when its environment equals the zygote's but for
*knobs* (``KNOBS``: the engine's and the kit's settings, the checks' own variables), and only for knobs that no
pre-imported module read (Python-level reads, recorded while the zygote imported), that fed none of the
engine's environment writes the zygote replayed, and that no environment scan of a pre-imported module could
have seen (each scan's site must be a known prefix scan, ``SCANS``). ``HOME`` is the same path for the zygote
and its checks (modules keep paths under it, e.g. huggingface_hub's cache), emptied back to what the imports
left there before each check: every check still starts with a fresh ``HOME``. Any other difference
(``TRITON_INTERPRET``, ``CUDA_VISIBLE_DEVICES``, ``PYTHONPATH``, ...) runs the fresh process as before.
``SSD_STREAM_FORK_SERVER=0`` turns the fork server off.
"""

from __future__ import annotations

import atexit
import fnmatch
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ZYGOTE = Path(__file__).with_name("zygote.py")
OFF_SWITCH = "SSD_STREAM_FORK_SERVER"

# Never imported by the zygote: the engines, the kit and the tests (they change state between checks).
EXCLUDED = ("sglang", "vllm", "sglang_ssd_stream", "vllm_ple_offload", "tests")
# Dependencies the zygote leaves to the checks: their import starts threads (humming's background kernel builds and
# their reaper threads), and a fork keeps only the thread that forks. A dependency found starting one stops the
# zygote (its ready says which), and its checks run in new processes.
STARTS_THREADS = ("humming",)
# The heavy modules the probe imports to learn the engine's dependencies.
ENTRIES = {
    "sglang": ["sglang.srt.managers.scheduler", "sglang.srt.managers.tokenizer_manager",
               "sglang.srt.entrypoints.http_server"],
    "vllm": ["vllm.config", "vllm.engine.arg_utils", "vllm.v1.worker.gpu_model_runner"],
}
# Variables a check may set differently from the zygote: read by the engine, the kit or the check only.
KNOBS = ("SGLANG_*", "VLLM_PLE_*", "QSA_CHECK_OUT", "EXPECT", "EXPECT_*", "FAIL_PLE_HOOKS")
# Environment scans seen while the engine's dependencies load, and the prefix each one looks for (read in
# their source): a knob with that prefix could change what they found.
SCANS = {"tqdm.utils": "TQDM_", "networkx.utils.backends": "NETWORKX_BACKEND_PRIORITY_", "fsspec.config": "FSSPEC_",
         "sglang.srt.environ": "SGL_"}


def enabled() -> bool:
    return os.environ.get(OFF_SWITCH, "1") != "0"


def differences(base: dict, env: dict, ready: dict) -> list[str]:
    """Why ``env`` cannot run in a zygote started with ``base`` (empty: it can)."""
    why = []
    unknown_scans = [s for s in ready.get("scans", []) if s not in SCANS]
    prefixes = tuple(SCANS[s] for s in ready.get("scans", []) if s in SCANS)
    observed = set(ready.get("observed", []))
    for key in sorted(set(base) | set(env)):
        if base.get(key) == env.get(key):
            continue
        if not any(fnmatch.fnmatchcase(key, k) for k in KNOBS):
            why.append(f"{key} differs and is not a knob")
        elif key in observed:
            why.append(f"{key} was read while the zygote imported")
        elif key.startswith(prefixes):
            why.append(f"{key} matches an environment scan of the zygote's imports")
        elif unknown_scans:
            why.append(f"{key} differs and the zygote's imports scanned the environment ({unknown_scans[0]})")
    return why


class Zygote:
    """One zygote: started lazily, one check at a time, gone when the outer pytest process is."""

    def __init__(self, python: str, engine: str, base_env: dict, home: Path, entries: list[str] | None = None,
                 cwd: Path = REPO):
        self.python, self.engine, self.base_env, self.home = python, engine, base_env, home
        self.dir = Path(tempfile.mkdtemp(prefix=f"{engine}-zygote-"))
        self.template = self.dir / "home-template"
        self.lock = threading.Lock()
        self.ready: dict | None = None
        self.failed: str | None = None
        self.runs = 0  # checks forked
        reply_r, reply_w = os.pipe()
        config = {"excluded": list(EXCLUDED), "avoid": list(STARTS_THREADS), "scans": SCANS, "reply_fd": reply_w,
                  "cwd": str(cwd), "entries": ENTRIES.get(engine, []) if entries is None else entries}
        self.log = open(self.dir / "zygote.log", "wb")  # lives as long as the zygote
        self.proc = subprocess.Popen([python, str(ZYGOTE), json.dumps(config)], stdin=subprocess.PIPE,
                                     stdout=self.log, stderr=self.log, cwd=cwd, env=base_env, pass_fds=(reply_w,))
        os.close(reply_w)
        self.replies = os.fdopen(reply_r, "rb")
        self._buf = b""
        atexit.register(self.close)

    def _message(self, timeout: float | None) -> dict | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.replies], [], [], left)[0]:
                return None
            data = os.read(self.replies.fileno(), 1 << 20)
            if not data:
                raise EOFError(f"the {self.engine} zygote died; its log: {self.dir / 'zygote.log'}")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def wait_ready(self, timeout: float | None) -> dict | None:
        """The zygote's ``ready`` (what it imported, read and scanned), None while it is still importing."""
        if self.ready is None and self.failed is None:
            try:
                msg = self._message(timeout)
            except EOFError as exc:
                self.failed = str(exc)
                return None
            if msg is None:
                return None
            self.ready = msg
            if msg.get("threads", 1) != 1:
                self.failed = (f"the zygote runs {msg['threads']} Python threads after its imports (the first after "
                               f"{msg.get('thread_starter')}): forks are unsafe")
                self.close()
                return None
            if self.home.exists():  # what the imports left in HOME: every check starts from it
                shutil.copytree(self.home, self.template, symlinks=True)
            else:
                self.template.mkdir()
        return self.ready if self.failed is None else None

    def _fresh_home(self) -> None:
        shutil.rmtree(self.home, ignore_errors=True)
        shutil.copytree(self.template, self.home, symlinks=True)

    def run(self, args: list[str], env: dict, cwd: Path, timeout: float, out: Path, err: Path,
            script: str | None = None) -> int:
        """Fork one ``python -m pytest ARGS``, or ``python SCRIPT ARGS`` (its own session); kill its group past
        ``timeout``."""
        self._fresh_home()
        env = {**env, **self.ready["delta"]}
        for key in self.ready.get("removed", []):
            env.pop(key, None)
        req = {"args": args, "env": env, "cwd": str(cwd), "stdout": str(out), "stderr": str(err), "script": script}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        started = self._message(60)
        if not started or started.get("op") != "started":
            raise RuntimeError(f"the {self.engine} zygote did not start the check: {started}")
        pid = started["pid"]
        self.runs += 1
        done = self._message(timeout)
        if done is None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._message(60)  # its exit
            raise subprocess.TimeoutExpired([self.python, *([script] if script else ["-m", "pytest"]), *args], timeout)
        return done["code"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if self.failed is None:  # else its log stays for the curious
            shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.home, ignore_errors=True)


_zygotes: dict[tuple[int, str], Zygote] = {}


def zygote_for(python: str, engine: str, base_env: dict) -> Zygote:
    """This process's zygote for ``python`` (started now if there is none yet)."""
    key = (os.getpid(), python)
    if key not in _zygotes:
        _zygotes[key] = Zygote(python, engine, base_env, Path(base_env["HOME"]))
    return _zygotes[key]


def known_zygote(python: str) -> Zygote | None:
    return _zygotes.get((os.getpid(), python))
