"""Planner arithmetic pinned to the write-ups' numbers, and every refusal."""

from __future__ import annotations

import json

import pytest

from sglang_ssd_stream.operate.capacity import (
    GIB,
    load_geometry,
    mamba_bytes_per_slot,
    mamba_slots_needed,
    mamba_slots_per_request,
    plan,
    sessions_of,
    weights_bytes,
)
from sglang_ssd_stream.operate.errors import ModelConfigError, PlanRefused

from .conftest import SIDES, add_ple_shards, write_model

CTX = 262_144


def _thor(g, **kw):
    args = dict(context_length=CTX, pool_tokens=557_056, running=4, draft_steps=3, mamba_slots=16, page_size=64,
                target_kv_dtype="fp8_e4m3", draft_kv_dtype="fp8_e4m3")
    args.update(kw)
    return plan(g, **args)


def test_geometry_of_the_writeup(writeup_config):
    g = load_geometry(writeup_config)
    assert (g.num_layers, g.full_attention_layers, g.linear_layers, g.kv_heads, g.head_dim, g.mtp_layers) == \
        (48, 12, 36, 2, 256, 1)


def test_bf16_kv_is_24_kib_per_token_and_6_gib_at_262144(writeup_config):
    p = _thor(load_geometry(writeup_config), target_kv_dtype="bfloat16", draft_kv_dtype="bfloat16", pool_tokens=CTX)
    assert p.bytes_per_token["target_kv"] == 24 * 1024
    assert p.at_context_gib["target_kv"] == 6.0
    assert p.sglang_log_gb["context"]["K"] == 3.00 and p.sglang_log_gb["context"]["V"] == 3.00  # "K size: 3.00 GB"
    assert p.at_context_gib["draft_kv"] == 0.5  # one MTP full-attention layer
    assert p.at_context_gib["qsa_index_k"] * 1024 == 192  # MiB
    assert round(p.at_context_gib["total"], 2) == 6.69
    assert p.at_context_gib["target_plus_draft"] == 6.5


def test_fp8_target_plus_draft_is_about_3_26_gib(writeup_config):
    p = _thor(load_geometry(writeup_config))
    assert p.bytes_per_token["target_kv"] == 12 * 1024 and p.bytes_per_token["draft_kv"] == 1024
    assert p.at_context_gib["target_plus_draft"] == 3.25
    logged = p.sglang_log_gb["context"]
    # sglang logs each buffer (262,144 + one 64-token page of rows) as .2f: 1.50 + 1.50 + 0.13 + 0.13 = 3.26
    assert (logged["K"], logged["V"], logged["draft_K"], logged["draft_V"]) == (1.5, 1.5, 0.13, 0.13)
    assert round(sum(logged.values()), 2) == 3.26


def test_thor_pool_holds_two_250k_sessions_or_four_shorter(writeup_config):
    p = _thor(load_geometry(writeup_config))
    assert p.sharing["full_windows"] == 2
    assert p.sharing["two_session_each"] == 278_528 >= 250_000
    assert p.sharing["per_running_request"] == 139_264
    assert sessions_of(p, 250_000) == 2
    assert sessions_of(p, 139_264) == 4
    assert sessions_of(p, 100_000) == 4  # capped by the 4 running slots, not by the pool
    assert p.pool_gib["target_kv"] + p.pool_gib["draft_kv"] == pytest.approx(6.90625)


def test_mamba_slots_four_requests_need_sixteen(writeup_config):
    assert mamba_slots_needed(4, 4) == 16
    # sglang 0.5.23's ratio per radix-cache setup (KVCacheConfigurator._calculate_mamba_ratio)
    assert mamba_slots_per_request(strategy="extra_buffer_lazy") == 4  # the Thor profile: 000 §9's 16 for 4
    assert mamba_slots_per_request(strategy="extra_buffer") == 5
    assert mamba_slots_per_request(strategy="extra_buffer", overlap=False) == 4
    assert mamba_slots_per_request(strategy="no_buffer") == 3
    assert mamba_slots_per_request(radix_cache=False, strategy="extra_buffer_lazy") == 1  # measured: e2e
    assert mamba_slots_per_request(strategy="auto", overlap=False, page_size=1) == 3
    assert mamba_slots_per_request(strategy="auto", page_size=64) == 5
    with pytest.raises(PlanRefused, match="unknown --mamba-radix-cache-strategy 'bogus'"):
        mamba_slots_per_request(strategy="bogus")
    p = _thor(load_geometry(writeup_config))
    assert p.mamba["needed"] == 16 and p.mamba["admits_requests"] == 4


