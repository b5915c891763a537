"""Patch 0005 in the installed sglang: client token ids outside [0, vocab_size) are refused at intake.

Calls the real ``TokenizerManager._tokenize_one_request`` with a real ``GenerateReqInput``; only the steps
after the input branch (length validation, building the scheduler object) are replaced by recorders, so
what reaches them is exactly what the scheduler would embed. Pristine, every bad id passes (RED).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import TokenizerManager

VOCAB = 1000


def tokenize(input_ids):
    tm = object.__new__(TokenizerManager)
    tm.model_config = SimpleNamespace(vocab_size=VOCAB, hf_config=SimpleNamespace(architectures=["Qwen3ForCausalLM"]))
    tm.mm_processor = None
    tm.tokenizer = None
    seen = {}
    tm._validate_one_request = lambda obj, ids: seen.setdefault("ids", list(ids))
    tm._create_tokenized_object = lambda obj, text, ids, *a, **k: seen.setdefault("built", list(ids))
    obj = GenerateReqInput(input_ids=input_ids, sampling_params={"max_new_tokens": 1})
    obj.normalize_batch_and_arguments()
    asyncio.run(tm._tokenize_one_request(obj))
    return seen


@pytest.mark.parametrize("bad", [VOCAB, 1_000_000, 2**70, -1, 1.5, True, "7", [11]],
                         ids=["vocab", "1e6", "2^70", "neg", "float", "bool", "str", "nested"])
def test_bad_id_refused(bad):
    with pytest.raises(ValueError) as err:
        tokenize([11, 12, bad])
    msg = str(err.value)
    assert "input_ids" in msg
    if isinstance(bad, int) and not isinstance(bad, bool):
        assert f"[0, {VOCAB})" in msg and str(bad) in msg  # names the limit and the id


def test_in_vocab_ids_pass_unchanged():
    ids = [0, 11, 12, VOCAB - 1]
    assert tokenize(list(ids)) == {"ids": ids, "built": ids}
