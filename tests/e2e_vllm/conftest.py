"""End-to-end scenarios: the real vLLM 0.33.0 OpenAI server of the cached venv, over HTTP, on a CPU (issue 26).

Every test here is marked ``e2e_vllm`` (``scripts/test.sh e2e-vllm`` runs them alone) and ``vllm`` (it needs the
vLLM venv; the ``vllm`` suite runs named paths only, so it does not pick these up). As in the sglang suite
(``tests/e2e``), a *scenario* is one server start: the server started with a configuration, the requests a proof
needs sent, the log and the process group kept, the server stopped (always, and before the next one starts).
Scenarios are session fixtures, so each server starts once however many tests read its results; tests only
assert.

The shared vLLM venv stays pristine: the suite never patches or writes it (the sglang suite patches its own venv;
this one cannot serialize with other users of the vLLM venv), so every streamed scenario on it sets
``VLLM_PLE_ALLOW_UNPATCHED=1`` and the plugin's guard says so in each process's log (test_1). The two scenarios that
need another source state (an unknown one, a patched one: test_4) run private copies of it made of hard links,
written only by rename (:func:`private_venv`); test_9 checks the shared venv is still pristine at the end.

Budget (CI: 2 cores): four serving starts, about 70-90 s each (three Python processes import vLLM), four refusals
that end in seconds (the plugin refuses before vLLM builds the model), 8 tokens per request; and one start of
about 4 minutes that serves proofs 4-6 (chunked prefill with an abort, ``validate``, ``watch``) at once.
One more start of about 2.7 minutes serves (b) with MTP 2 (test_7; its baseline is (b) itself). The hot file
across stops (test_8) is one chain of three starts over a private sidecar copy and data directory (each start
reads one hot file, and its three proofs need three different outcomes); its first start is (b)'s own (the forged
file it must refuse leaves its row cache cold, as (b)'s always was), so it adds two serving starts (about 70-90 s
each): 12 starts in all. Serving starts share vLLM's model-inspection cache (:data:`MODELINFO_CACHE`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from ..e2e.probes import token_ids
from ..e2e.server import ServerFailed, request_failed, shared_tls, stop_all
from ..engine import EngineVenv, engine_venv
from .models import make_qwen4_exp_vllm
from .server import VllmServer

MAX_TOKENS = 8  # per request, everywhere in this suite
# Three greedy prompts: text, and token ids of two lengths (the tokenizer's specials are ids < 10).
PROMPTS = {"text": "The secret code number is", "ids-24": token_ids(24, 0), "ids-97": token_ids(97, 1)}
ALLOW_UNPATCHED = {"VLLM_PLE_ALLOW_UNPATCHED": "1"}  # the venv is pristine; see the module docstring
REFUSE_TIMEOUT = 180.0  # a refusal comes in seconds; a server that serves instead is stopped by then


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/e2e_vllm/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e_vllm)
            item.add_marker(pytest.mark.vllm)  # needs the vLLM venv: the sglang suite's "not vllm" leaves it out


# ----------------------------------------------------------------------------- scenarios

# vLLM prefixes each line its processes write once its logging is set up: ``(APIServer pid=N) ...``,
# ``(EngineCore pid=N) ...``, ``(VllmWorker-0 pid=N) ...`` / ``(Worker pid=N) ...`` (the same worker).
PREFIX = re.compile(r"^\((?P<title>[A-Za-z][\w-]*) pid=(?P<pid>\d+)\) ")
MARKS = re.compile(r"\bpid (\d+)\b|^[IWEF]\d{4} [\d:.]+ (\d+) ")  # the stand-in's lines, torch's own
ROLES = {"api_server": ("APIServer",), "engine_core": ("EngineCore",), "worker": ("VllmWorker", "Worker")}


@dataclass
class Scenario:
    name: str
    env: dict
    leader: int = 0  # the launcher's pid: the API server itself, and the process group's id
    log: str = ""
    pids: dict = field(default_factory=dict)  # pid -> command line of every group member seen while it served
    exit_code: int | None = None  # for a server that had to refuse
    left_behind: dict = field(default_factory=dict)  # a refusing server: its group 15 s after the launcher exited
    after_stop: dict = field(default_factory=dict)  # the group after our stop(): must be empty
    results: dict = field(default_factory=dict)
    seconds: float = 0.0
    ready_seconds: float = 0.0

    def role_pids(self) -> dict[str, set[int]]:
        """The pids vLLM's line prefixes name for each role (``api_server``, ``engine_core``, ``worker``)."""
        out: dict[str, set[int]] = {role: set() for role in ROLES}
        for line in self.log.splitlines():
            m = PREFIX.match(line)
            if m:
                for role, titles in ROLES.items():
                    if m["title"].startswith(titles):
                        out[role].add(int(m["pid"]))
        return out

    def lines_of(self, pid: int) -> list[str]:
        """The log lines process ``pid`` wrote: those vLLM prefixed with its pid, the unprefixed ones that carry
        its pid (the stand-in's ``pid N``, torch's ``W1204 12:00:00.0 N``) and, for the launcher (the API
        server), the unmarked lines it wrote before vLLM set up its logging there: every one before the first
        mark of any other process. The engine core and the worker write their plugin lines with a prefix, so an
        unprefixed line of the plugin's can only be the launcher's."""
        lines, others_started = [], False
        for line in self.log.splitlines():
            m = PREFIX.match(line)
            marks = {int(m["pid"])} if m else {int(g) for groups in MARKS.findall(line) for g in groups if g}
            others_started = others_started or bool(marks - {self.leader})
            if marks == {pid} or (not marks and pid == self.leader and not others_started):
                lines.append(line)
        return lines

    def grep(self, pattern: str, pid: int | None = None) -> list[str]:
        lines = self.log.splitlines() if pid is None else self.lines_of(pid)
        return [line for line in lines if re.search(pattern, line)]