def test_five_mamba_slots_refused_for_four_requests(writeup_config):
    with pytest.raises(PlanRefused, match=r"5 Mamba slots admit only 1 of 4 running requests.*16 slots"):
        _thor(load_geometry(writeup_config), mamba_slots=5)


def test_mamba_state_bytes_per_slot(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
                               "num_key_value_heads": 1, "head_dim": 8, "mtp_num_hidden_layers": 0,
                               "linear_num_value_heads": 2, "linear_num_key_heads": 1, "linear_key_head_dim": 4,
                               "linear_value_head_dim": 3, "linear_conv_kernel_dim": 4}))
    g = load_geometry(cfg)
    # one GDN layer: SSM 2x4x3 fp32 = 96 B; conv (2x1x4 + 2x3) = 14 channels x 3 taps x 2 B = 84 B
    assert mamba_bytes_per_slot(g) == 96 + 84


def test_vllm_a100_pool_holds_11_28_full_contexts(writeup_config):
    # write-up 002: a 2,955,692-token pool = 11.28 full 262,144 contexts, above --max-num-seqs 8
    p = plan(load_geometry(writeup_config), context_length=CTX, pool_tokens=2_955_692, running=8, draft_steps=3,
             mamba_slots=None, tensor_parallel=4)
    assert round(p.sharing["full_windows_exact"], 2) == 11.28
    assert p.sharing["full_windows"] == 11 > 8
    assert p.bytes_per_token["target_kv"] == 12 * 1024  # 2 KV heads over TP4: one head per rank (BF16)


def test_memory_fit_thor(writeup_config):
    # Thor: 122.86 GiB visible (write-up 003), 0.95 static, ~86.05 GB of NVFP4 + MTP weights (000 §5)
    p = _thor(load_geometry(writeup_config), device_memory_gib=122.86, mem_fraction=0.95, weights_gib=86.05)
    assert p.memory["needed_gib"] < p.memory["left_after_weights_gib"]
    assert p.memory["max_pool_tokens"] % 64 == 0 and p.memory["max_pool_tokens"] > 557_056


def test_pool_from_memory_when_not_given(writeup_config):
    p = _thor(load_geometry(writeup_config), pool_tokens=None, device_memory_gib=100, mem_fraction=0.9,
              weights_gib=80)
    assert p.pool_tokens == p.memory["max_pool_tokens"]
    assert p.pool_tokens % 64 == 0


def test_refuses_pool_that_does_not_fit(writeup_config):
    with pytest.raises(PlanRefused, match=r"557,056-token pool needs .* GiB .* only .* GiB is left after 112.00 GiB"):
        _thor(load_geometry(writeup_config), device_memory_gib=122.86, mem_fraction=0.95, weights_gib=112.0)


def test_refuses_when_weights_leave_nothing(writeup_config):
    with pytest.raises(PlanRefused, match="not enough for 16 Mamba slots"):
        _thor(load_geometry(writeup_config), device_memory_gib=96, mem_fraction=0.9, weights_gib=90)


def test_refuses_partial_memory_arguments(writeup_config):
    with pytest.raises(PlanRefused, match="needs all of device memory"):
        _thor(load_geometry(writeup_config), device_memory_gib=96)


def test_refuses_bad_fraction(writeup_config):
    with pytest.raises(PlanRefused, match=r"mem fraction must be in \(0, 1\]"):
        _thor(load_geometry(writeup_config), device_memory_gib=96, mem_fraction=1.5, weights_gib=1)


def test_refuses_context_larger_than_pool(writeup_config):
    with pytest.raises(PlanRefused, match="context length 262,144 exceeds the 131,072-token pool"):
        _thor(load_geometry(writeup_config), pool_tokens=131_072)


def test_refuses_unaligned_pool(writeup_config):
    with pytest.raises(PlanRefused, match="not a multiple of the 64-token KV page; use 557,056"):
        _thor(load_geometry(writeup_config), pool_tokens=557_100)


