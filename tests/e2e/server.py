"""The real ``sglang serve`` of the cached sglang venv, on a free loopback port, on a CPU.

One server at a time (the box has 2 cores and 24 GiB shared): starting one stops any other this process
started. Each server runs in its own session (process group); :meth:`SglangServer.stop` ends the whole
group (SIGTERM, then SIGKILL), and so do the scenario's ``finally``, an ``atexit`` hook and a SIGTERM
handler (``conftest.py``). A watchdog process, in a session of its own, ends the group when the test
process disappears without cleaning up (SIGKILL, a CI timeout), so no server outlives its test run.

What a CPU box needs to run it (issue 18):

* ``SGLANG_USE_CPU_ENGINE=1`` (sglang's ``is_cpu()``), ``--device cpu``;
* a stub ``libcuda.so.1`` on ``LD_LIBRARY_PATH`` so the CUDA build of ``sgl_kernel`` imports: every driver
  symbol it links returns an error (:func:`build_stub_driver`);
* ``TRITON_INTERPRET=1`` for the Triton kernels sglang runs on CPU tensors;
* caps, or it takes the machine: ``--max-total-tokens 4096 --context-length 256``,
  ``--max-mamba-cache-size 64`` for hybrid models, ``--sleep-on-idle``;
* for qwen4_exp, the test-owned CPU stand-in (``cpu_standin/``) on ``PYTHONPATH``.
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).resolve().parent / "cpu_standin"
CAPS = ["--max-total-tokens", "4096", "--context-length", "256", "--sleep-on-idle"]
HYBRID_CAPS = ["--max-mamba-cache-size", "64", "--disable-radix-cache"]  # mamba_hook.py:120 wants the latter
CONTEXT = 256
POLL_S = 0.25  # how often a wait for a start, an exit or a death looks again (each look costs a few ms)


@functools.cache
def shared_tls():
    """One TLS context for every request the tests send (``httpx.get(..., verify=shared_tls())``). Every request is
    plain http on loopback, but httpx builds a new context for each call made without a client, loading the CA
    bundle: ~25 ms of CPU a call, 110 s of the e2e suite's readiness polls in a profiled run."""
    import ssl

    return ssl.create_default_context()

# The driver entry points the CUDA build of sgl_kernel links (nm -D --undefined-only over its .so files).
DRIVER_SYMBOLS = (
    "cuCtxFromGreenCtx", "cuCtxPopCurrent_v2", "cuCtxPushCurrent_v2", "cuDevResourceGenerateDesc",
    "cuDevSmResourceSplitByCount", "cuDeviceGetDevResource", "cuDriverGetVersion", "cuGetProcAddress_v2",
    "cuGreenCtxCreate", "cuGreenCtxDestroy", "cuGreenCtxGetDevResource", "cuPointerGetAttribute", "cuStreamCreate",
    "cuGetErrorString",
)
CUDA_ERROR_NO_DEVICE = 100


def build_stub_driver(out: Path) -> Path:
    """A ``libcuda.so.1`` whose every entry point returns CUDA_ERROR_NO_DEVICE; returns its directory."""
    out.mkdir(parents=True, exist_ok=True)
    src = out / "stub_libcuda.c"
    src.write_text("/* test-only stub driver: sgl_kernel's CUDA build links these; none of them works */\n" + "".join(
        f"int {name}(void) {{ return {CUDA_ERROR_NO_DEVICE}; }}\n" for name in DRIVER_SYMBOLS))
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(out / "libcuda.so.1"), str(src)],
                   check=True, capture_output=True, text=True)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_live: set[SglangServer] = set()

# argv: the test process's pid, the server's process group. Ends the group (TERM, then KILL) if the test
# process goes away first; exits quietly once the group is gone.
WATCHDOG = """
import os, signal, sys, time
owner, group = int(sys.argv[1]), int(sys.argv[2])
def alive(pid, sig=os.kill):
    try:
        sig(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
while alive(group, os.killpg):
    if not alive(owner):
        for s, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 0)):
            try:
                os.killpg(group, s)
            except ProcessLookupError:
                break
            time.sleep(grace)
        break
    time.sleep(1)
"""


def stop_all() -> None:
    for s in list(_live):
        s.stop()


atexit.register(stop_all)


class ServerFailed(RuntimeError):
    """The server exited or never became healthy; the message carries the end of its log."""


def request_failed(scenario: str, server, exc: Exception) -> str:
    """What a scenario whose request failed says: whether the server died under it (then a behaviour the scenario
    relies on, a patch or the plugin, is missing: its log's end says which), never a bare connection error."""
    died = server.proc is not None and server.proc.poll() is not None
    what = (f"the server died while serving this scenario's requests (exit {server.proc.returncode}): a behaviour "
            "it relies on (a patch, the plugin) is missing or broken" if died else "a request failed; the server lives")
    return f"scenario {scenario}: {what} ({type(exc).__name__}: {exc}). Its log ends:\n{server.tail()}"