# Serving starts share one VLLM_CACHE_ROOT: vLLM keeps the model class's inspection there (``modelinfos/``, keyed
# by the SHA of the model module's sources), so every serving start after the first skips the inspection
# subprocess (``python -m vllm.model_executor.models.registry``: one more import of vLLM and torch, ~10 s of CPU
# per start). Its output is captured by vLLM, so no test reads it; the API server and the worker still import the
# model module themselves. The refusals keep their own empty cache (their HOME): the flipped sidecar must be
# caught in that subprocess (test_3).
MODELINFO_CACHE = "VLLM_CACHE_ROOT"


class Stage:
    """Runs one server at a time and records what the tests need."""

    def __init__(self, python: str, root: Path):
        self.python, self.root = python, root
        self.cache_root = root / "vllm-cache"  # see MODELINFO_CACHE
        self.timings: dict[str, float] = {}
        self.scenarios: list[Scenario] = []

    def _server(self, name: str, model: Path, env: dict, python: str | None = None,
                args: tuple[str, ...] = (), extra: dict | None = None) -> VllmServer:
        return VllmServer(python or self.python, model, self.root / name / "home", env={**env, **(extra or {})},
                          name=name, args=list(args))

    def _record(self, sc: Scenario, server: VllmServer, t0: float) -> None:
        server.stop()
        sc.after_stop = server.group_pids()
        sc.log = server.log()
        sc.seconds = time.monotonic() - t0
        self.timings[sc.name] = sc.seconds
        self.scenarios.append(sc)

    def serve(self, name: str, model: Path, exercise, env: dict, *, python: str | None = None,
              args: tuple[str, ...] = ()) -> Scenario:
        """``python``: another venv's interpreter (a private copy); ``args``: more server flags (the last wins)."""
        sc = Scenario(name, env)
        # a private copy's start keeps its own cache: its sources differ, and an entry it wrote would make the
        # shared venv's next start inspect again
        cache = self.cache_root if python is None else self.root / name / "vllm-cache"
        server = self._server(name, model, env, python, args, extra={MODELINFO_CACHE: str(cache)})
        t0 = time.monotonic()
        try:
            server.start()
            sc.leader = server.proc.pid
            server.wait_ready()
            sc.ready_seconds = time.monotonic() - t0
            sc.pids = server.group_pids()
            sc.results = exercise(server) or {}
            sc.pids.update(server.group_pids())
        except ServerFailed as exc:
            pytest.fail(f"scenario {name}: {exc}")
        except httpx.HTTPError as exc:
            pytest.fail(request_failed(name, server, exc))
        finally:
            self._record(sc, server, t0)
        return sc

    def refuse(self, name: str, model: Path, env: dict, timeout: float = REFUSE_TIMEOUT, *,
               python: str | None = None) -> Scenario:
        """A server that must stop before serving: its exit code and log."""
        sc = Scenario(name, env)
        server = self._server(name, model, env, python)
        t0 = time.monotonic()
        try:
            server.start()
            sc.leader = server.proc.pid
            sc.exit_code = server.wait_exit(timeout)
            sc.ready_seconds = time.monotonic() - t0
            sc.left_behind = server.settle()  # vLLM's own teardown, before ours
        except ServerFailed as exc:
            pytest.fail(f"scenario {name}: {exc}")
        finally:
            self._record(sc, server, t0)
        return sc


def _stop_servers_on_sigterm(signum, frame):
    stop_all()
    raise SystemExit(128 + signum)


