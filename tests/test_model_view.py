"""`model build-view` / `check-view` on synthetic snapshots shaped like the write-up's step 3."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_ssd_stream.errors import EXIT_ENVIRONMENT, EXIT_OK, EXIT_REFUSED
from sglang_ssd_stream.operate.model_view import (
    BACKUP_NAME,
    MARKER_NAME,
    ForeignViewDirectory,
    ModelViewError,
    build_view,
    check_view,
)
from sglang_ssd_stream.sidecar import load_manifest, verify_sidecar
from sglang_ssd_stream.sidecar.errors import SidecarPathEscape
from sglang_ssd_stream.sidecar.verify import SERVE

REPO = Path(__file__).resolve().parents[1]
PLE = "model.language_model.layers.{l}.ple.ple_embedding.ngram_embedding"
DENSE_SHARDS = ["model-bf16-00001-of-00002.safetensors", "model-bf16-00002-of-00002.safetensors"]
EXPERT_SHARDS = [f"layer-{i:02d}-experts-0.safetensors" for i in range(3)]
PLE_SHARDS = [f"model-plefp8-{k:05d}-of-00004.safetensors" for k in range(4)]
SCALE = "model-plefp8-scale.safetensors"
TABLE = "ple/qwen3.8-flash-next-ple-fp8.bin"


def _safetensors(path: Path, name: str) -> None:
    header = json.dumps({name: {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x80\x3e")


def make_snapshots(tmp: Path, *, hf_layout: bool = True) -> tuple[Path, Path, dict]:
    """A dense snapshot (config, index, dense shards, no experts) and a prepared one (experts,
    mtp/, sidecar, scale), the latter as an HF cache snapshot whose files link into blobs/."""
    dense = tmp / "dense"
    dense.mkdir()
    (dense / "config.json").write_text('{"model_type": "qwen4_exp"}')
    (dense / "tokenizer.json").write_text("{}")
    (dense / "chat_template.jinja").write_text("{{ x }}")
    for f in DENSE_SHARDS:
        (dense / f).write_bytes(b"dense" + f.encode())
    wm = {f"model.language_model.layers.{i}.mlp.w{j}": DENSE_SHARDS[j % 2] for i in range(4) for j in range(3)}
    wm.update({f"model.language_model.layers.{i}.mlp.experts.w": EXPERT_SHARDS[i] for i in range(3)})
    for k, f in enumerate(PLE_SHARDS):
        wm[f"{PLE.format(l=3)}.shard_{2 * k}.weight"] = f
        wm[f"{PLE.format(l=3)}.shard_{2 * k + 1}.weight"] = f
    wm[f"{PLE.format(l=3)}.weight_scale"] = SCALE
    index = {"metadata": {"total_size": 1}, "weight_map": wm}
    (dense / "model.safetensors.index.json").write_text(json.dumps(index))

    repo = tmp / "hub" / "models--o--prepared"
    prepared = repo / "snapshots" / ("a" * 40) if hf_layout else tmp / "prepared"
    blobs = repo / "blobs"
    prepared.mkdir(parents=True)
    blobs.mkdir(parents=True)

    def put(rel: str, data: bytes | None = None, writer=None) -> None:
        blob = blobs / hashlib.sha256(rel.encode()).hexdigest()
        if writer:
            writer(blob)
        else:
            blob.write_bytes(data)
        dst = prepared / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if hf_layout:
            os.symlink(os.path.relpath(blob, dst.parent), dst)
        else:
            os.rename(blob, dst)

    rows, cols = 1000, 160
    table = bytes(range(256)) * (rows * cols // 256) + bytes(rows * cols % 256)
    put(TABLE, table)
    put(SCALE, writer=lambda p: _safetensors(p, f"{PLE.format(l=3)}.weight_scale"))
    for f in EXPERT_SHARDS:
        put(f, b"experts" + f.encode())
    put("mtp/model.safetensors", b"mtp")
    manifest = {"format": "sglang-ssd-stream", "version": 1, "tables": [
        {"layer": 3, "path": TABLE, "sha256": hashlib.sha256(table).hexdigest(), "dtype": "float8_e4m3fn",
         "rows": rows, "columns": cols, "row_start": 0, "bytes": rows * cols}]}
    put("ssd-stream.json", json.dumps(manifest).encode())
    return dense, prepared, index


@pytest.fixture
def snaps(tmp_path):
    return make_snapshots(tmp_path)


def cli(*args: str, prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    code = ("import sys, argparse; "
            "from sglang_ssd_stream.operate.model_view import add_model_view_commands as add; "
            "from sglang_ssd_stream.errors import KitError\n"
            "p = argparse.ArgumentParser(); s = p.add_subparsers(required=True); add(s)\n"
            "a = p.parse_args(sys.argv[1:])\n"
            "try: sys.exit(a.func(a))\n"
            "except KitError as e: print(e.message, file=sys.stderr); sys.exit(e.exit_code)")
    return subprocess.run([*(prefix or []), sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)


def test_build_view_layout_index_and_counts(snaps, tmp_path):
    dense, prepared, index = snaps
    view = tmp_path / "view"
    r = cli("build-view", "--dense", str(dense), "--prepared", str(prepared), "-o", str(view))
    assert r.returncode == EXIT_OK, r.stderr
    wm = index["weight_map"]
    kept = {n: f for n, f in wm.items() if ".ngram_embedding.shard_" not in n}
    assert f"weights: {len(kept)} mappings, shards: {len(set(kept.values()))}" in r.stdout
    assert f"removed {len(wm) - len(kept)} PLE shard mappings" in r.stdout and "model view is complete" in r.stdout

    served = json.loads((view / "model.safetensors.index.json").read_text())
    assert served["weight_map"] == kept and served["metadata"] == index["metadata"]
    assert served["weight_map"][f"{PLE.format(l=3)}.weight_scale"] == SCALE  # scale tensor kept
    assert json.loads((view / BACKUP_NAME).read_text()) == index
    assert not any((view / f).exists() for f in PLE_SHARDS)
    for f in DENSE_SHARDS + ["config.json", "tokenizer.json", "chat_template.jinja"]:
        assert (view / f).is_symlink() and os.path.realpath(view / f) == str(dense / f)
    for f in EXPERT_SHARDS + [SCALE, TABLE, "mtp"]:
        assert (view / f).is_symlink() and os.path.samefile(view / f, prepared / f)
    assert (view / "ple").is_dir() and not (view / "ple").is_symlink()
    assert not (view / "ssd-stream.json").is_symlink()  # copied: the verify cache lands beside it
    assert (view / "ssd-stream.json").read_bytes() == (prepared / "ssd-stream.json").read_bytes()


def test_view_sidecar_loads_only_through_its_prepared_snapshot(snaps, tmp_path):
    from sglang_ssd_stream.sidecar.view import load_sidecar

    dense, prepared, _ = snaps
    view = tmp_path / "view"
    build_view(dense, prepared, view)
    with pytest.raises(SidecarPathEscape):  # the table resolves into the prepared snapshot's blobs/
        load_manifest(view)
    m = load_sidecar(view)  # the one loader: the marker's snapshot, table for table
    verify_sidecar(m, caller=SERVE, progress=False)  # what a serving start records
    assert (view / ".ssd-stream-verified.json").is_file()
    check_view(view)  # the verify cache is not a foreign file, not a dangling link
    build_view(dense, prepared, view)  # and a rebuild keeps it
    assert verify_sidecar(load_sidecar(view), progress=False).tables[0].status == "cached"


def test_rebuild_is_idempotent(snaps, tmp_path):
    dense, prepared, _ = snaps
    view = tmp_path / "view"
    first = build_view(dense, prepared, view)
    listing = sorted(str(p.relative_to(view)) for p in view.rglob("*"))
    second = build_view(dense, prepared, view)
    assert second == first
    assert sorted(str(p.relative_to(view)) for p in view.rglob("*")) == listing
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".view.")]  # no temp dirs left


def test_refuses_a_directory_it_did_not_make(snaps, tmp_path):
    dense, prepared, _ = snaps
    view = tmp_path / "view"
    view.mkdir()
    (view / "weights.bin").write_bytes(b"mine")
    with pytest.raises(ForeignViewDirectory, match="was not made by"):
        build_view(dense, prepared, view)
    assert os.listdir(view) == ["weights.bin"]


def test_refuses_a_view_with_foreign_files(snaps, tmp_path):
    dense, prepared, _ = snaps
    view = tmp_path / "view"
    build_view(dense, prepared, view)
    (view / "notes.txt").write_text("added by hand")
    before = sorted(os.listdir(view))
    r = cli("build-view", "--dense", str(dense), "--prepared", str(prepared), "-o", str(view))
    assert r.returncode == EXIT_REFUSED and "notes.txt" in r.stderr
    assert sorted(os.listdir(view)) == before


def test_refuses_a_forged_marker(snaps, tmp_path):
    dense, prepared, _ = snaps
    view = tmp_path / "view"
    view.mkdir()
    (view / MARKER_NAME).write_text('{"format": "something-else", "entries": []}')
    with pytest.raises(ForeignViewDirectory, match="not a sglang-ssd-stream-view marker"):
        build_view(dense, prepared, view)


def test_dangling_expert_link_in_the_prepared_snapshot(snaps, tmp_path):
    dense, prepared, _ = snaps
    os.unlink(os.path.realpath(prepared / EXPERT_SHARDS[1]))  # blob gone, snapshot link dangles
    with pytest.raises(ModelViewError, match=f"{EXPERT_SHARDS[1]}.*dangling link"):
        build_view(dense, prepared, tmp_path / "view")
    assert not (tmp_path / "view").exists()


def test_check_view_finds_a_link_that_went_dangling(snaps, tmp_path):
    dense, prepared, _ = snaps
    view = tmp_path / "view"
    build_view(dense, prepared, view)
    os.unlink(os.path.realpath(prepared / "mtp" / "model.safetensors"))
    r = cli("check-view", str(view))
    assert r.returncode != EXIT_OK and "dangling link" in r.stderr and "mtp/model.safetensors" in r.stderr


def test_check_view_missing_shard_and_missing_required_file(snaps, tmp_path):
    dense, prepared, _ = snaps
    view = tmp_path / "view"
    build_view(dense, prepared, view)
    os.unlink(view / DENSE_SHARDS[0])
    with pytest.raises(ModelViewError, match=f"indexed shard.*{DENSE_SHARDS[0]}"):
        check_view(view)
    build_view(dense, prepared, view)
    os.unlink(view / "config.json")
    with pytest.raises(ModelViewError, match="required file config.json"):
        check_view(view)


def test_shard_in_neither_snapshot(snaps, tmp_path):
    dense, prepared, _ = snaps
    os.unlink(dense / DENSE_SHARDS[1])
    with pytest.raises(ModelViewError, match=f"{DENSE_SHARDS[1]} listed in .* is in neither snapshot"):
        build_view(dense, prepared, tmp_path / "view")


def test_prepared_snapshot_without_sidecar(snaps, tmp_path):
    dense, prepared, _ = snaps
    os.unlink(prepared / "ssd-stream.json")
    with pytest.raises(Exception, match="sidecar manifest not found"):
        build_view(dense, prepared, tmp_path / "view")


def test_read_only_output_directory(snaps, tmp_path):
    """A real read-only bind mount (user namespace), which root cannot write either."""
    dense, prepared, _ = snaps
    parent = tmp_path / "ro"
    parent.mkdir()
    script = 'set -e; mount --bind "$0" "$0"; mount -o remount,bind,ro "$0"; exec "$@"'
    r = cli("build-view", "--dense", str(dense), "--prepared", str(prepared), "-o", str(parent / "view"),
            prefix=["unshare", "-Urm", "sh", "-c", script, str(parent)])
    assert r.returncode == EXIT_ENVIRONMENT, (r.returncode, r.stderr)
    assert "Read-only file system" in r.stderr and "Nothing was changed" in r.stderr
    assert os.listdir(parent) == []


def test_build_view_out_is_a_real_option_and_prefixes_are_refused(snaps, tmp_path, capsys):
    """Issue 17 item 7: the README's `build-view … --out DIR` worked only by argparse prefix matching."""
    from sglang_ssd_stream.cli import main
    from sglang_ssd_stream.errors import EXIT_USAGE

    dense, prepared, _ = snaps
    for flag in ("--out", "--output", "-o"):
        out = tmp_path / f"view{flag.strip('-')}"
        assert main(["model", "build-view", "--dense", str(dense), "--prepared", str(prepared), flag, str(out)]) == 0
        assert (out / MARKER_NAME).is_file()
    with pytest.raises(SystemExit) as exc:
        main(["model", "build-view", "--dense", str(dense), "--prepared", str(prepared), "--outp", str(tmp_path / "x")])
    assert exc.value.code == EXIT_USAGE and not (tmp_path / "x").exists()
    assert "required: -o/--out/--output" in capsys.readouterr().err  # --outp is no abbreviation of anything


