"""Our CPU n-gram hash (``sidecar/ngram.py``) == vLLM 0.33.0's, bit for bit (runs in the vLLM venv).

Reference: vLLM's own table arithmetic (``Qwen4ExpNGramEmbedding._make_layer_multipliers`` /
``_make_vocab_layout``, and the buffers of a really constructed embedding), its ids from the real
``compute_ngram_ids`` (the CPU torch path) and from the real Triton kernel ``_ple_ngram_ids_kernel``
run by the interpreter, with each request's history built by the real
``Qwen4ExpModelState._prepare_ngram_context`` from the request's token ids. vLLM imports Triton
through ``vllm.triton_utils``, which hands a CPU process a placeholder, so the kernel's source is
taken from ``common/ops/ple.py`` with ``ast`` and jitted by the real ``triton`` (as the GPU scripts do
with sglang's kernel). Stand-ins: the ``self`` the methods read (the embedding's buffers), the input
batch and request states ``_prepare_ngram_context`` reads.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_ssd_stream.sidecar.ngram import NGramHash, qwen38_flash_next
from tests.vllm import harness

VOCAB, EOS = 151_936, 151_645
PROFILE = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.function_scoped_fixture])


def _jit_kernel():
    import vllm.models.qwen4_exp.common.ops.ple as ple

    src = Path(ple.__file__).read_text()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "_ple_ngram_ids_kernel")
    start = min(d.lineno for d in fn.decorator_list) - 1
    body = "\n".join(src.splitlines()[start:fn.end_lineno])
    path = Path(tempfile.mkdtemp(prefix="vllm-ple-kernel-")) / "vllm_ple_ngram_ids_kernel.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n" + body + "\n")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod._ple_ngram_ids_kernel


@pytest.fixture(scope="module")
def vl():
    ne, _ = harness.modules()
    from vllm.models.qwen4_exp.nvidia.model_state import Qwen4ExpModelState

    return types.SimpleNamespace(C=ne.Qwen4ExpNGramEmbedding, State=Qwen4ExpModelState, kernel=_jit_kernel())


def vllm_hash(vl, *, vocab=VOCAB, eos=EOS, ngram_size=3, heads=8, base=20_000_000, divisible=128, seed=1234, index=0):
    """The ``self`` of vLLM's hashing methods, its buffers built by vLLM's own classmethods, and the rows."""
    m = vl.C._make_layer_multipliers(ngram_size=ngram_size, unigram_vocab_size=vocab, seed=seed,
                                     ple_dense_layer_id=index)
    sizes, offsets, total = vl.C._make_vocab_layout(ngram_vocab_size_base=base, ngram_heads=(ngram_size - 1) * heads,
                                                    ple_dense_layer_id=index)
    self = types.SimpleNamespace(
        layer_multipliers=torch.tensor(m), ngram_heads_vocab_sizes=torch.tensor(sizes),
        ngram_heads_offsets=torch.tensor(offsets), eos_token_id=eos, heads_per_ngram=heads, ngram_size=ngram_size,
        _shift_precompute=vl.C._shift_precompute, _shift_apply=vl.C._shift_apply)
    return self, -(-total // divisible) * divisible


def ours_from(self, rows: int) -> NGramHash:
    return NGramHash.from_module(self, rows=rows)


def test_production_table_layout(vl):
    self, rows = vllm_hash(vl)
    assert rows == 320_001_536
    assert ours_from(self, rows) == qwen38_flash_next()


@settings(max_examples=40, **PROFILE)
@given(vocab=st.integers(2, 300_000), seed=st.integers(0, 2**40), index=st.integers(0, 4),
       ngram_size=st.integers(2, 4), heads=st.integers(1, 8), base=st.integers(2, 30_000_000),
       divisible=st.sampled_from([1, 8, 64, 128, 1000]))
def test_parameters_match_vllms_arithmetic(vl, vocab, seed, index, ngram_size, heads, base, divisible):
    self, rows = vllm_hash(vl, vocab=vocab, seed=seed, index=index, ngram_size=ngram_size, heads=heads, base=base,
                           divisible=divisible)
    ours = NGramHash.from_config(unigram_vocab_size=vocab, eos_token_id=EOS, ngram_size=ngram_size,
                                 heads_per_ngram=heads, ngram_vocab_size_base=base,
                                 make_ngram_vocab_size_divisible_by=divisible, seed=seed, ple_layer_index=index)
    assert ours == ours_from(self, rows)


def test_a_constructed_embedding_carries_the_same_buffers(vl):
    """The real module's registered buffers (vLLM's class selection and distributed setup included)."""
    cfg = harness.text_config()
    with harness.distributed():
        emb = harness.build(cfg, cpu_offload=False)
    ours = NGramHash.from_config(unigram_vocab_size=cfg.vocab_size, eos_token_id=cfg.eos_token_id,
                                 ngram_size=cfg.ngram_size, heads_per_ngram=cfg.heads_per_ngram,
                                 ngram_vocab_size_base=cfg.ngram_vocab_size_base,
                                 make_ngram_vocab_size_divisible_by=cfg.make_ngram_vocab_size_divisible_by)
    assert ours == NGramHash.from_module(emb, rows=harness.layout(cfg).rows)


def scheduled_batch(vl, requests, eos: int):
    """``requests``: (all token ids so far, computed tokens, tokens scheduled now). Returns vLLM's
    input_ids, query_start_loc and the ngram_context its model state builds for them."""
    width = max(len(t) for t, _, _ in requests) + 1
    all_ids = torch.full((len(requests), width), 0, dtype=torch.int32)
    for i, (t, _, _) in enumerate(requests):
        all_ids[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    state = types.SimpleNamespace(
        ngram_context=torch.full((len(requests) + 2, 2), eos, dtype=torch.int32), ngram_eos_token_id=eos,
        ngram_context_offsets=torch.arange(-2, 0, dtype=torch.int64))
    batch = types.SimpleNamespace(num_reqs=len(requests), idx_mapping=torch.arange(len(requests)))
    req = types.SimpleNamespace(
        num_computed_tokens=types.SimpleNamespace(gpu=torch.tensor([c for _, c, _ in requests])),
        all_token_ids=types.SimpleNamespace(gpu=all_ids))
    ctx = vl.State._prepare_ngram_context(state, batch, req)[:len(requests)].clone()
    ids = torch.tensor([x for t, c, k in requests for x in t[c:c + k]], dtype=torch.int64)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum([k for _, _, k in requests])]), dtype=torch.int32)
    return ids, qsl, ctx


@st.composite
def batches(draw, vocab: int, eos: int):
    tok = st.one_of(st.integers(0, vocab - 1), st.just(eos))
    reqs = []
    for _ in range(draw(st.integers(1, 4))):
        t = draw(st.lists(tok, min_size=1, max_size=40))
        computed = draw(st.integers(0, len(t) - 1))
        reqs.append((t, computed, draw(st.integers(1, len(t) - computed))))
    return reqs


def expected(ours: NGramHash, requests) -> np.ndarray:
    return np.concatenate([ours.chunk_ids(t, c, c + k).reshape(k, -1) for t, c, k in requests])


@settings(max_examples=60, **PROFILE)
@given(data=st.data(), small=st.booleans())
def test_cpu_path_matches(vl, data, small):
    """vLLM's ``compute_ngram_ids`` on CPU tensors (its torch reference path)."""
    vocab, eos, kw = (50, 7, dict(vocab=50, eos=7, base=100, seed=data.draw(st.integers(0, 2**32)),
                                  index=data.draw(st.integers(0, 3)))) if small else (VOCAB, EOS, {})
    self, rows = vllm_hash(vl, **kw)
    requests = data.draw(batches(vocab, eos))
    ids, qsl, ctx = scheduled_batch(vl, requests, eos)
    got = vl.C.compute_ngram_ids(self, ids, qsl, ctx).numpy()
    np.testing.assert_array_equal(got, expected(ours_from(self, rows), requests))


