#!/usr/bin/env python3
"""sglang 0.5.23's own HTTP server on the GPU machine, with the kit loaded as users load it (issue 40, first slice).

The GPU machine (Python 3.12, torch 2.11.0+cu130, triton 3.6.0, transformers 5.17.0, no network) cannot *install*
sglang 0.5.23 (it pins torch 2.14.1), so this script carries what it lacks in one call and starts the real server:

``pack`` (on the CPU box, writes the git-ignored ``.gpu/sglang-pack/carry``, about 45 MB):

* ``deps.tar.xz``: the 50 distributions the server's import chain needs and the machine lacks
  (``gpu-e2e-feasibility.md``: 37 + IPython's 13 lazy ones), cp312 wheels fetched with ``pip download
  --require-hashes`` against ``hashes/locks/sglang-0.5.23-py312-x86_64.txt``, transformers 5.19.0 (sglang's pin;
  the machine's 5.17.0 refuses the model's QSA layer type), and the kit itself as a wheel (``pip wheel .``: its
  ``sglang.srt.plugins`` entry point is how sglang finds it), installed here with ``pip install --target`` and
  carried as one archive (half the wheels' size);
* ``site.tar.xz``: sglang's own files from the hash-locked cp312 wheel, **patched by the kit's own**
  ``sglang-ssd-stream patch apply --site-packages`` (``patch verify`` must pass; the pristine backups travel
  too), without ``test/``, ``benchmark/``, ``multimodal_gen/`` and the optional Rust ``.so`` files; and
  sglang-kernel 0.4.10's pure-Python files from its hash-checked wheel, with the test-owned stand-in
  ``scripts/gpu/sgl_kernel_standin/common_ops.py`` in place of ``sm90/`` and ``sm100/common_ops.abi3.so``
  (that ``.so`` cannot load on torch 2.11; the stand-in's docstring lists each op it replaces);
* ``model.tar``: the tiny random qwen4_exp of the CPU e2e suite (``tests/e2e/models.py``: 3 GDN + 1 QSA
  layers, PLE on layers 1 and 2, MoE, hyper-connections, the NEXTN draft in ``mtp/``, copy bias 0.5) and its
  sidecar (``sglang-ssd-stream sidecar build``).

``serve`` (on the GPU machine): unpacks into ``/tmp/site``; puts ``scripts/gpu/flash_attn_standin`` there as
``flash_attn`` unless the machine has ``flash_attn_varlen_func`` (sglang's QSA decode needs one on SM90; that
file's docstring says why it cannot be carried); records versions, the device and the disk (``fio``, when the
machine has it), checks the import chain (``--no-import-probe`` skips it), then starts
``python -m sglang.launch_server`` once per scenario (``SGLANG_PLUGINS=ssd_stream``, the
profiles' way), waits for ``/health``, sends the CPU e2e suite's greedy token-id prompts (24, 97, 180 tokens,
16 out, ``/generate``) and stops the server's process group. Scenarios: ``sidecar-eager`` (the PLE table read
from the sidecar, ``--disable-cuda-graph``), ``ram-eager`` (no sidecar: the table in GPU memory), then the same
two with decode CUDA graphs on (``sidecar-graph``, ``ram-graph``: ``--cuda-graph-backend-prefill disabled``) and
with sglang's default prefill graphs too (``sidecar-graph-prefill``, ``ram-graph-prefill``; its breakable
backend). Issue 40's other items, each on a server it shares where the flags agree (``--graphs eager|graph|
graph-prefill`` picks their CUDA graphs; ``--dry-run`` prints every server's command, environment and work):

* ``mtp-sidecar``: the same greedy prompts with MTP off (``sidecar-<graphs>``) and on (``mtp-sidecar-<graphs>``:
  the thor profile's speculative flags as the carried kit defines them, NEXTN 3/1/4 with the draft in ``mtp/``;
  FP8 draft KV and ReplaySSM dropped, each with its reason), ids compared; acceptance from the responses'
  verify counts, sglang's decode lines and ``/metrics``;
* ``trunc-patched`` / ``trunc-pristine`` (write-up 000 §8, the CPU suite's ``probes.MTP_TRUNCATION`` and
  ``FITS``, imported): over-long prompts with ``--allow-auto-truncate`` and 8 or 1 tokens, on the MTP server
  (patched) and on a pristine one (sglang's files extracted again and reverted by the kit's ``patch revert``,
  first on its PYTHONPATH, the escape knob ``SGLANG_SSD_STREAM_ALLOW_UNPATCHED=1``); each request bounded by
  ``--trunc-bound`` (a request still running then is recorded as never answering); patched is judged as
  test_2/test_5 judge it, pristine is recorded;
* ``cold-prompt``: a 2,304-token prompt twice (sidecar pages dropped from the page cache before each), time to
  first token, row cache off (``cold-off-*``) and on (``cold-on-*``, 1,024 MiB); ``fio`` if the machine has it,
  else Python ``O_DIRECT`` reads labelled as the fallback;
* ``survey``: the CPU suite's malformed-request survey (``probes.malformed``, imported) on the MTP-off server;
* per server: its GPU memory from nvidia-smi (its process group) beside the kit's ``plan`` for the same flags.

Each work has its budget (``--greedy-budget``, ``--trunc-bound``, ``--survey-budget``, ``--cold-budget``), each
server ``--first-budget``/``--budget``, the whole ``--deadline``; after a server fails the rest are skipped unless
``--keep-going``; ``--reference`` adds an earlier call's greedy ids to the equality checks. Writes
``results.json`` (token ids, timings, versions, equality checks, per-scenario verdicts, the stand-in ops that
ran) and one log per server under ``--out``.

Exact command (CPU box, repo root; the lock's wheels are fetched once)::

    .gpu/kitvenv/bin/python scripts/gpu/sglang_server_gpu.py pack --model-python <sglang-venv>/bin/python

then on the GPU machine (``run`` with ``carry=[".gpu/sglang-pack/carry"]``)::

    python3 scripts/gpu/sglang_server_gpu.py serve --carry .gpu/sglang-pack/carry --out $OUT --deadline 560

(``benchmarks/gpu_server/README.md``, "Next call", has each call's exact scenarios and budgets.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACK = REPO / ".gpu" / "sglang-pack"
LOCK = REPO / "hashes" / "locks" / "sglang-0.5.23-py312-x86_64.txt"
STANDIN = Path(__file__).resolve().parent / "sgl_kernel_standin" / "common_ops.py"
FA_STANDIN = Path(__file__).resolve().parent / "flash_attn_standin" / "__init__.py"

# gpu-e2e-feasibility.md: the distributions the server's import chain needs that the GPU machine lacks, and
# IPython's lazy dependencies (sglang/utils.py imports IPython.display)
MISSING = """annotated-types apache-tvm-ffi cffi compressed-tensors dill distro fastapi gguf ipython jsonschema
jsonschema-specifications loguru msgspec openai openai-harmony opentelemetry-api orjson partial-json-parser pybase64
pydantic pydantic-core python-multipart pyzmq referencing rpds-py setproctitle sniffio soundfile starlette
torch-memory-saver traitlets typing-inspection unidiff uvicorn watchfiles xgrammar zstandard
asttokens executing ipython-pygments-lexers jedi matplotlib-inline parso pexpect prompt-toolkit ptyprocess pure-eval
pygments stack-data wcwidth""".split()
# Present on the machine but older than sglang's pin, and too old for the model: transformers 5.17.0's Qwen4Exp
# config refuses the QSA layers ("Unsupported Qwen4-Exp layer types: ['indexed_attention']", second GPU call);
# sglang 0.5.23 pins 5.19.0.
NEWER = ["transformers"]
PLATFORMS = ["manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64",
             "manylinux1_x86_64", "any"]
STRIP = ("sglang/test/", "sglang/benchmark/", "sglang/multimodal_gen/")

# the CPU e2e suite's greedy probes (tests/e2e/conftest.py: PLE_PROMPTS, MAX_TOKENS; probes.token_ids)
PROMPTS = (24, 97, 180)
MAX_TOKENS = 16


def token_ids(n: int, seed: int = 0) -> list[int]:
    return [10 + (i * 37 + seed * 101) % 980 for i in range(n)]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def lock_entries(names: list[str]) -> dict[str, tuple[str, list[str]]]:
    """{name: (pinned line, [sha256, ...])} for ``names`` from the py312 lock."""
    out = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", LOCK.read_text()):
        m = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", block)
        if m and m.group(1).lower() in names:
            out[m.group(1).lower()] = (f"{m.group(1)}=={m.group(2)}", re.findall(r"sha256:([0-9a-f]{64})", block))
    if set(names) - set(out):
        sys.exit(f"not in {LOCK.name}: {sorted(set(names) - set(out))}")
    return out


# ----------------------------------------------------------------------------------------------- pack (CPU box)


def pack(args) -> None:
    carry = PACK / "carry"
    dl = PACK / "wheels"
    shutil.rmtree(carry, ignore_errors=True)
    carry.mkdir(parents=True)
    dl.mkdir(parents=True, exist_ok=True)
    entries = lock_entries([*MISSING, *NEWER, "sglang", "sglang-kernel"])
    req = PACK / "req.txt"
    req.write_text("".join(f"{line} " + " ".join(f"--hash=sha256:{h}" for h in hashes) + "\n"
                           for name, (line, hashes) in entries.items() if name != "sglang-kernel"))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--require-hashes", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none",
           *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dl), "-r", str(req)]
    subprocess.run(cmd, check=True)
    wheels = {}
    for name in [*MISSING, *NEWER, "sglang"]:
        stem = entries[name][0].split("==")
        pat = re.compile(rf"{re.sub('[-_.]+', '[-_.]', stem[0])}-{re.escape(stem[1])}-", re.I)
        (whl,) = [w for w in dl.glob("*.whl") if pat.match(w.name)]
        if sha256(whl) not in entries[name][1]:
            sys.exit(f"{whl.name}: SHA-256 not in the lock")
        wheels[name] = whl
    # the kit as users install it (a wheel: its entry point is how sglang finds the plugin)
    kit_dir = PACK / "kit-wheel"
    shutil.rmtree(kit_dir, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(kit_dir), str(REPO)], check=True)
    (kit_whl,) = kit_dir.glob("*.whl")
    # installed here (pip install --target, as the machine would) and carried as one tar.xz: half the wheels' size
    deps = PACK / "deps"
    shutil.rmtree(deps, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(deps), *[str(wheels[n]) for n in [*MISSING, *NEWER]], str(kit_whl)], check=True)
    shutil.rmtree(deps / "bin", ignore_errors=True)
    with tarfile.open(carry / "deps.tar.xz", "w:xz", preset=6) as t:
        for p in sorted(deps.iterdir()):
            t.add(p, arcname=p.name)

    # sglang's own files, patched by the kit's own CLI
    site = PACK / "site"
    shutil.rmtree(site, ignore_errors=True)
    with zipfile.ZipFile(wheels["sglang"]) as z:
        z.extractall(site)
    kit = [sys.executable, "-m", "sglang_ssd_stream", "patch"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([*kit, "apply", "--site-packages", str(site)], check=True, env=env)
    subprocess.run([*kit, "verify", "--site-packages", str(site)], check=True, env=env, stdout=subprocess.DEVNULL)
    status = subprocess.run([*kit, "status", "--json", "--site-packages", str(site)], check=True, env=env,
                            capture_output=True, text=True).stdout
    (carry / "patch-status.json").write_text(status)
    for d in STRIP:
        shutil.rmtree(site / d, ignore_errors=True)
    for so in site.glob("sglang/**/*.so"):
        so.unlink()

    # sglang-kernel: its Python files only (hash-checked wheel), the stand-in where the compiled ops were
    kwhl = Path(args.sglang_kernel_wheel) if args.sglang_kernel_wheel else next(
        Path.home().glob(".cache/sglang-ssd-stream/wheelhouse/sglang-0.5.23-*/sglang_kernel-0.4.10-*.whl"))
    if sha256(kwhl) not in entries["sglang-kernel"][1]:
        sys.exit(f"{kwhl}: SHA-256 not in the lock")
    with zipfile.ZipFile(kwhl) as z:
        for n in z.namelist():
            if n.endswith(".py") or ".dist-info/" in n:
                z.extract(n, site)
    for sub in ("sm90", "sm100"):
        (site / "sgl_kernel" / sub).mkdir(exist_ok=True)
        shutil.copy2(STANDIN, site / "sgl_kernel" / sub / "common_ops.py")
    with tarfile.open(carry / "site.tar.xz", "w:xz", preset=6) as t:
        for p in sorted(site.iterdir()):
            t.add(p, arcname=p.name)

    # the tiny model (tests/e2e/models.py) and its sidecar, written by the sglang venv's python (transformers)
    model_root = PACK / "model"
    shutil.rmtree(model_root, ignore_errors=True)
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]);"
            "from tests.e2e.models import make_qwen4_exp, write_mtp_draft;"
            "m = make_qwen4_exp(Path(sys.argv[2]) / 'qwen4_exp', copy_bias=0.5); write_mtp_draft(m)")
    menv = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1", "HOME": str(PACK / "home"),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run([args.model_python, "-c", code, str(REPO), str(model_root)], check=True, env=menv)
    subprocess.run([args.model_python, "-m", "sglang_ssd_stream", "sidecar", "build", str(model_root / "qwen4_exp"),
                    "-o", str(model_root / "sidecar"), "-q"], check=True, env=menv)
    with tarfile.open(carry / "model.tar", "w") as t:
        t.add(model_root / "qwen4_exp", arcname="qwen4_exp")
        t.add(model_root / "sidecar", arcname="sidecar")
    manifest = {"files": {str(p.relative_to(carry)): {"bytes": p.stat().st_size, "sha256": sha256(p)}
                          for p in sorted(carry.rglob("*")) if p.is_file()},
                "sglang_wheel": {"file": wheels["sglang"].name, "sha256": sha256(wheels["sglang"])},
                "wheels": {w.name: sha256(w) for w in [*wheels.values(), kit_whl]},
                "sglang_kernel_wheel": {"file": kwhl.name, "sha256": sha256(kwhl)},
                "standin_sha256": sha256(STANDIN), "stripped": [*STRIP, "sglang/**/*.so"]}
    (carry / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    total = sum(f["bytes"] for f in manifest["files"].values())
    print(f"wrote {carry}: {len(manifest['files'])} files, {total / 1e6:.1f} MB")


# ----------------------------------------------------------------------------------------------- serve (GPU)


def sh(cmd: str) -> str:
    p = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    return (p.stdout + p.stderr).strip()


def post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def stop_group(proc: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        end = time.monotonic() + grace
        while time.monotonic() < end:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


# ----------------------------------------------------------------------------------------------- the servers

# decode graphs / prefill graphs per mode; the suffix of every server's name
MODES = {"eager": (False, False), "graph": (True, False), "graph-prefill": (True, True)}
# the first call's servers, greedy requests only: name -> (PLE source, mode)
GREEDY_SERVERS = {"sidecar-eager": ("sidecar", "eager"), "ram-eager": ("ram", "eager"),
                  "sidecar-graph": ("sidecar", "graph"), "ram-graph": ("ram", "graph"),
                  "sidecar-graph-prefill": ("sidecar", "graph-prefill"),
                  "ram-graph-prefill": ("ram", "graph-prefill")}
# issue 40's remaining items, each run on a server it shares where the configuration is the same
SCENARIOS = ("mtp-sidecar", "trunc-patched", "trunc-pristine", "cold-prompt", "survey")
WORK_ORDER = ("greedy", "trunc", "cold", "survey")  # the survey last: a request in it may end the server
CONTEXT = 256  # the CPU e2e suite's context (tests/e2e/server.py CAPS): the §8 prompts are over it
COLD_PROMPT = 2304  # tokens of the cold prompt (36 pages of 64), sent twice per server
COLD_CONTEXT = 3072  # the cold-prompt servers' context (the prompt must fit; the tiny model's positions: 4096)
ROW_CACHE_ON_MB = 1024  # the thor profile's SGLANG_SSD_STREAM_ROW_CACHE_MB
PAGE = 64  # qwen4_exp's KV page (QSA forces it; the CPU suite's test_2_truncation reads it from the log too)
# patch 0007's settings, as the CPU suite's survey servers set them (tests/e2e/conftest.py BODY_LIMITS)
BODY_LIMITS = {"SGLANG_MAX_REQUEST_BODY_MB": "4", "SGLANG_REQUEST_BODY_TIMEOUT": "5"}
ALLOW_UNPATCHED = {"SGLANG_SSD_STREAM_ALLOW_UNPATCHED": "1"}  # the kit's escape knob: the plugin on pristine
# the thor profile's speculative flags: kept as the profile has them, or dropped with the reason; a flag in
# neither set is refused (decided here, never passed or lost silently; tests/e2e/speculative.py does the same)
SPEC_KEEP = ("--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps",
             "--speculative-eagle-topk", "--speculative-num-draft-tokens")
SPEC_DROP = {
    "--speculative-draft-kv-cache-dtype": "FP8 draft KV: the harness serves BF16 KV (the tiny BF16 checkpoint, and "
                                          "the MTP-off server compared with it has no FP8 KV either)",
    "--enable-linear-replayssm-spec": "ReplaySSM's Triton kernel refuses the tiny model's geometry (BKT=8 must be "
                                      ">=16 for tl.dot; measured on CPU, tests/e2e/speculative.py)",
}
SPEC_PROBE = ("import json; from sglang_ssd_stream.operate.profiles import get_profile; p = get_profile('thor', "
              "'sglang'); print(json.dumps([[f, p.has(f), p.value(f) if p.has(f) else None] "
              "for f in p.speculative_flags]))")


@dataclass
class Server:
    """One server start and the work sent to it (several scenarios share a start where their flags agree)."""

    name: str
    ple: str  # sidecar | ram (sglang's table in GPU memory)
    mode: str  # a key of MODES
    mtp: bool = False
    pristine: bool = False  # sglang's site files reverted by the kit's `patch revert`, the escape knob set
    row_cache_mb: int = 0
    context: int = CONTEXT
    works: list = field(default_factory=list)
    serves: list = field(default_factory=list)  # the scenario names it serves

    def add(self, scenario: str, *works: str) -> Server:
        for w in works:
            if w not in self.works:
                self.works.append(w)
        if scenario not in self.serves:
            self.serves.append(scenario)
        self.works.sort(key=WORK_ORDER.index)
        return self


def build_servers(names: list[str], mode: str, trunc_mtp: bool = True) -> list[Server]:
    """The servers ``names`` (scenarios and first-call server names) need, in the order first needed."""
    if mode not in MODES:
        sys.exit(f"--graphs {mode!r}: one of {', '.join(MODES)}")
    servers: dict[str, Server] = {}

    def want(name: str, **kw) -> Server:
        return servers.setdefault(name, Server(name, mode=kw.pop("mode", mode), **kw))

    for n in names:
        if n in GREEDY_SERVERS:
            ple, m = GREEDY_SERVERS[n]
            want(n, ple=ple, mode=m).add(n, "greedy")
        elif n == "mtp-sidecar":  # MTP off first: the same prompts, the same flags but the speculative ones
            want(f"sidecar-{mode}", ple="sidecar").add(n, "greedy")
            want(f"mtp-sidecar-{mode}", ple="sidecar", mtp=True).add(n, "greedy")
        elif n == "trunc-patched":
            want(f"mtp-sidecar-{mode}" if trunc_mtp else f"sidecar-{mode}", ple="sidecar",
                 mtp=trunc_mtp).add(n, "trunc")
        elif n == "trunc-pristine":  # as the CPU suite's pristine servers: sglang's own table (no sidecar)
            want(f"mtp-pristine-{mode}" if trunc_mtp else f"pristine-{mode}", ple="ram", mtp=trunc_mtp,
                 pristine=True).add(n, "greedy", "trunc")
        elif n == "cold-prompt":
            want(f"cold-off-{mode}", ple="sidecar", context=COLD_CONTEXT).add(n, "greedy", "cold")
            want(f"cold-on-{mode}", ple="sidecar", context=COLD_CONTEXT, row_cache_mb=ROW_CACHE_ON_MB).add(
                n, "greedy", "cold")
        elif n == "survey":
            want(f"sidecar-{mode}", ple="sidecar").add(n, "greedy", "survey")
        else:
            sys.exit(f"unknown scenario {n!r}; known: {', '.join([*GREEDY_SERVERS, *SCENARIOS])}")
    return list(servers.values())


def speculative_flags(python: str, env: dict, draft: Path) -> tuple[list[str], dict]:
    """The thor profile's speculative flags as the kit (the one the server loads) defines them: the argv for
    ``draft``, and the record (kept, dropped with the reason)."""
    p = subprocess.run([python, "-c", SPEC_PROBE], capture_output=True, text=True, env=env, timeout=120)
    if p.returncode:
        raise RuntimeError(f"the kit's thor profile could not be read: {p.stderr.strip()[-800:]}")
    argv, record = [], {"kept": {}, "dropped": {}}
    for flag, has, value in json.loads(p.stdout.strip().splitlines()[-1]):
        if not has:
            continue
        if flag in SPEC_KEEP:
            value = str(draft) if flag == "--speculative-draft-model-path" else value
            argv += [flag] if value is None else [flag, value]
            record["kept"][flag] = value
        elif flag in SPEC_DROP:
            record["dropped"][flag] = SPEC_DROP[flag]
        else:
            raise RuntimeError(f"the thor profile sets {flag}: decide in SPEC_KEEP/SPEC_DROP whether the GPU "
                               "harness keeps or drops it")
    return argv, record


def server_command(s: Server, python: str, model: Path, port: int, spec: list[str]) -> list[str]:
    graphs, prefill_graphs = MODES[s.mode]
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--max-total-tokens", "4096", "--context-length", str(s.context),
           "--max-mamba-cache-size", "64", "--disable-radix-cache", "--allow-auto-truncate",
           "--ple-offload-embedding", "--skip-server-warmup", "--attention-backend", "triton",
           "--sampling-backend", "pytorch", "--mem-fraction-static", "0.5", "--max-running-requests", "8"]
    if s.mtp:  # the speculative flags only: everything else as the MTP-off server it is compared with
        cmd += [*spec, "--enable-metrics"]
    if graphs:
        cmd += ["--cuda-graph-max-bs-decode", "8"]
        if not prefill_graphs:  # decode graphs only; sglang 0.5.23 also captures prefill graphs by default
            cmd += ["--cuda-graph-backend-prefill", "disabled"]
    else:
        cmd += ["--disable-cuda-graph"]
    return cmd


def server_env(s: Server, base_env: dict, sidecar: Path, pristine_site: Path) -> dict:
    env = dict(base_env)
    if s.ple == "sidecar":
        env.update({"SGLANG_SSD_STREAM_SIDECAR": str(sidecar), "SGLANG_SSD_STREAM_IO": "mmap",
                    "SGLANG_SSD_STREAM_ROW_CACHE_MB": str(s.row_cache_mb)})
    if "survey" in s.works:
        env.update(BODY_LIMITS)
    if s.pristine:
        env.update(ALLOW_UNPATCHED)
        env["PYTHONPATH"] = f"{pristine_site}:{base_env['PYTHONPATH']}"
    return env


def make_pristine_site(carry: Path, site: Path, pristine: Path, env: dict) -> dict:
    """sglang's files as the wheel has them: the carried (patched) sglang extracted again beside the site and
    reverted by the kit's own ``patch revert`` from the pristine backups the pack carries (the CPU suite's
    ``ensure_pristine`` does the same to its venv). Put before the site on the pristine server's PYTHONPATH."""
    shutil.rmtree(pristine, ignore_errors=True)
    pristine.mkdir(parents=True)
    keep = ("sglang/", ".sglang-ssd-stream/", "sglang-0.5.23.dist-info/")
    with tarfile.open(carry / "site.tar.xz") as tf:
        tf.extractall(pristine, members=[m for m in tf.getmembers() if m.name.startswith(keep)])
    kit = [sys.executable, "-m", "sglang_ssd_stream", "patch"]
    out, states = {}, {}
    for step in ("revert", "status"):
        p = subprocess.run([*kit, step, "--json", "--site-packages", str(pristine)], capture_output=True, text=True,
                           env=env, timeout=300)
        out[step] = {"rc": p.returncode, "stdout": p.stdout[-1500:], "stderr": p.stderr[-1500:]}
        if step == "status":
            try:
                states = {f["path"]: f["state"] for f in json.loads(p.stdout)["files"]}
            except (ValueError, KeyError, TypeError):
                pass
    out["files"] = states
    out["states"] = sorted(set(states.values()))
    out["pristine"] = out["revert"]["rc"] == 0 and out["states"] == ["pristine"]
    return out


