"""The doctor's launch checks against vLLM's own code: its ``vllm serve`` parser, its graph modes, and
the rule the real embedding applies when vLLM builds the model (the doctor must refuse exactly what
the model build refuses).

Runs inside the vLLM venv (CPU platform, ``VLLM_TARGET_DEVICE=cpu``).
"""

from __future__ import annotations

import os

import pytest

from tests.vllm import harness
from tests.vllm.synthetic import random_table, write_sidecar
from vllm_ple_offload import doctor, env


@pytest.fixture(scope="module", autouse=True)
def tp1():
    with harness.distributed(1):
        yield


def streaming(path, backend="pread", **extra):
    return {"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": backend, "VLLM_PLE_SIDECAR": str(path),
            "VLLM_PLE_ALLOW_UNPATCHED": "1", **extra}


@pytest.mark.parametrize("flags,mode,source", [
    ([], "FULL_AND_PIECEWISE", "vLLM's default at -O2"),  # the README's old example line
    (["--enforce-eager"], "NONE", "--enforce-eager"),
    (["-cc.cudagraph_mode=PIECEWISE"], "PIECEWISE", "--compilation-config"),
    (["--compilation-config", '{"cudagraph_mode": "PIECEWISE"}'], "PIECEWISE", "--compilation-config"),
    (["--compilation-config", '{"mode":0,"cudagraph_mode":"FULL_DECODE_ONLY"}'], "FULL_DECODE_ONLY",
     "--compilation-config"),  # the a100x4 profile
    (["-O1"], "PIECEWISE", "vLLM's default at -O1"),
    (["-O0"], "NONE", "vLLM's default at -O0"),
    (["--compilation-config", '{"cudagraph_mode": "FULL"}', "--enforce-eager"], "NONE", "--enforce-eager"),
    (["/opt/venv/bin/vllm", "serve", "/models/m", "--enforce-eager"], "NONE", "--enforce-eager"),  # a launch line
])
def test_requested_cudagraph_mode_with_vllms_parser(flags, mode, source):
    got, where = doctor.requested_cudagraph_mode(flags)
    assert (got.name, where) == (mode, source)


@pytest.mark.parametrize("flags,procs", [
    ([], 1), (["--tensor-parallel-size", "4"], 4), (["-tp", "2", "-pp", "2"], 4),
    (["--tensor-parallel-size", "2", "--data-parallel-size", "2"], 4), (["--no-such-flag"], 1),
])
def test_worker_processes_from_vllms_parser(flags, procs):
    """Each worker process builds its own row caches: the doctor multiplies the budget by their number."""
    assert doctor.worker_processes(flags) == procs


def test_unparseable_serve_flags_are_a_finding(tmp_path):
    s = env.read_settings(streaming(tmp_path))
    f = doctor.check_cudagraph_mode(s, ["--no-such-flag"])
    assert f.level == "error" and f.message.count("vLLM's parser refuses") == 1
    assert "unrecognized arguments: --no-such-flag" in f.message


def test_our_plugin_does_not_judge_the_doctors_own_environment(monkeypatch):
    """vLLM's parser runs the general plugins; ours must not read this process's VLLM_PLE_* meanwhile
    (here a half configuration it would refuse), and the environment comes back unchanged."""
    import vllm.plugins

    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setenv("VLLM_PLE_ALLOW_UNPATCHED", "1")  # alone: the plugin refuses it
    got, _ = doctor.requested_cudagraph_mode(["--enforce-eager"])
    assert got.name == "NONE" and os.environ["VLLM_PLE_ALLOW_UNPATCHED"] == "1"


def test_full_graph_rule():
    from vllm.config.compilation import CUDAGraphMode

    s = env.read_settings(streaming("/nowhere"))  # pread
    pinned = env.read_settings({"VLLM_PLE_CPU_OFFLOAD": "1"})
    mmap = env.read_settings(streaming("/nowhere", "mmap"))  # captured reads verified under FULL graphs
    refused = {m.name for m in CUDAGraphMode if doctor.full_graph_refusal(s, m)}
    assert refused == {m.name for m in CUDAGraphMode if m.has_full_cudagraphs()}
    assert {"FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"} <= refused and not {"PIECEWISE", "NONE"} & refused
    assert not any(doctor.full_graph_refusal(x, m) for x in (pinned, mmap) for m in CUDAGraphMode)


@pytest.mark.parametrize("backend", ["pread", "mmap"])
def test_doctor_refuses_exactly_what_the_model_build_refuses(tmp_path, monkeypatch, backend):
    """Whatever rule the embedding applies at build (today: no FULL graphs for pread),
    the preflight's rule gives the same answer for every graph mode vLLM has."""
    from vllm.config.compilation import CUDAGraphMode

    from vllm_ple_offload.errors import PleSettingsError

    cfg = harness.text_config()
    lay = harness.layout(cfg)
    manifest = write_sidecar(tmp_path / "sc", {harness.LAYER: ("bfloat16", random_table(lay.rows, lay.row_bytes, 0))})
    harness.load_plugins(monkeypatch, streaming(manifest, backend))
    settings = env.read_settings(streaming(manifest, backend))
    for mode in CUDAGraphMode:
        try:
            harness.build(cfg, cudagraph_mode=mode.name)
            built_refused = False
        except PleSettingsError as exc:
            assert "cudagraph_mode=" in str(exc), exc
            built_refused = True
        assert built_refused == (doctor.full_graph_refusal(settings, mode) is not None), mode.name