@dataclass(eq=False)
class SglangServer:
    python: str
    model: Path
    home: Path
    driver_dir: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    standin: bool = False
    name: str = "server"

    def __post_init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.home / f"{self.name}.log"
        self.proc: subprocess.Popen | None = None

    # ------------------------------------------------------------------ lifecycle

    def command(self) -> list[str]:
        sglang = str(Path(self.python).parent / "sglang")  # the entry point users run (profiles print it)
        return [sglang, "serve", "--model-path", str(self.model), "--host", "127.0.0.1",
                "--port", str(self.port), "--device", "cpu", *CAPS, *self.args]

    def start(self) -> SglangServer:
        stop_all()  # never two servers at once
        self.home.mkdir(parents=True, exist_ok=True)
        path = [str(STANDIN)] if self.standin else []
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "SGLANG_", "SSD_STREAM_"))}
        env.update({
            "HOME": str(self.home), "SGLANG_USE_CPU_ENGINE": "1", "TRITON_INTERPRET": "1",
            "LD_LIBRARY_PATH": os.pathsep.join([str(self.driver_dir), *filter(None, [env.get("LD_LIBRARY_PATH")])]),
            "PYTHONPATH": os.pathsep.join([*path, str(REPO)]), "PYTHONDONTWRITEBYTECODE": "1",
            "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
        })
        env.update(self.env)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        _live.add(self)
        subprocess.Popen([sys.executable, "-c", WATCHDOG, str(os.getpid()), str(self.proc.pid)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 420.0) -> SglangServer:
        """Until /health answers 200 (sglang's own warm-up request has then run); raises ServerFailed."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"{self.name} exited {self.proc.returncode} before /health:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", verify=shared_tls(), timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(POLL_S)
        raise ServerFailed(f"{self.name} not healthy in {timeout:.0f} s:\n{self.tail()}")

    def wait_exit(self, timeout: float = 420.0) -> int:
        """For a server that must refuse to start: its launcher's exit code (raises if it became healthy or
        hung). What is left of its group is for the caller to look at (:meth:`group_pids`) before :meth:`stop`."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return self.proc.returncode
            try:
                if httpx.get(f"{self.url}/health", verify=shared_tls(), timeout=5).status_code == 200:
                    raise ServerFailed(f"{self.name} became healthy but must have refused to start:\n{self.tail()}")
            except httpx.HTTPError:
                pass
            time.sleep(POLL_S)
        raise ServerFailed(f"{self.name} neither served nor exited in {timeout:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        """End the server's whole process group: SIGTERM, then SIGKILL after 20 s."""
        _live.discard(self)
        if self.proc is None:
            return
        for sig, grace in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            if self._group_gone(0):
                break
            try:
                os.killpg(self.proc.pid, sig)  # our own session (start_new_session=True), nothing else
            except ProcessLookupError:
                break
            if self._group_gone(grace):
                break
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        if not self._log.closed:
            self._log.close()

    def _group_gone(self, grace: float) -> bool:
        deadline = time.monotonic() + grace
        while True:
            self.proc.poll()  # reap the launcher if it exited
            if not self.group_pids():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)

    def settle(self, grace: float = 15.0) -> dict[int, str]:
        """After the launcher exited on its own: what of its group is still alive after ``grace`` seconds."""
        self._group_gone(grace)
        return self.group_pids()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ------------------------------------------------------------------ evidence

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def tail(self, n: int = 6000) -> str:
        return self.log()[-n:]

    def group_pids(self) -> dict[int, str]:
        """pid -> process title of every live process in the server's group (sglang::scheduler, ...)."""
        out = {}
        if self.proc is None:
            return out
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.getpgid(int(entry.name)) != self.proc.pid:
                    continue
                stat = (entry / "stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] == "Z":  # a zombie is gone, only not yet reaped
                    continue
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except (OSError, ProcessLookupError):
                continue
        return out

    def cpu_seconds(self) -> float:
        """CPU time (user + system, with reaped children) of the group's live processes: the e2e budget is
        judged on this, since the wall time of a shared box says little about a 2-core CI runner."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for pid in self.group_pids():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime
        return total / tick

    def lines(self, pattern: str) -> list[str]:
        return [line for line in self.log().splitlines() if re.search(pattern, line)]

    # ------------------------------------------------------------------ requests

    def post(self, path: str, body: dict, timeout: float = 300.0):
        import httpx

        return httpx.post(f"{self.url}{path}", verify=shared_tls(), json=body, timeout=timeout)

    def complete(self, prompt, max_tokens: int, *, logprobs: bool = False, timeout: float = 300.0, **extra) -> dict:
        """``/v1/completions``, greedy; ``prompt`` is text or a list of token ids.

        Returns the JSON (raises on HTTP errors)."""
        body = {"model": str(self.model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}
        if logprobs:
            body["logprobs"] = 1
        r = self.post("/v1/completions", body, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def generate_ids(self, input_ids: list[int], max_new_tokens: int, *, timeout: float = 300.0) -> dict:
        """Native ``/generate`` with token ids in and out, greedy, with output logprobs."""
        r = self.post("/generate", {"input_ids": input_ids, "return_logprob": True,
                                    "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}},
                      timeout=timeout)
        r.raise_for_status()
        return r.json()