# ----------------------------------------------------------------------------------------------- requests


def generate(url: str, ids: list[int], max_new: int, timeout: float) -> dict:
    body = post(f"{url}/generate", {"input_ids": ids, "return_logprob": True,
                                    "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0}},
                timeout=timeout)
    meta = body["meta_info"]
    return {"prompt_tokens": meta["prompt_tokens"], "output_ids": body["output_ids"],
            "logprobs": [e[0] for e in meta["output_token_logprobs"]], "finish_reason": meta["finish_reason"],
            "spec_verify_ct": meta.get("spec_verify_ct"),
            "spec_num_correct_drafts": meta.get("spec_num_correct_drafts")}


def greedy(url: str, budget: float) -> list[dict]:
    """The CPU e2e suite's greedy probes (prompts of 24, 97, 180 ids, 16 out) through ``/generate``."""
    runs, t0 = [], time.monotonic()
    for seed, n in enumerate(PROMPTS):
        t1 = time.monotonic()
        try:
            run = generate(url, token_ids(n, seed), MAX_TOKENS, max(10.0, budget - (t1 - t0)))
        except Exception as exc:  # noqa: BLE001 - recorded
            runs.append({"prompt_tokens": n, "error": f"{type(exc).__name__}: {exc}"})
            break
        runs.append({**run, "seconds": round(time.monotonic() - t1, 3)})
    return runs


def streamed(url: str, ids: list[int], max_new: int, timeout: float) -> dict:
    """One streamed greedy ``/generate``: seconds to the first chunk (time to first token) and to the end."""
    body = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0}}
    req = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0, first, last = time.monotonic(), None, None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            if first is None:
                first = time.monotonic() - t0
            last = json.loads(line[5:])
    meta = (last or {}).get("meta_info", {})
    return {"ttft_s": first and round(first, 4), "total_s": round(time.monotonic() - t0, 4),
            "prompt_tokens": meta.get("prompt_tokens"), "completion_tokens": meta.get("completion_tokens"),
            "finish_reason": meta.get("finish_reason")}


