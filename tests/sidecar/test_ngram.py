"""The engine-neutral n-gram hash (no engine here; the engine equality is in tests/{sglang,vllm}/checks)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_ssd_stream.sidecar.ngram import NGramHash, head_layout, is_prime, nth_prime_after, qwen38_flash_next

SMALL = NGramHash.from_config(unigram_vocab_size=50, eos_token_id=7, ngram_vocab_size_base=100)


def _sieve(n: int) -> np.ndarray:
    s = np.ones(n, dtype=bool)
    s[:2] = False
    for p in range(2, int(n ** 0.5) + 1):
        if s[p]:
            s[p * p::p] = False
    return s


def test_is_prime_agrees_with_a_sieve():
    s = _sieve(200_000)
    assert [is_prime(i) for i in range(200_000)] == s.tolist()


def test_is_prime_on_large_known_values():
    assert is_prime(2**61 - 1) and is_prime(18446744073709551557)  # a Mersenne prime; the largest prime < 2^64
    assert not is_prime(2**61 + 1) and not is_prime(3215031751)  # 3215031751: strong pseudoprime to bases 2,3,5,7


def test_head_layout_is_consecutive_distinct_primes_across_layers():
    s0, o0, t0 = head_layout(ngram_vocab_size_base=100, ngram_heads=4, ple_layer_index=0)
    s1, _, _ = head_layout(ngram_vocab_size_base=100, ngram_heads=4, ple_layer_index=1)
    assert s0 == [101, 103, 107, 109] and s1 == [113, 127, 131, 137]
    assert o0 == [0, 101, 204, 311] and t0 == 420
    assert nth_prime_after(99, 8) == 137


def test_production_rows():
    h = qwen38_flash_next()
    assert h.rows == 320_001_536 and h.ngram_heads == 16 and h.head_sizes[0] == 20_000_003


def test_ids_land_in_their_head_partition():
    h = qwen38_flash_next()
    ids = h.ids(np.random.default_rng(0).integers(0, 151_936, 5000))
    lo, hi = np.array(h.head_offsets), np.array(h.head_offsets) + np.array(h.head_sizes)
    assert ((ids >= lo) & (ids < hi)).all() and ids.dtype == np.int64 and ids.shape == (5000, 16)


def test_eos_hides_older_tokens():
    """An EOS among the predecessors replaces every older token by EOS; the token itself may be EOS."""
    a = SMALL.ids([3, 7, 5, 9])  # t=2 (token 5): predecessors 7 (EOS), 3 -> 3 is hidden
    b = SMALL.ids([4, 7, 5, 9])
    np.testing.assert_array_equal(a[2:], b[2:])  # token 3 vs 4 invisible behind the EOS
    assert not np.array_equal(a[1], b[1])  # but visible to the EOS token's own n-grams
    # a request's start is an EOS history:
    np.testing.assert_array_equal(SMALL.ids([5, 9]), SMALL.ids([5, 9], history=[7, 7]))
    np.testing.assert_array_equal(SMALL.ids([5, 9], history=[1, 7]), SMALL.ids([5, 9], history=[2, 7]))


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.one_of(st.integers(0, 49), st.just(7)), max_size=60), data=st.data())
def test_chunk_ids_equal_the_whole_prompts_slice(tokens, data):
    start = data.draw(st.integers(0, len(tokens)))
    stop = data.draw(st.integers(start, len(tokens)))
    whole = SMALL.ids(tokens)
    np.testing.assert_array_equal(SMALL.chunk_ids(tokens, start, stop), whole[start:stop].reshape(-1))


@pytest.mark.parametrize("tokens", [np.zeros((2, 2), np.int64), np.array([1.5]), "abc",
                                    np.array([2**63], dtype=np.uint64)])
def test_refuses_tokens_that_are_not_integer_ids(tokens):
    with pytest.raises(ValueError):
        SMALL.ids(tokens)


def test_refuses_a_wrong_history_and_a_chunk_outside_the_prompt():
    with pytest.raises(ValueError, match="history must be a 1-D integer array of 2 values"):
        SMALL.ids([1, 2], history=[7])
    with pytest.raises(ValueError, match=r"chunk \[3, 5\) is outside the prompt's 4 tokens"):
        SMALL.chunk_ids([1, 2, 3, 4], 3, 5)


def test_refuses_inconsistent_buffers():
    with pytest.raises(ValueError, match="inconsistent n-gram hash"):
        NGramHash.from_buffers([1, 3, 5], [11, 13], [0, 11], heads_per_ngram=2, eos_token_id=0, rows=100)
    with pytest.raises(ValueError, match="beyond the table's 20 rows"):
        NGramHash.from_buffers([1, 3], [11, 13], [0, 11], heads_per_ngram=2, eos_token_id=0, rows=20)