@pytest.fixture(scope="session")
def engine() -> EngineVenv:
    """The pinned vLLM venv, which must be pristine: read (``patch status``), never written."""
    eng = engine_venv("vllm")
    states = eng.states()
    assert states == {"pristine"}, (f"the vLLM venv {eng.python} is not pristine ({states}); this suite serves "
                                    f"the pristine venv with VLLM_PLE_ALLOW_UNPATCHED=1 and never patches it")
    previous = signal.signal(signal.SIGTERM, _stop_servers_on_sigterm)
    try:
        yield eng
    finally:
        stop_all()
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="session")
def root(tmp_path_factory) -> Path:
    yield tmp_path_factory.mktemp("e2e_vllm")
    for path in list(_removals):  # the private venv copies, removed while later scenarios ran
        removed(path)


@pytest.fixture(scope="session")
def stage(engine, root, request):
    st = Stage(engine.python, root)
    yield st
    if st.timings:
        lines = [f"  {sc.name}: {sc.seconds:.0f} s wall ({'ready' if sc.exit_code is None else 'exited'} after "
                 f"{sc.ready_seconds:.0f} s)" for sc in st.scenarios]
        request.config._e2e_vllm_timings = "\n".join(
            [f"e2e-vllm server scenarios: {len(st.timings)} starts, {sum(st.timings.values()):.0f} s wall", *lines])


def pytest_terminal_summary(terminalreporter, config):
    text = getattr(config, "_e2e_vllm_timings", None)
    if text:
        terminalreporter.write_line(text)


# ----------------------------------------------------------------------------- models and sidecars


def kit(engine: EngineVenv, *args: str) -> subprocess.CompletedProcess:
    """``sglang-ssd-stream ARGS`` as a user runs it, in the vLLM venv, from this checkout."""
    r = subprocess.run([engine.python, "-m", "sglang_ssd_stream", *args], capture_output=True, text=True,
                       env=engine.env(), timeout=600)
    if r.returncode != 0:
        raise AssertionError(f"sglang-ssd-stream {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r


@pytest.fixture(scope="session")
def qwen4_model(root) -> Path:
    return make_qwen4_exp_vllm(root / "qwen4_exp")


@pytest.fixture(scope="session")
def sidecar(engine, qwen4_model, root) -> Path:
    out = root / "sidecar"
    kit(engine, "sidecar", "build", str(qwen4_model), "-o", str(out), "-q")
    return out


@pytest.fixture(scope="session")
def other_rows_model(root) -> Path:
    """The tiny qwen4_exp with every PLE shard negated: the same model with other PLE rows."""
    return make_qwen4_exp_vllm(root / "qwen4_exp-other-rows", negate_ple=True)


@pytest.fixture(scope="session")
def other_rows_sidecar(engine, other_rows_model, root) -> Path:
    out = root / "sidecar-other-rows"
    kit(engine, "sidecar", "build", str(other_rows_model), "-o", str(out), "-q")
    return out


DAMAGED_TABLE = "ple/layer-1.bin"


def damaged_copy(sidecar: Path, dest: Path, how: str) -> Path:
    """A copy of ``sidecar`` with one table cut short by a page (``truncated``) or one bit of one byte in its
    middle flipped (``flipped``); the verifier's cache of the original is not copied."""
    shutil.copytree(sidecar, dest)
    for cache in dest.glob(".ssd-stream-verified*"):
        cache.unlink()
    table = dest / DAMAGED_TABLE
    data = bytearray(table.read_bytes())
    if how == "truncated":
        data = data[: len(data) - 4096]
    else:
        data[len(data) // 2] ^= 0x01
    table.write_bytes(bytes(data))
    return dest


# ----------------------------------------------------------------------------- what a scenario sends


def greedy_runs(server: VllmServer) -> dict[str, dict]:
    """Each of :data:`PROMPTS` through ``/v1/completions``, greedy, one at a time (no batching differences)."""
    return {label: server.greedy(prompt, MAX_TOKENS) for label, prompt in PROMPTS.items()}


def streamed(backend: str, sidecar: Path, **extra: str) -> dict:
    return {"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": backend, "VLLM_PLE_SIDECAR": str(sidecar),
            **ALLOW_UNPATCHED, **extra}


# ----------------------------------------------------------------------------- scenarios (one server each)


@pytest.fixture(scope="session")
def vllm_table(stage, qwen4_model) -> Scenario:
    """(a) The reference: the plugin is loaded (VLLM_PLUGINS names it) but no ``VLLM_PLE_*`` is set, so it does
    nothing and vLLM's own ``Qwen4ExpPLEPinnedHostEmbedding`` holds the table (ordinary memory via the stand-in)."""
    return stage.serve("vllm-table", qwen4_model, lambda s: {"greedy": greedy_runs(s)}, env={})


@pytest.fixture(scope="session")
def streamed_mmap(stage, qwen4_model, hot_setup) -> Scenario:
    """(b) The streamed sidecar read through ``mmap``, the default row cache (1024 MiB) and prompt-ahead prefetch.

    It is also the first start of the hot file's chain (:func:`hot_forged`, test_8): the sidecar is the chain's
    private copy (the same bytes as :func:`sidecar`), the data directory the chain's, holding a forged hot file
    that the worker must refuse once, so the row cache starts cold as (b)'s always did; the file is written only
    at the stop (``VLLM_PLE_HOT_INTERVAL_S=0``: with the default 600 s nothing is written while (b) serves
    either). One start serves both proofs."""
    from ..hot_forgery import header

    sc = stage.serve("streamed-mmap", qwen4_model, greedy_after_log,
                     env=hot_env(hot_setup["sidecar"], hot_setup["home"]))
    sc.results["after_stop"] = hot_files(hot_setup["home"])
    if hot_setup["path"].exists():
        sc.results["header"] = header(hot_setup["path"])
    return sc


@pytest.fixture(scope="session")
def in_place_checkpoint(engine, qwen4_model, root) -> tuple[Path, dict]:
    """A copy of the tiny qwen4_exp with its in-place manifest (``sidecar build --in-place``: no table copied),
    and its files before the build."""
    from ..in_place_served import in_place_copy

    return in_place_copy(lambda *a: kit(engine, *a), qwen4_model, root / "qwen4_exp-in-place")


@pytest.fixture(scope="session")
def streamed_pread(stage, in_place_checkpoint) -> Scenario:
    """(c) The streamed sidecar read through ``pread``, row cache off (``VLLM_PLE_ROW_CACHE_MB=0``), on the
    checkpoint itself served in place: ``--model`` and ``VLLM_PLE_SIDECAR`` both the checkpoint, whose
    ``ssd-stream.json`` names regions of its own shards ((b) reads the same rows from a copied sidecar)."""
    ckpt, _ = in_place_checkpoint
    return stage.serve("streamed-pread", ckpt, lambda s: {"greedy": greedy_runs(s)},
                       env=streamed("pread", ckpt, VLLM_PLE_ROW_CACHE_MB="0"))


@pytest.fixture(scope="session")
def other_rows(stage, other_rows_model, other_rows_sidecar) -> Scenario:
    """(d) The control: (b)'s configuration on the negated checkpoint with its own sidecar."""
    return stage.serve("other-rows", other_rows_model, lambda s: {"greedy": greedy_runs(s)},
                       env=streamed("mmap", other_rows_sidecar))


# ----------------------------------------------------------------------------- MTP 2 (issue 26 item 6)

MTP_TOKENS = 2  # num_speculative_tokens, as the kit's vLLM thor profile (write-up 003) serves
MTP_ARGS = ("--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": MTP_TOKENS},
                                               separators=(",", ":")))
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total")