def evict(paths: list[Path]) -> int:
    """Drops the files' clean pages from the page cache (``POSIX_FADV_DONTNEED``): the next read goes to disk."""
    n = 0
    os.sync()  # dirty pages (the sidecar was just unpacked) are not dropped
    for f in paths:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def cold(url: str, sidecar: Path, budget: float) -> dict:
    """The cold prompt twice (its sidecar pages dropped from the page cache before each): time to first token."""
    files = [p for p in sorted(sidecar.rglob("*")) if p.is_file()]
    runs, t0 = [], time.monotonic()
    for i in range(2):
        evicted = evict(files)
        try:
            r = streamed(url, token_ids(COLD_PROMPT, 7), MAX_TOKENS, max(10.0, budget - (time.monotonic() - t0)))
        except Exception as exc:  # noqa: BLE001 - recorded
            runs.append({"run": i + 1, "error": f"{type(exc).__name__}: {exc}"})
            break
        runs.append({"run": i + 1, "sidecar_files_evicted": evicted, **r})
    return {"prompt_tokens_sent": COLD_PROMPT, "runs": runs}


def load_probes(root: Path, site: Path | None = None):
    """The CPU e2e suite's request lists (``tests/e2e/probes.py``), imported, never copied. They need httpx: the
    machine's own (openai, which the server imports, depends on it), else the carried site's, put last."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import importlib

    try:
        import httpx  # noqa: F401
    except ImportError:
        if site is not None:
            sys.path.append(str(site))
    return importlib.import_module("tests.e2e.probes")


def probes_root() -> Path:
    """``tests/e2e/probes.py`` beside this script (where the device copy puts it), else the repository's."""
    here = Path(__file__).resolve().parent
    return here if (here / "tests" / "e2e" / "probes.py").exists() else REPO