def run_kernel(vl, self, ids, qsl, ctx) -> np.ndarray:
    out = torch.empty((ids.numel(), self.ngram_heads_vocab_sizes.numel()), dtype=torch.long)
    n, reqs = ids.numel(), qsl.numel() - 1
    vl.kernel[(-(-n // 8),)](ids, qsl, ctx, self.layer_multipliers, self.ngram_heads_vocab_sizes,
                             self.ngram_heads_offsets, out, n, reqs, self.eos_token_id,
                             binary_search_iters=reqs.bit_length(), NGRAM_CONTEXT_LEN=ctx.shape[1],
                             HEADS_PER_NGRAM=self.heads_per_ngram, BLOCK_T=8, launch_pdl=False, num_warps=4)
    return out.numpy()


@settings(max_examples=12, **PROFILE)
@given(data=st.data())
def test_triton_kernel_matches(vl, data):
    """vLLM's GPU hash kernel (what serves on CUDA), run by the Triton interpreter."""
    self, rows = vllm_hash(vl)
    requests = data.draw(batches(VOCAB, EOS))
    ids, qsl, ctx = scheduled_batch(vl, requests, EOS)
    np.testing.assert_array_equal(run_kernel(vl, self, ids, qsl, ctx), expected(ours_from(self, rows), requests))


@settings(max_examples=10, **PROFILE)
@given(tokens=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=3, max_size=30))
def test_out_of_vocabulary_tokens_wrap_like_both_paths(vl, tokens):
    """Products overflow int64 outside the vocabulary: ours wraps and fixes negative remainders as
    vLLM's torch path and its kernel do."""
    self, rows = vllm_hash(vl)
    ids = torch.tensor(tokens[2:], dtype=torch.int64)
    qsl = torch.tensor([0, len(tokens) - 2], dtype=torch.int32)
    ctx = torch.tensor([tokens[:2]], dtype=torch.int32)
    want = ours_from(self, rows).ids(tokens[2:], tokens[:2])
    np.testing.assert_array_equal(vl.C.compute_ngram_ids(self, ids, qsl, ctx).numpy(), want)
    np.testing.assert_array_equal(run_kernel(vl, self, ids, qsl, ctx), want)


def test_a_different_hash_is_detected(vl):
    self, rows = vllm_hash(vl)
    other, _ = vllm_hash(vl, seed=1235)
    requests = [(list(range(100, 140)), 0, 40)]
    ids, qsl, ctx = scheduled_batch(vl, requests, EOS)
    got = vl.C.compute_ngram_ids(self, ids, qsl, ctx).numpy()
    np.testing.assert_array_equal(got, expected(ours_from(self, rows), requests))
    assert not np.array_equal(got, expected(ours_from(other, rows), requests))
