"""serve: exact command lines per profile, the exposure rule, extras, preflight and the doctor seam."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_ssd_stream.operate import add_operate_commands
from sglang_ssd_stream.operate.errors import ServeRefused
from sglang_ssd_stream.operate.launch import build_launch
from sglang_ssd_stream.operate.profiles import PROFILES, get_profile

from .conftest import SIDES, write_model

PY = "/venv/bin/python"
SGLANG = "/venv/bin/sglang"  # the console script beside the runtime's Python

THOR_ARGS = [
    "--model-path", "/m", "--trust-remote-code", "--quantization", "modelopt_fp4",
    "--fp4-gemm-backend", "flashinfer_cutlass", "--kv-cache-dtype", "fp8_e4m3",
    "--speculative-draft-kv-cache-dtype", "fp8_e4m3", "--page-size", "64",
    "--mamba-radix-cache-strategy", "extra_buffer_lazy", "--mamba-track-interval", "64", "--mamba-ssm-dtype", "float32",
    "--speculative-algorithm", "NEXTN", "--speculative-draft-model-path", "/m/mtp", "--speculative-num-steps", "3",
    "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4", "--enable-metrics", "--allow-auto-truncate",
    "--enable-multimodal", "--reasoning-parser", "auto", "--tool-call-parser", "auto",
    "--attention-backend", "triton", "--moe-runner-backend", "flashinfer_cutlass",
    "--context-length", "262144", "--max-total-tokens", "557056", "--max-running-requests", "4",
    "--max-mamba-cache-size", "16", "--cuda-graph-max-bs-decode", "4", "--disable-prefill-cuda-graph",
    "--chunked-prefill-size", "2048", "--mem-fraction-static", "0.95", "--enable-linear-replayssm-spec",
    "--sleep-on-idle",
]


def _parser(engine):
    p = argparse.ArgumentParser()
    add_operate_commands(p.add_subparsers(dest="command", required=True), SIDES[engine])
    return p


def test_thor_exact_argv_and_env():
    launch = build_launch(PROFILES["sglang", "thor"], SIDES["sglang"], model="/m", draft="/m/mtp", python=PY,
                          base_env={"PATH": "/bin"})
    assert launch.argv == [SGLANG, "serve", *THOR_ARGS, "--host", "127.0.0.1", "--port", "8000"]
    assert launch.env == {"PATH": "/bin", "SGLANG_PLUGINS": "ssd_stream", "SGLANG_QSA_PREFILL_LOGITS_BUDGET_MB": "32",
                          "SGLANG_EMPTY_CACHE_INTERVAL": "60", "SGLANG_SANITIZE_NAN_LOGITS": "1",
                          "SGLANG_SSD_STREAM_ROW_CACHE_MB": "1024", "SGLANG_SSD_STREAM_PREFETCH_DRAFTS": "1"}


def test_exported_knobs_win_over_the_profile_and_are_shown():
    """Issue 28 item 1: the README's comparison (ROW_CACHE_MB=0 against the default) must run what it says;
    an exported IO mode acts, so the printed command shows it; a bad value is kept for the doctor to refuse."""
    base = {"PATH": "/bin", "SGLANG_SSD_STREAM_ROW_CACHE_MB": "0", "SGLANG_SSD_STREAM_IO": "pread"}
    launch = build_launch(PROFILES["sglang", "thor"], SIDES["sglang"], model="/m", draft="/m/mtp", python=PY,
                          base_env=base)
    assert launch.env["SGLANG_SSD_STREAM_ROW_CACHE_MB"] == "0"
    assert launch.profile_env["SGLANG_SSD_STREAM_ROW_CACHE_MB"] == "0"
    assert launch.profile_env["SGLANG_SSD_STREAM_IO"] == "pread"  # inherited and acting: printed
    assert "keeping the exported SGLANG_SSD_STREAM_ROW_CACHE_MB=0 (profile thor sets 1024)" in launch.notes
    bad = build_launch(PROFILES["sglang", "thor"], SIDES["sglang"], model="/m", draft="/m/mtp", python=PY,
                       base_env={"SGLANG_SSD_STREAM_ROW_CACHE_MB": "abc"})
    assert bad.env["SGLANG_SSD_STREAM_ROW_CACHE_MB"] == "abc"  # not silently replaced


@pytest.mark.parametrize("exported,ok", [("other", False), ("", True), ("other,ssd_stream", True)])
def test_an_exported_plugin_list_may_add_plugins_never_drop_ours(exported, ok):
    def launch():
        return build_launch(PROFILES["sglang", "thor"], SIDES["sglang"], model="/m", draft="/m/mtp", python=PY,
                            base_env={"SGLANG_PLUGINS": exported})
    if ok:
        assert launch().env["SGLANG_PLUGINS"] == exported  # empty loads every installed plugin, ours included
    else:
        with pytest.raises(ServeRefused, match="SGLANG_PLUGINS=other leaves out ssd_stream"):
            launch()


def test_discrete_gpu_profile_values():
    launch = build_launch(PROFILES["sglang", "discrete-gpu"], SIDES["sglang"], model="/m", draft="/d", python=PY,
                          base_env={})
    a = launch.argv
    pairs = {a[i]: a[i + 1] for i in range(len(a) - 1) if a[i].startswith("--") and not a[i + 1].startswith("--")}
    assert pairs["--kv-cache-dtype"] == pairs["--speculative-draft-kv-cache-dtype"] == "fp8_e4m3"
    assert (pairs["--context-length"], pairs["--max-total-tokens"], pairs["--max-running-requests"],
            pairs["--max-mamba-cache-size"], pairs["--port"]) == ("131072", "131072", "1", "5", "30000")
    assert launch.env["SGLANG_PLUGINS"] == "ssd_stream"
    assert launch.env["SGLANG_SSD_STREAM_ROW_CACHE_MB"] == "4096"  # PLE row cache in host RAM (issue 19)


def test_vllm_a100x4_exact_argv_and_env():
    launch = build_launch(PROFILES["vllm", "a100x4"], SIDES["vllm"], model="/model", host="0.0.0.0", api_key="k",
                          python=PY, served_names=("qwen3.8-flash-next", "qwen3.8-27b-int8-w8a16"), base_env={})
    assert launch.argv == [
        "/venv/bin/vllm", "serve", "/model", "--tensor-parallel-size", "4", "--enable-expert-parallel",
        "--max-model-len", "262144", "--max-num-seqs", "8", "--max-num-batched-tokens", "16384",
        "--gpu-memory-utilization", "0.88", "--disable-custom-all-reduce",
        "--speculative-config", '{"method":"mtp","num_speculative_tokens":3}',
        "--compilation-config", '{"mode":0,"cudagraph_mode":"FULL_DECODE_ONLY"}',
        "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_xml", "--reasoning-parser", "qwen3",
        "--enable-prompt-tokens-details", "--enable-prefix-caching",
        "--host", "0.0.0.0", "--port", "30001", "--api-key", "k",
        "--served-model-name", "qwen3.8-flash-next", "qwen3.8-27b-int8-w8a16"]
    assert launch.env == {"VLLM_PLE_CPU_OFFLOAD": "1", "OMP_NUM_THREADS": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


def test_vllm_default_served_name():
    argv = build_launch(PROFILES["vllm", "a100x4"], SIDES["vllm"], model="/model", python=PY, base_env={}).argv
    assert argv[-2:] == ["--served-model-name", "qwen3.8-flash-next"]


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.5", "::", "thor.lan"])
def test_open_bind_without_key_refused(host):
    with pytest.raises(ServeRefused, match=f"refusing to bind {host} without an API key"):
        build_launch(PROFILES["sglang", "thor"], SIDES["sglang"], model="/m", draft="/d", host=host, base_env={})


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_needs_no_key(host):
    assert "--api-key" not in build_launch(PROFILES["sglang", "thor"], SIDES["sglang"], model="/m", draft="/d",
                                           host=host, base_env={}).argv


def test_open_bind_with_key_or_explicit_allow():
    a = build_launch(PROFILES["sglang", "thor"], SIDES["sglang"], model="/m", draft="/d", host="0.0.0.0",
                     api_key="s3cret", base_env={})
    assert a.argv[-4:] == ["--port", "8000", "--api-key", "s3cret"]
    assert "s3cret" not in a.shell() and "--api-key '***'" in a.shell()
    b = build_launch(PROFILES["sglang", "thor"], SIDES["sglang"], model="/m", draft="/d", host="0.0.0.0",
                     allow_unauthenticated=True, base_env={})
    assert b.argv[-4:] == ["--host", "0.0.0.0", "--port", "8000"]


def test_served_name_alias_sglang():
    a = build_launch(PROFILES["sglang", "thor"], SIDES["sglang"], model="/m", draft="/d",
                     served_names=("Qwen/Qwen3.6-27B-NVFP4",), base_env={})
    assert a.argv[-2:] == ["--served-model-name", "Qwen/Qwen3.6-27B-NVFP4"]
    with pytest.raises(ServeRefused, match="sglang serves one --served-model-name"):
        build_launch(PROFILES["sglang", "thor"], SIDES["sglang"], model="/m", draft="/d", served_names=("a", "b"),
                     base_env={})


def test_extra_args_override_profile_value_once():
    a = build_launch(PROFILES["sglang", "thor"], SIDES["sglang"], model="/m", draft="/d",
                     extra=["--", "--chunked-prefill-size", "4096", "--log-requests"], base_env={})
    assert a.argv.count("--chunked-prefill-size") == 1
    assert a.argv[-3:] == ["--chunked-prefill-size", "4096", "--log-requests"]


@pytest.mark.parametrize("extra", [["--host", "0.0.0.0"], ["--api-key=x"], ["--model-path", "/other"]])
def test_extra_args_cannot_bypass_serve_options(extra):
    with pytest.raises(ServeRefused, match="through serve's own options"):
        build_launch(PROFILES["sglang", "thor"], SIDES["sglang"], model="/m", draft="/d", extra=extra, base_env={})


def test_extra_running_requests_beyond_mamba_slots_refused():
    with pytest.raises(ServeRefused, match=r"--max-mamba-cache-size 16 admits only 4 of --max-running-requests 8.*32"):
        build_launch(PROFILES["sglang", "thor"], SIDES["sglang"], model="/m", draft="/d",
                     extra=["--max-running-requests", "8"], base_env={})
    ok = build_launch(PROFILES["sglang", "thor"], SIDES["sglang"], model="/m", draft="/d",
                      extra=["--max-running-requests=8", "--max-mamba-cache-size=32"], base_env={})
    assert ok.argv[-2:] == ["--max-running-requests=8", "--max-mamba-cache-size=32"]


def test_expandable_segments_refused_for_vllm():
    with pytest.raises(ServeRefused, match="pidfd_getfd"):
        build_launch(PROFILES["vllm", "a100x4"], SIDES["vllm"], model="/m",
                     base_env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})


def test_unknown_profile_refused():
    with pytest.raises(ServeRefused, match="unknown vllm profile 'discrete-gpu'; known: a100x4, thor"):
        get_profile("discrete-gpu", "vllm")


def test_serve_execs_with_exact_argv(tmp_path, monkeypatch):
    model = write_model(tmp_path / "model")
    calls = []
    args = _parser("sglang").parse_args(["serve", "--profile", "thor", "--model", str(model), "--served-name", "alias",
                                         "--", "--log-requests"])
    monkeypatch.setenv("KEEP_ME", "1")
    rc = args.func(args, exec_fn=lambda f, argv, env: calls.append((f, argv, env)))
    assert rc == 0 and len(calls) == 1
    f, argv, env = calls[0]
    sglang = str(Path(sys.executable).parent / "sglang")
    assert f == sglang and argv[:2] == [sglang, "serve"]
    paths = {"/m": str(model), "/m/mtp": f"{model}/mtp"}
    assert argv[2:] == [paths.get(x, x) for x in THOR_ARGS] + [
        "--host", "127.0.0.1", "--port", "8000", "--served-model-name", "alias", "--log-requests"]
    assert env["KEEP_ME"] == "1" and env["SGLANG_QSA_PREFILL_LOGITS_BUDGET_MB"] == "32"


def test_serve_dry_run_prints_and_does_not_exec(tmp_path, capsys):
    model = write_model(tmp_path / "model")
    key = tmp_path / "key"
    key.write_text("topsecret\n")
    args = _parser("sglang").parse_args(["serve", "--profile", "thor", "--model", str(model), "--host", "0.0.0.0",
                                         "--api-key-file", str(key), "--dry-run"])
    assert args.func(args, exec_fn=lambda *a: pytest.fail("exec in dry run")) == 0
    out = capsys.readouterr().out
    assert out.startswith("SGLANG_PLUGINS=ssd_stream SGLANG_QSA_PREFILL_LOGITS_BUDGET_MB=32 ")
    assert "/sglang serve --model-path " in out and "--api-key '***'" in out and "topsecret" not in out


def test_serve_unreadable_key_file(tmp_path):
    model = write_model(tmp_path / "model")
    args = _parser("sglang").parse_args(["serve", "--profile", "thor", "--model", str(model),
                                         "--api-key-file", str(tmp_path / "nope")])
    from sglang_ssd_stream.errors import EnvironmentProblem
    with pytest.raises(EnvironmentProblem, match="cannot read --api-key-file"):
        args.func(args, exec_fn=lambda *a: None)


def test_preflight_refuses_missing_model_config(tmp_path):
    args = _parser("sglang").parse_args(["serve", "--profile", "thor", "--model", str(tmp_path)])
    with pytest.raises(ServeRefused, match="model directory .* has no config.json"):
        args.func(args, exec_fn=lambda *a: pytest.fail("exec after failed preflight"))


def test_preflight_refuses_missing_draft(tmp_path):
    model = write_model(tmp_path / "model", draft=False)
    args = _parser("sglang").parse_args(["serve", "--profile", "thor", "--model", str(model)])
    with pytest.raises(ServeRefused, match=r"draft \(MTP\) directory .*/mtp' has no config.json"):
        args.func(args, exec_fn=lambda *a: pytest.fail("exec"))


def test_preflight_refuses_bad_sidecar(tmp_path):
    model = write_model(tmp_path / "model")
    (model / "ple" / "layer-3.bin").write_bytes(b"short")
    args = _parser("sglang").parse_args(["serve", "--profile", "thor", "--model", str(model)])
    with pytest.raises(ServeRefused, match=r"\[error\] sidecar: .*layer-3.bin"):
        args.func(args, exec_fn=lambda *a: pytest.fail("exec"))


def test_vllm_serve_needs_no_sidecar(tmp_path):
    model = write_model(tmp_path / "model", sidecar=False, draft=False)
    calls = []
    args = _parser("vllm").parse_args(["serve", "--profile", "a100x4", "--model", str(model)])
    args.func(args, exec_fn=lambda f, argv, env: calls.append(argv))
    assert calls[0][:3] == [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", str(model)]


def test_doctor_seam_called_and_can_refuse(tmp_path, monkeypatch, capsys):
    from sglang_ssd_stream.findings import ERROR, WARNING, Finding
    from sglang_ssd_stream.sglang import doctor

    model = write_model(tmp_path / "model")
    seen = {}

    def preflight(**kw):
        seen.update(kw)
        return [Finding(WARNING, "swap", "swap is 2 GiB; the Thor write-up runs 16 GiB", "add swap")]

    monkeypatch.setattr(doctor, "preflight", preflight)
    args = _parser("sglang").parse_args(["serve", "--profile", "thor", "--model", str(model)])
    calls = []
    assert args.func(args, exec_fn=lambda *a: calls.append(a)) == 0 and calls
    assert (seen["profile"], seen["model"], seen["draft"]) == ("thor", str(model), f"{model}/mtp")
    assert seen["env"]["SGLANG_PLUGINS"] == "ssd_stream"
    assert "--mem-fraction-static" in seen["argv"]  # the doctor sees the whole launch line
    assert "preflight: warning: swap: swap is 2 GiB" in capsys.readouterr().err

    monkeypatch.setattr(doctor, "preflight", lambda **kw: [Finding(ERROR, "swap", "swap missing", "add swap")])
    with pytest.raises(ServeRefused, match="swap missing"):
        args.func(args, exec_fn=lambda *a: pytest.fail("exec after a refusal"))
    dry = _parser("sglang").parse_args(["serve", "--profile", "thor", "--model", str(model), "--dry-run"])
    assert dry.func(dry) == 0
    out = capsys.readouterr().out
    assert "# [error] swap: swap missing\n#     fix: add swap\n" in out


def test_serve_model_from_state(tmp_path, monkeypatch):
    model = write_model(tmp_path / "snap")
    data = tmp_path / "data"
    data.mkdir()
    (data / "state.json").write_text(json.dumps({"version": 1, "snapshot": str(model)}))
    calls = []
    args = _parser("sglang").parse_args(["serve", "--profile", "thor", "--data-dir", str(data)])
    args.func(args, exec_fn=lambda f, argv, env: calls.append(argv))
    assert calls[0][calls[0].index("--model-path") + 1] == str(model)
    empty = tmp_path / "empty"
    args = _parser("sglang").parse_args(["serve", "--profile", "thor", "--data-dir", str(empty)])
    with pytest.raises(ServeRefused, match="no --model and no state.json"):
        args.func(args, exec_fn=lambda *a: None)


def test_every_sglang_profile_flag_exists_in_real_sglang_0_5_23():
    """The real launcher's --help (this venv's `sglang serve`, its LLM server) lists every flag our profiles emit."""
    env = {**os.environ, "SGLANG_SSD_STREAM_ALLOW_UNPATCHED": "1"}
    r = subprocess.run([str(Path(sys.executable).parent / "sglang"), "serve", "--model-type", "llm", "--help"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    flags = {f for p in PROFILES.values() if p.engine == "sglang" for f, _ in p.args}
    missing = sorted(f for f in flags if f"{f} " not in r.stdout and f"{f}\n" not in r.stdout)
    assert not missing


@pytest.mark.real_doctor
def test_real_doctor_refuses_this_cpu_only_host(tmp_path):
    """No stand-in: the real doctor runs before exec and refuses a host without a CUDA device."""
    model = write_model(tmp_path / "model")
    args = _parser("sglang").parse_args(["serve", "--profile", "thor", "--model", str(model)])
    with pytest.raises(ServeRefused, match="no CUDA device"):
        args.func(args, exec_fn=lambda *a: pytest.fail("must not exec"))


@pytest.mark.real_doctor
@pytest.mark.parametrize("profile", ["thor", "discrete-gpu"])
def test_real_dry_run_reports_on_a_cpu_only_host(tmp_path, capsys, profile):
    """Issue 17 item 1: the dry run prints the command and the real doctor's verdict, exit 0, here too."""
    model = write_model(tmp_path / "model")
    args = _parser("sglang").parse_args(["serve", "--profile", profile, "--model", str(model), "--dry-run"])
    assert args.func(args, exec_fn=lambda *a: pytest.fail("exec in dry run")) == 0
    out = capsys.readouterr().out.splitlines()
    assert "/sglang serve --model-path " in out[0]
    comments = out[1:]
    assert comments and all(line.startswith("# ") for line in comments)
    assert any(line.startswith("# [error] device: no CUDA device") for line in comments)
    assert any(line.startswith("# [ok] model: ") for line in comments)
    assert comments[-1].startswith("# a real serve would refuse here: ")


