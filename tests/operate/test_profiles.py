"""The profile table: the vLLM Thor profile of write-up 003 and the `--mtp auto|on|off` knob."""

from __future__ import annotations

import argparse
import json

import pytest

from sglang_ssd_stream.operate import add_operate_commands
from sglang_ssd_stream.operate.launch import build_launch
from sglang_ssd_stream.operate.profiles import PROFILES, PROFILES_BY_ENGINE, get_profile, with_mtp
from sglang_ssd_stream.operate.service import render_compose

from .conftest import SIDES, write_model

PY = "/venv/bin/python"
VLLM_THOR = PROFILES["vllm", "thor"]


def _parser(engine):
    p = argparse.ArgumentParser()
    add_operate_commands(p.add_subparsers(dest="command", required=True), SIDES[engine])
    return p


def test_vllm_thor_exact_argv_and_env():
    """Write-up 003 §1 and §5: FP8 E4M3 KV, FA4, --long-prefill-token-threshold 1024, memory 0.70, 8 sequences,
    4,096 batched tokens, MTP=2, PLE by mmap with the 24 x 2,048 fetch pool."""
    launch = build_launch(VLLM_THOR, SIDES["vllm"], model="/m", python=PY, base_env={})
    assert launch.argv == [
        "/venv/bin/vllm", "serve", "/m", "--max-model-len", "262144", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "4096", "--gpu-memory-utilization", "0.70", "--kv-cache-dtype", "fp8_e4m3",
        "--attention-config.flash_attn_version", "4", "--long-prefill-token-threshold", "1024",
        "--enable-prefix-caching", "--speculative-config", '{"method":"mtp","num_speculative_tokens":2}',
        "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_xml", "--reasoning-parser", "qwen3",
        "--host", "127.0.0.1", "--port", "8001", "--served-model-name", "qwen3.8-flash-next"]
    assert launch.env == {"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": "mmap", "VLLM_PLE_SIDECAR": "/m",
                          "VLLM_PLE_FETCH_WORKERS": "24", "VLLM_PLE_ROWS_PER_TASK": "2048",
                          "VLLM_PLE_PREFETCH_DRAFTS": "1"}


def test_the_thor_profiles_of_both_engines_are_distinct():
    assert set(PROFILES_BY_ENGINE["sglang"]) == {"thor", "discrete-gpu"}
    assert set(PROFILES_BY_ENGINE["vllm"]) == {"a100x4", "thor"}
    assert get_profile("thor", "sglang").engine == "sglang" and get_profile("thor", "vllm").engine == "vllm"


@pytest.mark.parametrize("context, streams, drafts, words", [
    (16384, 8, False, "68.3 tok/s without MTP vs 36.0"),
    (16384, 4, False, "+90 %"),
    (8192, 2, False, ">= 8,192"),
    (200000, 1, False, "one stream at long context was not measured"),
    (500, 4, True, "c4 json 141.3 vs 90.5"),
    (8191, 8, True, "< 8,192"),
])
def test_mtp_auto_by_expected_context(context, streams, drafts, words):
    profile, why = with_mtp(VLLM_THOR, "auto", expected_context=context, concurrency=streams)
    assert profile.drafts is drafts and words in why
    assert why.startswith("MTP on:" if drafts else "MTP off:")
    assert f"at {streams} stream(s)" in why


def test_mtp_off_drops_the_whole_speculative_config():
    """vLLM refuses num_speculative_tokens=0 (pydantic > 0), so off means no --speculative-config at all."""
    off, why = with_mtp(VLLM_THOR, "off")
    argv = build_launch(off, SIDES["vllm"], model="/m", python=PY, base_env={}).argv
    assert not any(a.startswith("--speculative") or "num_speculative_tokens" in a for a in argv)
    assert len(argv) == len(build_launch(VLLM_THOR, SIDES["vllm"], model="/m", python=PY, base_env={}).argv) - 2
    assert with_mtp(VLLM_THOR, "on")[0] is VLLM_THOR


