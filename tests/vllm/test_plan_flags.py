"""``vllm-ple-offload plan`` speaks vLLM's flag names and says how to find ``--device-memory-gib``
(issue 16 item 7). Pure Python: the plan needs no engine."""

from __future__ import annotations

import json

import pytest

from tests.operate.conftest import WRITEUP_TEXT_CONFIG
from vllm_ple_offload.cli import build_parser, main

VLLM_FLAGS = ["--max-model-len", "--max-num-seqs", "--num-speculative-tokens", "--block-size",
              "--gpu-memory-utilization", "--pool-tokens", "--mamba-slots", "--device-memory-gib"]
SGLANG_ONLY = ["--context-length", "--max-total-tokens", "--max-running-requests", "--speculative-num-steps",
               "--page-size", "--mem-fraction", "--max-mamba-cache-size"]


@pytest.fixture
def config(tmp_path):
    p = tmp_path / "config.json"
    # a config transformers' Qwen4ExpConfig accepts: plan loads it with the engine's own class first
    p.write_text(json.dumps({"model_type": "qwen4_exp", "text_config": WRITEUP_TEXT_CONFIG}))
    return p


def test_plan_help_speaks_vllm(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--help"])
    text = capsys.readouterr().out
    assert all(f in text for f in VLLM_FLAGS), text
    assert not [f for f in SGLANG_ONLY if f"{f} " in text or f"{f}\n" in text], text
    assert "torch.cuda.mem_get_info()[1] / 2**30" in " ".join(text.split())  # how to find the device memory


def test_sglang_plan_keeps_its_names():
    import argparse

    from sglang_ssd_stream.cli import Parser
    from sglang_ssd_stream.operate import add_operate_commands
    from sglang_ssd_stream.operate.side import EngineSide, python_module

    side = EngineSide(name="sglang", display="SGLang", tool="t", launcher=python_module("m"), preflight=lambda **k: [],
                      service="systemd")
    sub = Parser(prog="t").add_subparsers(dest="command", parser_class=Parser)
    plan = add_operate_commands(sub, side)["plan"]
    opts = {s for a in plan._actions for s in a.option_strings}
    assert set(SGLANG_ONLY) <= opts and not {"--max-model-len", "--max-num-seqs"} & opts
    del argparse


def test_vllm_flags_set_the_plan(config, capsys):
    code = main(["plan", "--profile", "a100x4", "--model", str(config), "--max-model-len", "131072",
                 "--max-num-seqs", "4", "--gpu-memory-utilization", "0.9", "--block-size", "16",
                 "--device-memory-gib", "79", "--weights-gib", "20", "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["context_length"], doc["running"], doc["page_size"]) == (131072, 4, 16)
    assert doc["memory"]["static_gib"] == pytest.approx(79 * 0.9)


def test_no_pool_size_says_how_to_find_the_device_memory(config, capsys):
    code = main(["plan", "--profile", "a100x4", "--model", str(config)])
    err = capsys.readouterr().err
    assert code == 2
    assert "no pool size: pass --pool-tokens, or --device-memory-gib" in err
    assert "torch.cuda.mem_get_info()[1] / 2**30" in err and "nvidia-smi --query-gpu=memory.total" in err
    assert "--max-total-tokens" not in err
