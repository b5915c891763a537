"""Drift classes on real sglang wheels (0.5.22 and 0.5.23, fetched once into the cache)."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
from pathlib import Path

import pytest

from sglang_ssd_stream.patching.diff import apply_file, load_patch
from sglang_ssd_stream.patching.drift import analyse_release, wheel_files
from sglang_ssd_stream.patching.engines import ENGINES
from sglang_ssd_stream.patching.manifest import known_manifests, load_manifest
from sglang_ssd_stream.patching.wheels import fetch_wheel, wheel_file_bytes

ENGINE = ENGINES["sglang"]


@pytest.fixture(scope="module")
def cache() -> Path:
    return Path(os.environ.get("SSD_STREAM_CACHE") or pytest.fail("run through scripts/test.sh"))


@pytest.fixture(scope="module")
def pinned():
    return next(m for m in known_manifests(ENGINE) if m.release == ENGINE.pinned)


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def test_pinned_release_is_identical(pinned, cache):
    wheel = fetch_wheel(ENGINE, pinned.release, "x86_64", cache)
    report = analyse_release(pinned, pinned.release, wheel_files(pinned, wheel))
    assert {p.klass for p in report.patches} == {"identical"}


def _only(manifest, patch_id):
    """The pinned manifest restricted to one patch (its files), as a maintainer porting it would see it."""
    return dataclasses.replace(manifest, patches=tuple(p for p in manifest.patches if p.id == patch_id),
                               files=tuple(f for f in manifest.files if f.patches == (patch_id,)), watch=())


def test_previous_release_is_moved_with_a_consistent_candidate(pinned, cache):
    """tokenizer_manager.py etc. changed between 0.5.22 and 0.5.23; the truncation hunks moved."""
    wheel = fetch_wheel(ENGINE, "0.5.22", "x86_64", cache)
    files = wheel_files(pinned, wheel)
    classes = {p.patch: p.klass for p in analyse_release(pinned, "0.5.22", files).patches}
    assert classes["0001-page-safe-truncation"] == "moved"
    pinned = _only(pinned, "0001-page-safe-truncation")
    report = analyse_release(pinned, "0.5.22", files)
    patch = report.patches[0]
    assert patch.klass == "moved"
    assert any(o != 0 for f in patch.files for o in f.offsets)  # really at another offset
    # The candidate's pristine hashes are the 0.5.22 files; its patched hashes are what the diff produces there.
    parsed = load_patch(pinned.diff_path(pinned.patches[0]), pinned.patches[0].id)
    for entry in report.candidate["files"]:
        data = files[entry["path"]]
        assert entry["pristine"] == _sha(data)
        out, _ = apply_file(data, parsed.files[entry["path"]], path=entry["path"], find_offsets=True)
        assert entry["patched"] == _sha(out)


def test_fix_already_upstream_is_recognised(pinned, cache):
    """A release that already carries the change: our own patched files, presented as a release."""
    wheel = fetch_wheel(ENGINE, pinned.release, "x86_64", cache)
    files = wheel_files(pinned, wheel)
    parsed = load_patch(pinned.diff_path(pinned.patches[0]), pinned.patches[0].id)
    landed = {p: (apply_file(b, parsed.files[p], path=p)[0] if p in parsed.files else b) for p, b in files.items()}
    report = analyse_release(pinned, "9.9.9", landed)
    assert report.patches[0].klass == "upstream"
    kept = report.candidate["patches"]
    assert pinned.patches[0].id not in kept and kept == [p.id for p in pinned.patches[1:]]


def test_conflict_on_a_line_that_changed_between_releases(pinned, cache, tmp_path):
    """A probe patch editing a scheduler.py line that is new in 0.5.23 cannot apply to 0.5.22."""
    rel = "sglang/srt/managers/scheduler.py"
    new = wheel_file_bytes(fetch_wheel(ENGINE, "0.5.23", "x86_64", cache), rel).decode()
    old = wheel_file_bytes(fetch_wheel(ENGINE, "0.5.22", "x86_64", cache), rel).decode()
    old_lines = set(old.splitlines())
    new_lines = new.splitlines(keepends=True)
    i = next(i for i, line in enumerate(new_lines) if line.strip() and line.rstrip("\n") not in old_lines
             and i > 10)
    edited = new_lines[:i] + ["# probe edit\n"] + new_lines[i:]
    diff = ("Description: probe\nOrigin: vendor\nBug: none (a probe)\nForwarded: no\nLast-Update: 2026-12-01\n"
            "Test: tests/sglang/test_drift_real_wheels.py\n\n"
            + "".join(difflib.unified_diff(new_lines, edited, f"a/{rel}", f"b/{rel}")))
    data = tmp_path / "data"
    (data / "patches" / "sglang").mkdir(parents=True)
    (data / "hashes").mkdir()
    (data / "patches" / "sglang" / "0001-probe.patch").write_text(diff)
    (data / "patches" / "sglang" / "series").write_text("0001-probe.patch\n")
    manifest = {"engine": "sglang", "release": "0.5.23", "patches": ["0001-probe"],
                "files": [{"path": rel, "pristine": _sha(new.encode()), "patched": _sha("".join(edited).encode()),
                           "patches": ["0001-probe"]}]}
    (data / "hashes" / "sglang-0.5.23.json").write_text(json.dumps(manifest))
    probe = load_manifest(data / "hashes" / "sglang-0.5.23.json")
    report = analyse_release(probe, "0.5.22", {rel: old.encode()})
    assert report.patches[0].klass == "conflict"
    assert "hunk #1" in report.patches[0].files[0].detail
    assert report.candidate is None
