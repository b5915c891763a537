"""Patch 0005 on the real sglang install of every release in the manifest: RED on pristine, GREEN patched."""

from __future__ import annotations

from ..engine import assert_red_green

PATCH_ID = "0005-prompt-token-ids-in-vocab"
CHECK = "tests/sglang/checks/check_0005_prompt_token_ids_in_vocab.py"

# Pristine sglang lets each of these ids through to the embedding (DID NOT RAISE).
RED = {f"test_bad_id_refused[{i}]" for i in ("vocab", "1e6", "2^70", "neg", "float", "bool", "str", "nested")}
GUARDS = {"test_in_vocab_ids_pass_unchanged"}  # valid ids reach the scheduler unchanged


def test_red_on_pristine_green_when_patched(sglang_release):
    assert_red_green(sglang_release, CHECK, RED, GUARDS)
