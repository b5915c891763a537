"""`serve`'s preflight (and so `serve --dry-run`) warns when the launch makes the engine read the model's files
whole while its index maps the PLE shards a sidecar streams: sglang's `--weight-loader-disable-mmap`, vLLM's
`--safetensors-load-strategy eager` (each engine's own iterator reads them so: the checks
`…weight_iterator_maps_a_ple_shard…` in tests/sglang and tests/vllm)."""

from __future__ import annotations

import pytest

from sglang_ssd_stream.findings import WARNING
from sglang_ssd_stream.operate.model_view import build_view
from sglang_ssd_stream.operate.preflight import loader_findings
from sglang_ssd_stream.operate.profiles import PROFILES_BY_ENGINE
from sglang_ssd_stream.sidecar.in_place import build_in_place

from .conftest import add_ple_shards, write_model


@pytest.fixture
def in_place(tmp_path):
    m = write_model(tmp_path / "ckpt", sidecar=False, draft=False)
    add_ple_shards(m)
    build_in_place(m, progress=False)
    return m


CASES = [("sglang", ["--weight-loader-disable-mmap"]), ("vllm", ["--safetensors-load-strategy", "eager"]),
         ("vllm", ["--safetensors-load-strategy=eager"])]


@pytest.mark.parametrize(("engine", "flags"), CASES)
def test_a_whole_file_load_of_the_checkpoint_itself_is_a_warning(in_place, engine, flags):
    profile = next(iter(PROFILES_BY_ENGINE[engine].values()))
    argv = ["serve", "--port", "8000", *flags]
    (f,) = loader_findings(profile, str(in_place), argv)
    assert f.level == WARNING and f.check == "loader", f
    assert f.message.startswith(f"{' '.join(flags).replace('=', ' ')} makes {engine} read every file of {in_place}")
    assert "the 2 PLE shard tensor(s) the sidecar streams" in f.message
    assert f"model build-view --dense {in_place} --prepared {in_place}" in f.fix


@pytest.mark.parametrize(("engine", "flags"), CASES)
def test_no_warning_by_default_for_a_view_or_without_a_sidecar(in_place, tmp_path, engine, flags):
    profile = next(iter(PROFILES_BY_ENGINE[engine].values()))
    assert loader_findings(profile, str(in_place), ["serve"]) == []  # the engines' default maps the files
    assert loader_findings(profile, str(in_place), ["serve", "--safetensors-load-strategy", "lazy"]) == []
    view = tmp_path / "view"
    build_view(in_place, in_place, view)
    assert loader_findings(profile, str(view), ["serve", *flags]) == []  # no PLE shard in its index
    (in_place / "ssd-stream.json").unlink()
    assert loader_findings(profile, str(in_place), ["serve", *flags]) == []  # the engine's own table: its choice