@pytest.fixture(scope="session")
def qwen4_mtp_model(qwen4_model, root) -> Path:
    """:func:`qwen4_model` copied file for file, plus the MTP draft's shard and ``mtp_num_hidden_layers``
    (``models.py:add_mtp_weights``): the target's tensors are the same bytes, so (b)'s sidecar serves it."""
    from .models import add_mtp_weights

    out = root / "qwen4_exp-mtp"
    shutil.copytree(qwen4_model, out)
    return add_mtp_weights(out)


PER_POSITION = re.compile(r'^vllm:spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position="(\d+)"[^}]*\} (\S+)$')


def spec_counters(server: VllmServer) -> dict:
    """vLLM's spec-decode totals from ``/metrics`` (Prometheus text; summed over label sets) and the accepted
    tokens per draft position (``per_position``)."""
    import httpx

    text = httpx.get(f"{server.url}/metrics", verify=shared_tls(), timeout=30).text
    out: dict = {name: 0.0 for name in SPEC_COUNTERS}
    per_position: dict[int, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
        m = PER_POSITION.match(line)
        if m:
            per_position[int(m[1])] = per_position.get(int(m[1]), 0.0) + float(m[2])
    out["per_position"] = per_position
    return out


@pytest.fixture(scope="session")
def streamed_mmap_mtp(stage, qwen4_mtp_model, sidecar, root) -> Scenario:
    """(b)'s configuration exactly (``mmap``, default row cache, prompt-ahead prefetch, the sidecar whose bytes (b)
    reads) on the checkpoint with its MTP draft, served with MTP 2: the greedy runs, then vLLM's spec-decode
    counters."""
    # the verify-step fetch on (off by default) and no hot file: it must be seen to read rows a cold cache lacks
    # (test_7); vLLM's metrics in multiprocess mode (an empty directory of its own), which carries the worker's
    # series of the kit to the API server's /metrics (test_9_metrics)
    from ..ple_metrics.prometheus_server import while_scraped

    prom = root / "streamed-mmap-mtp-prometheus"
    prom.mkdir()

    def exercise(server):  # a real Prometheus scrapes it meanwhile (test_7_metrics)
        return while_scraped(server.url, lambda: {"greedy": greedy_runs(server), "spec": spec_counters(server),
                                                  "metrics": metrics_at_idle(server)})

    return stage.serve("streamed-mmap-mtp", qwen4_mtp_model, exercise,
                       env=streamed("mmap", sidecar, VLLM_PLE_HOT_SHARE_PCT="0", VLLM_PLE_PREFETCH_DRAFTS="1",
                                    PROMETHEUS_MULTIPROC_DIR=str(prom)),
                       args=MTP_ARGS)


def metrics_at_idle(server: VllmServer) -> str:
    """``/metrics`` once the traffic is over and the kit's periodic publish has run since (at idle, every row
    cache's statistics are whole: no lookup is half counted)."""
    from sglang_ssd_stream.ple_metrics.publish import PUBLISH_INTERVAL_S

    time.sleep(2.5 * PUBLISH_INTERVAL_S)
    return httpx.get(f"{server.url}/metrics", verify=shared_tls(), timeout=30).text


BAD_KNOB = ("VLLM_PLE_FETCH_WORKERS", "+8")  # int() would take it; the plugin's one rule for numbers does not


@pytest.fixture(scope="session")
def bad_knob(stage, qwen4_model, sidecar) -> Scenario:
    name, value = BAD_KNOB
    return stage.refuse("bad-knob", qwen4_model, env=streamed("mmap", sidecar, **{name: value}), timeout=120)


@pytest.fixture(scope="session", params=["truncated", "flipped"])
def damaged_sidecar(request, stage, qwen4_model, sidecar, root) -> tuple[str, Path, Scenario]:
    """(b)'s configuration on a damaged copy of the sidecar; ``VLLM_PLE_NO_VERIFY`` unset (the SHA check on)."""
    how = request.param
    damaged = damaged_copy(sidecar, root / f"sidecar-{how}", how)
    env = streamed("mmap", damaged)
    assert "VLLM_PLE_NO_VERIFY" not in env
    return how, damaged, stage.refuse(f"sidecar-{how}", qwen4_model, env=env)


# ----------------------------------------------------------------------------- private copies of the venv (2)

PATCH_TARGET = "vllm/models/qwen4_exp/nvidia/ops/qsa.py"  # the one file vllm 0.33.0's patch series touches


def site_packages(venv_python: str) -> Path:
    (sp,) = Path(venv_python).parent.parent.glob("lib/python*/site-packages")
    return sp


def private_venv(engine: EngineVenv, dest: Path) -> tuple[EngineVenv, float]:
    """A private copy of the shared venv made of hard links (``cp -al``, as ``tests/vllm``'s ``vllm_private``):
    no file is copied, so it takes about a second. The kit's patcher and :func:`replace_file` write by rename,
    so the shared venv's files (the same inodes) are never written. Returns the copy and the seconds it took."""
    t0 = time.monotonic()
    subprocess.run(["cp", "-al", str(Path(engine.python).parent.parent), str(dest)], check=True)
    return EngineVenv("vllm", str(dest / "bin" / "python")), time.monotonic() - t0


_removals: dict[Path, threading.Thread] = {}


def remove_soon(path: Path) -> None:
    """Start removing ``path`` (a private venv copy) in a thread. Its ~93k hard links take 25-30 s to unlink on
    the 2-core box's ext4, nearly all of it waiting on the disk (under 1 s of CPU), so the removal overlaps the
    next server's start instead of adding to the session's end; :func:`removed` waits for it."""
    if path not in _removals:
        _removals[path] = threading.Thread(target=shutil.rmtree, args=(path,), kwargs={"ignore_errors": True},
                                           name=f"rm {path.name}", daemon=True)
        _removals[path].start()


def removed(path: Path) -> None:
    """``path`` removed: the removal :func:`remove_soon` started, or one started now, finished."""
    remove_soon(path)
    _removals[path].join()


def replace_file(path: Path, data: bytes) -> None:
    """Write ``data`` as a new file renamed over ``path`` (never into the hard-linked inode)."""
    tmp = path.with_name(path.name + ".e2e-new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def target_status(venv: EngineVenv) -> dict:
    """The kit's ``patch status --json`` entry of :data:`PATCH_TARGET` in ``venv`` (read only)."""
    (entry,) = [f for f in venv.status()["files"] if f["path"] == PATCH_TARGET]
    return entry


@pytest.fixture(scope="session")
def unknown_source(stage, engine, qwen4_model, sidecar, root) -> Scenario:
    """(b)'s configuration, escape hatch included (``VLLM_PLE_ALLOW_UNPATCHED=1``), on a private copy of the venv
    whose patch target has one line appended after install: a source state the kit knows no hash for."""
    dest = root / "venv-unknown"
    venv, copy_s = private_venv(engine, dest)
    target = site_packages(venv.python) / PATCH_TARGET
    replace_file(target, target.read_bytes() + b"\n# edited after install: a state the kit has no hash for\n")
    try:
        status = target_status(venv)
        sc = stage.refuse("unknown-source", qwen4_model, env=streamed("mmap", sidecar), python=venv.python,
                          timeout=120)
        sc.results = {"copy_seconds": copy_s, "status": status, "python": venv.python,
                      "sha256": hashlib.sha256(target.read_bytes()).hexdigest()}
        remove_soon(dest)  # the tests read only the results above
        yield sc
    finally:
        removed(dest)


# ----------------------------------------------------------------------------- the patched, chunked server (2, 4, 5)

CHUNK = 16  # --max-num-batched-tokens of the patched-chunked server: every prompt below is prefilled in chunks
CONTEXT = 128  # its --max-model-len: validate's over-long prompt (x1.075) is refused at once, no compute spent
ROW_CACHE_MB = 64  # its VLLM_PLE_ROW_CACHE_MB: the budget the worker's RSS is held to
ABORTED = (token_ids(112, 11), 4)  # 7 chunks; the client goes away after ABORT_AFTER_S
ABORT_AFTER_S = 6.0  # a chunk is ~2-5 s here (16 tokens through the Triton interpreter), so it is mid-prefill
CONCURRENT = {"b": (token_ids(40, 12), 2), "c": (token_ids(48, 13), 2), "d": (token_ids(56, 14), 2)}
WATCH_INTERVAL_S, WATCH_SAMPLES = 5.0, 12  # about a minute
VALIDATE_SUITES = "needle,truncation,soak,canary"
VALIDATE_ARGS = ("--suite", VALIDATE_SUITES, "--lengths", "16", "--answer-tokens", "4", "--truncation-max-tokens",
                 "4", "--cycles", "1", "--soak-tokens", "16", "--continue-tokens", "2", "--compact-tokens", "2",
                 "--canary-tokens", "8", "--kv-wait", "20", "--timeout", "300")
REPORT_EVERY_S = 60.0  # vllm_ple_offload/prompt_prefetch.py: the activity line's period (read, not imported)
ACTIVITY_LINE = re.compile(r"PLE prompt-ahead prefetch: \d+ chunk\(s\) fetched")
UNFINISHED_LINE = re.compile(r"PLE prompt-ahead prefetch: request \S+ left \(\w[\w-]*\) with its prefill unfinished")


# What the plugin's register() computes first in every vLLM process (vllm_ple_offload/activate.py), run in the
# copy's interpreter: the plugin logs only the verdict's warnings, so a patched engine's OK verdict is not in the
# server's log (docs/e2e-vllm-notes.md).
GUARD_VERDICT = ("from sglang_ssd_stream.patching.guard import verdict\n"
                 "for f in verdict('vllm').findings(allow_unpatched=False):\n    print(f.line())")


@pytest.fixture(scope="session")
def patched_venv(engine, root):
    """A private copy of the venv, patched with the kit's own CLI (``vllm-ple-offload patch apply``, then
    ``verify``): the engine as a user who ran the README's install has it."""
    dest = root / "venv-patched"
    venv, copy_s = private_venv(engine, dest)
    try:
        t0 = time.monotonic()
        venv.ensure_patched()
        patch_s = time.monotonic() - t0
        guard = subprocess.run([venv.python, "-c", GUARD_VERDICT], capture_output=True, text=True, env=venv.env(),
                               timeout=120)
        # one ``patch status`` for both facts below (``states()`` and ``target_status()`` each ran one)
        files = venv.status()["files"]
        (target,) = [f for f in files if f["path"] == PATCH_TARGET]
        yield venv, {"python": venv.python, "copy_seconds": copy_s, "patch_seconds": patch_s,
                     "states": {f["state"] for f in files}, "target": target, "guard": guard.stdout + guard.stderr}
    finally:
        removed(dest)


def _activity_after(server: VllmServer, mark: str) -> int:
    """How many activity lines the server wrote after the line holding ``mark`` (the leave that logs ``mark`` writes
    one right after it; the next comes with a later leave, at least :data:`REPORT_EVERY_S` later)."""
    lines = server.log().splitlines()
    at = next((i for i, line in enumerate(lines) if mark in line), None)
    return 0 if at is None else sum(1 for line in lines[at + 1:] if ACTIVITY_LINE.search(line))


def chunked_traffic(server: VllmServer, engine: EngineVenv, sidecar: Path, out: Path) -> dict:
    """Items 4 and 5 against one server, with the worker's RSS sampled and ``watch`` running throughout:
    the aborted prompt first (alone it takes every chunk of a step), three long prompts right behind it, then
    ``validate``; finally, if the activity line has not come again since the one the abort wrote (it comes at most
    once a minute, :data:`REPORT_EVERY_S`), short requests until it does (bounded)."""
    from . import traffic

    res: dict = {"worker": traffic.worker_pid(server)}
    rss = traffic.RssSampler(res["worker"])
    rss.start()
    env = engine.env()
    watch, watch_t0 = traffic.start_watch(engine.python, env, server.url, sidecar, out / "watch", WATCH_INTERVAL_S,
                                          WATCH_SAMPLES)
    t0 = time.monotonic()
    try:
        with traffic.abort_mid_prefill(server, *ABORTED, after=ABORT_AFTER_S) as aborted:
            time.sleep(0.5)  # the aborted one arrives first
            sent = traffic.together(server, CONCURRENT)
        res["aborted"] = aborted.result
        res["concurrent"] = traffic.join(sent)
        res["phase_seconds"] = time.monotonic() - t0
        res["validate"] = traffic.run_validate(engine.python, env, server.url, out / "validate-report",
                                               *VALIDATE_ARGS)
        deadline, nudges = time.monotonic() + 90, []
        while _activity_after(server, "with its prefill unfinished") < 2 and time.monotonic() < deadline:
            nudges.append(traffic.completion(server, token_ids(8, 15), 1))
            time.sleep(5)
        res["nudges"] = nudges
    finally:
        res["watch"] = traffic.finish_watch(watch, out / "watch", watch_t0, timeout=WATCH_INTERVAL_S *
                                            WATCH_SAMPLES + 60)
        res["rss"] = rss.stop()
        res["seconds"] = time.monotonic() - t0
        summary = {k: v for k, v in res.items() if k not in ("watch", "validate")}
        summary["validate_seconds"] = res.get("validate", {}).get("seconds")
        summary["watch_seconds"] = res["watch"]["seconds"]
        (out / "traffic.json").write_text(json.dumps(summary, indent=1, default=str))  # for the notes and CI logs
    return res


@pytest.fixture(scope="session")
def patched_chunked(stage, engine, patched_venv, qwen4_model, sidecar, root) -> Scenario:
    """(b)'s streamed configuration (``mmap``, row cache of :data:`ROW_CACHE_MB`, prompt-ahead prefetch) on the
    patched private copy, **without** ``VLLM_PLE_ALLOW_UNPATCHED``, prefilling in chunks of :data:`CHUNK` tokens;
    it serves items 4 (concurrent chunked prefills, one aborted) and 5 (``validate``, ``watch``)."""
    venv, facts = patched_venv
    env = {"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": "mmap", "VLLM_PLE_SIDECAR": str(sidecar),
           "VLLM_PLE_ROW_CACHE_MB": str(ROW_CACHE_MB)}
    sc = stage.serve("patched-chunked", qwen4_model, lambda s: chunked_traffic(s, engine, sidecar, root / "tools"),
                     env=env, python=venv.python,
                     args=("--max-num-batched-tokens", str(CHUNK), "--max-model-len", str(CONTEXT)))
    sc.results["venv"] = facts
    remove_soon(Path(venv.python).parent.parent)  # its one server has stopped; the tests read only the results
    return sc


# ----------------------------------------------------------------------------- the hot file across stops (issue 38)

# One chain of three starts on a private copy of the sidecar and one private data directory
# (SGLANG_SSD_STREAM_HOME), the hot file written only at a stop (VLLM_PLE_HOT_INTERVAL_S=0):
#   1 streamed-mmap, (b) itself (:func:`hot_forged` is :func:`streamed_mmap`): a forged file at the worker's path
#     (the kit's own profile, rows changed, checksums recomputed, identities kept: tests/hot_forgery.py) is
#     refused once, cold; the stop writes the real file (s, a)
#   2 hot-restart: loads it before the first request (s); then a table is rewritten in place with its mtime put
#     back, and the stop refuses to save (b)
#   3 hot-restored: the operator renamed the right table over it; the file bound to the old one is refused (b)
# One file is read per start, so (a), (s)'s load and (b)'s restart take a start each.
HOT_ROLE = "vllm-cpu-tp0-pp0"  # the CPU worker's role (prompt_prefetch._role): TP rank 0, PP rank 0, no GPU
HOT_TABLE = "ple/layer-1.bin"  # the table (b) rewrites in place, then restores by rename
INVERT = bytes(range(255, -1, -1))  # bytes.translate table: every bit flipped
HOT_CORPUS = "The secret code number is 42. " * 8  # the profile's one request (any text the tokenizer takes)


def hot_env(sidecar: Path, home: Path) -> dict:
    return streamed("mmap", sidecar, VLLM_PLE_HOT_INTERVAL_S="0", SGLANG_SSD_STREAM_HOME=str(home))


def hot_files(home: Path) -> dict[str, bytes]:
    """Every file in the data directory's hot-file folder (temporaries included), name -> bytes."""
    folder = home / "hot"
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())} if folder.is_dir() else {}