class Served:
    """What ``tests/e2e/probes.py`` calls on a server (``SglangServer``'s url, port, model, proc and post)."""

    def __init__(self, url: str, port: int, model: Path, proc: subprocess.Popen):
        self.url, self.port, self.model, self.proc = url, port, model, proc

    def post(self, path: str, body: dict, timeout: float = 300.0):
        import httpx

        return httpx.post(f"{self.url}{path}", json=body, timeout=timeout)


def usage(probe: dict) -> tuple:
    body = probe.get("body") or {}
    try:
        return body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]
    except (KeyError, IndexError, TypeError):
        return None, None, None


def truncation(probes, served: Served, bound: float) -> dict:
    """Write-up 000 §8 as the CPU suite sends it (``probes.MTP_TRUNCATION``: 275 ids over the 256-token context
    with 8 and 1 tokens, 252 ids near it with 8; ``probes.FITS``), each request bounded at ``bound`` s (a request
    still running then is recorded as never answering, ``status: None``), the scheduler's counters after each."""
    out = {}
    for label, (n, max_tokens) in probes.MTP_TRUNCATION.items():
        probe = probes.completion(served, probes.token_ids(n), max_tokens, timeout=bound)
        probe.update(sent=n, max_tokens=max_tokens, alive=served.proc.poll() is None)
        try:
            probe["after"] = probes.settle(served, timeout=10.0) if probe["alive"] else None
        except Exception as exc:  # noqa: BLE001 - recorded
            probe["after"] = f"{type(exc).__name__}: {exc}"
        out[label] = probe
    n, max_tokens = probes.FITS
    if served.proc.poll() is None:
        fits = probes.completion(served, probes.token_ids(n, 6), max_tokens, timeout=bound, ignore_eos=True)
        out["fits"] = {**fits, "sent": n, "max_tokens": max_tokens}
    return out


def trunc_verdict(probes: dict, pristine: bool, page: int | None) -> dict:
    """Patched (the CPU suite's test_2/test_5 assertions): each over-long prompt is cut to whole pages inside the
    context and the client's budget comes back with ``length``; the prompt that fits is served whole. Pristine:
    what it did, per probe (answered with which usage, or never within the bound), no verdict."""
    seen = {}
    for label, p in probes.items():
        prompt, completion, finish = usage(p)
        seen[label] = {"status": p.get("status"), "seconds": round(p.get("seconds", 0), 2), "prompt": prompt,
                       "completion": completion, "finish": finish, "sent": p.get("sent"),
                       "max_tokens": p.get("max_tokens"), "alive_after": p.get("alive", True),
                       "never_answered_within_bound": p.get("status") is None}
    if pristine:
        return {"observed": seen}
    bad = []
    for label, v in seen.items():
        if label == "fits":
            ok = (v["status"], v["prompt"], v["completion"], v["finish"]) == (200, v["sent"], v["max_tokens"], "length")
        else:
            ok = (v["status"] == 200 and v["finish"] == "length" and v["completion"] == v["max_tokens"]
                  and v["prompt"] is not None and v["prompt"] < v["sent"] and page is not None
                  and v["prompt"] % page == 0 and v["prompt"] + v["completion"] <= CONTEXT)
        if not ok:
            bad.append(label)
    return {"ok": not bad and "fits" in seen and len(seen) >= 4, "failed": bad, "page_size": page, "observed": seen}