def test_refuses_no_pool(writeup_config):
    with pytest.raises(PlanRefused, match="no pool size"):
        _thor(load_geometry(writeup_config), pool_tokens=None)


@pytest.mark.parametrize("kw,msg", [({"running": 0}, "running requests must be at least 1"),
                                    ({"draft_steps": -1}, "draft steps must be >= 0"),
                                    ({"target_kv_dtype": "int3"}, "unknown KV dtype 'int3'"),
                                    ({"tensor_parallel": 0}, "tensor parallel size must be at least 1")])
def test_refuses_bad_inputs(writeup_config, kw, msg):
    with pytest.raises(PlanRefused, match=msg):
        _thor(load_geometry(writeup_config), **kw)


def test_config_missing_field_is_refused_not_guessed(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 48, "full_attention_interval": 4, "head_dim": 256}))
    with pytest.raises(ModelConfigError, match="'num_key_value_heads' is missing; the planner will not guess"):
        load_geometry(cfg)


def test_config_layer_types_length_mismatch(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 3, "layer_types": ["full_attention"]}))
    with pytest.raises(ModelConfigError, match="layer_types has 1 entries for 3 layers"):
        load_geometry(cfg)


def test_config_missing_or_not_json(tmp_path):
    with pytest.raises(ModelConfigError, match="no such file"):
        load_geometry(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ModelConfigError, match="not JSON"):
        load_geometry(tmp_path)


def test_config_impossible_value(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 4, "full_attention_interval": 4, "num_key_value_heads": 0,
                               "head_dim": 8, "mtp_num_hidden_layers": 0, "linear_num_value_heads": 1,
                               "linear_num_key_heads": 1, "linear_key_head_dim": 1, "linear_value_head_dim": 1,
                               "linear_conv_kernel_dim": 4}))
    with pytest.raises(ModelConfigError, match="kv_heads=0 is impossible"):
        load_geometry(cfg)


def test_weights_from_index(tmp_path):
    m = write_model(tmp_path / "m", shards={"a.safetensors": 1 << 20, "b.safetensors": 3 << 20})
    assert weights_bytes(m) == 4 << 20
    (m / "b.safetensors").unlink()
    with pytest.raises(ModelConfigError, match="shard b.safetensors listed in the index is missing"):
        weights_bytes(m)
    with pytest.raises(ModelConfigError, match="no model.safetensors.index.json; pass --weights-gib"):
        weights_bytes(tmp_path)


def test_gib_constant():
    assert GIB == 1 << 30


