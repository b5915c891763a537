"""The CPU n-gram hash used for prompt-ahead prefetch == vLLM 0.33.0's (check_ngram_hash.py in the venv)."""

from __future__ import annotations

from ..engine import outcomes_only

CHECK = "tests/vllm/checks/check_ngram_hash.py"
EXPECTED = {
    "test_production_table_layout",
    "test_parameters_match_vllms_arithmetic",
    "test_a_constructed_embedding_carries_the_same_buffers",
    "test_cpu_path_matches",
    "test_triton_kernel_matches",
    "test_out_of_vocabulary_tokens_wrap_like_both_paths",
    "test_a_different_hash_is_detected",
}


def test_ngram_hash_is_vllms(vllm):
    r = vllm.run_checks(CHECK)
    assert outcomes_only(r) == {t: "passed" for t in EXPECTED}, r["__output__"]