def greedy_after_log(server: VllmServer) -> dict:
    """The log as it was before the first request, then :func:`greedy_runs`."""
    return {"log_before_requests": server.log(), "greedy": greedy_runs(server)}


@pytest.fixture(scope="session")
def hot_setup(engine, qwen4_model, sidecar, root) -> dict:
    """The private sidecar copy, the data directory and, in it, a forged hot file: the kit's own ``sidecar
    profile`` writes the real file the worker looks for, then :func:`tests.hot_forgery.forge` forges it."""
    from ..hot_forgery import forge, header

    private = root / "sidecar-hot"
    shutil.copytree(sidecar, private)
    for cache in private.glob(".ssd-stream-verified*"):
        cache.unlink()
    home = root / "hot-home"
    corpus = root / "hot-corpus.txt"
    corpus.write_text(HOT_CORPUS)
    r = subprocess.run([engine.python, "-m", "vllm_ple_offload.cli", "sidecar", "profile", str(private), "--model",
                        str(qwen4_model), "--corpus", str(corpus), "--role", HOT_ROLE, "--json"],
                       capture_output=True, text=True, timeout=600,
                       env=engine.env({"SGLANG_SSD_STREAM_HOME": str(home), "HF_HUB_OFFLINE": "1"}))
    assert r.returncode == 0, r.stdout + r.stderr
    path = Path(json.loads(r.stdout)["path"])
    genuine = header(path)
    forged_rows = forge(path, private)
    return {"sidecar": private, "home": home, "path": path, "genuine": genuine, "forged": header(path),
            "forged_rows": forged_rows, "forged_bytes": path.read_bytes()}


