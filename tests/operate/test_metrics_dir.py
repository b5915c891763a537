"""The Prometheus multiprocess directory of a launch (operate/metrics_dir.py): vLLM's workers reach /metrics only
through PROMETHEUS_MULTIPROC_DIR, so `vllm-ple-offload serve` and the compose file give every start a new empty
one; an exported one is kept unless an earlier run's files are in it (both engines would add them to this run's
counters); sglang makes its own with --enable-metrics."""

from __future__ import annotations

import os
import stat
import tempfile

import pytest

from sglang_ssd_stream.operate.errors import ServeRefused
from sglang_ssd_stream.operate.metrics_dir import PREFIX

from .conftest import write_model
from .test_serve import _parser

VAR = "PROMETHEUS_MULTIPROC_DIR"


@pytest.fixture
def tmp_root(tmp_path, monkeypatch):
    """The system temporary directory serve makes its directory in, watched."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    monkeypatch.delenv(VAR, raising=False)
    return root


def _made(root) -> list:
    """What serve made there (an engine's own import may leave other things, e.g. torch's inductor cache)."""
    return [p for p in root.iterdir() if p.name.startswith(PREFIX)]


def _serve(engine, model, *extra):
    args = _parser(engine).parse_args(["serve", "--profile", "a100x4" if engine == "vllm" else "thor",
                                       "--model", str(model), *extra])
    seen = []

    def fake_exec(file, argv, env):  # what the engine would find at its start
        where = env.get(VAR)
        seen.append({"dir": where, "files": sorted(os.listdir(where)) if where else None,
                     "mode": stat.S_IMODE(os.stat(where).st_mode) if where else None})
        if where:  # the engine's processes write their values there
            with open(os.path.join(where, f"counter_{len(seen)}.db"), "wb") as f:
                f.write(b"\0" * 64)

    assert args.func(args, exec_fn=fake_exec) == 0
    return seen[0]


def test_vllm_serve_gives_each_start_a_new_empty_private_directory_removed_after(tmp_path, tmp_root, capsys):
    model = write_model(tmp_path / "model", sidecar=False, draft=False)
    first = _serve("vllm", model)
    second = _serve("vllm", model)
    for start in (first, second):
        assert start["dir"] and os.path.dirname(start["dir"]) == str(tmp_root), start
        assert start["files"] == [] and start["mode"] == 0o700, start  # empty, this user's only
    assert first["dir"] != second["dir"]  # the first start's counter file never reaches the second
    assert _made(tmp_root) == []  # each removed once its engine ended
    assert f"serve: {VAR}={second['dir']}: new for this start" in capsys.readouterr().err


def test_the_dry_run_shows_it_and_makes_nothing(tmp_path, tmp_root, capsys):
    model = write_model(tmp_path / "model", sidecar=False, draft=False)
    args = _parser("vllm").parse_args(["serve", "--profile", "a100x4", "--model", str(model), "--dry-run"])
    assert args.func(args, exec_fn=lambda *a: pytest.fail("exec in dry run")) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert f'{VAR}="$(mktemp -d)" ' in line.split(" serve ")[0]
    assert _made(tmp_root) == []  # a report writes nothing


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_an_exported_empty_directory_is_kept(tmp_path, tmp_root, monkeypatch, engine):
    model = write_model(tmp_path / "model", sidecar=engine == "sglang", draft=engine == "sglang")
    mine = tmp_path / "mine"
    mine.mkdir()
    monkeypatch.setenv(VAR, str(mine))
    assert _serve(engine, model)["dir"] == str(mine)  # both engines use an exported one as it is
    assert mine.is_dir() and _made(tmp_root) == []  # not the kit's to remove


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_an_exported_directory_with_an_earlier_runs_files_is_refused(tmp_path, tmp_root, monkeypatch, capsys,
                                                                     engine):
    model = write_model(tmp_path / "model", sidecar=engine == "sglang", draft=engine == "sglang")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "counter_4242.db").write_bytes(b"\0" * 64)
    (mine / "tmpabc").mkdir()  # sglang's own subdirectory of an exported one: no values of its own
    monkeypatch.setenv(VAR, str(mine))
    with pytest.raises(ServeRefused, match=rf"metrics_dir: {VAR}={mine} holds 1 metrics file\(s\) of an earlier "
                                           r"run \(counter_4242.db\): their values would be added"):
        _serve(engine, model)
    args = _parser(engine).parse_args(["serve", "--profile", "a100x4" if engine == "vllm" else "thor",
                                       "--model", str(model), "--dry-run"])
    assert args.func(args) == 0
    assert f"# [error] metrics_dir: {VAR}={mine} holds 1 metrics file(s)" in capsys.readouterr().out
    assert (mine / "counter_4242.db").exists()  # refused, never wiped


def test_an_exported_path_that_is_no_directory_is_refused(tmp_path, tmp_root, monkeypatch):
    model = write_model(tmp_path / "model", sidecar=False, draft=False)
    monkeypatch.setenv(VAR, str(tmp_path / "absent"))
    with pytest.raises(ServeRefused, match=rf"{VAR}=.*absent' is not a directory"):
        _serve("vllm", model)


def test_sglang_serve_leaves_it_to_sglang(tmp_path, tmp_root):
    """sglang 0.5.23's --enable-metrics makes a fresh one itself (set_prometheus_multiproc_dir)."""
    model = write_model(tmp_path / "model")
    assert _serve("sglang", model)["dir"] is None


def test_the_compose_file_mounts_a_tmpfs_there():
    from sglang_ssd_stream.operate.service import CONTAINER_METRICS_DIR

    from .test_service import _compose

    out = _compose()
    assert f'      {VAR}: "{CONTAINER_METRICS_DIR}"' in out.split("    environment:\n")[1].split("    cap_add:")[0]
    assert f'    tmpfs:\n      - "{CONTAINER_METRICS_DIR}"\n' in out  # Docker removes it when the container stops