def test_plan_command_uses_profile_values(tmp_path, capsys):
    import argparse

    from sglang_ssd_stream.operate import add_operate_commands

    m = write_model(tmp_path / "m")
    p = argparse.ArgumentParser()
    add_operate_commands(p.add_subparsers(dest="command", required=True), SIDES["sglang"])
    args = p.parse_args(["plan", "--profile", "thor", "--model", str(m), "--json", "--sessions", "250000"])
    assert args.func(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["context_length"], doc["pool_tokens"], doc["running"], doc["mamba_slots"], doc["page_size"]) == \
        (262_144, 557_056, 4, 16, 64)
    assert doc["at_context_gib"]["target_plus_draft"] == 3.25 and doc["sessions"] == {"250000": 2}
    args = p.parse_args(["plan", "--profile", "thor", "--model", str(m), "--max-mamba-cache-size", "5"])
    with pytest.raises(PlanRefused, match="admit only 1 of 4"):
        args.func(args)
    # memory fit with weights read from the index (4,000 B + 500 B of draft): fits, text output
    args = p.parse_args(["plan", "--profile", "thor", "--model", str(m), "--draft", str(m / "mtp"),
                         "--device-memory-gib", "16"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert ("Mamba: 16 slots (16 needed for 4 requests x 4 each; admits 4 at once)" in out
            and "memory: 15.20 GiB static" in out)


def test_plan_vllm_profile(tmp_path, capsys):
    import argparse

    from sglang_ssd_stream.operate import add_operate_commands

    m = write_model(tmp_path / "m")
    p = argparse.ArgumentParser()
    add_operate_commands(p.add_subparsers(dest="command", required=True), SIDES["vllm"])
    args = p.parse_args(["plan", "--profile", "a100x4", "--model", str(m), "--max-total-tokens", "2955692", "--json"])
    assert args.func(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["running"], doc["draft_steps"], doc["target_kv_dtype"]) == (8, 3, "bfloat16")
    assert round(doc["sharing"]["full_windows_exact"], 2) == 11.28
    assert doc["ple_row_cache"] is None  # the a100x4 table is pinned in RAM: no row cache


def test_plan_counts_vllms_row_cache_only_for_a_streamed_backend(tmp_path, capsys, monkeypatch):
    import argparse

    from sglang_ssd_stream.operate import add_operate_commands

    m = write_model(tmp_path / "m")
    p = argparse.ArgumentParser()
    add_operate_commands(p.add_subparsers(dest="command", required=True), SIDES["vllm"])
    monkeypatch.delenv("VLLM_PLE_OFFLOAD_BACKEND", raising=False)
    monkeypatch.delenv("VLLM_PLE_ROW_CACHE_MB", raising=False)
    flags = ["--max-total-tokens", "2955692", "--json"]
    args = p.parse_args(["plan", "--profile", "thor", "--model", str(m), *flags])  # thor streams with mmap
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["ple_row_cache"] == {
        "variable": "VLLM_PLE_ROW_CACHE_MB", "mib": 1024, "gib": 1.0, "source": "the default"}
    args = p.parse_args(["plan", "--profile", "a100x4", "--model", str(m), *flags])
    assert args.func(args) == 0 and json.loads(capsys.readouterr().out)["ple_row_cache"] is None
    monkeypatch.setenv("VLLM_PLE_OFFLOAD_BACKEND", "pread")  # a100x4 sets no backend: the inherited one acts
    args = p.parse_args(["plan", "--profile", "a100x4", "--model", str(m), *flags])
    assert args.func(args) == 0 and json.loads(capsys.readouterr().out)["ple_row_cache"]["mib"] == 1024


def test_plan_counts_the_mtp_draft_weights_when_the_profile_drafts(tmp_path, capsys):
    """Issue 17 item 3: the README's `plan --profile thor --model M --device-memory-gib 122.86` left the
    MTP draft (8.08 GB in write-up 000) out of the weights unless --draft was given."""
    import argparse

    from sglang_ssd_stream.operate import add_operate_commands

    m = write_model(tmp_path / "m", shards={"model-00001.safetensors": 3 << 20})  # mtp/ holds 500 B
    (m / "mtp" / "mtp.safetensors").write_bytes(b"\0" * (1 << 20))
    p = argparse.ArgumentParser()
    add_operate_commands(p.add_subparsers(dest="command", required=True), SIDES["sglang"])

    def headroom(*extra):
        args = p.parse_args(["plan", "--profile", "thor", "--model", str(m), "--device-memory-gib", "16", *extra])
        assert args.func(args) == 0
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if x.startswith("memory: "))
        return out.splitlines()[0], float(line.split("headroom ")[1].split(" GiB")[0]), line

    first, with_draft, line = headroom()
    assert first == f"weights: model 0.00 GiB + MTP draft 0.00 GiB ({m}/mtp) = 0.00 GiB"
    assert "- 0.00 GiB weights" in line
    args = p.parse_args(["plan", "--profile", "thor", "--model", str(m), "--device-memory-gib", "16", "--json"])
    args.func(args)
    assert json.loads(capsys.readouterr().out)["memory"]["weights_gib"] * GIB == (3 << 20) + (1 << 20)
    # no drafting: the draft is not loaded, so it does not count
    first, without, _ = headroom("--speculative-num-steps", "0")  # the Mamba slots stay 16: drafting is not in them
    assert first == "weights: model 0.00 GiB (no speculative decoding)"
    # an explicit --draft elsewhere counts that directory
    other = tmp_path / "draft"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"\0" * (2 << 20))
    first, _, _ = headroom("--draft", str(other))
    assert first.endswith(f"({other}) = 0.00 GiB")
    args = p.parse_args(["plan", "--profile", "thor", "--model", str(m), "--device-memory-gib", "16", "--json",
                         "--draft", str(other)])
    args.func(args)
    assert json.loads(capsys.readouterr().out)["memory"]["weights_gib"] * GIB == (3 << 20) + (2 << 20)


