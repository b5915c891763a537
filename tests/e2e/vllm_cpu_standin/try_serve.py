"""Reproduce the vLLM 0.33.0 OpenAI server on a CPU box, end to end (issue 26 probe; tests/e2e_vllm is the suite).

Writes the tiny random-weight qwen4_exp into a temp dir (tests/e2e_vllm/models.py: tests/e2e/models.py plus the
one config field vLLM needs), optionally builds its PLE sidecar with the kit's CLI, starts
``python -m vllm.entrypoints.openai.api_server`` of the hash-locked vLLM venv with this directory's CPU
stand-in on PYTHONPATH, sends one greedy ``/v1/completions`` request, prints the answer, stops the server
(its whole process group) and checks that no process of it is left.

    python tests/e2e/vllm_cpu_standin/try_serve.py                 # vLLM's own (stood-in pinned) PLE table
    python tests/e2e/vllm_cpu_standin/try_serve.py --backend mmap  # the plugin's streamed sidecar (mmap)
    python tests/e2e/vllm_cpu_standin/try_serve.py --backend pread --row-cache-mb 0
    python tests/e2e/vllm_cpu_standin/try_serve.py --backend mmap --mtp 2  # MTP draft in the checkpoint, 2 tokens

Run it with any Python 3.11+ (it runs the venv's own Python for everything engine-side). ``--python`` picks the
venv (default: $SSD_STREAM_VLLM_PYTHON, else the cached hash-locked one). Exit 0 only when the answer came.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
DEFAULT_PY = os.environ.get("SSD_STREAM_VLLM_PYTHON") or next(
    iter(sorted(glob.glob(os.path.expanduser("~/.cache/sglang-ssd-stream/venvs/vllm-0.33.0-*/bin/python")))), "")

# vLLM flags: the engine caps for a 2-core box, and what the CPU path needs.
SERVE_ARGS = [
    "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
    "--enforce-eager",  # no torch.compile / graphs on the CPU path
    "--language-model-only",  # no vision tower (the tiny checkpoint's is untested by anything)
    "-cc", json.dumps({"custom_ops": ["none"]}),  # every CustomOp takes its torch forward_native
    "--served-model-name", "qwen4-tiny",
]

# The tiny qwen4_exp plus the config field vLLM needs, and the negative control (other PLE rows): the same
# writer the pytest suite (tests/e2e_vllm) uses.
WRITE_MODEL = r"""
import sys
from pathlib import Path
from tests.e2e_vllm.models import make_qwen4_exp_vllm
make_qwen4_exp_vllm(Path(sys.argv[1]), negate_ple="negate-ple" in sys.argv[2:], mtp="mtp" in sys.argv[2:])
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd, env, **kw):
    print("+", " ".join(shlex.quote(str(c)) for c in cmd), flush=True)
    return subprocess.run(cmd, env=env, check=True, **kw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=DEFAULT_PY, help="the vLLM venv's python")
    ap.add_argument("--backend", choices=["none", "pinned", "mmap", "pread"], default="none",
                    help="none: plugin loaded but off (vLLM's own table); else VLLM_PLE_OFFLOAD_BACKEND")
    ap.add_argument("--row-cache-mb", default=None, help="VLLM_PLE_ROW_CACHE_MB (streamed backends)")
    ap.add_argument("--negate-ple", action="store_true", help="negative control: every PLE shard negated")
    ap.add_argument("--mtp", type=int, default=0,
                    help="N > 0: write the MTP draft into the checkpoint and serve with "
                         "--speculative-config {method: mtp, num_speculative_tokens: N}")
    ap.add_argument("--prompt", default="The secret code number is")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=int, default=420, help="seconds for startup")
    ap.add_argument("--workdir", default=None, help="keep the model/logs here instead of a temp dir")
    args = ap.parse_args()
    if not args.python or not Path(args.python).exists():
        print(f"no vLLM venv python: {args.python!r}", file=sys.stderr)
        return 4

    work = Path(args.workdir or tempfile.mkdtemp(prefix="vllm-cpu-try-"))
    work.mkdir(parents=True, exist_ok=True)
    home = work / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTEST_", "SGLANG_", "SSD_STREAM_"))}
    env.update({
        "HOME": str(home), "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)]), "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "VLLM_TARGET_DEVICE": "cpu",  # CPU platform (vllm serve cannot infer a device without a GPU)
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: no memory probe of the whole box
        "TRITON_INTERPRET": "1",  # vLLM's Triton kernels run on CPU tensors in the interpreter
        "VLLM_PLUGINS": "ple_offload",  # the kit's general plugin, by the entry point the venv's install declares
    })

    model = work / "qwen4_exp"
    t0 = time.time()
    run([args.python, "-c", WRITE_MODEL, str(model), *(["negate-ple"] if args.negate_ple else []),
         *(["mtp"] if args.mtp else [])],
        {**env, "PYTHONPATH": str(REPO)}, cwd=REPO, stdout=subprocess.DEVNULL)
    print(f"model written in {time.time() - t0:.1f} s: {model}", flush=True)

    if args.backend != "none":
        env["VLLM_PLE_CPU_OFFLOAD"] = "1"
        env["VLLM_PLE_OFFLOAD_BACKEND"] = args.backend
        env["VLLM_PLE_ALLOW_UNPATCHED"] = "1"  # the shared venv may be pristine; the plugin says so in its log
        if args.backend in ("mmap", "pread"):
            sidecar = work / "sidecar"
            t0 = time.time()
            run([args.python, "-m", "sglang_ssd_stream", "sidecar", "build", str(model), "-o", str(sidecar), "-q"],
                {**env, "PYTHONPATH": str(REPO)}, cwd=REPO)
            print(f"sidecar built in {time.time() - t0:.1f} s: {sidecar}", flush=True)
            env["VLLM_PLE_SIDECAR"] = str(sidecar)
            if args.row_cache_mb is not None:
                env["VLLM_PLE_ROW_CACHE_MB"] = args.row_cache_mb

    port = free_port()
    cmd = [args.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), *SERVE_ARGS]
    if args.mtp:
        cmd += ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": args.mtp})]
    shown = {k: env[k] for k in sorted(env) if k.startswith(("VLLM_", "TRITON_")) or k in ("PYTHONPATH", "HOME")}
    print("server env:", " ".join(f"{k}={shlex.quote(v)}" for k, v in shown.items()), flush=True)
    print("server cmd:", " ".join(shlex.quote(c) for c in cmd), flush=True)
    log_path = work / "server.log"
    log = open(log_path, "w")
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work, start_new_session=True)
    rc = 1
    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            if proc.poll() is not None:
                print(f"server exited {proc.returncode} before it was healthy; end of {log_path}:", flush=True)
                print("".join(open(log_path).readlines()[-40:]))
                return 1
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() - t0 > args.timeout:
                print(f"server not healthy after {args.timeout} s; see {log_path}")
                return 1
            time.sleep(1)
        started = time.time() - t0
        print(f"server healthy after {started:.1f} s", flush=True)
        body = {"model": "qwen4-tiny", "prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 0,
                "logprobs": 1, "return_token_ids": True}
        req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t1 = time.time()
        with urllib.request.urlopen(req, timeout=300) as r:
            answer = json.loads(r.read())
        choice = answer["choices"][0]
        print(f"answer in {time.time() - t1:.1f} s: text={choice['text']!r}")
        print("token_ids:", choice.get("token_ids"))
        print("logprobs:", [round(x, 6) for x in choice["logprobs"]["token_logprobs"]])
        print(json.dumps({"startup_s": round(started, 1), "text": choice["text"], "token_ids": choice.get("token_ids"),
                          "token_logprobs": choice["logprobs"]["token_logprobs"], "backend": args.backend}))
        interesting = [ln.rstrip() for ln in open(log_path) if "vllm_cpu_standin" in ln or "ple-offload" in ln.lower()
                       or "PLE " in ln or "Using V2 Model Runner" in ln or "plugin" in ln.lower()]
        print(f"--- {len(interesting)} stand-in/plugin lines of {log_path} (first 60):")
        print("\n".join(interesting[:60]))
        rc = 0
    finally:
        for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                continue
            # the group may outlive its leader for a moment (engine core, workers)
            deadline = time.time() + grace
            while time.time() < deadline:
                try:
                    os.killpg(proc.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.5)
            else:
                continue
            break
        log.close()
        try:
            os.killpg(proc.pid, 0)
            print(f"WARNING: process group {proc.pid} still alive", file=sys.stderr)
            rc = rc or 1
        except ProcessLookupError:
            print(f"server stopped (process group {proc.pid} gone); log: {log_path}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
