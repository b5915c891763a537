"""What an e2e start serving an in-place sidecar must show: the manifest it served names the checkpoint's own
shards, and nothing was copied. Shared by both server suites (one start in each serves a checkpoint in place)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from sglang_ssd_stream.sidecar.format import INDEX_NAME, MANIFEST_NAME, VERSION_IN_PLACE, load_manifest
from sglang_ssd_stream.sidecar.verify import CACHE_NAME


def files_of(root: Path) -> dict[str, int]:
    """Every regular file under ``root`` (relative POSIX path -> size)."""
    return {p.relative_to(root).as_posix(): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def in_place_copy(kit, source: Path, dest: Path) -> tuple[Path, dict[str, int]]:
    """A private copy of the checkpoint ``source`` (the shared one stays without a manifest: sglang would find
    one in its model directory) with its in-place manifest, built by the kit's CLI as a user runs it; and the
    copy's files before the build (:func:`files_of`)."""
    shutil.copytree(source, dest)
    before = files_of(dest)
    kit("sidecar", "build", "--in-place", str(dest), "-q")
    return dest, before


def assert_served_in_place(ckpt: Path, before: dict[str, int]) -> None:
    """``ckpt``'s manifest is version 2 and every region of every table lies in a shard file of ``ckpt`` its index
    names (``model.safetensors`` for a checkpoint of one file); ``ckpt`` holds its files ``before`` the build,
    unchanged in size, plus the manifest and the verified cache alone (no table copied anywhere in it)."""
    doc = json.loads((ckpt / MANIFEST_NAME).read_text())
    assert doc["version"] == VERSION_IN_PLACE, doc["version"]
    index = ckpt / INDEX_NAME  # a single-file checkpoint has none: its one file is the shard
    shards = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {"model.safetensors"}
    manifest = load_manifest(ckpt)
    assert manifest.tables and all(t.in_place for t in manifest.tables)
    for t in manifest.tables:
        assert sum(r.rows for r in t.regions) == t.rows
        for r in t.regions:
            assert r.path in shards and r.file == (ckpt / r.path).resolve(), (t.layer, r.path, r.file)
            assert r.tensor and ".ngram_embedding.shard_" in r.tensor, r.tensor
    after = files_of(ckpt)
    assert {k: after[k] for k in before} == before  # every checkpoint file, same size
    assert set(after) - set(before) == {MANIFEST_NAME, CACHE_NAME}, sorted(set(after) - set(before))
    assert after[MANIFEST_NAME] + after[CACHE_NAME] < 1 << 20  # kilobytes: no table's bytes