def test_mtp_auto_without_an_expected_context_keeps_the_default_and_says_how_to_choose():
    profile, why = with_mtp(VLLM_THOR, "auto")
    assert profile is VLLM_THOR and "--expected-context" in why and "8,192" in why


def test_mtp_on_sglang_profiles():
    """Issue 28 item 4: `--mtp auto` where no rule was measured is refused (it never decided anything); the
    default keeps the profile's drafting and says that no rule exists."""
    from sglang_ssd_stream.operate.errors import ServeRefused

    thor = PROFILES["sglang", "thor"]
    with pytest.raises(ServeRefused, match=r"--mtp auto: profile thor \(sglang\) has no measured on/off rule for "
                                           r"MTP \(measured: vllm thor \(write-up 003\)\); choose --mtp on"):
        with_mtp(thor, "auto", expected_context=100_000)
    profile, why = with_mtp(thor)
    assert profile is thor and "no on/off rule was measured" in why
    assert with_mtp(VLLM_THOR)[1] == with_mtp(VLLM_THOR, "auto")[1]  # a profile with a rule: the default is auto
    off, _ = with_mtp(thor, "off")
    argv = build_launch(off, SIDES["sglang"], model="/m", python=PY, base_env={}).argv
    assert not [a for a in argv if "speculative" in a or "replayssm" in a] and not off.needs_draft
    no_draft = with_mtp(off, "on")
    assert no_draft[1] == "MTP: profile thor does not draft"


def test_serve_and_plan_take_the_knob(tmp_path, capsys):
    model = write_model(tmp_path / "m")
    calls = []
    args = _parser("vllm").parse_args(["serve", "--profile", "thor", "--model", str(model),
                                       "--expected-context", "32768"])
    assert args.func(args, exec_fn=lambda f, argv, env: calls.append(argv)) == 0
    assert "--speculative-config" not in calls[0]
    assert "vllm-ple-offload: MTP off: expected context 32,768 tokens at 8 stream(s)" in capsys.readouterr().err
    plan = _parser("vllm").parse_args(["plan", "--profile", "thor", "--model", str(model), "--json",
                                       "--max-total-tokens", "833617"])
    plan.func(plan)
    on = json.loads(capsys.readouterr().out)
    plan = _parser("vllm").parse_args(["plan", "--profile", "thor", "--model", str(model), "--json",
                                       "--max-total-tokens", "833617", "--mtp", "off"])
    plan.func(plan)
    off = json.loads(capsys.readouterr().out)
    assert (on["draft_steps"], off["draft_steps"]) == (2, 0)
    assert off["bytes_per_token"]["draft_kv"] == 0 < on["bytes_per_token"]["draft_kv"]
    assert (on["target_kv_dtype"], on["running"]) == ("fp8_e4m3", 8)


def test_service_writes_the_decision_down(capsys):
    args = _parser("sglang").parse_args(["service", "--profile", "thor", "--model", "/m", "--user", "u",
                                         "--home", "/h", "--cli", "/c", "--mtp", "off"])
    args.func(args)
    assert "serve --profile thor --model /m --host 127.0.0.1 --mtp off\n" in capsys.readouterr().out


def test_compose_for_the_vllm_thor_profile():
    out = render_compose(with_mtp(VLLM_THOR, "off")[0], SIDES["vllm"], service="s", image="i", model_dir="/srv/m",
                         cache_dir="/c", port=None, publish="127.0.0.1", require_api_key=False,
                         allow_unauthenticated=False, served_names=())
    assert '              device_ids: ["0"]' in out  # one GPU: no tensor parallel
    assert '      VLLM_PLE_SIDECAR: "/model"' in out and '      VLLM_PLE_FETCH_WORKERS: "24"' in out
    assert "speculative" not in out and '      - "127.0.0.1:8001:8001"' in out


def test_every_profile_has_watch_limits_with_a_reason():
    for p in PROFILES.values():
        assert p.watch is not None and p.watch.why
        assert p.watch.mem_available_incident_gib < p.watch.mem_available_warn_gib
