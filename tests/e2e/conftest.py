"""End-to-end scenarios: the real sglang 0.5.23 server of the cached venv, over HTTP, on a CPU (issue 18).

Every test here is marked ``e2e`` (``scripts/test.sh e2e`` runs them alone). A *scenario* is one server
start: the engine put in a patch state, the server started, the requests a proof needs sent, the log and
process titles kept, the server stopped (always, and before the next one starts). Scenarios are
session fixtures, so each server starts once however many tests read its results; tests only assert.

Budget (CI: 2 cores): nineteen server starts (four of them MTP; issue 38 added the forged hot file); 16 generated
tokens per request except the MTP probes that need a long decode (clients that go away, concurrency: up to 200).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from ..engine import EngineVenv, engine_venv
from . import probes
from .models import VOCAB
from .probes import token_ids
from .server import HYBRID_CAPS, ServerFailed, SglangServer, build_stub_driver, request_failed, shared_tls, stop_all

ALLOW_UNPATCHED = {"SGLANG_SSD_STREAM_ALLOW_UNPATCHED": "1"}
# patch 0007's settings, lowered so the survey's oversized body and half-sent request cost little time
BODY_LIMITS = {"SGLANG_MAX_REQUEST_BODY_MB": str(probes.BODY_LIMIT_MB),
               "SGLANG_REQUEST_BODY_TIMEOUT": str(probes.BODY_TIMEOUT_S)}
MAX_TOKENS = 16  # per request, everywhere in this suite
# Truncation probes (token ids, so lengths are exact): over the 256-token context by the write-up's 1.075,
# and between the scheduler's input limit (context - 6) and the context.
TRUNCATION_PROMPTS = {"over": 275, "near": 252}
TRUNCATION_MAX_TOKENS = 8
# Greedy PLE probes: token-id prompts of three lengths (one prefill chunk each), 16 tokens out.
PLE_PROMPTS = (24, 97, 180)
QWEN4_COPY_BIAS = 0.5  # models.py:make_qwen4_exp says why and how much
# sglang's own warm-up request (8 tokens through the chat template before /health answers 200; 1 to 13 s of
# server CPU here) is skipped by every scenario whose tests never read it. Kept where they do: the hot file's
# chain counts its activity line (the first one) and its rows, and the MTP sidecar's verify-step fetch counts it.
NO_WARMUP = ("--skip-server-warmup",)


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


@dataclass
class Scenario:
    name: str
    state: str  # patched | pristine
    log: str = ""
    pids: dict = field(default_factory=dict)  # pid -> process title while it served
    exit_code: int | None = None  # for a server that had to refuse
    left_behind: dict = field(default_factory=dict)  # a refusing server: its group 15 s after the launcher exited
    after_stop: dict = field(default_factory=dict)  # the group after our stop(): must be empty
    results: dict = field(default_factory=dict)
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # the server's processes, sampled before it stops

    def pid_lines(self, pattern: str, title: str) -> list[str]:
        """Log lines matching ``pattern`` written by the process titled ``title`` (e.g. sglang::scheduler)."""
        import re

        pids = {p for p, t in self.pids.items() if t.startswith(title)}
        return [line for line in self.log.splitlines()
                if re.search(pattern, line) and any(f"pid {p}:" in line for p in pids)]


class Stage:
    """Puts the engine in a state, runs one server, records what the tests need."""

    def __init__(self, engine: EngineVenv, root: Path, driver: Path):
        self.engine, self.root, self.driver = engine, root, driver
        self.timings: dict[str, tuple[float, float]] = {}  # name -> (wall s, server CPU s)
        self.scenarios: list[Scenario] = []
        self.state: str | None = None  # the engine state this stage last put and verified (nothing else sets it)

    def _engine_state(self, state: str) -> None:
        if state != self.state:  # every server's plugin checks the source again in each of its processes
            self.state = None
            (self.engine.ensure_patched if state == "patched" else self.engine.ensure_pristine)()
            self.state = state

    def serve(self, name: str, state: str, model: Path, exercise, *, standin: bool = False, args=(), env=None,
              ) -> Scenario:
        self._engine_state(state)
        sc = Scenario(name, state)
        server = SglangServer(self.engine.python, model, self.root / name, self.driver, args=list(args),
                              env={**(env or {})}, standin=standin, name=name)
        t0 = time.monotonic()
        try:
            server.start().wait_ready()
            sc.pids = server.group_pids()
            sc.results = exercise(server) or {}
            sc.pids.update(server.group_pids())
        except ServerFailed as exc:
            pytest.fail(f"scenario {name}: {exc}")
        except httpx.HTTPError as exc:
            pytest.fail(request_failed(name, server, exc))
        finally:
            sc.cpu_seconds = server.cpu_seconds()
            server.stop()
            sc.after_stop = server.group_pids()
            sc.log = server.log()
            sc.seconds = time.monotonic() - t0
            self.timings[name] = (sc.seconds, sc.cpu_seconds)
            self.scenarios.append(sc)
        return sc

    def refuse(self, name: str, state: str, model: Path, *, standin: bool = False, args=(), env=None) -> Scenario:
        """A server that must stop before serving: its exit code and log."""
        self._engine_state(state)
        sc = Scenario(name, state)
        server = SglangServer(self.engine.python, model, self.root / name, self.driver, args=list(args),
                              env={**(env or {})}, standin=standin, name=name)
        t0 = time.monotonic()
        try:
            server.start()
            sc.exit_code = server.wait_exit()
            sc.left_behind = server.settle()  # sglang's own teardown, before ours
        except ServerFailed as exc:
            pytest.fail(f"scenario {name}: {exc}")
        finally:
            server.stop()
            sc.after_stop = server.group_pids()
            sc.log = server.log()
            sc.seconds = time.monotonic() - t0
            self.timings[name] = (sc.seconds, 0.0)
            self.scenarios.append(sc)
        return sc


def _stop_servers_on_sigterm(signum, frame):
    stop_all()
    raise SystemExit(128 + signum)


@pytest.fixture(scope="session")
def engine():
    """The pinned sglang venv; pristine before and after the session (the scenarios patch it)."""
    eng = engine_venv("sglang")
    previous = signal.signal(signal.SIGTERM, _stop_servers_on_sigterm)
    eng.ensure_pristine()
    try:
        yield eng
    finally:
        stop_all()
        signal.signal(signal.SIGTERM, previous)
        eng.ensure_pristine()


@pytest.fixture(scope="session")
def e2e_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def stage(engine, e2e_root, request):
    st = Stage(engine, e2e_root, build_stub_driver(e2e_root / "driver"))
    yield st
    if st.timings:
        wall, cpu = (sum(t[i] for t in st.timings.values()) for i in (0, 1))
        lines = [f"  {name}: {w:.0f} s wall, {c:.0f} s server CPU" for name, (w, c) in st.timings.items()]
        request.config._e2e_timings = "\n".join(
            [f"e2e server scenarios: {len(st.timings)} starts, {wall:.0f} s wall, {cpu:.0f} s server CPU", *lines])
    surveys = {sc.name: sc.results["malformed"] for sc in st.scenarios if "malformed" in sc.results}
    if surveys:
        request.config._e2e_survey = survey_table(surveys)


def survey_table(surveys: dict) -> str:
    """The malformed-request survey of each scenario side by side (docs/malformed-requests.md is written from it)."""
    def cell(case):
        if case is None:
            return "not sent"
        status = case["status"] if case["status"] is not None else "no answer"
        return f"{status}{' leaks-paths' if case['leaks'] else ''}{'' if case['alive_after'] else ' SERVER-DOWN'}"

    names = list(dict.fromkeys(n for s in surveys.values() for n in s["cases"]))
    lines = [f"malformed-request survey ({' | '.join(surveys)}):"]
    lines += [f"  {n}: {' | '.join(cell(s['cases'].get(n)) for s in surveys.values())}" for n in names]
    lines += [f"  half-sent request, {name}: {'dropped' if s['half_request']['dropped'] else 'held'} after "
              f"{s['half_request']['after']:.0f} s" for name, s in surveys.items()]
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter, config):
    for attr in ("_e2e_timings", "_e2e_survey", "_e2e_hot"):
        text = getattr(config, attr, None)
        if text:
            terminalreporter.write_line(text)


# ----------------------------------------------------------------------------- models and sidecars


@pytest.fixture(scope="session")
def qwen3_model(e2e_root) -> Path:
    from .models import make_qwen3

    return make_qwen3(e2e_root / "qwen3")


@pytest.fixture(scope="session")
def qwen4_model(e2e_root) -> Path:
    """The tiny qwen4_exp with its NEXTN draft in ``mtp/``, as the real checkpoint ships it."""
    from .models import make_qwen4_exp, write_mtp_draft

    # a target that sometimes repeats a token: the draft (which proposes the token just emitted) is then
    # accepted part of the time, so MTP on equals MTP off is proven through the accept path too
    model = make_qwen4_exp(e2e_root / "qwen4_exp", copy_bias=QWEN4_COPY_BIAS)
    write_mtp_draft(model)
    return model


def kit(engine: EngineVenv, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``sglang-ssd-stream ARGS`` as a user runs it, in the engine venv, from this checkout."""
    env = engine.env()
    r = subprocess.run([engine.python, "-m", "sglang_ssd_stream", *args], capture_output=True, text=True, env=env,
                       timeout=600)
    if check and r.returncode != 0:
        raise AssertionError(f"sglang-ssd-stream {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r


@pytest.fixture(scope="session")
def sidecar(engine, qwen4_model, e2e_root) -> Path:
    out = e2e_root / "sidecar"
    kit(engine, "sidecar", "build", str(qwen4_model), "-o", str(out), "-q")
    return out


@pytest.fixture(scope="session")
def other_rows_model(other_rows_sidecar, e2e_root) -> Path:
    """The checkpoint ``other_rows_sidecar`` was built from (the tiny qwen4_exp with every PLE shard negated)."""
    return e2e_root / "qwen4_exp-other-rows"


@pytest.fixture(scope="session")
def other_rows_sidecar(engine, qwen4_model, e2e_root) -> Path:
    """A valid sidecar of the same geometry whose PLE rows differ (every shard negated)."""
    from safetensors.torch import load_file, save_file

    ck = e2e_root / "qwen4_exp-other-rows"
    shutil.copytree(qwen4_model, ck)
    for f in ck.glob("*.safetensors"):
        tensors = load_file(str(f))
        for name in tensors:
            if ".ngram_embedding.shard_" in name:
                tensors[name] = -tensors[name]
        save_file(tensors, str(f), metadata={"format": "pt"})
    out = e2e_root / "sidecar-other-rows"
    kit(engine, "sidecar", "build", str(ck), "-o", str(out), "-q")
    return out


def damaged_copy(sidecar: Path, dest: Path, how: str) -> Path:
    """A copy of ``sidecar`` with layer 1's table cut short (``truncated``) or one byte changed (``tampered``)."""
    shutil.copytree(sidecar, dest)
    for cache in dest.glob(".ssd-stream-verified*"):
        cache.unlink()
    table = dest / "ple" / "layer-1.bin"
    data = bytearray(table.read_bytes())
    if how == "truncated":
        data = data[: len(data) - 4096]
    else:
        data[len(data) // 2] ^= 0x01
    table.write_bytes(bytes(data))
    return dest


# ----------------------------------------------------------------------------- what a scenario sends


def send_truncation_probes(server: SglangServer) -> dict:
    """The over-long prompts with a small ``max_tokens``: status, usage and finish reason of each."""
    import httpx

    out = {}
    for label, n in TRUNCATION_PROMPTS.items():
        t0 = time.monotonic()
        try:
            r = server.post("/v1/completions", {"model": str(server.model), "prompt": token_ids(n),
                                                "max_tokens": TRUNCATION_MAX_TOKENS, "temperature": 0.0}, timeout=180)
            body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {"text": r.text}
            out[label] = {"sent": n, "status": r.status_code, "body": body, "seconds": time.monotonic() - t0}
        except httpx.HTTPError as exc:
            out[label] = {"sent": n, "status": None, "error": f"{type(exc).__name__}: {exc}",
                          "seconds": time.monotonic() - t0}
    return out


def greedy_runs(server: SglangServer) -> list[dict]:
    """Token-id prompts through ``/generate``, greedy, 16 tokens out: output ids and their logprobs."""
    runs = []
    for seed, n in enumerate(PLE_PROMPTS):
        t0 = time.monotonic()
        body = server.generate_ids(token_ids(n, seed), MAX_TOKENS)
        seconds = time.monotonic() - t0
        meta = body["meta_info"]
        runs.append({"prompt_tokens": meta["prompt_tokens"], "output_ids": body["output_ids"],
                     "logprobs": [entry[0] for entry in meta["output_token_logprobs"]],
                     "logprob_ids": [entry[1] for entry in meta["output_token_logprobs"]],
                     "finish_reason": meta["finish_reason"], "spec_verify_ct": meta.get("spec_verify_ct"),
                     "spec_num_correct_drafts": meta.get("spec_num_correct_drafts"), "seconds": seconds})
    return runs


def metrics_at_idle(server: SglangServer) -> str:
    """``/metrics`` once the traffic is over and the kit's periodic publish has run since (at idle, every row
    cache's statistics are whole: no lookup is half counted)."""
    from sglang_ssd_stream.ple_metrics.publish import PUBLISH_INTERVAL_S

    time.sleep(2.5 * PUBLISH_INTERVAL_S)
    return httpx.get(f"{server.url}/metrics", verify=shared_tls(), timeout=30).text


def qwen4_args(*extra: str) -> list[str]:
    return [*HYBRID_CAPS, "--allow-auto-truncate", *extra]


# ----------------------------------------------------------------------------- scenarios (one server each)


@pytest.fixture(scope="session")
def refused_pristine(stage, qwen3_model) -> Scenario:
    """A pristine engine with the plugin installed and no escape hatch: the server must not start."""
    return stage.refuse("refused-pristine", "pristine", qwen3_model)


@pytest.fixture(scope="session")
def qwen3_patched(stage, qwen3_model, e2e_root) -> Scenario:
    """Patched engine, the plugin installed (sidecar hooks on), an ordinary model: Qwen3, page size 1.
    Also serves the validation suite (``sglang-ssd-stream validate``, the real CLI)."""

    def exercise(server):
        out = {"completion": server.complete("The harbor lantern", MAX_TOKENS, logprobs=True),
               "truncation": send_truncation_probes(server), "fits": probes.fits(server)}
        report = e2e_root / "validate-report"
        t0 = time.monotonic()
        r = kit(stage.engine, "validate", "--url", f"{server.url}/v1", "--model", str(server.model),
                "--answer-tokens", str(MAX_TOKENS), "--truncation-max-tokens", str(TRUNCATION_MAX_TOKENS),
                "--cycles", "1", "--continue-tokens", str(MAX_TOKENS), "--compact-tokens", str(MAX_TOKENS),
                "--turns", "2", "--turn-tokens", str(MAX_TOKENS), "--canary-tokens", str(MAX_TOKENS),
                "--kv-wait", "20", "--timeout", "120", "--out", str(report), "-q", check=False)
        out["validate"] = {"rc": r.returncode, "stdout": r.stdout, "stderr": r.stderr, "out": report,
                           "seconds": time.monotonic() - t0}
        return out

    return stage.serve("qwen3-patched", "patched", qwen3_model, exercise, args=["--allow-auto-truncate", *NO_WARMUP])


# Sent last to the pristine Qwen3 server: it ends the server (patch 0006 RED over HTTP).
PRISTINE_KILLER = "logprobs-over-limit"
# Not sent to a pristine server: n=100000 stalls it for the 300 s watchdog before it dies (CI time), and the
# token ids past the vocabulary end it (proven by qwen4_mtp_pristine), and so does a negative one (measured here).
PRISTINE_SKIP = ("n-oversized", "ids-negative", "ids-past-vocab", "generate-ids-past-vocab", "batch-one-id-past-vocab")


@pytest.fixture(scope="session")
def qwen3_pristine(stage, qwen3_model) -> Scenario:
    """Pristine: the truncation probes, then the malformed-request survey, then the request that ends it."""

    def exercise(server):
        out = {"truncation": send_truncation_probes(server), "fits": probes.fits(server),
               "malformed": probes.malformed(server, VOCAB, skip=(*PRISTINE_SKIP, PRISTINE_KILLER))}
        kill = probes.malformed_cases(server, VOCAB)[PRISTINE_KILLER]
        try:
            r = kill()
            out["killer"] = {"status": r.status_code}
        except Exception as exc:  # the connection dies with the server
            out["killer"] = {"status": None, "error": f"{type(exc).__name__}: {exc}"}
        out["killer"]["death"] = probes.wait_dead(server)
        return out

    return stage.serve("qwen3-pristine", "pristine", qwen3_model, exercise, args=["--allow-auto-truncate", *NO_WARMUP],
                       env={**ALLOW_UNPATCHED, **BODY_LIMITS})  # pristine has no such settings: they do nothing


QSA_BUDGET_MB = 32


@pytest.fixture(scope="session")
def qwen4_ram(stage, qwen4_model) -> Scenario:
    """Patched engine, tiny qwen4_exp (page 64 forced by QSA), PLE table offloaded to host RAM by sglang
    itself (no sidecar: our hooks installed but inert), the QSA budget knob set."""

    def exercise(server):
        return {"greedy": greedy_runs(server), "truncation": send_truncation_probes(server),
                "fits": probes.fits(server)}

    return stage.serve("qwen4-ram", "patched", qwen4_model, exercise, standin=True,
                       args=qwen4_args("--ple-offload-embedding", *NO_WARMUP),
                       env={"SGLANG_QSA_PREFILL_LOGITS_BUDGET_MB": str(QSA_BUDGET_MB)})


@pytest.fixture(scope="session")
def qwen4_pristine(stage, qwen4_model) -> Scenario:
    return stage.serve("qwen4-pristine", "pristine", qwen4_model,
                       lambda s: {"truncation": send_truncation_probes(s), "fits": probes.fits(s)},
                       standin=True, args=qwen4_args(*NO_WARMUP), env=ALLOW_UNPATCHED)


def _sidecar_scenario(stage, qwen4_model, sidecar, name, io, *, row_cache_mb: str | None = "0") -> Scenario:
    """``io``'s reader alone (row cache budget 0), or, with ``row_cache_mb=None``, the default: the row cache
    (1024 MiB for all PLE layers) with prompt-ahead prefetch in front of it. ``sidecar=None``: the manifest in the
    model directory (the plugin finds it there, no knob)."""
    env = {"SGLANG_SSD_STREAM_IO": io}
    if sidecar is not None:
        env["SGLANG_SSD_STREAM_SIDECAR"] = str(sidecar)
    if row_cache_mb is not None:
        env["SGLANG_SSD_STREAM_ROW_CACHE_MB"] = row_cache_mb
    return stage.serve(name, "patched", qwen4_model, lambda s: {"greedy": greedy_runs(s)}, standin=True,
                       args=qwen4_args("--ple-offload-embedding", *NO_WARMUP), env=env)


@pytest.fixture(scope="session")
def qwen4_sidecar_mmap(stage, qwen4_model, sidecar) -> Scenario:
    return _sidecar_scenario(stage, qwen4_model, sidecar, "qwen4-sidecar-mmap", "mmap")


@pytest.fixture(scope="session")
def in_place_checkpoint(engine, qwen4_model, e2e_root) -> tuple[Path, dict]:
    """A copy of the tiny qwen4_exp with its in-place manifest (``sidecar build --in-place``: no table copied),
    and its files before the build."""
    from ..in_place_served import in_place_copy

    return in_place_copy(lambda *a: kit(engine, *a), qwen4_model, e2e_root / "qwen4_exp-in-place")


@pytest.fixture(scope="session")
def qwen4_sidecar_pread(stage, in_place_checkpoint) -> Scenario:
    """The ``pread`` reader, row cache off, on the checkpoint itself served in place (``--model-path`` the
    checkpoint, its ``ssd-stream.json`` found there): the copied sidecar's other starts read the same rows."""
    ckpt, _ = in_place_checkpoint
    return _sidecar_scenario(stage, ckpt, None, "qwen4-sidecar-pread", "pread")


def _hot_scenario(stage, qwen4_model, sidecar, home: Path, name: str) -> Scenario:
    """The default launch (the hot file on by default) over its own data directory ``home``: the greedy prompts
    twice, the first pass on whatever the start brought (cold, or the hot file), the second warm."""
    env = {"SGLANG_SSD_STREAM_SIDECAR": str(sidecar), "SGLANG_SSD_STREAM_IO": "mmap",
           "SGLANG_SSD_STREAM_HOME": str(home)}
    sc = stage.serve(name, "patched", qwen4_model, lambda s: {"greedy": greedy_runs(s), "warm": greedy_runs(s)},
                     standin=True, args=qwen4_args("--ple-offload-embedding"), env=env)
    sc.results["hot_files"] = sorted((home / "hot").glob("*.plehot")) if (home / "hot").is_dir() else []
    return sc


@pytest.fixture(scope="session")
def hot_home(e2e_root) -> Path:
    return e2e_root / "hot-home"


@pytest.fixture(scope="session")
def qwen4_sidecar_cache(stage, qwen4_model, sidecar, hot_home) -> Scenario:
    """The default launch (issue 19): rows through the PLE row cache, prefills announced to the prefetch, and the
    hot file (issue 27) in an empty data directory: a cold start, whose stop writes the hot file."""
    return _hot_scenario(stage, qwen4_model, sidecar, hot_home, "qwen4-sidecar-cache")


@pytest.fixture(scope="session")
def qwen4_sidecar_restart(stage, qwen4_model, sidecar, hot_home, qwen4_sidecar_cache) -> Scenario:
    """Issue 27 item 6: the same launch started again over the data directory the first start left, its hot
    file read before the first request."""
    assert qwen4_sidecar_cache.results["hot_files"], "the first start left no hot file"
    return _hot_scenario(stage, qwen4_model, sidecar, hot_home, "qwen4-sidecar-restart")


TAMPERED_LAYER = 0  # the table rewritten in place while it is served (issue 38 item 1 (b))
TAMPER_PROMPTS = ((40, 7), (60, 8))  # (tokens, seed): rows the greedy prompts never looked up, after the rewrite


@pytest.fixture(scope="session")
def tampered(e2e_root, sidecar, hot_home, qwen4_sidecar_cache) -> dict:
    """A private copy of the sidecar (its tables are rewritten below; no other scenario reads them) and a data
    directory holding the first start's hot file forged (:func:`hot_forgery.forge`: every row wrong, checksums
    recomputed, bound to the copy's tables as they are)."""
    from sglang_ssd_stream.sidecar.format import load_manifest

    from ..hot_forgery import forge

    (good,) = qwen4_sidecar_cache.results["hot_files"]
    copy, home = e2e_root / "sidecar-hot-rewritten", e2e_root / "hot-home-forged"  # not damaged_copy's names
    shutil.copytree(sidecar, copy)
    forged = home / "hot" / good.name
    rows = sum(forge(good, sidecar, dest=forged, bind_to=copy).values())
    table = load_manifest(copy).table(TAMPERED_LAYER).file
    return {"sidecar": copy, "home": home, "file": forged, "rows": rows, "table": Path(table)}


def _identity(path: Path) -> tuple:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def qwen4_sidecar_forged(stage, qwen4_model, tampered, other_rows_sidecar) -> Scenario:
    """Issue 38 item 1 over HTTP. (a) The default launch over the forged hot file: one warning, a cold start.
    (b) Then, while it serves, the table of layer TAMPERED_LAYER rewritten in place with another checkpoint's
    rows and its mtime put back (the reader's blind spot: the prompts after it read wrong rows into the cache),
    so its stop (SIGTERM) must refuse to save any row. The data directory's file is recorded before and after."""
    from sglang_ssd_stream.sidecar.format import load_manifest

    from ..hot_forgery import rewrite_in_place

    wrong = Path(load_manifest(other_rows_sidecar).table(TAMPERED_LAYER).file).read_bytes()
    tampered["before"] = _identity(tampered["file"])

    def exercise(server):
        out = {"greedy": greedy_runs(server)}
        rewrite_in_place(tampered["table"], wrong)
        out["after_rewrite"] = [server.generate_ids(token_ids(n, seed), MAX_TOKENS)["output_ids"]
                                for n, seed in TAMPER_PROMPTS]
        return out

    env = {"SGLANG_SSD_STREAM_SIDECAR": str(tampered["sidecar"]), "SGLANG_SSD_STREAM_IO": "mmap",
           "SGLANG_SSD_STREAM_HOME": str(tampered["home"])}
    sc = stage.serve("qwen4-sidecar-forged", "patched", qwen4_model, exercise, standin=True,
                     args=qwen4_args("--ple-offload-embedding"), env=env)
    sc.results["file_after_stop"] = _identity(tampered["file"])
    return sc


@pytest.fixture(scope="session")
def qwen4_sidecar_restart_without(stage, qwen4_model, sidecar, tampered, qwen4_sidecar_forged) -> Scenario:
    """The restart without a usable hot file: the same launch and knobs, after the first start as the restart
    with it (the engine's compile caches as warm). Its data directory is the forged start's, after the operator
    restored the rewritten table as the docs say (a new file renamed over it): the file there, bound to the
    table it replaced, must be refused, so this start is cold and serves the right rows (issue 38 item 1 (b))."""
    from sglang_ssd_stream.sidecar.format import load_manifest

    from ..hot_forgery import restore_by_rename

    right = Path(load_manifest(sidecar).table(TAMPERED_LAYER).file).read_bytes()
    restore_by_rename(tampered["table"], right)
    return _hot_scenario(stage, qwen4_model, tampered["sidecar"], tampered["home"], "qwen4-sidecar-restart-without")


@pytest.fixture(scope="session")
def qwen4_other_rows(stage, other_rows_model, other_rows_sidecar) -> Scenario:
    """The negated checkpoint with its own sidecar: its rows, bound to it, must change the output."""
    return _sidecar_scenario(stage, other_rows_model, other_rows_sidecar, "qwen4-sidecar-other-rows", "mmap")


@pytest.fixture(scope="session")
def qwen4_foreign_sidecar(stage, qwen4_model, other_rows_sidecar) -> Scenario:
    """The model with another checkpoint's self-consistent sidecar: refused at load (the shard spot-check)."""
    return stage.refuse("qwen4-sidecar-foreign", "patched", qwen4_model, standin=True,
                        args=qwen4_args("--ple-offload-embedding"),
                        env={"SGLANG_SSD_STREAM_SIDECAR": str(other_rows_sidecar),
                             "SGLANG_SSD_STREAM_ROW_CACHE_MB": "0"})


@pytest.fixture(scope="session", params=["truncated", "tampered"])
def qwen4_damaged_sidecar(request, stage, qwen4_model, sidecar, e2e_root) -> tuple[str, Path, Scenario]:
    how = request.param
    damaged = damaged_copy(sidecar, e2e_root / f"sidecar-{how}", how)
    sc = stage.refuse(f"qwen4-sidecar-{how}", "patched", qwen4_model, standin=True,
                      args=qwen4_args("--ple-offload-embedding"), env={"SGLANG_SSD_STREAM_SIDECAR": str(damaged)})
    return how, damaged, sc


# ----------------------------------------------------------------------------- NEXTN / MTP (issue 30)
# The Thor profile's speculative launch scaled to this CPU (speculative.py says flag by flag), a qwen4_exp
# with its draft. Each scenario serves many cases: one start per engine state and PLE source.


def mtp_server_args(model: Path, *extra: str, mamba_slots: int | None = None) -> list[str]:
    from .models import MTP_DIR
    from .speculative import mtp_args

    # --disable-radix-cache as every hybrid scenario here (HYBRID_CAPS); the Mamba cache is the profile's
    return ["--disable-radix-cache", *mtp_args(model / MTP_DIR, mamba_slots=mamba_slots), *extra]


VOCAB_PAST = [11, 12, 10**6]  # issue 30: this prompt ended the whole pristine server


@pytest.fixture(scope="session")
def qwen4_mtp_pristine(stage, qwen4_model) -> Scenario:
    """The pristine engine under MTP, sglang's in-RAM PLE table: the write-up §8 probes (each bounded: the
    write-up saw the request never finish), clients that go away, then a token id past the vocabulary (the
    server may die of it: observed, bounded, last)."""

    def exercise(server):
        out = {"greedy": greedy_runs(server), "truncation": probes.truncation(server),
               "disconnects": probes.disconnects(server)}
        out["past_vocab"] = probes.completion(server, VOCAB_PAST, 2, timeout=60)
        out["past_vocab_death"] = probes.wait_dead(server)
        return out

    return stage.serve("qwen4-mtp-pristine", "pristine", qwen4_model, exercise, standin=True,
                       args=mtp_server_args(qwen4_model, "--ple-offload-embedding", *NO_WARMUP), env=ALLOW_UNPATCHED)


@pytest.fixture(scope="session")
def qwen4_mtp_ram(stage, qwen4_model) -> Scenario:
    """Ours under MTP, sglang's in-RAM PLE table: greedy runs (against the same build without MTP), the §8
    probes, the profile's four requests at once, clients that go away, a token id past the vocabulary."""

    def exercise(server):
        out = {"greedy": greedy_runs(server), "truncation": probes.truncation(server), "fits": probes.fits(server),
               "four": probes.four_at_once(server), "disconnects": probes.disconnects(server)}
        out["past_vocab"] = probes.completion(server, VOCAB_PAST, 2, timeout=60)
        out["alive_after_past_vocab"] = probes.alive(server)
        out["concurrency"] = probes.concurrency(server, 4)
        out["malformed"] = probes.malformed(server, VOCAB)
        return out

    return stage.serve("qwen4-mtp-ram", "patched", qwen4_model, exercise, standin=True,
                       args=mtp_server_args(qwen4_model, "--ple-offload-embedding", *NO_WARMUP), env=BODY_LIMITS)


@pytest.fixture(scope="session")
def qwen4_mtp_sidecar(stage, qwen4_model, sidecar) -> Scenario:
    """Ours under MTP with the default launch's PLE path: the sidecar through the row cache, prompt-ahead
    prefetch on."""
    # the verify-step fetch on (off by default) and no hot file: it must be seen to read rows a cold cache lacks
    # (test_5); the profile's --enable-metrics: the kit's series in sglang's /metrics after the traffic, scraped by
    # a real Prometheus too (test_7)
    from ..ple_metrics.prometheus_server import while_scraped

    def exercise(server):
        return while_scraped(server.url, lambda: {"greedy": greedy_runs(server), "metrics": metrics_at_idle(server)})

    return stage.serve("qwen4-mtp-sidecar", "patched", qwen4_model, exercise,
                       standin=True, args=mtp_server_args(qwen4_model, "--ple-offload-embedding"),
                       env={"SGLANG_SSD_STREAM_SIDECAR": str(sidecar), "SGLANG_SSD_STREAM_IO": "mmap",
                            "SGLANG_SSD_STREAM_HOT_SHARE_PCT": "0", "SGLANG_SSD_STREAM_PREFETCH_DRAFTS": "1"})


FEW_MAMBA_SLOTS = 2  # fewer than the profile's 4 running requests need with the radix cache off (1 each)


@pytest.fixture(scope="session")
def qwen4_mtp_few_mamba(stage, qwen4_model) -> Scenario:
    """Issue 30 item 4: the MTP launch with a Mamba cache too small for its running requests; how many of four
    requests sent together really run at once."""
    args = mtp_server_args(qwen4_model, "--ple-offload-embedding", mamba_slots=FEW_MAMBA_SLOTS)
    sc = stage.serve("qwen4-mtp-few-mamba", "patched", qwen4_model,
                     lambda s: {"concurrency": probes.concurrency(s, 4)}, standin=True, args=[*args, *NO_WARMUP])
    sc.results["args"] = args
    return sc