def test_plan_without_a_draft_directory_is_refused_not_undercounted(tmp_path):
    import argparse

    from sglang_ssd_stream.operate import add_operate_commands

    m = write_model(tmp_path / "m", draft=False)
    p = argparse.ArgumentParser()
    add_operate_commands(p.add_subparsers(dest="command", required=True), SIDES["sglang"])
    args = p.parse_args(["plan", "--profile", "thor", "--model", str(m), "--device-memory-gib", "16"])
    with pytest.raises(PlanRefused, match=r"drafts 3 tokens with the MTP model.*/mtp does not exist; pass --draft"):
        args.func(args)
    args = p.parse_args(["plan", "--profile", "thor", "--model", str(m), "--device-memory-gib", "16",
                         "--weights-gib", "1"])
    assert args.func(args) == 0


def test_plan_states_the_ple_row_cache_budget(tmp_path, capsys, monkeypatch):
    """Issue 19: the plan counts the row cache a launch gets (the exported value, which a launch keeps; else
    the profile's; else the default), and refuses a value the plugin refuses."""
    import argparse

    from sglang_ssd_stream.operate import add_operate_commands

    m = write_model(tmp_path / "m")
    p = argparse.ArgumentParser()
    add_operate_commands(p.add_subparsers(dest="command", required=True), SIDES["sglang"])
    monkeypatch.setenv("SGLANG_SSD_STREAM_ROW_CACHE_MB", "77")  # the exported value wins, as in the launch
    for profile, mib, source in (("thor", 77, "exported"), ("discrete-gpu", 77, "exported")):
        args = p.parse_args(["plan", "--profile", profile, "--model", str(m), "--json"])
        assert args.func(args) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["ple_row_cache"] == {"variable": "SGLANG_SSD_STREAM_ROW_CACHE_MB", "mib": mib, "gib": mib / 1024,
                                        "source": source}
    args = p.parse_args(["plan", "--profile", "thor", "--model", str(m), "--row-cache-mb", "0"])
    assert args.func(args) == 0
    assert ("PLE row cache: off (SGLANG_SSD_STREAM_ROW_CACHE_MB=0, this plan's --row-cache-mb)"
            in capsys.readouterr().out)
    monkeypatch.delenv("SGLANG_SSD_STREAM_ROW_CACHE_MB")
    args = p.parse_args(["plan", "--profile", "thor", "--model", str(m)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "PLE row cache: 1,024 MiB of registered host memory for all PLE layers " \
           "(SGLANG_SSD_STREAM_ROW_CACHE_MB=1024, the profile's)" in out
    args = p.parse_args(["plan", "--profile", "thor", "--model", str(m), "--row-cache-mb", "-3"])
    with pytest.raises(PlanRefused, match=r"SGLANG_SSD_STREAM_ROW_CACHE_MB=-3 is out of range"):
        args.func(args)


def test_row_cache_budget_sources():
    from sglang_ssd_stream.operate.capacity import row_cache_budget

    K = "SGLANG_SSD_STREAM_ROW_CACHE_MB"
    knob = (K, 1024)
    assert row_cache_budget(None, {}, {}) is None  # an engine without a row cache
    assert row_cache_budget(knob, {}, {})["mib"] == 1024 and row_cache_budget(knob, {}, {})["source"] == "the default"
    assert row_cache_budget(knob, {}, {K: "12"}) == {"variable": K, "mib": 12, "gib": 12 / 1024,
                                                "source": "exported"}
    assert row_cache_budget(knob, {K: "5"}, {K: "12"})["mib"] == 12  # exported wins, as in a launch
    assert row_cache_budget(knob, {K: "5"}, {})["mib"] == 5
    assert row_cache_budget(knob, {K: "5"}, {}, override_mb=0)["mib"] == 0
    with pytest.raises(PlanRefused, match=f"{K}='x' is not an integer number of MiB"):
        row_cache_budget(knob, {}, {K: "x"})


def _gdn_plus(tmp_path, attention_type, **extra):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 4, "num_key_value_heads": 1, "head_dim": 8,
                               "layer_types": ["linear_attention"] * 3 + [attention_type],
                               "linear_num_value_heads": 1, "linear_num_key_heads": 1, "linear_key_head_dim": 1,
                               "linear_value_head_dim": 1, "linear_conv_kernel_dim": 4, **extra}))
    return cfg