@pytest.mark.real_doctor
@pytest.mark.parametrize("profile", ["thor", "discrete-gpu"])
def test_real_dry_run_says_each_check_once(tmp_path, profile):
    """Issue 43 item 6: model_config and sidecar were said by serve's file checks and again by the doctor."""
    model = write_model(tmp_path / "model")
    r = subprocess.run([sys.executable, "-m", "sglang_ssd_stream", "serve", "--profile", profile, "--model",
                        str(model), "--dry-run"], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[2], env={**os.environ, "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    checks = [line.split("]", 1)[1].split(":", 1)[0].strip() for line in r.stdout.splitlines()
              if line.startswith("# [")]
    assert {"model_config", "sidecar", "device"} <= set(checks), r.stdout
    assert len(checks) == len(set(checks)), r.stdout


def test_dry_run_reports_file_problems_instead_of_refusing(tmp_path, capsys):
    """A dry run names every problem (missing draft, bad sidecar) as a finding; a real serve refuses on them."""
    model = write_model(tmp_path / "model", draft=False)
    (model / "ple" / "layer-3.bin").write_bytes(b"short")
    args = _parser("sglang").parse_args(["serve", "--profile", "thor", "--model", str(model), "--dry-run"])
    assert args.func(args, exec_fn=lambda *a: pytest.fail("exec in dry run")) == 0
    out = capsys.readouterr().out
    assert "# [error] draft: draft (MTP) directory" in out and "# [error] sidecar: " in out
    assert "# a real serve would refuse here: 2 error(s) above" in out
    args = _parser("sglang").parse_args(["serve", "--profile", "thor", "--model", str(model)])
    with pytest.raises(ServeRefused, match=r"(?s)\[error\] draft: .*\[error\] sidecar: "):
        args.func(args, exec_fn=lambda *a: pytest.fail("exec"))


