"""Issue 26 item 6: MTP 2 on the CPU path, greedy outputs equal to MTP off.

The checkpoint carries its MTP draft (``models.py:add_mtp_weights``: ``mtp.*`` in one more shard of the model
directory, where vLLM 0.33's ``--speculative-config '{"method":"mtp",...}'`` loads it from) and the server runs
(b)'s streamed configuration exactly (``mmap``, default row cache, prompt-ahead prefetch, the sidecar whose bytes
(b) reads) with ``num_speculative_tokens`` 2, as the kit's vLLM thor profile (write-up 003). The baseline is (b) itself
(``streamed_mmap``, MTP off; test_2 proves it equal to vLLM's own table): the target's tensors are the same
bytes, only the draft's shard and ``text_config.mtp_num_hidden_layers`` were added.

The draft proposes the token the target just emitted (see ``add_mtp_weights``), so some drafts are accepted and
the rollback to an accepted draft token runs (the GDN state resumed from a later slot of
``spec_state_indices``, ``ple_conv``'s window from a later column) as well as the rejections. Greedy output must
not depend on any of it: token ids equal (b)'s, logprobs within fp32 rounding (:data:`LOGPROB_TOL`).
"""

from __future__ import annotations

import re

from .conftest import MAX_TOKENS, MTP_TOKENS, PROMPTS


def _greedy(sc) -> dict[str, tuple[list[int], list[float]]]:
    runs = sc.results["greedy"]
    assert list(runs) == list(PROMPTS)
    return {label: (run["token_ids"], run["logprobs"]) for label, run in runs.items()}


def test_answers_are_whole(streamed_mmap_mtp):
    for label, run in streamed_mmap_mtp.results["greedy"].items():
        assert run["finish_reason"] == "length" and run["completion_tokens"] == MAX_TOKENS, (label, run)
        assert len(run["token_ids"]) == MAX_TOKENS and len(run["logprobs"]) == MAX_TOKENS, (label, run)
        if label != "text":
            assert run["prompt_token_ids"] == PROMPTS[label], label


# Token ids must be equal. Logprobs: a verify step scores 3 positions in one forward (batch shapes other than
# MTP off's 1-token decode steps), so the fp32 log-softmax may differ in its last bits: measured at most 2.9e-6
# (2026-12-04; the text prompt bit-equal but for one 4.8e-7), against ~1e-2 between this model's candidates.
LOGPROB_TOL = 1e-4


def test_mtp_greedy_equals_mtp_off(streamed_mmap, streamed_mmap_mtp):
    mtp, off = _greedy(streamed_mmap_mtp), _greedy(streamed_mmap)
    report = {label: {"ids_mtp": mtp[label][0], "ids_off": off[label][0],
                      "logprob_diff": [a - b for a, b in zip(mtp[label][1], off[label][1], strict=True)]}
              for label in PROMPTS}
    print("MTP vs off:", report)
    assert {k: v[0] for k, v in mtp.items()} == {k: v[0] for k, v in off.items()}, report  # token ids
    worst = max(abs(d) for r in report.values() for d in r["logprob_diff"])
    assert worst <= LOGPROB_TOL, report


def test_speculative_decoding_ran(streamed_mmap_mtp):
    """vLLM resolved the draft, drafted 2 tokens per step, verified them and accepted some: its own counters
    (``/metrics``) and its log lines, and the stand-ins of the spec path ran in the worker."""
    sc = streamed_mmap_mtp
    spec = sc.results["spec"]
    print("spec-decode counters:", spec)
    drafts = spec["vllm:spec_decode_num_drafts_total"]
    drafted = spec["vllm:spec_decode_num_draft_tokens_total"]
    accepted = spec["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and drafted == MTP_TOKENS * drafts, spec
    assert 0 < accepted < drafted, spec  # some accepted (the rollback ran), some rejected
    assert sum(spec["per_position"].values()) == accepted and set(spec["per_position"]) <= set(range(MTP_TOKENS)), spec
    # each verify step yields 1 + its accepted tokens (the last may overshoot max_tokens by up to MTP_TOKENS)
    assert drafts + accepted <= len(PROMPTS) * (MAX_TOKENS + MTP_TOKENS), spec
    assert sc.grep(r"Resolved architecture: Qwen4ExpMTP"), "the draft model was not resolved"
    assert sc.grep(r"speculative_config=SpeculativeConfig\(method='mtp', .*num_spec_tokens=2\)")
    assert sc.grep(r"SpecDecoding metrics: .*Drafted: [1-9]\d* tokens"), "no spec-decode metrics line"
    (worker,) = sc.role_pids()["worker"]
    for ran in (r"ran ple_conv \(torch, mode=spec\)", r"ran _C::fused_sigmoid_gating_delta_rule_update_spec_cpu"):
        assert sc.grep(ran, worker), f"worker (pid {worker}): no {ran!r}"
    assert not sc.grep(r"Traceback", worker)


def test_a_verify_steps_rows_are_fetched_as_soon_as_its_drafts_exist(streamed_mmap_mtp):
    """Issue 27 item 3: after each step's sampling and proposal, every decoding request's next verify row (its
    last sampled token and drafts) is hashed after its n-gram history from vLLM's own request state and fetched
    into the row caches. On this CPU that happens before the next step, so every row a pure verify forward looks
    up must be in the caches: a wrong history, hash or token row would show as lookups that read the disk."""
    sc = streamed_mmap_mtp
    ran = [line for line in sc.log.splitlines()
           if re.search(r"PLE prefetch: the rows of a verify step \(\d+ request\(s\), \d+ tokens each\)", line)]
    assert ran and f"{1 + MTP_TOKENS} tokens each" in ran[0], sc.log[-4000:]
    lines = [line for line in sc.log.splitlines() if "PLE prompt-ahead prefetch:" in line and "verify" in line]
    assert lines, sc.log[-4000:]
    last = lines[-1]
    steps, tokens = (int(x) for x in re.search(r"(\d+) verify step\(s\) fetched ahead \((\d+) tokens", last).groups())
    verify, misses = (int(x) for x in re.search(r"verify forwards on this CPU: (\d+), their lookups that read the "
                                                r"disk: (\d+)", last).groups())
    # a row is the last sampled token and up to MTP_TOKENS drafts (vLLM marks drafts it did not propose -1: cut)
    assert steps > 0 and steps <= tokens <= steps * (1 + MTP_TOKENS) and verify > 0, last
    assert misses == 0, last
    # the control: on this cold cache the fetch itself placed rows the verify forwards then found (without it,
    # those lookups would have read the disk)
    placed = int(re.search(r"superseded, (\d+) rows placed", last).group(1))
    assert placed > 0, last