@pytest.mark.parametrize("kind", ["full_attention", "qwen_sparse_attention", "indexed_attention"])
def test_every_layer_type_sglang_counts_as_attention_holds_kv(tmp_path, kind):
    # sglang 0.5.23 (configs/qwen4_exp.py layers_block_type) gives each of these a KV cache; a QSA layer named
    # "indexed_attention" was counted as neither, so the plan said 0 bytes of KV per token
    g = load_geometry(_gdn_plus(tmp_path, kind, mtp_num_hidden_layers=1))
    assert (g.full_attention_layers, g.linear_layers) == (1, 3)
    p = plan(g, context_length=64, pool_tokens=128, running=1, draft_steps=0, mamba_slots=None, page_size=64)
    assert p.bytes_per_token["target_kv"] == 1 * 1 * 8 * 2 * 2


def test_an_unknown_layer_type_is_refused_by_name(tmp_path):
    with pytest.raises(ModelConfigError, match="layer type\\(s\\) 'sliding_attention' unknown to the planner"):
        load_geometry(_gdn_plus(tmp_path, "sliding_attention", mtp_num_hidden_layers=1))


def test_without_a_draft_layer_count_mtp_off_is_planned_and_a_draft_refused(tmp_path):
    g = load_geometry(_gdn_plus(tmp_path, "indexed_attention"))  # neither mtp field
    assert g.mtp_layers is None
    p = plan(g, context_length=64, pool_tokens=128, running=1, draft_steps=0, mamba_slots=None, page_size=64)
    assert p.bytes_per_token["draft_kv"] == 0
    with pytest.raises(PlanRefused, match="neither mtp_num_hidden_layers nor num_nextn_predict_layers"):
        plan(g, context_length=64, pool_tokens=128, running=1, draft_steps=3, mamba_slots=None, page_size=64)


def test_no_attention_layer_is_refused_not_divided_by_zero(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 1, "layer_types": ["linear_attention"], "num_key_value_heads": 1,
                               "head_dim": 8, "linear_num_value_heads": 1, "linear_num_key_heads": 1,
                               "linear_key_head_dim": 1, "linear_value_head_dim": 1, "linear_conv_kernel_dim": 4}))
    with pytest.raises(PlanRefused, match="no attention layer, so no KV per token"):
        plan(load_geometry(cfg), context_length=64, pool_tokens=None, running=1, draft_steps=0, mamba_slots=None,
             page_size=64, device_memory_gib=8, mem_fraction=0.5, weights_gib=1)


def test_plan_leaves_an_in_place_ple_table_out_of_the_weights(tmp_path, capsys):
    """The checkpoint itself as the model, its in-place manifest beside its index: the PLE shard tensors the
    index maps are streamed from disk, not loaded, so the plan's resident weights leave their bytes out (and say
    so); the same checkpoint without the manifest counts every shard."""
    import argparse

    from sglang_ssd_stream.operate import add_operate_commands
    from sglang_ssd_stream.operate.plan_cli import _plan_weights
    from sglang_ssd_stream.sidecar.in_place import build_in_place

    m = write_model(tmp_path / "m", sidecar=False)
    table = add_ple_shards(m)
    files = sum(f.stat().st_size for f in m.glob("*.safetensors"))
    p = argparse.ArgumentParser()
    add_operate_commands(p.add_subparsers(dest="command", required=True), SIDES["sglang"])
    argv = ["plan", "--profile", "thor", "--model", str(m), "--draft", str(m / "mtp"), "--device-memory-gib", "16"]

    def weights() -> tuple[float, str]:
        args = p.parse_args(argv)
        assert args.func(args) == 0
        line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("weights:"))
        return _plan_weights(args, 3)[0], line  # the GiB the fit above used, unrounded

    before = weights()
    build_in_place(m, progress=False)
    after = weights()
    draft = (m / "mtp" / "mtp.safetensors").stat().st_size
    assert before[0] * GIB == files + draft and "in place" not in before[1]
    assert after[0] * GIB == files - table + draft, (after, files, table)
    assert after[1].endswith(f"(PLE tables in place, {table / GIB:.2f} GiB streamed from its shards, not counted)")
