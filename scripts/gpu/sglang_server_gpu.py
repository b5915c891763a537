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
backend); after a scenario fails the rest are skipped unless ``--keep-going``; ``--reference`` adds an earlier
call's greedy ids to the equality checks. Writes ``results.json`` (token ids, timings, versions,
equality checks, the stand-in ops that ran) and one log per scenario under ``--out``.

Exact command (CPU box, repo root; the lock's wheels are fetched once)::

    .gpu/kitvenv/bin/python scripts/gpu/sglang_server_gpu.py pack --model-python <sglang-venv>/bin/python

then on the GPU machine (``run`` with ``carry=[".gpu/sglang-pack/carry"]``)::

    python3 scripts/gpu/sglang_server_gpu.py serve --carry .gpu/sglang-pack/carry --out $OUT --deadline 560
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
import time
import urllib.error
import urllib.request
import zipfile
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


def scenario(name: str, site: Path, model: Path, sidecar: Path | None, graphs: bool, out: Path, port: int,
             budget: float, base_env: dict, prefill_graphs: bool = False) -> dict:
    res: dict = {"name": name, "sidecar": bool(sidecar), "cuda_graphs": graphs, "prefill_graphs": prefill_graphs}
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--max-total-tokens", "4096", "--context-length", "256",
           "--max-mamba-cache-size", "64", "--disable-radix-cache", "--allow-auto-truncate",
           "--ple-offload-embedding", "--skip-server-warmup", "--attention-backend", "triton",
           "--sampling-backend", "pytorch", "--mem-fraction-static", "0.5", "--max-running-requests", "8"]
    if graphs:
        cmd += ["--cuda-graph-max-bs-decode", "8"]
        if not prefill_graphs:  # decode graphs only; sglang 0.5.23 also captures prefill graphs by default
            cmd += ["--cuda-graph-backend-prefill", "disabled"]
    else:
        cmd += ["--disable-cuda-graph"]
    env = dict(base_env)
    if sidecar:
        env.update({"SGLANG_SSD_STREAM_SIDECAR": str(sidecar), "SGLANG_SSD_STREAM_IO": "mmap",
                    "SGLANG_SSD_STREAM_ROW_CACHE_MB": "0"})
    res["command"] = " ".join(cmd)
    res["env"] = {k: v for k, v in env.items() if k.startswith(("SGLANG", "SGL_", "SSD"))}
    log_path = out / f"{name}.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
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
                runs = []
                for seed, n in enumerate(PROMPTS):
                    t1 = time.monotonic()
                    try:
                        body = post(f"{url}/generate", {"input_ids": token_ids(n, seed), "return_logprob": True,
                                                        "sampling_params": {"max_new_tokens": MAX_TOKENS,
                                                                            "temperature": 0.0}},
                                    timeout=max(10.0, budget - (time.monotonic() - t0)))
                    except Exception as exc:  # noqa: BLE001 - recorded, the next scenario still runs
                        runs.append({"prompt_tokens": n, "error": f"{type(exc).__name__}: {exc}"})
                        break
                    meta = body["meta_info"]
                    runs.append({"prompt_tokens": meta["prompt_tokens"], "output_ids": body["output_ids"],
                                 "logprobs": [e[0] for e in meta["output_token_logprobs"]],
                                 "finish_reason": meta["finish_reason"], "seconds": round(time.monotonic() - t1, 3)})
                res["greedy"] = runs
                if any("error" in r for r in runs):
                    res["error"] = "a greedy request failed: " + next(r["error"] for r in runs if "error" in r)
                try:
                    with urllib.request.urlopen(f"{url}/get_server_info", timeout=10) as r:
                        info = json.loads(r.read())
                    res["server_info"] = {k: info.get(k) for k in ("version", "attention_backend",
                                                                   "disable_cuda_graph", "cuda_graph_max_bs",
                                                                   "sampling_backend", "moe_runner_backend",
                                                                   "linear_attn_backend", "page_size",
                                                                   "max_total_num_tokens", "disable_overlap_schedule")}
                except Exception as exc:  # noqa: BLE001
                    res["server_info"] = f"{type(exc).__name__}: {exc}"
                res["gpu_memory_used_mib"] = sh("nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits")
        finally:
            stop_group(proc)
    res["seconds"] = round(time.monotonic() - t0, 1)
    text = log_path.read_text(errors="replace")
    res["plugin_lines"] = [ln for ln in text.splitlines() if "sglang-ssd-stream plugin" in ln][:12]
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


