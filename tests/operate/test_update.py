"""update-model with the real huggingface_hub, offline: a prepared cache, a missing revision, bad snapshots."""

from __future__ import annotations

import json

import pytest

from sglang_ssd_stream.operate.errors import ModelUpdateError, Offline
from sglang_ssd_stream.operate.update import read_state, update_model

from .conftest import SIDES, write_model

REPO = "org/prepared"
C1, C2 = "1" * 40, "2" * 40


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the test machine reaches no hub; the cache answers
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)


def _cache_snapshot(data, commit, ref="main", **kw):
    """Lay out huggingface_hub's cache as a download would: snapshots/<commit>/ and refs/<ref>."""
    repo = data / "huggingface" / "hub" / "models--org--prepared"
    snap = write_model(repo / "snapshots" / commit, **kw)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snap


def test_update_from_cache_pins_commit_and_keeps_old(tmp_path, capsys):
    data = tmp_path / "data"
    s1 = _cache_snapshot(data, C1)
    r = update_model(data, REPO, "main", progress=False)
    assert (r.changed, r.old_revision, r.new_revision, r.snapshot) == (True, None, C1, str(s1))
    st = read_state(data)
    assert (st["model_repo"], st["model_revision"], st["requested_revision"], st["history"]) == (REPO, C1, "main", [])
    again = update_model(data, REPO, "main", progress=False)
    assert again.changed is False
    s2 = _cache_snapshot(data, C2)
    r2 = update_model(data, REPO, "main", progress=False)
    assert (r2.old_revision, r2.new_revision) == (C1, C2)
    st = read_state(data)
    assert st["snapshot"] == str(s2) and st["history"] == [{"model_repo": REPO, "model_revision": C1,
                                                            "snapshot": str(s1)}]
    assert s1.is_dir() and (s1 / "ssd-stream.json").is_file()  # never deleted automatically


def test_offline_and_not_cached_is_a_clear_refusal(tmp_path):
    data = tmp_path / "data"
    with pytest.raises(Offline, match=r"cannot reach the model hub for org/prepared@v9 .*Nothing was changed"):
        update_model(data, REPO, "v9", progress=False)
    assert read_state(data) is None


def test_corrupt_sidecar_leaves_state_unchanged(tmp_path):
    data = tmp_path / "data"
    _cache_snapshot(data, C1)
    update_model(data, REPO, "main", progress=False)
    before = (data / "state.json").read_bytes()
    s2 = _cache_snapshot(data, C2)
    table = s2 / "ple" / "layer-3.bin"
    table.write_bytes(b"\xff" + table.read_bytes()[1:])
    with pytest.raises(ModelUpdateError, match="PLE sidecar .* failed verification: .*SHA-256"):
        update_model(data, REPO, "main", progress=False)
    assert (data / "state.json").read_bytes() == before


def test_incomplete_index_refused(tmp_path):
    data = tmp_path / "data"
    s = _cache_snapshot(data, C1)
    (s / "model-00002.safetensors").unlink()
    with pytest.raises(ModelUpdateError, match="maps tensors to missing shard.*model-00002.safetensors"):
        update_model(data, REPO, "main", progress=False)
    assert read_state(data) is None


def test_missing_required_file_refused(tmp_path):
    data = tmp_path / "data"
    _cache_snapshot(data, C1, sidecar=False)
    with pytest.raises(ModelUpdateError, match="lacks ssd-stream.json"):
        update_model(data, REPO, "main", progress=False)


def test_empty_revision_and_bad_state(tmp_path):
    with pytest.raises(ModelUpdateError, match="empty revision names nothing"):
        update_model(tmp_path, REPO, "")
    (tmp_path / "state.json").write_text("{]")
    with pytest.raises(ModelUpdateError, match="state.json is unreadable"):
        read_state(tmp_path)
    (tmp_path / "state.json").write_text(json.dumps({"version": 7}))
    with pytest.raises(ModelUpdateError, match="not a version-1 state file"):
        read_state(tmp_path)


def test_update_command_output(tmp_path, capsys):
    import argparse

    from sglang_ssd_stream.operate import add_operate_commands

    data = tmp_path / "data"
    _cache_snapshot(data, C1)
    p = argparse.ArgumentParser()
    add_operate_commands(p.add_subparsers(dest="command", required=True), SIDES["sglang"])
    args = p.parse_args(["update-model", "--repo", REPO, "--revision", "main", "--data-dir", str(data), "-q"])
    assert args.func(args) == 0
    assert capsys.readouterr().out.startswith(f"Model updated: (none) -> {C1}\n")
    assert args.func(args) == 0
    assert capsys.readouterr().out == f"Model is current: {REPO}@{C1}\n"


def test_update_command_in_the_thor_recipes_form(tmp_path, capsys):
    """Write-up 000 step 2 runs `update-model --data-dir DIR`: no --revision, so the branch head (main) is
    resolved to its commit and pinned (issue 17 item 7: that form exited 64)."""
    from sglang_ssd_stream.cli import main

    data = tmp_path / "data"
    repo = data / "huggingface" / "hub" / "models--garnermccloud--Qwen3.8-Flash-Next-NVFP4-SSD-Stream"
    write_model(repo / "snapshots" / C1)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(C1)
    assert main(["update-model", "--data-dir", str(data), "-q"]) == 0
    assert capsys.readouterr().out.startswith(f"Model updated: (none) -> {C1}\n")
    st = read_state(data)
    assert (st["model_repo"], st["model_revision"], st["requested_revision"]) == (
        "garnermccloud/Qwen3.8-Flash-Next-NVFP4-SSD-Stream", C1, "main")