def test_a_checkpoint_of_ones_own_keeps_its_mtp_draft(snaps, tmp_path):
    """Issue 43 item 4 (the README's path (b)): `sidecar build` writes only the tables, so the draft stays in the
    checkpoint (--dense); the view links it from there (before: silently left out, and MTP could not start)."""
    dense, prepared, _ = snaps
    shutil.rmtree(prepared / "mtp")
    (dense / "mtp").mkdir()
    (dense / "mtp" / "model.safetensors").write_bytes(b"mtp")
    view = tmp_path / "view"
    build_view(dense, prepared, view)
    assert (view / "mtp").is_symlink() and os.path.samefile(view / "mtp", dense / "mtp")


def test_a_single_file_checkpoint_says_how_to_proceed(snaps, tmp_path):
    """Issue 43 item 4: no index to rewrite; the refusal says what to do instead (the sidecar knob, or a sharded
    save), not only that an index is missing."""
    dense, prepared, _ = snaps
    os.unlink(dense / "model.safetensors.index.json")
    (dense / "model.safetensors").write_bytes(b"x")
    r = cli("build-view", "--dense", str(dense), "--prepared", str(prepared), "-o", str(tmp_path / "view"))
    assert r.returncode != EXIT_OK and "Traceback" not in r.stderr
    assert f"{dense} is a single-file checkpoint" in r.stderr and f"SGLANG_SSD_STREAM_SIDECAR={prepared}" in \
        r.stderr and "VLLM_PLE_SIDECAR" in r.stderr and "max_shard_size" in r.stderr, r.stderr
    assert not (tmp_path / "view").exists()
