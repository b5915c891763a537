"""The GPU server harness's CPU side (``scripts/gpu/sglang_server_gpu.py``, issue 40): which servers a call
starts for which scenarios and with which flags (its ``--dry-run``, the real script), the thor profile's
speculative flags as the kit defines them, the write-up 000 §8 verdict, MTP acceptance, the planner's input and
the disk-read fallback. What needs the GPU (the servers themselves) runs on the GPU machine only."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_ssd_stream.operate.profiles import get_profile

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu" / "sglang_server_gpu.py"
ALL = "mtp-sidecar,trunc-patched,trunc-pristine,survey,cold-prompt"


@pytest.fixture(scope="module")
def h():
    spec = importlib.util.spec_from_file_location("sglang_server_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _dry_run(tmp_path: Path, *extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, str(SCRIPT), "serve", "--dry-run", "--out", str(tmp_path), *extra],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads((tmp_path / "results.json").read_text())


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    return _dry_run(tmp_path_factory.mktemp("eager"), "--scenarios", ALL)


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    return _dry_run(tmp_path_factory.mktemp("graph"), "--scenarios", ALL, "--graphs", "graph")


def test_one_start_per_configuration_in_the_order_needed(eager):
    r = eager
    servers = {s["name"]: s for s in r["servers"]}
    assert list(servers) == ["sidecar-eager", "mtp-sidecar-eager", "mtp-pristine-eager", "cold-off-eager",
                             "cold-on-eager"]
    # MTP off first (the same prompts), the survey on that server; the patched §8 probes on the MTP server
    assert servers["sidecar-eager"]["serves"] == ["mtp-sidecar", "survey"]
    assert servers["sidecar-eager"]["works"] == ["greedy", "survey"]  # the survey last: it may end a server
    assert servers["mtp-sidecar-eager"]["serves"] == ["mtp-sidecar", "trunc-patched"]
    assert servers["mtp-pristine-eager"]["works"] == ["greedy", "trunc"]
    for s in r["servers"]:
        assert "--disable-cuda-graph" in s["command"].split(), s["name"]
    assert r["plan"] == [{"server": s["name"], "serves": s["serves"], "works": s["works"]} for s in r["servers"]]


def test_mtp_servers_take_the_thor_profiles_speculative_flags(eager):
    r = eager
    profile = get_profile("thor", "sglang")
    servers = {s["name"]: s["command"].split() for s in r["servers"]}
    for name, argv in servers.items():
        mtp = name.startswith("mtp-")
        assert ("--speculative-algorithm" in argv) == mtp, name
        if mtp:
            for flag in ("--speculative-algorithm", "--speculative-num-steps", "--speculative-eagle-topk",
                         "--speculative-num-draft-tokens"):
                assert argv[argv.index(flag) + 1] == profile.value(flag), (name, flag)
            assert argv[argv.index("--speculative-draft-model-path") + 1] == "/tmp/sg/qwen4_exp/mtp"
            # everything but the speculative flags (and /metrics) as the MTP-off server it is compared with
            base = servers["sidecar-eager"]
            rest = [a for a in argv if a not in base and not a.startswith("--speculative")]
            assert set(rest) <= {"--enable-metrics", "30001", "30002", "/tmp/sg/qwen4_exp/mtp",
                                 *(profile.value(f) for f in profile.speculative_flags if profile.has(f))}, rest
    kept, dropped = r["speculative"]["kept"], r["speculative"]["dropped"]
    assert set(kept) | set(dropped) == {f for f in profile.speculative_flags if profile.has(f)}
    assert all(dropped.values())  # each with its reason


def test_pristine_and_row_cache_servers(graph, h):
    r = graph
    servers = {s["name"]: s for s in r["servers"]}
    pristine = servers["mtp-pristine-graph"]["env"]
    assert pristine["SGLANG_SSD_STREAM_ALLOW_UNPATCHED"] == "1"
    assert pristine["PYTHONPATH"].split(":")[0] == "/tmp/site-pristine"
    assert "SGLANG_SSD_STREAM_SIDECAR" not in pristine  # as the CPU suite's pristine servers: sglang's table
    assert "SGLANG_SSD_STREAM_ALLOW_UNPATCHED" not in servers["mtp-sidecar-graph"]["env"]
    off, on = servers["cold-off-graph"], servers["cold-on-graph"]
    assert off["env"]["SGLANG_SSD_STREAM_ROW_CACHE_MB"] == "0" and int(on["env"]["SGLANG_SSD_STREAM_ROW_CACHE_MB"]) > 0
    for s in (off, on):
        argv = s["command"].split()
        assert int(argv[argv.index("--context-length") + 1]) >= h.COLD_PROMPT + h.MAX_TOKENS >= 2048
        assert "--row-cache-mb" in s["plan_command"]
    for s in r["servers"]:
        argv = s["command"].split()
        assert "--disable-cuda-graph" not in argv and argv[argv.index("--cuda-graph-backend-prefill") + 1] == "disabled"
    assert servers["sidecar-graph"]["env"]["SGLANG_MAX_REQUEST_BODY_MB"] == "4"  # the survey's server only
    assert "SGLANG_MAX_REQUEST_BODY_MB" not in servers["mtp-sidecar-graph"]["env"]


def test_unknown_scenario_and_unknown_speculative_flag_are_refused(h, monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match="unknown scenario 'mtp'"):
        h.build_servers(["mtp"], "eager")
    monkeypatch.setattr(h, "SPEC_KEEP", h.SPEC_KEEP[:-1])  # the profile's num-draft-tokens, undecided
    with pytest.raises(RuntimeError, match="--speculative-num-draft-tokens: decide"):
        h.speculative_flags(sys.executable, {**os.environ, "PYTHONPATH": str(REPO)}, tmp_path)


def _probe(sent, max_tokens, prompt, completion, finish="length", status=200):
    body = {"usage": {"prompt_tokens": prompt, "completion_tokens": completion}, "choices": [{"finish_reason": finish}]}
    return {"status": status, "body": body, "seconds": 0.2, "sent": sent, "max_tokens": max_tokens, "alive": True}


def test_truncation_verdict_mirrors_the_cpu_suite(h):
    good = {"over-8": _probe(275, 8, 192, 8), "over-1": _probe(275, 1, 192, 1), "near-8": _probe(252, 8, 192, 8),
            "fits": _probe(220, 24, 220, 24)}
    assert h.trunc_verdict(good, False, 64)["ok"] is True
    collapsed = {**good, "over-8": _probe(275, 8, 256, 0)}  # the write-up's pristine budget: nothing left
    assert h.trunc_verdict(collapsed, False, 64)["failed"] == ["over-8"]
    unaligned = {**good, "near-8": _probe(252, 8, 200, 8)}
    assert h.trunc_verdict(unaligned, False, 64)["failed"] == ["near-8"]
    assert h.trunc_verdict({k: v for k, v in good.items() if k != "fits"}, False, 64)["ok"] is False
    hung = {**good, "over-8": {"status": None, "error": "ReadTimeout", "seconds": 30.0, "sent": 275, "max_tokens": 8}}
    v = h.trunc_verdict(hung, True, 64)
    assert "ok" not in v and v["observed"]["over-8"]["never_answered_within_bound"] is True
    assert v["observed"]["over-1"]["never_answered_within_bound"] is False


def test_mtp_acceptance_from_the_responses_and_the_log(h):
    runs = [{"output_ids": list(range(16)), "spec_verify_ct": 10, "spec_num_correct_drafts": 5},
            {"output_ids": list(range(16)), "spec_verify_ct": 15, "spec_num_correct_drafts": 0}]
    log = "Decode batch, #running-req: 1, accept len: 1.50, accept rate: 0.17\n"
    s = h.spec_stats(runs, log, "sglang:spec_accept_length 1.5\n# HELP x\nother 1\n", 3)
    assert (s["verify_passes"], s["correct_drafts"], s["drafts_proposed"]) == (25, 5, 75)
    assert s["accept_rate"] == round(5 / 75, 4) and s["accept_length"] == round(30 / 25, 4)
    assert s["log_accept_len_rate"] == [(1.5, 0.17)] and s["metrics"] == ["sglang:spec_accept_length 1.5"]


def _safetensors(path: Path, names: list[str]) -> None:
    header = json.dumps({n: {"dtype": "BF16", "shape": [1], "data_offsets": [2 * i, 2 * i + 2]}
                         for i, n in enumerate(names)}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(2 * len(names)))


def test_planner_view_counts_the_draft_layers_in_the_file(h, tmp_path):
    """The tiny checkpoint's config has no MTP layer count (the planner refuses to guess it): the view's count is
    read from the draft's safetensors header. (The plan itself runs on the GPU machine, with the carried
    transformers that accepts the tiny config.)"""
    _safetensors(tmp_path / "d.safetensors", ["mtp.layers.0.a", "mtp.layers.0.b", "mtp.layers.1.a", "mtp.fc"])
    assert h.safetensors_layers(tmp_path / "d.safetensors", "mtp.layers.") == 2
    plan = {"as_is": {"rc": 3, "stderr": "field 'mtp_num_hidden_layers' is missing"},
            "view": {"rc": 0, "plan": {"memory": {"needed_gib": 0.5, "weights_gib": 0.25, "static_gib": 39.8}}}}
    v = h.memory_vs_plan({"plan": plan, "gpu_memory": {"server_mib": 1110}})
    assert (v["server_mib"], v["plan_needed_gib"], v["plan_from"]) == (1110, 0.5, "view")
    assert "mtp_num_hidden_layers" in v["plan_refused"] and v["view_failed"] is None


def test_disk_fallback_reads_or_says_why_not(h, tmp_path):
    r = h.direct_reads(tmp_path, 0.2, size_mb=4)
    assert r["method"].endswith("(fallback: no fio)") and not (tmp_path / "direct.dat").exists()
    if "error" not in r:  # O_DIRECT refused (tmpfs): recorded as such
        for name in ("randread-4k-qd1", "seqread-1m-qd1"):
            assert r[name]["reads"] > 0 and 0 < r[name]["lat_mean_us"], r
