"""``vllm-ple-offload serve`` runs the vLLM doctor before it execs vLLM (real vLLM venv, CPU platform).

What the launch inherits (``VLLM_PLE_*``, ``VLLM_PLUGINS``) reaches the exec'd environment and the
printed command; the preflight judges the whole launch line with the plugin's own rules, so a
streamed backend under the a100x4 profile's FULL_DECODE_ONLY graphs is refused before vLLM starts
rather than minutes later at model build (``pread`` here: the graph rule is the embedding's,
``doctor.full_graph_refusal``).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from ..operate.conftest import WRITEUP_TEXT_CONFIG
from .synthetic import random_table, write_sidecar


@pytest.fixture
def model(tmp_path):
    m = tmp_path / "model"
    m.mkdir()
    # a config transformers' Qwen4ExpConfig accepts (serve loads it with the engine's own class first)
    (m / "config.json").write_text(json.dumps({"architectures": ["Qwen4ExpForConditionalGeneration"],
                                               "model_type": "qwen4_exp", "text_config": WRITEUP_TEXT_CONFIG}))
    return m


@pytest.fixture
def sidecar(tmp_path):
    return write_sidecar(tmp_path / "sc", {3: ("bfloat16", random_table(64, 160, 0))})


def serve(vllm, *args, **env):
    return subprocess.run([vllm.python, "-m", "vllm_ple_offload.cli", "serve", *args], capture_output=True,
                          text=True, env=vllm.env(env), timeout=900)


def test_inherited_variables_reach_the_exec_environment_and_the_printed_command(tmp_path, model):
    from sglang_ssd_stream.operate.launch import build_launch
    from sglang_ssd_stream.operate.profiles import get_profile
    from vllm_ple_offload.side import SIDE

    inherited = {"PATH": "/bin", "VLLM_PLE_OFFLOAD_BACKEND": "mmap", "VLLM_PLE_SIDECAR": "/data/sc",
                 "VLLM_PLUGINS": "ple_offload", "HF_TOKEN": "not-shown"}
    launch = build_launch(get_profile("a100x4", "vllm"), SIDE, model=str(model), python="/venv/bin/python",
                          base_env=inherited)
    assert {k: launch.env[k] for k in ("VLLM_PLE_OFFLOAD_BACKEND", "VLLM_PLE_SIDECAR", "VLLM_PLUGINS")} == \
        {"VLLM_PLE_OFFLOAD_BACKEND": "mmap", "VLLM_PLE_SIDECAR": "/data/sc", "VLLM_PLUGINS": "ple_offload"}
    line = launch.shell()
    prefix = line.split(" /venv/bin/vllm ")[0].split()
    assert {"VLLM_PLE_CPU_OFFLOAD=1", "VLLM_PLE_OFFLOAD_BACKEND=mmap", "VLLM_PLE_SIDECAR=/data/sc",
            "VLLM_PLUGINS=ple_offload"} <= set(prefix)  # inherited ones too (they were left out)
    assert not [p for p in prefix if p.startswith(("HF_TOKEN", "PATH"))]  # only what changes the plugin's behaviour
    assert launch.env["VLLM_PLE_CPU_OFFLOAD"] == "1"  # the profile's own value


def test_dry_run_shows_the_streamed_backend_refused_under_full_graphs(vllm, model, sidecar):
    r = serve(vllm, "--profile", "a100x4", "--model", str(model), "--dry-run", VLLM_PLE_OFFLOAD_BACKEND="pread",
              VLLM_PLE_SIDECAR=str(sidecar), VLLM_PLE_ALLOW_UNPATCHED="1")
    assert r.returncode == 0, r.stderr[-3000:]  # a dry run reports
    lines = r.stdout.splitlines()
    shown = set(lines[0].split(" serve ")[0].split())
    assert {"VLLM_PLE_ALLOW_UNPATCHED=1", "VLLM_PLE_CPU_OFFLOAD=1", "VLLM_PLE_OFFLOAD_BACKEND=pread",
            f"VLLM_PLE_SIDECAR={sidecar}"} <= shown  # inherited ones too (they were left out)
    assert "FULL_DECODE_ONLY" in lines[0]
    report = "\n".join(lines[1:])
    assert "# [error] cudagraph_mode: cudagraph_mode=FULL_DECODE_ONLY: pread PLE backend" in report
    assert "# [ok] sidecar_sha" not in report  # serve leaves the 47 GiB hash to the plugin and its cache
    assert "# [ok] fetch_round: " in report and "# [warning] uva: CpuPlatform" in report
    # issue 43 item 3: this CPU box has no CUDA GPU, which the profiles need: said before vLLM would say it
    assert "# [error] device: vLLM finds no CUDA GPU here (its platform is CpuPlatform)" in report
    assert lines[-1] == "# a real serve would refuse here: 2 error(s) above"


def test_serve_on_a_host_without_a_gpu_is_refused_naming_it(vllm, model, sidecar):
    """Issue 43 item 3: the preflight refuses a host without a CUDA GPU, naming it first (before: no finding said
    so, and where nothing else was refused vllm serve stopped with "Failed to infer device type"), as the SGLang
    side does."""
    r = serve(vllm, "--profile", "a100x4", "--model", str(model), VLLM_PLE_OFFLOAD_BACKEND="pread",
              VLLM_PLE_SIDECAR=str(sidecar), VLLM_PLE_ALLOW_UNPATCHED="1")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "doctor refused the launch:" in r.stderr and "Traceback" not in r.stderr
    assert "[error] device: vLLM finds no CUDA GPU here (its platform is CpuPlatform): the launch profiles serve " \
        "on CUDA GPUs" in r.stderr
    assert "fix: run on the GPU host; check the driver with nvidia-smi" in r.stderr


def test_serve_refuses_before_exec(vllm, model, sidecar):
    r = serve(vllm, "--profile", "a100x4", "--model", str(model), VLLM_PLE_OFFLOAD_BACKEND="pread",
              VLLM_PLE_SIDECAR=str(sidecar), VLLM_PLE_ALLOW_UNPATCHED="1", VLLM_PLUGINS="other")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "doctor refused the launch:" in r.stderr
    assert "[error] plugin_allowlist: VLLM_PLUGINS='other' does not name ple_offload" in r.stderr
    assert "[error] cudagraph_mode: cudagraph_mode=FULL_DECODE_ONLY" in r.stderr
    assert "Traceback" not in r.stderr


def test_serve_refuses_the_plugins_refusals(vllm, model):
    r = serve(vllm, "--profile", "a100x4", "--model", str(model), "--dry-run", VLLM_PLE_FETCH_WORKERS="24")
    assert r.returncode == 0
    assert ("# [error] settings: VLLM_PLE_FETCH_WORKERS only apply to the mmap and pread backends, not to "
            "VLLM_PLE_OFFLOAD_BACKEND=pinned") in r.stdout
