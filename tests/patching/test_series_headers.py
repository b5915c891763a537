"""The shipped kit data: one series per engine holds the order, every patch in it carries a complete
DEP-3 header, manifests hold only per-release data, and git never converts their bytes."""

from __future__ import annotations

import json
import subprocess

import pytest

from sglang_ssd_stream.errors import BadKitData
from sglang_ssd_stream.patching.diff import HEADER_FIELDS_REQUIRED, load_patch, parse_header, upstream_status
from sglang_ssd_stream.patching.engines import ENGINES, data_root
from sglang_ssd_stream.patching.manifest import known_manifests
from sglang_ssd_stream.patching.series import load_series, patch_path

from .conftest import REPO

ROOT = data_root()


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_series_lists_exactly_the_patch_files(engine):
    series = load_series(ROOT, ENGINES[engine])
    on_disk = sorted(p.stem for p in (ROOT / "patches" / engine).glob("*.patch"))
    assert sorted(series) == on_disk
    assert list(series) == sorted(series), "series order is the numbering order"


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_every_patch_in_the_series_has_a_complete_header(engine):
    for pid in load_series(ROOT, ENGINES[engine]):
        header = load_patch(patch_path(ROOT, ENGINES[engine], pid), pid).header
        assert all(header.get(f) for f in HEADER_FIELDS_REQUIRED), (pid, header)
        assert (REPO / header["Test"]).is_file(), f"{pid}: Test {header['Test']} does not exist"
        assert upstream_status(header).startswith("bug ")


def test_0002_names_the_upstream_pull_request():
    header = load_patch(patch_path(ROOT, ENGINES["sglang"], "0002-qsa-fp8-kv-descales"), "0002").header
    assert header["Bug"] == "https://github.com/sgl-project/sglang/pull/36644"


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_manifests_hold_only_per_release_data(engine):
    manifests = known_manifests(ENGINES[engine])
    assert manifests
    series = load_series(ROOT, ENGINES[engine])
    for m in manifests:
        raw = json.loads(m.source.read_text())
        assert set(raw) <= {"engine", "release", "patches", "files", "watch", "wheels"}
        assert all(isinstance(p, str) for p in raw["patches"]), "patches are ids; order/diff/upstream are gone"
        ids = [p.id for p in m.patches]
        assert ids == [p for p in series if p in ids]


HEADER = ("Description: x\nOrigin: vendor\nBug: none (x)\nForwarded: no\nLast-Update: 2026-12-01\n"
          "Test: tests/x.py\n\n--- a/x\n")


@pytest.mark.parametrize("edit,message", [
    (lambda h: h.replace("Bug: none (x)\n", ""), "lacks ['Bug']"),
    (lambda h: h.replace("Forwarded: no", "Forwarded: maybe"), "Forwarded 'maybe'"),
    (lambda h: h.replace("2026-12-01", "2026-13-01"), "Last-Update '2026-13-01'"),
    (lambda h: h.replace("Bug: none (x)", "Bug: see slack"), "Bug 'see slack'"),
    (lambda h: h.replace("Origin: vendor", "Origin: me"), "Origin 'me'"),
    (lambda h: h.replace("Test: tests/x.py", "Test: ../x.py"), "Test '../x.py'"),
    (lambda h: h.replace("Origin: vendor\n", "Origin: vendor\nOrigin: other\n"), "gives Origin twice"),
])
def test_header_parser_refuses(edit, message):
    assert parse_header(HEADER, "t")["Bug"] == "none (x)"
    with pytest.raises(BadKitData, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        parse_header(edit(HEADER), "t")


def test_git_never_converts_patches_or_hashes():
    for path in ("patches/sglang/series", "patches/sglang/0001-page-safe-truncation.patch",
                 "hashes/sglang-0.5.23.json", "hashes/locks/anything.txt"):
        out = subprocess.run(["git", "check-attr", "text", "eol", "--", path], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout
        assert f"{path}: text: unset" in out and f"{path}: eol: lf" in out, out
    for p in [*(REPO / "patches").rglob("*"), *(REPO / "hashes").rglob("*")]:
        if p.is_file():
            assert b"\r" not in p.read_bytes(), f"{p} has a carriage return"