def test_dry_run_reports_a_doctor_that_cannot_run(tmp_path, capsys, monkeypatch):
    """An engine that is not installed is a finding of the dry run (exit 0) and a refusal of serve (its code)."""
    from sglang_ssd_stream.errors import EnvironmentProblem
    from sglang_ssd_stream.sglang import doctor

    def broken(**kw):
        raise EnvironmentProblem("sglang is not installed in this Python")

    monkeypatch.setattr(doctor, "preflight", broken)
    model = write_model(tmp_path / "model")
    args = _parser("sglang").parse_args(["serve", "--profile", "thor", "--model", str(model), "--dry-run"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "# [error] doctor: SGLang doctor could not run: sglang is not installed" in out
    assert "#     fix: ./install.sh --engine sglang" in out
    args = _parser("sglang").parse_args(["serve", "--profile", "thor", "--model", str(model)])
    with pytest.raises(EnvironmentProblem):
        args.func(args, exec_fn=lambda *a: pytest.fail("exec"))


def test_serve_sizes_reader_threads_to_the_cgroup_quota(tmp_path, monkeypatch, capsys):
    """Write-up 004: a pool sized past a 16-CPU quota was throttled for 2,242 s; serve sizes the sidecar's
    reader pool to the quota, says why, and leaves a value the operator exported alone."""
    from sglang_ssd_stream.checks import host

    monkeypatch.setattr(host, "cpu_budget", lambda **kw: host.CpuBudget(affinity=76, quota_cpus=16.0, source="cpu.max"))
    monkeypatch.delenv("SGLANG_SSD_STREAM_READ_WORKERS", raising=False)
    model = write_model(tmp_path / "model")
    calls = []
    args = _parser("sglang").parse_args(["serve", "--profile", "thor", "--model", str(model)])
    args.func(args, exec_fn=lambda f, argv, env: calls.append(env))
    assert calls[0]["SGLANG_SSD_STREAM_READ_WORKERS"] == "12"
    assert "serve: sized SGLANG_SSD_STREAM_READ_WORKERS=12 (was 16): the cgroup quota allows 16 CPUs" in \
        capsys.readouterr().err
    dry = _parser("sglang").parse_args(["serve", "--profile", "thor", "--model", str(model), "--dry-run"])
    dry.func(dry)
    assert " SGLANG_SSD_STREAM_READ_WORKERS=12 " in capsys.readouterr().out.splitlines()[0]

    monkeypatch.setenv("SGLANG_SSD_STREAM_READ_WORKERS", "40")
    calls.clear()
    args.func(args, exec_fn=lambda f, argv, env: calls.append(env))
    assert calls[0]["SGLANG_SSD_STREAM_READ_WORKERS"] == "40" and "sized" not in capsys.readouterr().err

    monkeypatch.setattr(host, "cpu_budget", lambda **kw: host.CpuBudget(affinity=14, quota_cpus=None, source=""))
    monkeypatch.delenv("SGLANG_SSD_STREAM_READ_WORKERS")
    calls.clear()
    args.func(args, exec_fn=lambda f, argv, env: calls.append(env))
    assert "SGLANG_SSD_STREAM_READ_WORKERS" not in calls[0]  # 16 fits 14 CPUs x 2: the engine's default stays


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_sidecar_check_trusts_what_that_engines_server_trusts(tmp_path, engine):
    """A sidecar whose tables live on another disk: `serve`'s own check refuses it as the server would, naming the
    knob, and passes it when the launch's environment sets that engine's TRUSTED_ROOTS (the other engine's grants
    nothing)."""
    from sglang_ssd_stream.findings import ERROR, OK
    from sglang_ssd_stream.knobs import knob
    from sglang_ssd_stream.operate.preflight import file_findings

    model = write_model(tmp_path / "m")
    disk2 = tmp_path / "disk2"
    disk2.mkdir()
    (model / "ple").rename(disk2 / "ple")
    (model / "ple").symlink_to(disk2 / "ple")
    profile = next(p for (e, _), p in PROFILES.items() if e == engine and p.needs_sidecar)
    other = "vllm" if engine == "sglang" else "sglang"
    own, theirs = knob(engine, "TRUSTED_ROOTS").name, knob(other, "TRUSTED_ROOTS").name
    for env in ({}, {theirs: str(disk2)}):
        [found] = [f for f in file_findings(profile, str(model), str(model / "mtp"), env) if f.check == "sidecar"]
        assert found.level == ERROR and "symlink escape" in found.message and own in found.message, found
    [found] = [f for f in file_findings(profile, str(model), str(model / "mtp"), {own: str(disk2)})
               if f.check == "sidecar"]
    assert found.level == OK, found
