"""With no VLLM_PLE_* variable, vLLM's real plugin loader runs our plugin and vLLM stays upstream.

Runs inside the vLLM venv (CPU platform). Proves: the entry point is discovered and called; it
imports nothing beyond its stdlib top and the settings parser, installs no import hook, and the
real qwen4_exp class selection picks upstream's classes (device class with
``cpu_offload: false``; upstream's pinned class, which cannot run on a CPU platform, otherwise).
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import entry_points

import pytest

from tests.vllm import harness


@pytest.fixture(scope="module", autouse=True)
def tp1():
    with harness.distributed(1):
        yield


def test_entry_point_is_declared():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("ple_offload") == "vllm_ple_offload.plugin:register"


def test_plugin_runs_and_changes_nothing(monkeypatch):
    from vllm_ple_offload import plugin
    from vllm_ple_offload import post_import as hook

    harness.load_plugins(monkeypatch, {})
    assert plugin._registered  # vLLM called register()
    assert hook._finder is None and not hook._callbacks
    heavy = {"vllm_ple_offload.activate", "vllm_ple_offload.embedding", "vllm_ple_offload.streaming",
             "vllm_ple_offload.doctor"}
    assert not heavy & set(sys.modules)
    ne, common = harness.modules()
    assert ne.Qwen4ExpPLEPinnedHostEmbedding is common.Qwen4ExpPLEPinnedHostEmbedding
    assert ne.Qwen4ExpPLEDeviceEmbedding is common.Qwen4ExpPLEDeviceEmbedding


def test_upstream_device_class_with_cpu_offload_false(monkeypatch):
    harness.load_plugins(monkeypatch, {})
    _, common = harness.modules()
    emb = harness.build(harness.text_config(), cpu_offload=False).ngram_embedding
    assert type(emb) is common.Qwen4ExpPLEDeviceEmbedding
    assert emb.weight.numel() == harness.layout(harness.text_config()).rows * 4


def test_upstream_pinned_class_with_cpu_offload_true(monkeypatch):
    """Upstream's pinned class needs CUDA's UVA view; on the CPU platform vLLM itself refuses it."""
    harness.load_plugins(monkeypatch, {})
    with pytest.raises(Exception) as e:
        harness.build(harness.text_config(), cpu_offload=True)
    frames = [str(f.path) for f in e.traceback]
    assert any(f.endswith("qwen4_exp/common/ngram_embedding.py") for f in frames)
    assert not any("vllm_ple_offload" in f for f in frames)


def test_vllm_plugins_allowlist_can_exclude_us(monkeypatch):
    from vllm_ple_offload import plugin

    monkeypatch.setenv("VLLM_PLUGINS", "")
    harness.load_plugins(monkeypatch, {"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": "bogus"})
    assert not plugin._registered  # not called, so even bad settings cannot stop the process


@pytest.mark.parametrize("value", [None, "", "ple_offload", "other", "other,ple_offload", "other, ple_offload",
                                   "ple_offload,", " ple_offload", "PLE_OFFLOAD"])
def test_the_allowlist_rule_is_vllms(monkeypatch, value):
    """env.plugin_excluded (what doctor and serve refuse on) predicts whether vLLM's real loader runs us."""
    from vllm_ple_offload import env, plugin

    if value is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", value)
    harness.load_plugins(monkeypatch, {})
    assert plugin._registered is (not env.plugin_excluded(dict(os.environ)))