def survey(probes, served: Served, vocab: int) -> dict:
    """The CPU suite's malformed-request survey (``probes.malformed``: its cases, its order, its checks)."""
    m = probes.malformed(served, vocab)
    m["alive_at_end"] = served.proc.poll() is None and probes.alive(served)
    bad = {n: {k: c.get(k) for k in ("status", "alive_after", "error")} for n, c in m["cases"].items()
           if c.get("status") is None or c["status"] >= 500 or not c.get("alive_after")}
    m["verdict"] = {"ok": m["killed_by"] is None and not bad and m["alive_at_end"] and bool(m["cases"]),
                    "cases": len(m["cases"]), "not_answered_or_5xx_or_killed": bad,
                    "leaking": {n: c["leaks"] for n, c in m["cases"].items() if c.get("leaks")}}
    return m


ACCEPT = re.compile(r"accept len: ([\d.]+), accept rate: ([\d.]+)")


def spec_stats(runs: list[dict], log: str, metrics: str, steps: int) -> dict:
    """MTP acceptance: from the responses (verify passes, correct drafts), sglang's decode log lines and its
    ``/metrics`` (the lines naming spec/accept)."""
    ok = [r for r in runs if r.get("spec_verify_ct") is not None]
    verify = sum(r["spec_verify_ct"] for r in ok)
    correct = sum(r.get("spec_num_correct_drafts") or 0 for r in ok)
    pairs = [(float(a), float(b)) for a, b in ACCEPT.findall(log)]
    return {"verify_passes": verify, "correct_drafts": correct, "drafts_proposed": steps * verify,
            "accept_rate": round(correct / (steps * verify), 4) if verify else None,
            "accept_length": round((sum(len(r["output_ids"]) for r in ok) - len(ok)) / verify, 4) if verify else None,
            "log_accept_len_rate": pairs[-20:],
            "metrics": [ln for ln in metrics.splitlines()
                        if ("spec" in ln or "accept" in ln) and not ln.startswith("#")][:40]}


# ----------------------------------------------------------------------------------------------- memory, plan


def gpu_memory(group: int | None) -> dict:
    """nvidia-smi from outside the server: the device's used/total MiB and the server group's processes."""
    out = {"device": sh("nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader,nounits")}
    if group is not None:
        apps, mine = sh("nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits"), {}
        for line in apps.splitlines():
            try:
                pid, mib = (int(x) for x in line.split(","))
            except ValueError:
                continue
            try:
                if os.getpgid(pid) == group:
                    mine[pid] = mib
            except OSError:
                pass
        out.update(processes=mine, server_mib=sum(mine.values()), compute_apps=apps[:600])
    return out


def safetensors_layers(path: Path, prefix: str) -> int:
    """Distinct ``<prefix><n>.`` layer indices in a safetensors file's header (read, not guessed)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        names = json.loads(f.read(n)).keys()
    return len({k[len(prefix):].split(".")[0] for k in names if k.startswith(prefix)})


def plan_args(s: Server, model: Path, device_gib: float | None, page: int) -> list[str]:
    args = ["plan", "--profile", "thor", "--model", str(model), "--context-length", str(s.context),
            "--max-total-tokens", "4096", "--max-running-requests", "8", "--max-mamba-cache-size", "64",
            "--kv-cache-dtype", "bf16", "--draft-kv-cache-dtype", "bf16", "--page-size", str(page),
            "--mem-fraction", "0.5", "--row-cache-mb", str(s.row_cache_mb), "--mtp", "on" if s.mtp else "off",
            "--json"]
    return args + (["--device-memory-gib", f"{device_gib:.2f}"] if device_gib else [])


def kit_plan(s: Server, model: Path, work: Path, env: dict, device_gib: float | None, page: int) -> dict:
    """The kit's ``plan`` for this server's flags. The tiny checkpoint's config has no MTP layer count, which the
    planner refuses to guess; then it runs again on a view whose config.json adds ``mtp_num_hidden_layers`` =
    the ``mtp.layers.<n>`` the draft's safetensors hold (recorded as such)."""
    def run(m: Path) -> dict:
        cmd = [sys.executable, "-m", "sglang_ssd_stream", *plan_args(s, m, device_gib, page)]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        r = {"command": " ".join(cmd[1:]), "rc": p.returncode, "stderr": p.stderr.strip()[-800:]}
        try:
            r["plan"] = json.loads(p.stdout)
        except ValueError:
            r["stdout"] = p.stdout[-800:]
        return r

    out = {"as_is": run(model)}
    if out["as_is"]["rc"] and "mtp_num_hidden_layers" in out["as_is"]["stderr"]:
        view = work / "plan-view"
        view.mkdir(exist_ok=True)
        cfg = json.loads((model / "config.json").read_text())
        n = safetensors_layers(model / "mtp" / "model.safetensors", "mtp.layers.")
        (cfg.get("text_config") or cfg)["mtp_num_hidden_layers"] = n
        (view / "config.json").write_text(json.dumps(cfg))
        for name in ("model.safetensors", "mtp"):
            if not (view / name).exists():
                (view / name).symlink_to(model / name)
        out["view"] = {"mtp_num_hidden_layers": n, "from": "mtp/model.safetensors (mtp.layers.<n>)", **run(view)}
    return out


# ----------------------------------------------------------------------------------------------- one server


