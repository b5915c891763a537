"""Drift classes on synthetic 'release' wheels built from the synthetic kit (no network)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

from sglang_ssd_stream.patching.drift import analyse_release
from sglang_ssd_stream.patching.manifest import load_manifest
from sglang_ssd_stream.patching.state import function_sha256

from .conftest import A_PATCHED, A_PRISTINE, B_PATCHED, B_PRISTINE, REPO, sha


def _manifest(kit, watch=None):
    if watch is not None:
        m = json.loads(kit.manifest_file().read_text())
        m["watch"] = watch
        kit.manifest_file().write_text(json.dumps(m))
    return load_manifest(kit.manifest_file())


def _release(a: str | None, b: str | None) -> dict:
    return {"sglang/srt/a.py": None if a is None else a.encode(),
            "sglang/srt/managers/b.py": None if b is None else b.encode()}


def _classes(report):
    return {f.path: f.klass for p in report.patches for f in p.files}, report.patches[0].klass


def test_identical_release(kit):
    report = analyse_release(_manifest(kit), "0.5.24", _release(A_PRISTINE, B_PRISTINE))
    assert _classes(report) == ({"sglang/srt/a.py": "identical", "sglang/srt/managers/b.py": "identical"},
                                "identical")
    cand = report.candidate
    assert {f["path"]: (f["pristine"], f["patched"]) for f in cand["files"]} == {
        "sglang/srt/a.py": (sha(A_PRISTINE), sha(A_PATCHED)),
        "sglang/srt/managers/b.py": (sha(B_PRISTINE), sha(B_PATCHED))}


def test_moved_release_writes_a_candidate_with_new_hashes(kit):
    shifted_a = "# new header line\n# another\n" + A_PRISTINE
    report = analyse_release(_manifest(kit), "0.5.24", _release(shifted_a, B_PRISTINE))
    files, klass = _classes(report)
    assert klass == "moved" and files["sglang/srt/a.py"] == "moved"
    a = next(f for p in report.patches for f in p.files if f.path == "sglang/srt/a.py")
    assert a.offsets == [2, 2]
    entry = next(f for f in report.candidate["files"] if f["path"] == "sglang/srt/a.py")
    expected = "# new header line\n# another\n" + A_PATCHED
    assert entry["pristine"] == sha(shifted_a) and entry["patched"] == sha(expected)


def test_upstream_release(kit):
    report = analyse_release(_manifest(kit), "0.5.24", _release(A_PATCHED, B_PATCHED))
    assert _classes(report)[1] == "upstream"
    assert report.candidate["patches"] == [] and report.candidate["files"] == []


def test_conflict_release_shows_the_failing_hunk(kit):
    rewritten = B_PRISTINE.replace("return n - 5", "return n - 7")
    report = analyse_release(_manifest(kit), "0.5.24", _release(A_PRISTINE, rewritten))
    files, klass = _classes(report)
    assert klass == "conflict" and files["sglang/srt/managers/b.py"] == "conflict"
    b = next(f for p in report.patches for f in p.files if f.path == "sglang/srt/managers/b.py")
    assert "hunk #1" in b.detail and "return n - 5" in b.detail
    assert report.candidate is None


def test_missing_file_is_a_conflict(kit):
    report = analyse_release(_manifest(kit), "0.5.24", _release(A_PRISTINE, None))
    assert _classes(report)[1] == "conflict"


def test_watched_function(kit):
    b_sha = function_sha256(B_PRISTINE.encode(), "limit")
    watch = [{"id": "limit-math", "path": "sglang/srt/managers/b.py", "function": "limit", "sha256": b_sha,
              "why": "the proof assumes this arithmetic"}]
    m = _manifest(kit, watch)
    same = analyse_release(m, "0.5.24", _release(A_PRISTINE, B_PRISTINE))
    assert same.watch[0]["state"] == "same"
    changed = analyse_release(m, "0.5.24", _release(A_PRISTINE, B_PRISTINE.replace("def other():\n    return 1",
                                                                                   "def other():\n    return 2")))
    assert changed.watch[0]["state"] == "same"  # a change elsewhere in the file is not flagged
    changed = analyse_release(m, "0.5.24", _release(A_PRISTINE, B_PATCHED))
    assert changed.watch[0]["state"] == "changed" and "watched code changed: limit-math" in changed.summary()
    gone = analyse_release(m, "0.5.24", _release(A_PRISTINE, "def other():\n    return 1\n"))
    assert gone.watch[0]["state"] == "missing"


def test_arch_mismatch_is_reported(kit):
    m = _manifest(kit)
    report = analyse_release(m, "0.5.24", _release(A_PRISTINE, B_PRISTINE),
                             other_arch=_release(A_PRISTINE, B_PRISTINE + "# arm\n"))
    assert report.arch_mismatch == ["sglang/srt/managers/b.py"]


def test_drift_cli_on_local_wheels(kit, tmp_path):
    """The real CLI over wheel files; no registry needed."""
    wheels = []
    for release, (a, b) in {"0.5.24": (A_PRISTINE, B_PRISTINE), "0.5.25": (A_PATCHED, B_PATCHED),
                            "0.5.26": (A_PRISTINE, B_PRISTINE.replace("n - 5", "n - 9"))}.items():
        w = tmp_path / f"sglang-{release}-cp311-cp311-manylinux_2_34_x86_64.whl"
        with zipfile.ZipFile(w, "w") as zf:
            zf.writestr("sglang/srt/a.py", a)
            zf.writestr("sglang/srt/managers/b.py", b)
        wheels += ["--wheel", str(w)]
    out = tmp_path / "report"
    # The pinned release of the real kit is 0.5.23, so give the synthetic manifest that name (it has it).
    r = subprocess.run([sys.executable, "-m", "sglang_ssd_stream", "patch", "drift", "--data-dir", str(kit.data),
                        "--out", str(out), *wheels], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    assert "| 0001-demo | identical | upstream | conflict |" in r.stdout
    data = json.loads((out / "drift.json").read_text())
    assert [d["patches"][0]["class"] for d in data] == ["identical", "upstream", "conflict"]
    assert (out / "sglang-0.5.24.candidate.json").exists()
    assert not (out / "sglang-0.5.26.candidate.json").exists()
    cand = json.loads((out / "sglang-0.5.24.candidate.json").read_text())
    assert cand["status"].startswith("unreviewed")
