"""Bad settings and bad machines stop vLLM's real plugin loader with a message that names the fix.

Runs inside the vLLM venv (CPU platform; the install is pristine, so most cases set
``VLLM_PLE_ALLOW_UNPATCHED=1``). Machine facts that a CPU box cannot have (UVA, a seccomp
filter, a missing capability) are injected at the preflight's fact readers.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from tests.vllm import harness
from tests.vllm.synthetic import random_table, write_sidecar

NO_PTRACE = {"CapEff": "0000000000000000", "Seccomp": "2"}
WITH_PTRACE = {"CapEff": f"{1 << 19:016x}", "Seccomp": "2"}


@pytest.fixture
def sidecar(tmp_path):
    cfg = harness.text_config()
    lay = harness.layout(cfg)
    return write_sidecar(tmp_path / "sc", {harness.LAYER: ("bfloat16", random_table(lay.rows, lay.row_bytes, 0))})


def streaming(manifest, **extra):
    return {"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": "pread", "VLLM_PLE_SIDECAR": str(manifest),
            "VLLM_PLE_ALLOW_UNPATCHED": "1", **extra}


def test_unknown_backend(monkeypatch):
    with pytest.raises(SystemExit, match="'ssd' is not a PLE backend; choose one of pinned, mmap, sidecar"):
        harness.load_plugins(monkeypatch, {"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": "ssd"})


def test_pinned_without_uva(monkeypatch):
    with pytest.raises(SystemExit, match=r"(?s)\[error\] uva: .*CpuPlatform.*fix: run on a CUDA GPU"):
        harness.load_plugins(monkeypatch, {"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_ALLOW_UNPATCHED": "1"})


def test_ptrace_denied_with_expandable_segments(monkeypatch, sidecar):
    from vllm_ple_offload import doctor as preflight

    monkeypatch.setattr(preflight, "_status_fields", lambda *a: NO_PTRACE)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(SystemExit, match=r"(?s)\[error\] ptrace: .*pidfd_getfd.*--cap-add SYS_PTRACE.*never --privileged"):
        harness.load_plugins(monkeypatch, streaming(sidecar))


def test_expandable_segments_with_ptrace_only_warns(monkeypatch, sidecar, caplog):
    from vllm_ple_offload import doctor as preflight, post_import as hook

    monkeypatch.setattr(preflight, "_status_fields", lambda *a: WITH_PTRACE)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    with caplog.at_level(logging.WARNING, logger="vllm.ple_offload"):
        harness.load_plugins(monkeypatch, streaming(sidecar))
    assert hook.registered(harness.NVIDIA) == 1
    assert "remove expandable_segments:True" in caplog.text


def test_unpatched_vllm_is_refused(monkeypatch, sidecar):
    settings = streaming(sidecar)
    del settings["VLLM_PLE_ALLOW_UNPATCHED"]
    with pytest.raises(SystemExit, match=r"(?s)not in the patched state .*vllm-ple-offload patch apply.*ALLOW_UNPATCHED=1"):
        harness.load_plugins(monkeypatch, settings)


def _data_dir_copy(tmp_path, edit):
    from sglang_ssd_stream.patching.engines import data_root

    root = tmp_path / "data"
    (root / "hashes").mkdir(parents=True)
    (root / "patches").symlink_to(data_root().resolve() / "patches")
    doc = json.loads((data_root() / "hashes" / "vllm-0.33.0.json").read_text())
    edit(doc)
    (root / "hashes" / "vllm-0.33.0.json").write_text(json.dumps(doc))
    return root


def test_changed_watched_function_is_refused(monkeypatch, sidecar, tmp_path):
    def corrupt(doc):
        doc["watch"][0]["sha256"] = "0" * 64

    monkeypatch.setenv("SSD_STREAM_DATA_DIR", str(_data_dir_copy(tmp_path, corrupt)))
    with pytest.raises(SystemExit, match="has SHA-256 [0-9a-f]{64}, expected 0{64}; the PLE backend swap relies on it"):
        harness.load_plugins(monkeypatch, streaming(sidecar))


def test_unknown_source_state_is_refused(monkeypatch, sidecar, tmp_path):
    def other_pristine(doc):
        doc["files"][0]["pristine"] = "1" * 64

    monkeypatch.setenv("SSD_STREAM_DATA_DIR", str(_data_dir_copy(tmp_path, other_pristine)))
    with pytest.raises(SystemExit, match="unknown or half-patched files are never used"):
        harness.load_plugins(monkeypatch, streaming(sidecar))


def test_release_without_manifest_is_refused(monkeypatch, sidecar, tmp_path):
    root = tmp_path / "empty"
    (root / "hashes").mkdir(parents=True)
    monkeypatch.setenv("SSD_STREAM_DATA_DIR", str(root))
    with pytest.raises(SystemExit, match="vllm 0.33.0 is installed .* which this kit does not know"):
        harness.load_plugins(monkeypatch, streaming(sidecar))


def test_sidecar_directory_without_manifest(monkeypatch, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="sidecar manifest not found"):
        harness.load_plugins(monkeypatch, streaming(tmp_path / "empty"))


def test_truncated_sidecar_table(monkeypatch, sidecar):
    table = sidecar.parent / "ple" / f"layer-{harness.LAYER}.bin"
    data = table.read_bytes()
    table.write_bytes(data[:-8])
    with pytest.raises(SystemExit, match="is truncated"):
        harness.load_plugins(monkeypatch, streaming(sidecar))
    shutil.rmtree(sidecar.parent)


def test_rocm_is_refused(monkeypatch):
    """The PLE backends are verified on CUDA only; on ROCm the swap refuses and names the fix."""
    from vllm.platforms import current_platform

    from vllm_ple_offload.activate import refuse_rocm
    from vllm_ple_offload.errors import PreflightFailed

    monkeypatch.setattr(type(current_platform), "is_rocm", lambda self: True)
    with pytest.raises(PreflightFailed, match="not verified on ROCm; unset VLLM_PLE_CPU_OFFLOAD"):
        refuse_rocm(None)
    monkeypatch.setattr(type(current_platform), "is_rocm", lambda self: False)
    refuse_rocm(None)  # CUDA (and the CPU test platform): no refusal