def bounded(fn, budget: float):
    """``fn()`` in a thread, waited on for ``budget`` s: its result, or a record that it ran over."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except Exception as exc:  # noqa: BLE001 - recorded
            box["value"] = {"error": f"{type(exc).__name__}: {exc}"}

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(budget)
    return box["value"] if "value" in box else {"error": f"over its budget of {budget:.0f} s"}


def run_server(s: Server, ctx: dict, port: int, budget: float) -> dict:
    """Starts ``s``, waits for /health within ``budget`` s, sends its works (each bounded), records the GPU
    memory and the kit's plan beside it, and stops the server's process group."""
    a = ctx["args"]
    res: dict = {"name": s.name, "serves": s.serves, "works": s.works, "sidecar": s.ple == "sidecar",
                 "cuda_graphs": MODES[s.mode][0], "prefill_graphs": MODES[s.mode][1], "mtp": s.mtp,
                 "pristine": s.pristine, "row_cache_mb": s.row_cache_mb if s.ple == "sidecar" else None,
                 "context_length": s.context}
    cmd = server_command(s, sys.executable, ctx["model"], port, ctx["spec"])
    env = server_env(s, ctx["env"], ctx["sidecar"], ctx["pristine_site"])
    res["command"] = " ".join(cmd)
    res["env"] = {k: v for k, v in env.items() if k.startswith(("SGLANG", "SGL_", "SSD"))}
    if s.pristine:
        res["env"]["PYTHONPATH"] = env["PYTHONPATH"]
        if not (ctx.get("pristine") or {}).get("pristine"):
            res["error"] = "no pristine sglang (the kit's patch revert on the carried copy failed; see pristine_site)"
            return res
    res["gpu_memory_before"] = gpu_memory(None)
    log_path = ctx["out"] / f"{s.name}.log"
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            while time.monotonic() - t0 < budget:
                if proc.poll() is not None:
                    res["error"] = f"server exited {proc.returncode} before /health"
                    break
                if healthy(url):
                    res["healthy_after_s"] = round(time.monotonic() - t0, 1)
                    break
                time.sleep(0.5)
            else:
                res["error"] = f"not healthy in {budget:.0f} s"
            if "healthy_after_s" in res:
                served = Served(url, port, ctx["model"], proc)
                try:
                    with urllib.request.urlopen(f"{url}/get_server_info", timeout=10) as r:
                        info = json.loads(r.read())
                    res["server_info"] = {k: info.get(k) for k in (
                        "version", "attention_backend", "disable_cuda_graph", "cuda_graph_max_bs", "sampling_backend",
                        "moe_runner_backend", "linear_attn_backend", "page_size", "max_total_num_tokens",
                        "disable_overlap_schedule", "speculative_algorithm", "speculative_num_steps",
                        "speculative_eagle_topk", "speculative_num_draft_tokens", "context_length")}
                except Exception as exc:  # noqa: BLE001
                    res["server_info"] = f"{type(exc).__name__}: {exc}"
                page = res["server_info"].get("page_size") if isinstance(res["server_info"], dict) else None
                probes = None
                if {"trunc", "survey"} & set(s.works):
                    try:
                        probes = load_probes(ctx["probes_root"], ctx.get("site"))
                    except Exception as exc:  # noqa: BLE001 - recorded
                        res["probes_import_error"] = f"{type(exc).__name__}: {exc}"
                for w in s.works:
                    left = ctx["deadline_at"] - time.monotonic() - 30
                    if left < 15:
                        res.setdefault("skipped_works", []).append(f"{w}: no time left")
                        continue
                    if proc.poll() is not None:
                        res.setdefault("skipped_works", []).append(f"{w}: the server is gone (exit {proc.returncode})")
                        continue
                    tw = time.monotonic()
                    if w == "greedy":
                        res["greedy"] = bounded(lambda: greedy(url, min(left, a.greedy_budget)),
                                                min(left, a.greedy_budget) + 5)
                        runs = res["greedy"] if isinstance(res["greedy"], list) else []
                        if not runs or any("error" in r for r in runs):
                            res["error"] = f"greedy requests failed: {res['greedy']}"[:600]
                    elif w == "trunc" and probes:
                        t = bounded(lambda: truncation(probes, served, a.trunc_bound),
                                    min(left, 5 * (a.trunc_bound + 20)))
                        res["truncation"] = t
                        if isinstance(t, dict) and "error" not in t:
                            res["truncation_verdict"] = trunc_verdict(t, s.pristine, page)
                    elif w == "cold":
                        res["cold"] = bounded(lambda: cold(url, ctx["sidecar"], min(left, a.cold_budget)),
                                              min(left, a.cold_budget) + 5)
                    elif w == "survey" and probes:
                        vocab = (json.loads((ctx["model"] / "config.json").read_text()).get("text_config") or {}).get(
                            "vocab_size")
                        res["survey"] = bounded(lambda: survey(probes, served, vocab), min(left, a.survey_budget))
                    res.setdefault("work_seconds", {})[w] = round(time.monotonic() - tw, 1)
                if s.mtp:
                    try:
                        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
                            metrics = r.read().decode(errors="replace")
                    except Exception as exc:  # noqa: BLE001
                        metrics = f"# {type(exc).__name__}: {exc}"
                    steps = int(next((v for f, v in ctx["spec_record"]["kept"].items()
                                      if f == "--speculative-num-steps"), 0) or 0)
                    res["spec"] = spec_stats(res.get("greedy") if isinstance(res.get("greedy"), list) else [],
                                             log_path.read_text(errors="replace"), metrics, steps)
                res["gpu_memory"] = gpu_memory(proc.pid)
                try:
                    res["plan"] = kit_plan(s, ctx["model"], ctx["work"], env, ctx.get("device_gib"), page or PAGE)
                except Exception as exc:  # noqa: BLE001 - recorded
                    res["plan"] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            stop_group(proc)
    res["seconds"] = round(time.monotonic() - t0, 1)
    text = log_path.read_text(errors="replace")
    res["plugin_lines"] = [ln for ln in text.splitlines() if "sglang-ssd-stream plugin" in ln][:12]
    res["ple_lines"] = [ln for ln in text.splitlines() if "PLE " in ln and ("cache" in ln or "ran" in ln)][:20]
    res["standin_lines"] = sorted({re.sub(r"pid \d+: ", "", ln) for ln in text.splitlines()
                                   if "-standin: " in ln and "ran stand-in" in ln})
    res["log_tail"] = text[-3000:]
    return res


def fio(work: Path, seconds: int) -> dict:
    """The machine's disk where the sidecar is read (``/tmp``), if fio is there: 4 KiB random reads at queue
    depth 1 and 1 MiB sequential reads, direct I/O, on a 512 MiB file."""
    exe = shutil.which("fio")
    if not exe or seconds <= 0:
        return {"fio": exe or "absent (not on PATH)"}
    out: dict = {"fio": exe, "version": sh(f"{exe} --version"), "dir": str(work), "df": sh(f"df -hT {work}")}
    for name, extra in (("randread-4k-qd1", "--rw=randread --bs=4k --iodepth=1"),
                        ("seqread-1m-qd8", "--rw=read --bs=1m --iodepth=8")):
        cmd = (f"{exe} --name={name} --filename={work}/fio.dat --size=512m --direct=1 --ioengine=libaio "
               f"{extra} --runtime={seconds} --time_based --output-format=json")
        p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=seconds + 120)
        try:
            job = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]["read"]
            out[name] = {"command": cmd, "iops": round(job["iops"]), "bw_MiB_s": round(job["bw"] / 1024, 1),
                         "lat_mean_us": round(job["lat_ns"]["mean"] / 1e3, 1),
                         "lat_p99_us": round(job["clat_ns"].get("percentile", {}).get("99.000000", 0) / 1e3, 1)}
        except (ValueError, KeyError, IndexError):
            out[name] = {"command": cmd, "rc": p.returncode, "output": (p.stdout + p.stderr)[-1500:]}
    Path(f"{work}/fio.dat").unlink(missing_ok=True)
    return out


def direct_reads(work: Path, seconds: float, size_mb: int = 256) -> dict:
    """A measured fallback where the machine has no ``fio`` (labelled as such, not fio): Python ``os.preadv``
    with ``O_DIRECT`` on a ``size_mb`` file in ``work`` (the directory the sidecar is read from), 4 KiB random
    reads at queue depth 1, then 1 MiB sequential reads, ``seconds`` each."""
    import mmap
    import random

    out: dict = {"method": "python os.preadv O_DIRECT (fallback: no fio)", "dir": str(work),
                 "df": sh(f"df -hT {work}"), "file_mib": size_mb}
    path = work / "direct.dat"
    try:
        with open(path, "wb") as f:
            block = os.urandom(1 << 20)
            for _ in range(size_mb):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        path.unlink(missing_ok=True)
        return {**out, "error": f"{type(exc).__name__}: {exc}"}
    try:
        rng = random.Random(0)
        for name, bs, pick in (("randread-4k-qd1", 4096, lambda i: rng.randrange(size_mb * 256) * 4096),
                               ("seqread-1m-qd1", 1 << 20, lambda i: (i % size_mb) << 20)):
            buf = mmap.mmap(-1, bs)  # page-aligned, as O_DIRECT wants
            lat, t0, i = [], time.monotonic(), 0
            try:
                while time.monotonic() - t0 < seconds:
                    t1 = time.perf_counter()
                    os.preadv(fd, [buf], pick(i))
                    lat.append(time.perf_counter() - t1)
                    i += 1
            except OSError as exc:
                out[name] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            lat.sort()
            wall = time.monotonic() - t0
            out[name] = {"reads": len(lat), "iops": round(len(lat) / wall),
                         "bw_MiB_s": round(len(lat) * bs / wall / 2**20, 1),
                         "lat_mean_us": round(sum(lat) / len(lat) * 1e6, 1),
                         "lat_p99_us": round(lat[int(0.99 * (len(lat) - 1))] * 1e6, 1)}
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return out


def serve(args) -> int:
    t_start = time.monotonic()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(args.tmp)
    site, work = tmp / "site", tmp / "sg"
    names = [n for n in args.scenarios.split(",") if n]
    servers = build_servers(names, args.graphs, args.trunc_mtp)
    results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv, "dry_run": args.dry_run,
                     "requested": names, "graphs": args.graphs, "trunc_mtp": args.trunc_mtp,
                     "budgets": {k: getattr(args, k) for k in ("deadline", "first_budget", "budget", "greedy_budget",
                                                              "trunc_bound", "survey_budget", "cold_budget")},
                     "plan": [{"server": s.name, "serves": s.serves, "works": s.works} for s in servers]}

    def save():
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))

    model, sidecar = work / "qwen4_exp", work / "sidecar"
    if args.dry_run:  # the commands each server would run, from this checkout's kit; nothing is started
        env = {**os.environ, "PYTHONPATH": str(REPO), "SGLANG_PLUGINS": "ssd_stream"}
        spec, record = speculative_flags(sys.executable, env, model / "mtp")
        results["speculative"] = record
        results["servers"] = [{"name": s.name, "serves": s.serves, "works": s.works,
                               "command": " ".join(server_command(s, "python3", model, 30000 + i, spec)),
                               "env": {k: v for k, v in server_env(s, env, sidecar, tmp / "site-pristine").items()
                                       if k.startswith(("SGLANG", "SSD")) or (s.pristine and k == "PYTHONPATH")},
                               "plan_command": "sglang-ssd-stream " + " ".join(plan_args(s, model, None, PAGE))}
                              for i, s in enumerate(servers)]
        results["probes"] = str(probes_root() / "tests" / "e2e" / "probes.py")
        save()
        print(json.dumps(results["servers"], indent=1))
        return 0

    carry = Path(args.carry).resolve()
    results["manifest"] = json.loads((carry / "MANIFEST.json").read_text())
    work.mkdir(exist_ok=True)
    t = time.monotonic()
    results["install"] = {}
    for name in ("deps.tar.xz", "site.tar.xz"):
        with tarfile.open(carry / name) as tf:
            tf.extractall(site)
    with tarfile.open(carry / "model.tar") as tf:
        tf.extractall(work)
    # the stand-in as this checkout has it (it may be newer than the pack's copy)
    standin = next((p for p in (STANDIN, Path(__file__).resolve().parent / "common_ops.py") if p.exists()), None)
    if standin:
        for sub in ("sm90", "sm100"):
            shutil.copy2(standin, site / "sgl_kernel" / sub / "common_ops.py")
        results["standin_sha256"] = sha256(standin)
    # flash_attn (QSA decode on SM90): the machine's own if it has one, else the stand-in (its docstring says why)
    has_fa = subprocess.run([sys.executable, "-c", "from flash_attn import flash_attn_varlen_func"],
                            capture_output=True, text=True)
    fa = next((p for p in (FA_STANDIN, Path(__file__).resolve().parent / "flash_attn_standin.py") if p.exists()),
              None)
    results["flash_attn"] = {"machine_has_flash_attn_varlen_func": has_fa.returncode == 0,
                             "probe": (has_fa.stderr or has_fa.stdout).strip()[-300:]}
    if has_fa.returncode != 0 and fa:
        (site / "flash_attn").mkdir(exist_ok=True)
        shutil.copy2(fa, site / "flash_attn" / "__init__.py")
        results["flash_attn"]["standin_sha256"] = sha256(fa)
    results["install"]["seconds"] = round(time.monotonic() - t, 1)

    nvcc = shutil.which("nvcc") or next((str(p) for p in Path("/usr/local").glob("cuda*/bin/nvcc")), None)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "SSD_STREAM_"))}
    env.update({"PYTHONPATH": str(site), "HOME": "/tmp/home", "SGLANG_PLUGINS": "ssd_stream",
                "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "SGLANG_JIT_CACHE_DIR": "/tmp/jit-cache",
                "TRITON_CACHE_DIR": "/tmp/triton-cache", "GPU_STANDIN_REPORT": str(work / "standin.jsonl")})
    if nvcc:
        env["CUDA_HOME"] = str(Path(nvcc).resolve().parents[1])
        env["PATH"] = f"{Path(nvcc).parent}:{env.get('PATH', '')}"
    total = sh("nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits").splitlines()
    results["device"] = {
        "nvidia_smi": sh("nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader"),
        "python": sys.version.split()[0], "nvcc": nvcc and sh(f"{nvcc} --version | tail -2"),
        "uname": sh("uname -r"), "cpus": os.cpu_count(),
        "versions (machine's own, without the carried site)": sh(
            f"{sys.executable} -c \"import torch, triton, transformers; print(torch.__version__, "
            "torch.version.cuda, triton.__version__, transformers.__version__)\"")}
    device_gib = int(total[0]) / 1024 if total and total[0].strip().isdigit() else None
    probe = ("import time, importlib; t=time.time()\n"
             "import sgl_kernel\n"
             "print('sgl_kernel', sgl_kernel.__version__, 'common_ops:', sgl_kernel.common_ops.__file__)\n"
             "for m in ['sglang', 'sglang.srt.entrypoints.http_server', 'sglang.srt.managers.scheduler',\n"
             "          'sglang.srt.model_executor.model_runner', 'sglang.srt.models.qwen4_exp',\n"
             "          'sglang.srt.models.qwen4_exp_mtp', 'sglang_ssd_stream.sglang.plugin']:\n"
             "    try:\n"
             "        importlib.import_module(m); print('ok', m, round(time.time()-t, 1))\n"
             "    except BaseException as e:\n"
             "        import traceback; traceback.print_exc(); print('FAIL', m, type(e).__name__, e)\n"
             "import importlib.metadata as md\n"
             "print('entry points:', [e.value for e in md.entry_points(group='sglang.srt.plugins')])\n"
             "for d in ['sglang', 'sglang-kernel', 'sglang-ssd-stream', 'torch', 'triton', 'transformers',\n"
             "          'flashinfer-python', 'apache-tvm-ffi']:\n"
             "    try: print(d, md.version(d))\n"
             "    except Exception as e: print(d, 'absent')\n")
    results["fio"] = fio(work, args.fio_seconds)
    if "cold-prompt" in names and not shutil.which("fio") and args.fio_seconds > 0:
        results["disk_fallback"] = direct_reads(work, min(args.fio_seconds, 6))
    save()
    if args.import_probe:
        p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=240)
        (out / "import.log").write_text(p.stdout + "\n--- stderr ---\n" + p.stderr)
        results["import_probe"] = {"rc": p.returncode, "stdout": p.stdout[-4000:]}
        save()
        print(p.stdout[-3000:], flush=True)

    ctx = {"args": args, "model": model, "sidecar": sidecar, "work": work, "out": out, "env": env, "site": site,
           "pristine_site": tmp / "site-pristine", "probes_root": probes_root(), "device_gib": device_gib,
           "deadline_at": t_start + args.deadline, "spec": [], "spec_record": {"kept": {}, "dropped": {}}}
    pf = ctx["probes_root"] / "tests" / "e2e" / "probes.py"
    results["probes"] = {"file": str(pf), "sha256": sha256(pf) if pf.exists() else None}
    if any(s.mtp for s in servers):
        try:
            ctx["spec"], ctx["spec_record"] = speculative_flags(sys.executable, env, model / "mtp")
        except RuntimeError as exc:
            results["speculative_error"] = str(exc)
        results["speculative"] = ctx["spec_record"]
    if any(s.pristine for s in servers):
        try:
            ctx["pristine"] = make_pristine_site(carry, site, ctx["pristine_site"], env)
        except Exception as exc:  # noqa: BLE001 - recorded; the pristine server is then not started
            ctx["pristine"] = {"pristine": False, "error": f"{type(exc).__name__}: {exc}"}
        results["pristine_site"] = ctx["pristine"]
    save()

    results["scenarios"] = []
    for i, s in enumerate(servers):
        left = args.deadline - (time.monotonic() - t_start) - 25
        if left < 45:
            results["scenarios"].append({"name": s.name, "serves": s.serves, "skipped": "no time left"})
            continue
        failed = [r["name"] for r in results["scenarios"] if r.get("error")]
        if failed and not args.keep_going:
            results["scenarios"].append({"name": s.name, "serves": s.serves,
                                         "skipped": f"{failed[0]} failed (--keep-going runs on)"})
            continue
        if s.mtp and not ctx["spec"]:
            results["scenarios"].append({"name": s.name, "serves": s.serves, "error": "no speculative flags",
                                         "detail": results.get("speculative_error")})
            continue
        budget = min(left, args.first_budget if i == 0 else args.budget)
        print(f"--- {s.name} ({', '.join(s.serves)}): budget {budget:.0f} s", flush=True)
        r = run_server(s, ctx, 30000 + i, budget)
        results["scenarios"].append(r)
        print(json.dumps({k: r.get(k) for k in ("name", "healthy_after_s", "error", "seconds", "work_seconds")}),
              flush=True)
        for run in r.get("greedy", []) if isinstance(r.get("greedy"), list) else []:
            print("  ", run.get("prompt_tokens"), run.get("output_ids") or run.get("error"), flush=True)
        save()
    by = {r["name"]: [g.get("output_ids") for g in r["greedy"]] for r in results["scenarios"]
          if isinstance(r.get("greedy"), list)}
    if args.reference:  # an earlier call's results.json: its scenarios compare as "<name> (reference)"
        ref = json.loads(Path(args.reference).read_text())
        results["reference"] = {"file": args.reference, "started": ref.get("started"),
                                "device": ref.get("device", {}).get("nvidia_smi")}
        for r in ref.get("scenarios", []):
            if isinstance(r.get("greedy"), list):
                by[f"{r['name']} (reference)"] = [g.get("output_ids") for g in r["greedy"]]
    checks = {}
    names_ = list(by)
    for a, b in [(a, b) for i, a in enumerate(names_) for b in names_[i + 1:]]:
        if by.get(a) and by.get(b) and len(by[a]) == len(PROMPTS) and len(by[b]) == len(PROMPTS):
            checks[f"{a} == {b}"] = by[a] == by[b]
    results["checks"] = checks
    results["verdicts"] = verdicts(results["scenarios"], checks, args.graphs)
    sj = work / "standin.jsonl"
    results["standin_reports"] = [json.loads(x) for x in sj.read_text().splitlines()] if sj.exists() else []
    results["seconds"] = round(time.monotonic() - t_start, 1)
    save()
    print("checks:", json.dumps(checks), flush=True)
    print("verdicts:", json.dumps({k: v.get("ok", v.get("observed") and "observed") for k, v in
                                   results["verdicts"].items()}), flush=True)
    return 0


def verdicts(runs: list[dict], checks: dict, mode: str) -> dict:
    """Per requested scenario, from what the servers recorded: ``ok`` true/false, or ``observed`` (pristine §8,
    where the write-up's behaviour is recorded, not required); ``ok: None`` where its server did not serve."""
    by = {r["name"]: r for r in runs}
    out: dict = {}
    for r in runs:
        for sc in r.get("serves", []):
            if sc in GREEDY_SERVERS:
                continue
            v = out.setdefault(sc, {"servers": []})
            v["servers"].append(r["name"])
    for sc, v in out.items():
        rs = [by[n] for n in v["servers"]]
        if any("healthy_after_s" not in r for r in rs):
            v["ok"] = None
            v["why"] = "; ".join(f"{r['name']}: {r.get('error') or r.get('skipped')}" for r in rs
                                 if "healthy_after_s" not in r)
            continue
        if sc == "mtp-sidecar":
            key = f"sidecar-{mode} == mtp-sidecar-{mode}"
            spec = by[f"mtp-sidecar-{mode}"].get("spec") or {}
            v.update(greedy_equal_mtp_off=checks.get(key), accept_rate=spec.get("accept_rate"),
                     accept_length=spec.get("accept_length"), verify_passes=spec.get("verify_passes"))
            v["ok"] = checks.get(key) is True and bool(spec.get("verify_passes"))
        elif sc in ("trunc-patched", "trunc-pristine"):
            tv = rs[0].get("truncation_verdict")
            v["ok"] = None if tv is None else tv.get("ok")
            v["observed"] = tv and tv["observed"]
            if tv is None:
                v["why"] = rs[0].get("probes_import_error") or str(rs[0].get("truncation"))[:300]
        elif sc == "cold-prompt":
            v["runs"] = {r["name"]: (r.get("cold") or {}).get("runs") for r in rs}
            v["ok"] = all(isinstance(x, list) and len(x) == 2 and all(
                (y.get("finish_reason") or {}).get("type") == "length" and (y.get("prompt_tokens") or 0) >= 2048
                and y.get("ttft_s") is not None for y in x) for x in v["runs"].values())
        elif sc == "survey":
            sv = rs[0].get("survey") or {}
            v["ok"] = (sv.get("verdict") or {}).get("ok")
            v["detail"] = sv.get("verdict") or sv.get("error") or rs[0].get("probes_import_error")
        v["gpu_memory_vs_plan"] = {r["name"]: memory_vs_plan(r) for r in rs}
    return out


def memory_vs_plan(r: dict) -> dict:
    """The server's GPU memory (nvidia-smi, its processes) beside the kit's plan for the same flags."""
    plan = (r.get("plan") or {})
    p = (plan.get("view") or plan.get("as_is") or {}).get("plan") or {}
    mem = p.get("memory") or {}
    return {"server_mib": (r.get("gpu_memory") or {}).get("server_mib"),
            "plan_needed_gib": mem.get("needed_gib"), "plan_weights_gib": mem.get("weights_gib"),
            "plan_static_gib": mem.get("static_gib"), "plan_from": "view" if plan.get("view") else "as_is",
            "plan_refused": (plan.get("as_is") or {}).get("stderr") if (plan.get("as_is") or {}).get("rc") else None,
            "view_failed": (plan.get("view") or {}).get("stderr", "")[-400:] if (plan.get("view") or {}).get("rc")
            else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="build .gpu/sglang-pack/carry on the CPU box")
    p.add_argument("--model-python", required=True, help="a python with transformers 5.19 (the sglang venv's)")
    p.add_argument("--sglang-kernel-wheel", help="sglang_kernel-0.4.10 wheel (default: the test wheelhouse's)")
    p.set_defaults(func=pack)
    s = sub.add_parser("serve", help="on the GPU machine: start the server per scenario, send greedy requests")
    s.add_argument("--carry", default=str(PACK / "carry"))
    s.add_argument("--out", required=True)
    s.add_argument("--deadline", type=float, default=560.0, help="seconds for the whole command")
    s.add_argument("--first-budget", type=float, default=300.0, help="seconds for the first server to serve")
    s.add_argument("--budget", type=float, default=150.0, help="seconds for each later server")
    s.add_argument("--scenarios", default="sidecar-eager,ram-eager,sidecar-graph,ram-graph",
                   help=f"comma-separated: servers with greedy requests only ({', '.join(GREEDY_SERVERS)}) and "
                        f"scenarios ({', '.join(SCENARIOS)}), which share a server where their flags agree")
    s.add_argument("--graphs", default="eager", choices=list(MODES),
                   help="CUDA graphs for the scenarios' servers: eager (none), graph (decode graphs only), "
                        "graph-prefill (sglang's default: prefill graphs too)")
    s.add_argument("--trunc-mtp", action=argparse.BooleanOptionalAction, default=True,
                   help="the write-up 000 §8 probes on MTP servers (the thor profile's NEXTN 3/1/4, as the "
                        "write-up ran them)")
    s.add_argument("--greedy-budget", type=float, default=90.0, help="seconds for a server's greedy requests")
    s.add_argument("--trunc-bound", type=float, default=30.0,
                   help="seconds each §8 request may take before it counts as never answering")
    s.add_argument("--survey-budget", type=float, default=150.0, help="seconds for the malformed-request survey")
    s.add_argument("--cold-budget", type=float, default=90.0, help="seconds for a server's two cold prompts")
    s.add_argument("--tmp", default="/tmp", help="where site/, site-pristine/ and sg/ (model, sidecar) are unpacked")
    s.add_argument("--dry-run", action="store_true",
                   help="print each server's command, environment and work (no carry, nothing started) and write "
                        "results.json's plan")
    s.add_argument("--fio-seconds", type=int, default=8, help="per fio job (0: none)")
    s.add_argument("--import-probe", action=argparse.BooleanOptionalAction, default=True,
                   help="import the server's chain once before the servers (about 30 s)")
    s.add_argument("--reference", help="an earlier call's results.json whose greedy ids the checks compare too")
    s.add_argument("--keep-going", action="store_true",
                   help="start the later scenarios after one failed (by default they are skipped)")
    s.set_defaults(func=serve)
    args = ap.parse_args()
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
