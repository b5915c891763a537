"""Proof 2: the streamed sidecar inside the real model forward, over the OpenAI API.

The same greedy ``/v1/completions`` requests (a text prompt and two token-id prompts, 8 tokens out, top-1
logprobs) against vLLM's own in-RAM PLE table (a) and the plugin's streamed sidecar, ``mmap`` with the default
row cache (b) and ``pread`` without one (c): token ids and logprobs must be identical. The control (d), the
checkpoint with every PLE shard negated and its own sidecar, must change them: the comparison can fail.
"""

from __future__ import annotations

import pytest

from .conftest import MAX_TOKENS, PROMPTS

ALL = ["vllm_table", "streamed_mmap", "streamed_pread", "other_rows"]


def _greedy(sc) -> dict[str, tuple[list[int], list[float]]]:
    """What the comparison compares: output token ids and their logprobs per prompt."""
    runs = sc.results["greedy"]
    assert list(runs) == list(PROMPTS)
    return {label: (run["token_ids"], run["logprobs"]) for label, run in runs.items()}


@pytest.mark.parametrize("name", ALL)
def test_answers_are_whole(request, name):
    sc = request.getfixturevalue(name)
    for label, run in sc.results["greedy"].items():
        assert run["finish_reason"] == "length" and run["completion_tokens"] == MAX_TOKENS, (label, run)
        assert len(run["token_ids"]) == MAX_TOKENS and len(run["logprobs"]) == MAX_TOKENS, (label, run)
        if label != "text":
            assert run["prompt_token_ids"] == PROMPTS[label], label


@pytest.mark.parametrize("name", ["streamed_mmap", "streamed_pread"])
def test_streamed_identical_to_vllm_table(request, vllm_table, name):
    sc = request.getfixturevalue(name)
    assert _greedy(sc) == _greedy(vllm_table)  # token ids and logprobs, bit for bit


def test_the_pread_start_served_the_checkpoint_in_place(streamed_pread, in_place_checkpoint):
    """(c)'s rows came from regions of the checkpoint's own shards (a version 2 manifest), nothing copied: its
    output equals (a)'s above."""
    from ..in_place_served import assert_served_in_place

    ckpt, before = in_place_checkpoint
    assert streamed_pread.env["VLLM_PLE_SIDECAR"] == str(ckpt)
    assert_served_in_place(ckpt, before)


def test_other_rows_change_the_output(vllm_table, streamed_mmap, other_rows):
    """Other PLE rows through the same configuration as (b): every prompt's logprobs differ, so the identity
    above is not an accident of PLE contributing nothing."""
    ref, other = _greedy(vllm_table), _greedy(other_rows)
    assert _greedy(streamed_mmap) == ref
    assert other != ref
    for label in PROMPTS:
        assert other[label][1] != ref[label][1], label
