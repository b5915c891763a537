"""Proof 3: the PLE sidecar inside the real model forward of the tiny qwen4_exp.

The same greedy requests (token ids in, 16 tokens out, with logprobs) against sglang's own offload path
(the table in host RAM, filled by its ``load_weights``) and against our sidecar, read with each reader:
token ids and logprobs must be identical, and all four hooks must say in the scheduler's log that they
ran. A sidecar with other rows must change the logprobs (the rows really reach the output), and a
truncated or tampered sidecar must stop the server at load with a message naming the file.
"""

from __future__ import annotations

import re

import pytest

from .conftest import MAX_TOKENS, PLE_PROMPTS

SCHEDULER = "sglang::scheduler"
HOOKS = ("allocate", "load_weights", "gather", "consume")


def _greedy(sc):
    runs = sc.results["greedy"]
    assert len(runs) == len(PLE_PROMPTS)
    for run, n in zip(runs, PLE_PROMPTS):
        assert run["prompt_tokens"] == n and len(run["output_ids"]) == MAX_TOKENS
        assert run["logprob_ids"] == run["output_ids"]
        assert run["finish_reason"]["type"] == "length"
    return runs


def test_ram_table_is_sglangs_own_offload_path(qwen4_ram):
    """The reference: sglang allocated the host table (pinned, here ordinary memory) and gathered from it;
    our hooks were installed but, with no sidecar, inert."""
    sc = qwen4_ram
    _greedy(sc)
    assert sc.pid_lines(r"ran pinned PLE table allocation", SCHEDULER)
    assert sc.pid_lines(r"ran torch\.cuda\.Stream", SCHEDULER)  # the offload path's prefetch stream
    assert "PLE sidecar hooks installed for Qwen4ExpForConditionalGeneration" in sc.log
    assert not re.search(r"PLE sidecar hook \w+ ran", sc.log)


@pytest.mark.parametrize("io", ["mmap", "pread"])
def test_sidecar_output_identical_to_ram_table(request, qwen4_ram, io):
    sc = request.getfixturevalue(f"qwen4_sidecar_{io}")
    assert _greedy(sc) == _greedy(qwen4_ram)  # token ids and logprobs, bit for bit


@pytest.mark.parametrize("io", ["mmap", "pread"])
def test_all_four_hooks_ran_in_the_scheduler(request, io):
    sc = request.getfixturevalue(f"qwen4_sidecar_{io}")
    lines = {hook: [line for line in sc.log.splitlines() if f"PLE sidecar hook {hook} ran" in line] for hook in HOOKS}
    assert all(lines.values()), {h: bool(v) for h, v in lines.items()}
    assert f"read through {io}" in lines["gather"][0]
    assert "pinned PLE table allocation" not in sc.log  # no host table: the rows came from the sidecar
    assert "layers [0, 1] bound to the sidecar" in lines["load_weights"][0]


def test_sidecar_rows_reach_the_output(qwen4_ram, qwen4_other_rows):
    """A valid sidecar with other rows (every PLE shard negated) changes the logprobs: the identity above is
    not an accident of PLE contributing nothing."""
    ours, other = _greedy(qwen4_ram), _greedy(qwen4_other_rows)
    assert [r["logprobs"] for r in ours] != [r["logprobs"] for r in other]


def test_damaged_sidecar_stops_the_server_at_load(qwen4_damaged_sidecar):
    how, damaged, sc = qwen4_damaged_sidecar
    assert sc.exit_code not in (None, 0), sc.log[-4000:]
    assert "Uvicorn running" not in sc.log
    # the scheduler's failure took the whole server down (sglang's own teardown, before ours)
    assert not any(t.startswith("sglang::") for t in sc.left_behind.values()), sc.left_behind
    # the kit's own error, raised in the scheduler while sglang builds the model, names the table and the fault
    error = "SidecarTruncated" if how == "truncated" else "SidecarChecksumMismatch"
    hits = [line for line in sc.log.splitlines() if error in line and "layer-1.bin" in line]
    assert hits, sc.log[-4000:]
    if how == "tampered":
        assert "has SHA-256" in hits[-1] and "expected" in hits[-1], hits[-1]
    else:
        assert f"{damaged}/ple/layer-1.bin is truncated" in hits[-1], hits[-1]
