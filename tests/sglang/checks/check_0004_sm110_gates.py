"""RED/GREEN check for patch 0004 (SM110 gates), sglang 0.5.23, on CPU.

Each architecture is faked in two ways, both driven by the real probes in ``utils.common``:
``fake_cuda`` makes torch report a CUDA device of that capability (``torch.cuda.is_available``,
``get_device_capability``, ``torch.version.cuda``; NVML answers "unknown") and clears the probes'
caches, for code that calls the probes directly; ``platform`` computes every platform fact with
those real probes and publishes them through sglang's own ``override_platform`` seam, for the
server-argument resolution (which would import CUDA-only extensions if torch itself claimed a
device). Server arguments are resolved by the real pipeline (``ServerArgs.resolve_once``) for a
qwen4_exp checkpoint with a compressed QSA indexer.

On pristine sglang the SM110 rows of ``test_resolved_attention_defaults`` and
``test_deep_gemm_jit`` fail; every other row, and everything patched, passes.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from unittest import mock

import pytest
import torch
from sglang.srt import runtime_context
from sglang.srt.arg_groups.model_override_base import resolved_view
from sglang.srt.configs.qwen4_exp import Qwen4ExpConfig
from sglang.srt.layers.attention import qwen_sparse_attn_backend as qsa_backend
from sglang.srt.layers.deep_gemm_wrapper import configurer
from sglang.srt.layers.quantization import fp8_utils
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils import common

ARCHS = {"sm110": (11, 0), "sm121": (12, 1), "sm120": (12, 0), "sm100": (10, 0), "sm90": (9, 0)}


def _clear_probe_caches() -> None:
    for value in list(vars(common).values()):
        if hasattr(value, "cache_clear"):
            value.cache_clear()


@contextlib.contextmanager
def fake_cuda(capability: tuple[int, int]):
    with mock.patch.object(torch.cuda, "is_available", lambda: True), \
            mock.patch.object(torch.cuda, "is_initialized", lambda: False), \
            mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: capability), \
            mock.patch.object(torch.version, "cuda", "13.0"), \
            mock.patch.object(common, "_get_device_sm_via_nvml", lambda: None):
        _clear_probe_caches()
        try:
            yield
        finally:
            _clear_probe_caches()


def probed_facts(capability: tuple[int, int]) -> dict:
    probes = {**runtime_context._PLATFORM_PROBES, **runtime_context._PLATFORM_VALUES}
    with fake_cuda(capability):
        return {fact: getattr(common, probe)() for fact, probe in probes.items()}


def platform(capability: tuple[int, int]):
    return runtime_context.override_platform(**probed_facts(capability))


def test_probes_see_sm110_as_blackwell_but_not_sm100():
    """The premise of the patch, from the real probes."""
    facts = probed_facts((11, 0))
    assert facts["is_blackwell"] and facts["is_sm100_or_sm110"] and facts["is_sm110"]
    assert not facts["is_sm100"] and not facts["is_sm120"] and facts["device_sm"] == 110


# --------------------------------------------------------------------------------------------
# Resolved server arguments for a qwen4_exp QSA checkpoint
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    config = Qwen4ExpConfig().to_dict()
    config["architectures"] = ["Qwen4ExpForConditionalGeneration"]
    config["text_config"].update(indexer_n_heads=16, indexer_kv_heads=1, indexer_head_dim=64,
                                 indexer_budget=2048, indexer_compress_ratio=4)
    path = tmp_path_factory.mktemp("qwen4_exp")
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def resolve(model_dir: str, arch: str, **flags):
    server_args = ServerArgs(model_path=model_dir, skip_tokenizer_init=True, device="cuda", **flags)
    with platform(ARCHS[arch]):
        server_args.resolve_once()
    return resolved_view(server_args)


ATTENTION_DEFAULTS = {"sm110": "triton", "sm121": "flashinfer", "sm120": "flashinfer", "sm100": "triton",
                      "sm90": "fa3"}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_resolved_attention_defaults(model_dir, arch):
    """SM110 takes the SM100 QSA default (triton, the Thor recipe), not the generic flashinfer."""
    view = resolve(model_dir, arch)
    assert (view.attention_backend, view.page_size, view.linear_attn_backend) == (ATTENTION_DEFAULTS[arch], 64,
                                                                                 "triton")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fp8_qsa_indexer_refused_off_sm90_sm100(model_dir, arch):
    """Kept: TileLang fp8 scoring is validated only on SM90/SM100."""
    if arch in ("sm90", "sm100"):
        assert resolve(model_dir, arch, qsa_indexer_dtype="fp8_e4m3").qsa_indexer_dtype == "fp8_e4m3"
    else:
        with pytest.raises(ValueError, match="requires a CUDA SM90/SM100 GPU"):
            resolve(model_dir, arch, qsa_indexer_dtype="fp8_e4m3")


def test_explicit_trtllm_mha_refused_on_sm110(model_dir):
    """Kept: TRT-LLM MHA kernels are not built for SM110."""
    with pytest.raises(ValueError, match="TRTLLM MHA backend"):
        resolve(model_dir, "sm110", attention_backend="trtllm_mha")


# --------------------------------------------------------------------------------------------
# DeepGEMM JIT and the fp8 GEMM route (module constants read at import)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def reload_configurer():
    """Re-evaluate configurer's import-time constants; restore the real ones afterwards."""
    yield lambda: importlib.reload(configurer)
    importlib.reload(configurer)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_deep_gemm_jit(monkeypatch, reload_configurer, arch):
    """DeepGEMM stays off on SM110 (sglang: its block-FP8 kernel does not support SM110)."""
    monkeypatch.delenv("SGLANG_ENABLE_JIT_DEEPGEMM", raising=False)
    with fake_cuda(ARCHS[arch]), platform(ARCHS[arch]):
        module = reload_configurer()
        sm120_apis = module._sm120_deep_gemm_apis_available()  # the installed deep_gemm answers this
        enabled, blackwell = module.ENABLE_JIT_DEEPGEMM, module.DEEPGEMM_BLACKWELL
    expected = {"sm110": False, "sm121": sm120_apis, "sm120": sm120_apis, "sm100": True, "sm90": True}[arch]
    assert (enabled, blackwell) == (expected, arch == "sm100")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fp8_gemm_auto_backend(monkeypatch, arch):
    """Upstream already routes fp8 GEMM "auto" to triton on SM110 and cutlass on SM12x."""
    monkeypatch.setattr(fp8_utils, "FP8_GEMM_RUNNER_BACKEND", None)
    with runtime_context.get_context().override_server_args(fp8_gemm_runner_backend="auto"), \
            platform(ARCHS[arch]):
        fp8_utils.initialize_fp8_gemm_config()
    expected = {"sm110": "triton", "sm121": "cutlass", "sm120": "cutlass", "sm100": "auto", "sm90": "auto"}[arch]
    assert fp8_utils.FP8_GEMM_RUNNER_BACKEND.value == expected


# --------------------------------------------------------------------------------------------
# QSA decode routes (lru-cached resolvers that call the probes directly)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(ARCHS))
def test_qsa_decode_routes(arch):
    """Kept: TRT-LLM sparse decode only on SM100/SM120; SM121 gets its own varlen kernel."""
    resolvers = (qsa_backend._resolve_trtllm_sparse_decode, qsa_backend._resolve_flash_attn_varlen_func)
    for resolver in resolvers:
        resolver.cache_clear()
    try:
        with fake_cuda(ARCHS[arch]):
            trtllm = qsa_backend._resolve_trtllm_sparse_decode()
            varlen = qsa_backend._resolve_flash_attn_varlen_func()
    finally:
        for resolver in resolvers:
            resolver.cache_clear()
    assert (trtllm is not None) is (arch in ("sm100", "sm120"))
    assert (getattr(varlen, "__name__", "") == "qwen38_qsa_sm121_varlen") is (arch == "sm121")
