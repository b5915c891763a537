"""The CPU n-gram hash used for prompt-ahead prefetch == sglang 0.5.23's (check_ngram_hash.py in the venv)."""

from __future__ import annotations

from ..engine import outcomes_only

CHECK = "tests/sglang/checks/check_ngram_hash.py"
EXPECTED = {
    "test_production_table_layout",
    "test_parameters_match_the_real_module",
    "test_default_seed_is_the_engines",
    "test_chunked_prefill_then_decode_match",
    "test_fused_decode_kernel_matches",
    "test_out_of_vocabulary_tokens_wrap_like_the_torch_path",
    "test_a_different_hash_is_detected",
}


def test_ngram_hash_is_sglangs(sglang):
    r = sglang.run_checks(CHECK)  # no source patch involved: the pristine engine is the reference
    assert outcomes_only(r) == {t: "passed" for t in EXPECTED}, r["__output__"]