def serve(args) -> int:
    t_start = time.monotonic()
    carry, out = Path(args.carry).resolve(), Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    site, work = Path("/tmp/site"), Path("/tmp/sg")
    work.mkdir(exist_ok=True)
    results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv,
                     "manifest": json.loads((carry / "MANIFEST.json").read_text())}

    def save():
        (out / "results.json").write_text(json.dumps(results, indent=1))

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
    model, sidecar = work / "qwen4_exp", work / "sidecar"

    nvcc = shutil.which("nvcc") or next((str(p) for p in Path("/usr/local").glob("cuda*/bin/nvcc")), None)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "SSD_STREAM_"))}
    env.update({"PYTHONPATH": str(site), "HOME": "/tmp/home", "SGLANG_PLUGINS": "ssd_stream",
                "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "SGLANG_JIT_CACHE_DIR": "/tmp/jit-cache",
                "TRITON_CACHE_DIR": "/tmp/triton-cache", "GPU_STANDIN_REPORT": str(work / "standin.jsonl")})
    if nvcc:
        env["CUDA_HOME"] = str(Path(nvcc).resolve().parents[1])
        env["PATH"] = f"{Path(nvcc).parent}:{env.get('PATH', '')}"
    results["device"] = {
        "nvidia_smi": sh("nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader"),
        "python": sys.version.split()[0], "nvcc": nvcc and sh(f"{nvcc} --version | tail -2"),
        "uname": sh("uname -r"), "cpus": os.cpu_count(),
        "versions (machine's own, without the carried site)": sh(
            f"{sys.executable} -c \"import torch, triton, transformers; print(torch.__version__, "
            "torch.version.cuda, triton.__version__, transformers.__version__)\"")}
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
    save()
    if args.import_probe:
        p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=240)
        (out / "import.log").write_text(p.stdout + "\n--- stderr ---\n" + p.stderr)
        results["import_probe"] = {"rc": p.returncode, "stdout": p.stdout[-4000:]}
        save()
        print(p.stdout[-3000:], flush=True)

    plan = {"sidecar-eager": (sidecar, False, False), "ram-eager": (None, False, False),
            "sidecar-graph": (sidecar, True, False), "ram-graph": (None, True, False),
            "sidecar-graph-prefill": (sidecar, True, True), "ram-graph-prefill": (None, True, True)}
    plan = [(name, *plan[name]) for name in args.scenarios.split(",") if name in plan]
    results["scenarios"] = []
    for i, (name, sc, graphs, prefill_graphs) in enumerate(plan):
        left = args.deadline - (time.monotonic() - t_start) - 25
        if left < 30:
            results["scenarios"].append({"name": name, "skipped": "no time left"})
            continue
        failed = [r["name"] for r in results["scenarios"] if r.get("error")]
        if failed and not args.keep_going:
            results["scenarios"].append({"name": name, "skipped": f"{failed[0]} failed (--keep-going runs on)"})
            continue
        budget = min(left, args.first_budget if i == 0 else args.budget)
        print(f"--- {name}: budget {budget:.0f} s", flush=True)
        r = scenario(name, site, model, sc, graphs, out, 30000 + i, budget, env, prefill_graphs)
        results["scenarios"].append(r)
        print(json.dumps({k: r.get(k) for k in ("name", "healthy_after_s", "error", "seconds")}), flush=True)
        for run in r.get("greedy", []):
            print("  ", run.get("prompt_tokens"), run.get("output_ids") or run.get("error"), flush=True)
        save()
    by = {r["name"]: [g.get("output_ids") for g in r.get("greedy", [])] for r in results["scenarios"]}
    if args.reference:  # an earlier call's results.json: its scenarios compare as "<name> (reference)"
        ref = json.loads(Path(args.reference).read_text())
        results["reference"] = {"file": args.reference, "started": ref.get("started"),
                                "device": ref.get("device", {}).get("nvidia_smi")}
        for r in ref.get("scenarios", []):
            if r.get("greedy"):
                by[f"{r['name']} (reference)"] = [g.get("output_ids") for g in r["greedy"]]
    checks = {}
    names = list(by)
    for a, b in [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]:
        if by.get(a) and by.get(b) and len(by[a]) == len(PROMPTS) and len(by[b]) == len(PROMPTS):
            checks[f"{a} == {b}"] = by[a] == by[b]
    results["checks"] = checks
    sj = work / "standin.jsonl"
    results["standin_reports"] = [json.loads(x) for x in sj.read_text().splitlines()] if sj.exists() else []
    results["seconds"] = round(time.monotonic() - t_start, 1)
    save()
    print("checks:", json.dumps(checks), flush=True)
    return 0


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
    s.add_argument("--scenarios", default="sidecar-eager,ram-eager,sidecar-graph,ram-graph")
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
