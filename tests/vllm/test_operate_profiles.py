"""Every vLLM launch profile (MTP on and off) parses with the real vLLM 0.33.0 `vllm serve` argument parser."""

from __future__ import annotations

import json
import subprocess

from sglang_ssd_stream.operate.launch import build_launch
from sglang_ssd_stream.operate.profiles import PROFILES_BY_ENGINE, with_mtp
from vllm_ple_offload.side import SIDE

PARSE = r"""
import json, sys
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = {}
for name, argv in json.loads(sys.argv[1]).items():
    a = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)  # exits 2 on an unknown flag
    out[name] = {"model": a.model_tag, "kv": a.kv_cache_dtype, "spec": a.speculative_config,
                 "fa": a.attention_config.flash_attn_version if a.attention_config else None,
                 "lpt": a.long_prefill_token_threshold, "seqs": a.max_num_seqs}
print(json.dumps(out))
"""


def test_vllm_profiles_parse_with_the_real_parser(vllm):
    argvs = {}
    for name, profile in PROFILES_BY_ENGINE["vllm"].items():
        for mode in ("on", "off"):
            p, _ = with_mtp(profile, mode)
            argv = build_launch(p, SIDE, model="/model", python="/venv/bin/python", base_env={}).argv
            assert argv[1] == "serve"
            argvs[f"{name}/{mode}"] = argv[2:]
    r = subprocess.run([vllm.python, "-c", PARSE, json.dumps(argvs)], capture_output=True, text=True,
                       env=vllm.env(), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["thor/on"] == {"model": "/model", "kv": "fp8_e4m3", "fa": 4, "lpt": 1024, "seqs": 8,
                              "spec": {"method": "mtp", "num_speculative_tokens": 2}}
    assert got["thor/off"]["spec"] is None and got["a100x4/off"]["spec"] is None
    assert got["a100x4/on"]["spec"] == {"method": "mtp", "num_speculative_tokens": 3}
