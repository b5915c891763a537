"""Bad settings and bad machines stop vLLM's real plugin loader with a message that names the fix.

Runs inside the vLLM venv (CPU platform; the install is pristine, so most cases set
``VLLM_PLE_ALLOW_UNPATCHED=1``). Machine facts that a CPU box cannot have (UVA, a seccomp
filter, a missing capability) are injected at the preflight's fact readers.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest

from sglang_ssd_stream.checks.sidecar import forget as forget_sidecars
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
    with pytest.raises(SystemExit, match="'ssd' is not a PLE backend; choose one of pinned, mmap, pread"):
        harness.load_plugins(monkeypatch, {"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": "ssd"})


def test_pinned_without_uva(monkeypatch):
    with pytest.raises(SystemExit, match=r"(?s)\[error\] uva: .*CpuPlatform.*fix: run on a CUDA GPU"):
        harness.load_plugins(monkeypatch, {"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_ALLOW_UNPATCHED": "1"})


def test_ptrace_denied_with_expandable_segments(monkeypatch, sidecar):
    from vllm_ple_offload import doctor as preflight

    monkeypatch.setattr(preflight, "_status_fields", lambda *a: NO_PTRACE)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(SystemExit,
                       match=r"(?s)\[error\] ptrace: .*pidfd_getfd.*--cap-add SYS_PTRACE.*never --privileged"):
        harness.load_plugins(monkeypatch, streaming(sidecar))


def test_expandable_segments_with_ptrace_only_warns(monkeypatch, sidecar, caplog):
    from vllm_ple_offload import doctor as preflight
    from vllm_ple_offload.embedding import StreamedPLEEmbedding

    monkeypatch.setattr(preflight, "_status_fields", lambda *a: WITH_PTRACE)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    with caplog.at_level(logging.WARNING, logger="vllm.ple_offload"):
        harness.load_plugins(monkeypatch, streaming(sidecar))
    assert harness.modules()[0].Qwen4ExpPLEPinnedHostEmbedding is StreamedPLEEmbedding  # started: swapped in
    assert "remove expandable_segments:True" in caplog.text


def test_unpatched_vllm_is_refused(monkeypatch, sidecar):
    settings = streaming(sidecar)
    del settings["VLLM_PLE_ALLOW_UNPATCHED"]
    with pytest.raises(SystemExit,
                       match=r"(?s)vllm 0.33.0 is not patched .*vllm-ple-offload patch apply.*ALLOW_UNPATCHED=1"):
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
    with pytest.raises(SystemExit, match="has SHA-256 [0-9a-f]{64}, expected 0{64}; we rely on it unpatched"):
        harness.load_plugins(monkeypatch, streaming(sidecar))


def test_unknown_source_state_is_refused(monkeypatch, sidecar, tmp_path):
    def other_pristine(doc):
        doc["files"][0]["pristine"] = "1" * 64

    monkeypatch.setenv("SSD_STREAM_DATA_DIR", str(_data_dir_copy(tmp_path, other_pristine)))
    with pytest.raises(SystemExit, match="files match no state this kit knows"):
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


# ----------------------------------------------------------------------------- issue 16


def flip_middle_byte(manifest) -> None:
    table = manifest.parent / "ple" / f"layer-{harness.LAYER}.bin"
    data = bytearray(table.read_bytes())
    data[len(data) // 2] ^= 0x5A
    table.write_bytes(bytes(data))  # same size: only the SHA-256 can tell


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_corrupted_sidecar_never_reaches_a_forward(monkeypatch, sidecar, backend):
    """One byte flipped mid-table (issue 16 item 1): refused before the embedding exists, with the shared
    verifier's message, through vLLM's real plugin loader (the model module is imported already here, so the
    check runs inside load_general_plugins; in a fresh worker it fails the model's import)."""

    flip_middle_byte(sidecar)
    forget_sidecars()
    with pytest.raises(SystemExit,
                       match=r"(?s)\[error\] sidecar_sha: PLE table ple/layer-3.bin \(layer 3\) has SHA-256 "
                             r"[0-9a-f]{64}, expected [0-9a-f]{64}.*never serve it with VLLM_PLE_NO_VERIFY"):
        harness.load_plugins(monkeypatch, streaming(sidecar, VLLM_PLE_OFFLOAD_BACKEND=backend))
    ne, common = harness.modules()
    assert ne.Qwen4ExpPLEPinnedHostEmbedding is common.Qwen4ExpPLEPinnedHostEmbedding  # nothing swapped in


def test_corrupted_sidecar_is_also_refused_at_a_fresh_model_import(tmp_path, sidecar):
    """The worker's order: plugin first, the model module later; the import itself fails."""
    import subprocess
    import sys

    flip_middle_byte(sidecar)
    code = ("import vllm.plugins; vllm.plugins.load_general_plugins(); print('plugins loaded', flush=True); "
            "import vllm.models.qwen4_exp.nvidia.model")
    env = dict(os.environ, **streaming(sidecar))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert "plugins loaded" in r.stdout and r.returncode != 0
    assert "PreflightFailed" in r.stderr and "[error] sidecar_sha: PLE table ple/layer-3.bin" in r.stderr


def test_no_verify_is_the_explicit_opt_out(monkeypatch, sidecar, caplog):
    from vllm_ple_offload import post_import as hook
    from vllm_ple_offload.embedding import StreamedPLEEmbedding

    flip_middle_byte(sidecar)
    forget_sidecars()
    with caplog.at_level(logging.WARNING, logger="vllm.ple_offload"):
        harness.load_plugins(monkeypatch, streaming(sidecar, VLLM_PLE_NO_VERIFY="1"))
    assert hook.registered(harness.NVIDIA) == 1  # one callback: the runtime guard's check, then the swap
    ne, _ = harness.modules()
    assert ne.Qwen4ExpPLEPinnedHostEmbedding is StreamedPLEEmbedding
    assert "VLLM_PLE_NO_VERIFY=1" in caplog.text and "corrupted row would be served" in caplog.text


def test_verified_sidecar_is_hashed_once_then_cached(monkeypatch, sidecar):
    from sglang_ssd_stream.sidecar import verify

    forget_sidecars()
    hashed = []
    real = verify.sha256_file
    monkeypatch.setattr(verify, "sha256_file", lambda *a, **k: hashed.append(a[0]) or real(*a, **k))
    harness.load_plugins(monkeypatch, streaming(sidecar))
    assert len(hashed) == 1
    forget_sidecars()  # a new process: the verified cache answers, nothing is re-read
    harness.load_plugins(monkeypatch, streaming(sidecar))
    assert len(hashed) == 1
    assert (sidecar.parent / ".ssd-stream-verified.json").is_file()


def test_fetch_round_beyond_the_bound_is_refused_naming_the_knob(monkeypatch, sidecar):
    """256 workers x 1,048,576 rows per task (issue 16 item 4): refused before any buffer exists."""
    with pytest.raises(SystemExit, match=r"(?s)\[error\] fetch_round: .*256 x 1,048,576 x 8 B = 2.00 GiB.*"
                                         r"fix: lower VLLM_PLE_ROWS_PER_TASK to at most 131,072"):
        harness.load_plugins(monkeypatch, streaming(sidecar, VLLM_PLE_FETCH_WORKERS="256",
                                                    VLLM_PLE_ROWS_PER_TASK="1048576"))


@pytest.mark.parametrize("value", ["+8", "1_6", " 8 ", "\u0668"])
def test_numbers_are_ascii_digits_only(monkeypatch, sidecar, value):
    with pytest.raises(SystemExit, match=r"VLLM_PLE_FETCH_WORKERS=.* is not an integer 1\.\.256 \(ASCII digits only\)"):
        harness.load_plugins(monkeypatch, streaming(sidecar, VLLM_PLE_FETCH_WORKERS=value))


def test_unknown_variable_stops_the_process(monkeypatch, sidecar):
    with pytest.raises(SystemExit, match=r"unknown variable\(s\) VLLM_PLE_BOGUS"):
        harness.load_plugins(monkeypatch, streaming(sidecar, VLLM_PLE_BOGUS="1"))


# The runtime guard (issue 16 item 8): what the plugin's own hook sees when vLLM runs it.

def test_watched_functions_pass_as_released(monkeypatch, sidecar):
    from vllm_ple_offload import post_import as hook
    from vllm_ple_offload import runtime_guard

    harness.load_plugins(monkeypatch, streaming(sidecar))
    for module in ("vllm.models.qwen4_exp.common.ngram_embedding", "vllm.models.qwen4_exp.common.ple",
                   "vllm.compilation.breakable_cudagraph", harness.NVIDIA, "vllm.models.qwen4_exp.amd.ple_layer"):
        assert hook.registered(module) == 1, module  # checked now, or when imported (amd: ROCm only)
    assert runtime_guard.module_name("vllm/models/qwen4_exp/common/ple.py") == "vllm.models.qwen4_exp.common.ple"


def _common():
    return harness.modules()[1]


@pytest.mark.parametrize("how", ["rebound", "wrapped", "staticmethod"])
def test_method_changed_after_the_class_definition_is_refused(monkeypatch, sidecar, how):
    import functools

    cls = _common().Qwen4ExpPLEEmbedding
    original = cls.__dict__["_gather_dp_ids"]

    def replacement(self, ngram_ids, slot_size):
        return original(self, ngram_ids, slot_size)

    new = {"rebound": replacement, "wrapped": functools.wraps(original)(replacement),
           "staticmethod": staticmethod(replacement)}[how]
    with pytest.raises(SystemExit,
                       match=r"not the code the kit verified: vllm/models/qwen4_exp/common/ngram_embedding.py:"
                             r"Qwen4ExpPLEEmbedding._gather_dp_ids as Python calls it is not the verified "
                             r"function"):
        harness.load_plugins(monkeypatch, streaming(sidecar),
                             prepare=lambda ne: monkeypatch.setattr(cls, "_gather_dp_ids", new))


def test_decorated_method_rewrapped_by_another_decorator_is_refused(monkeypatch, sidecar):
    """_finalize_prefetch is released wrapped by @eager_break_during_capture (itself watched): any other
    wrapper is refused, the released one passes (the first test)."""
    import functools

    cls = _common().Qwen4ExpPLEPinnedHostEmbedding
    released = cls.__dict__["_finalize_prefetch"]

    @functools.wraps(released)
    def outer(*a, **k):
        return released(*a, **k)

    with pytest.raises(SystemExit, match=r"Qwen4ExpPLEPinnedHostEmbedding._finalize_prefetch is not the wrapper "
                                         r"@eager_break_during_capture builds"):
        harness.load_plugins(monkeypatch, streaming(sidecar),
                             prepare=lambda ne: monkeypatch.setattr(cls, "_finalize_prefetch", outer))


def test_module_global_rebound_is_refused(monkeypatch, sidecar):
    import vllm.compilation.breakable_cudagraph as bc

    with pytest.raises(SystemExit,
                       match=r"vllm/compilation/breakable_cudagraph.py:eager_break_during_capture as Python "
                             r"calls it is not the verified function"):
        harness.load_plugins(monkeypatch, streaming(sidecar),
                             prepare=lambda ne: monkeypatch.setattr(bc, "eager_break_during_capture", lambda fn: fn))


def test_class_rebound_is_refused(monkeypatch, sidecar):
    common = _common()
    other = type("Qwen4ExpPLEEmbedding", (common.Qwen4ExpPLEEmbedding,), {})
    with pytest.raises(SystemExit, match=r"ngram_embedding.py:Qwen4ExpPLEEmbedding.__init__ is None, not a function"):
        harness.load_plugins(monkeypatch, streaming(sidecar),
                             prepare=lambda ne: monkeypatch.setattr(common, "Qwen4ExpPLEEmbedding", other))


def test_a_table_kept_outside_the_artifact_streams_only_from_a_named_root(monkeypatch, tmp_path):
    """A table linked to another disk: refused when the plugin loads, naming the knob;
    VLLM_PLE_TRUSTED_ROOTS=<that disk> (as SGLang's SGLANG_SSD_STREAM_TRUSTED_ROOTS) streams its rows, bit-exact."""
    cfg = harness.text_config()
    lay = harness.layout(cfg)
    table = random_table(lay.rows, lay.row_bytes, 11)
    manifest = write_sidecar(tmp_path / "sc", {harness.LAYER: ("bfloat16", table)})
    disk2 = tmp_path / "disk2"
    disk2.mkdir()
    link = tmp_path / "sc" / "ple" / f"layer-{harness.LAYER}.bin"
    link.rename(disk2 / link.name)
    link.symlink_to(disk2 / link.name)
    with harness.distributed(1):
        with pytest.raises(SystemExit, match=r"symlink escape.*VLLM_PLE_TRUSTED_ROOTS"):
            harness.load_plugins(monkeypatch, streaming(manifest, VLLM_PLE_OFFLOAD_BACKEND="mmap"))
        harness.load_plugins(monkeypatch, streaming(manifest, VLLM_PLE_OFFLOAD_BACKEND="mmap",
                                                    VLLM_PLE_TRUSTED_ROOTS=str(disk2)))
        _streams_bit_exact(cfg, table, 5)


def test_a_model_views_sidecar_streams_its_rows(monkeypatch, tmp_path):
    """VLLM_PLE_SIDECAR = a model view (the vLLM thor profile's {model}): the doctor, the SHA-256 check
    and the embedding all load it with the view's trusted roots, as SGLang does."""
    from tests.vllm.synthetic import write_view

    cfg = harness.text_config()
    lay = harness.layout(cfg)
    table = random_table(lay.rows, lay.row_bytes, 7)
    write_sidecar(tmp_path / "prepared", {harness.LAYER: ("bfloat16", table)})
    view = write_view(tmp_path / "view", tmp_path / "prepared")
    with harness.distributed(1):
        harness.load_plugins(monkeypatch, streaming(view, VLLM_PLE_OFFLOAD_BACKEND="mmap"))
        _streams_bit_exact(cfg, table, 3)


def _streams_bit_exact(cfg, table, seed: int) -> None:
    """The real embedding of the plugin just loaded looks up a batch: the table's own rows, bit for bit."""
    import torch

    model = harness.build(cfg)
    ids, qsl, ctx = harness.ngram_batch(seed)
    model.start_prefetch(ids, qsl, ctx)
    got = model(torch.empty(0), ids, qsl, ctx)
    want = harness.rows_of(table, model.compute_ngram_ids(ids, qsl, ctx))
    assert got.contiguous().view(torch.uint8).numpy().tobytes() == want.tobytes()