@pytest.fixture(scope="session")
def hot_forged(streamed_mmap) -> Scenario:
    """Start 1: the forged file at the worker's path; the stop writes the real file. This is (b)'s start,
    :func:`streamed_mmap`: its configuration is (b)'s, on the chain's sidecar copy and data directory."""
    return streamed_mmap


def rewrite_in_place(table: Path) -> dict:
    """Every byte of ``table`` inverted in its own inode, its atime and mtime put back (a writer that hides its
    write: :func:`tests.hot_forgery.rewrite_in_place`); returns the stat before and after and the original bytes."""
    from ..hot_forgery import rewrite_in_place as hidden_write

    before = os.stat(table)
    data = table.read_bytes()
    hidden_write(table, data.translate(INVERT))
    return {"before": before, "after": os.stat(table), "original": data}


@pytest.fixture(scope="session")
def hot_restart(stage, qwen4_model, hot_setup, hot_forged) -> Scenario:
    """Start 2 over start 1's data directory: it loads the file; after its requests a table is rewritten in
    place (mtime put back) while it serves, so its stop must not save."""
    table = hot_setup["sidecar"] / HOT_TABLE

    def exercise(server: VllmServer) -> dict:
        out = greedy_after_log(server)
        out["rewrite"] = rewrite_in_place(table)
        return out

    sc = stage.serve("hot-restart", qwen4_model, exercise, env=hot_env(hot_setup["sidecar"], hot_setup["home"]))
    sc.results["after_stop"] = hot_files(hot_setup["home"])
    return sc


@pytest.fixture(scope="session")
def hot_restored(stage, qwen4_model, hot_setup, hot_restart) -> Scenario:
    """Start 3: the operator wrote the right table as a new file and renamed it over the rewritten one
    (:func:`replace_file`); the data directory still holds the file bound to the old table."""
    table = hot_setup["sidecar"] / HOT_TABLE
    rewritten = os.stat(table)
    replace_file(table, hot_restart.results["rewrite"]["original"])
    before = hot_files(hot_setup["home"])
    sc = stage.serve("hot-restored", qwen4_model, greedy_after_log,
                     env=hot_env(hot_setup["sidecar"], hot_setup["home"]))
    sc.results.update({"rewritten": rewritten, "restored": os.stat(table), "before_start": before})
    return sc
