"""The patch engine on a synthetic install: happy path, refusals, and that refusals change nothing."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
from filelock import FileLock

from sglang_ssd_stream.errors import (
    EXIT_BAD_KIT_DATA,
    EXIT_ENVIRONMENT,
    EXIT_LOCKED,
    EXIT_NOT_VERIFIED,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
)

from .conftest import REPO, sha


def test_apply_verify_revert_roundtrip(kit):
    before = kit.contents()
    r = kit.cli("status")
    assert r.returncode == EXIT_OK, r.stderr
    assert r.stdout.count("pristine ") == 2
    assert kit.cli("verify").returncode == EXIT_NOT_VERIFIED

    r = kit.cli("apply")
    assert r.returncode == EXIT_OK, r.stderr
    for rel, (_, patched) in kit.files.items():
        assert kit.path(rel).read_text() == patched
    assert kit.cli("verify").returncode == EXIT_OK

    again = kit.cli("apply")
    assert again.returncode == EXIT_OK and "already patched: nothing to do" in again.stdout

    r = kit.cli("revert")
    assert r.returncode == EXIT_OK, r.stderr
    assert kit.contents() == before  # byte-exact
    assert kit.cli("verify").returncode == EXIT_NOT_VERIFIED
    assert "already pristine" in kit.cli("revert").stdout


def test_json_reports(kit):
    r = kit.cli("status", "--json")
    report = json.loads(r.stdout)
    assert report["manifest_release"] == "0.5.23" and report["installed_release"] == "0.5.23"
    assert {f["state"] for f in report["files"]} == {"pristine"}
    assert all(f["sha256"] == f["pristine"] for f in report["files"])
    kit.cli("apply")
    report = json.loads(kit.cli("verify", "--json").stdout)
    assert report["exit_code"] == 0 and {f["state"] for f in report["files"]} == {"patched"}


def test_dry_run_writes_nothing(kit):
    before = kit.contents()
    r = kit.cli("apply", "--dry-run")
    assert r.returncode == EXIT_OK, r.stderr
    assert "would patch sglang/srt/a.py" in r.stdout
    assert kit.contents() == before
    assert not (kit.site / ".sglang-ssd-stream").exists()


def test_dry_run_on_a_patched_site_says_so_plainly(kit):
    assert kit.cli("apply").returncode == EXIT_OK
    r = kit.cli("apply", "--dry-run")
    assert r.returncode == EXIT_OK, r.stderr
    assert "  already patched: nothing to do" in r.stdout and "would already" not in r.stdout


def test_tampered_file_is_refused_with_exact_message(kit):
    target = kit.path("sglang/srt/managers/b.py")
    target.write_text(target.read_text() + "# local edit\n")
    before = kit.contents()
    r = kit.cli("apply")
    assert r.returncode == EXIT_REFUSED
    m = json.loads(kit.manifest_file().read_text())
    entry = next(f for f in m["files"] if f["path"] == "sglang/srt/managers/b.py")
    expected = (f"Refusing to patch an unknown sglang source state: sglang/srt/managers/b.py has SHA-256 "
                f"{sha(before['sglang/srt/managers/b.py'])}; known: 0.5.23={entry['pristine']}/{entry['patched']}")
    assert expected in r.stderr
    assert "Nothing was changed." in r.stderr
    assert kit.contents() == before
    status = kit.cli("status")
    assert "unknown" in status.stdout and kit.cli("verify").returncode == EXIT_NOT_VERIFIED


def test_half_patched_group_is_refused_then_revert_repairs(kit):
    assert kit.cli("apply").returncode == EXIT_OK
    a = kit.path("sglang/srt/a.py")
    a.write_text(kit.files["sglang/srt/a.py"][0])  # someone restored one file by hand
    before = kit.contents()
    r = kit.cli("apply")
    assert r.returncode == EXIT_REFUSED and "half-patched group" in r.stderr
    assert kit.contents() == before
    assert kit.cli("revert").returncode == EXIT_OK
    assert {rel: p.decode() for rel, p in kit.contents().items()} == {r: v[0] for r, v in kit.files.items()}


@pytest.mark.parametrize("damage", ["context", "truncated", "empty", "garbage", "hunk-count"])
def test_corrupt_diff_is_refused(kit, damage):
    diff = kit.diff_file()
    text = diff.read_text()
    if damage == "context":
        text = text.replace(" line 3\n", " line three\n", 1)
    elif damage == "truncated":
        text = text[: len(text) * 2 // 3]
    elif damage == "empty":
        text = text.split("--- ")[0]
    elif damage == "garbage":
        text = text.replace("@@ -", "@@ -x", 1)
    else:
        text = text.replace("+line 30b\n", "", 1)
    diff.write_text(text)
    before = kit.contents()
    r = kit.cli("apply")
    assert r.returncode == EXIT_BAD_KIT_DATA, (r.returncode, r.stderr)
    assert kit.contents() == before
    assert not list(kit.site.rglob("backups/*"))


def test_patched_hash_mismatch_is_refused(kit):
    m = json.loads(kit.manifest_file().read_text())
    m["files"][0]["patched"] = "0" * 64
    kit.manifest_file().write_text(json.dumps(m))
    before = kit.contents()
    r = kit.cli("apply")
    assert r.returncode == EXIT_BAD_KIT_DATA and "manifest expects 000000" in r.stderr
    assert kit.contents() == before


def test_missing_target_file_is_refused(kit):
    kit.path("sglang/srt/a.py").unlink()
    before = kit.path("sglang/srt/managers/b.py").read_bytes()
    r = kit.cli("apply")
    assert r.returncode == EXIT_REFUSED and "sglang/srt/a.py is missing" in r.stderr
    assert kit.path("sglang/srt/managers/b.py").read_bytes() == before
    assert "missing" in kit.cli("status").stdout


@pytest.mark.parametrize("bad_path", ["/etc/passwd", "sglang/../../evil.py", "sglang/./a.py", "other/x.py"])
def test_manifest_path_escape_is_refused(kit, bad_path):
    m = json.loads(kit.manifest_file().read_text())
    m["files"][0]["path"] = bad_path
    kit.manifest_file().write_text(json.dumps(m))
    r = kit.cli("status")
    assert r.returncode == EXIT_BAD_KIT_DATA and repr(bad_path) in r.stderr


def test_symlink_escaping_the_package_is_refused(kit, tmp_path):
    outside = tmp_path / "outside.py"
    outside.write_text(kit.files["sglang/srt/a.py"][0])
    a = kit.path("sglang/srt/a.py")
    a.unlink()
    a.symlink_to(outside)
    r = kit.cli("apply")
    assert r.returncode == EXIT_REFUSED and "sglang/srt/a.py is a symlink" in r.stderr, r.stderr
    assert outside.read_text() == kit.files["sglang/srt/a.py"][0]
    s = kit.cli("status")  # the other files are still listed (issue 15 item 6)
    assert "Traceback" not in s.stderr
    assert "unknown   sglang/srt/a.py" in s.stdout and "pristine  sglang/srt/managers/b.py" in s.stdout


@pytest.mark.parametrize("mutation", ["extra-field", "missing-field", "bad-sha", "unknown-patch", "not-in-series"])
def test_malformed_manifest_is_refused(kit, mutation):
    m = json.loads(kit.manifest_file().read_text())
    if mutation == "extra-field":
        m["files"][0]["note"] = "x"
    elif mutation == "missing-field":
        del m["files"][0]["patched"]
    elif mutation == "bad-sha":
        m["files"][0]["pristine"] = "ABC"
    elif mutation == "unknown-patch":
        m["files"][0]["patches"] = ["0002-nope"]
    else:
        m["patches"] = ["0009-not-in-series"]
    kit.manifest_file().write_text(json.dumps(m))
    before = kit.contents()
    assert kit.cli("apply").returncode == EXIT_BAD_KIT_DATA
    assert kit.contents() == before


def test_diff_touching_an_unlisted_file_is_refused(kit):
    m = json.loads(kit.manifest_file().read_text())
    m["files"] = m["files"][:1]
    kit.manifest_file().write_text(json.dumps(m))
    before = kit.contents()
    r = kit.cli("apply")
    assert r.returncode == EXIT_BAD_KIT_DATA and "does not list" in r.stderr
    assert kit.contents() == before


def test_wrong_engine_release_is_refused(kit):
    dist = next(kit.site.glob("sglang-*.dist-info"))
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.24\n")
    dist.rename(kit.site / "sglang-0.5.24.dist-info")
    before = kit.contents()
    r = kit.cli("apply")
    assert r.returncode == EXIT_REFUSED
    assert "sglang 0.5.24 is installed" in r.stderr and "known releases: 0.5.23" in r.stderr
    assert kit.contents() == before


def test_engine_not_installed(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = subprocess.run([sys.executable, "-m", "sglang_ssd_stream", "patch", "status", "--site-packages", str(empty)],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == EXIT_ENVIRONMENT and "no sglang/ package" in r.stderr


def test_concurrent_installer_is_refused(kit):
    state = kit.site / ".sglang-ssd-stream" / "sglang"
    state.mkdir(parents=True)
    before = kit.contents()
    with FileLock(str(state / "lock")):
        r = kit.cli("apply")
    assert r.returncode == EXIT_LOCKED and "another installer" in r.stderr
    assert kit.contents() == before
    assert kit.cli("apply").returncode == EXIT_OK  # and it works once the lock is free


def test_mode_is_kept(kit):
    a = kit.path("sglang/srt/a.py")
    os.chmod(a, 0o640)
    assert kit.cli("apply").returncode == EXIT_OK
    assert stat.S_IMODE(a.stat().st_mode) == 0o640
    assert kit.cli("revert").returncode == EXIT_OK
    assert stat.S_IMODE(a.stat().st_mode) == 0o640


def test_stale_bytecode_is_dropped(kit):
    cache = kit.path("sglang/srt/a.py").parent / "__pycache__"
    cache.mkdir()
    pyc = cache / "a.cpython-311.pyc"
    pyc.write_bytes(b"stale")
    assert kit.cli("apply").returncode == EXIT_OK
    assert not pyc.exists()


def test_revert_without_backup_is_refused(kit):
    assert kit.cli("apply").returncode == EXIT_OK
    for b in (kit.site / ".sglang-ssd-stream" / "sglang" / "backups").iterdir():
        b.unlink()
    before = kit.contents()
    r = kit.cli("revert")
    assert r.returncode == EXIT_REFUSED and "no backup" in r.stderr
    assert kit.contents() == before


def test_corrupt_backup_is_refused(kit):
    assert kit.cli("apply").returncode == EXIT_OK
    for b in (kit.site / ".sglang-ssd-stream" / "sglang" / "backups").iterdir():
        b.write_bytes(b"corrupt")
    before = kit.contents()
    r = kit.cli("revert")
    assert r.returncode == EXIT_REFUSED and "corrupt" in r.stderr
    assert kit.contents() == before


def test_read_only_site_packages(kit):
    """A real read-only bind mount (user namespace), which root cannot write either."""
    before = kit.contents()
    site = str(kit.site)
    script = ("set -e; mount --bind \"$0\" \"$0\"; mount -o remount,bind,ro \"$0\"; exec \"$@\"")
    cmd = ["unshare", "-Urm", "sh", "-c", script, site]
    r = kit.cli("apply", prefix=cmd)
    assert r.returncode == EXIT_ENVIRONMENT, (r.returncode, r.stderr)
    assert "Nothing was changed" in r.stderr or "nothing was changed" in r.stderr
    assert "EROFS" in r.stderr and "cannot :" not in r.stderr, r.stderr  # the step is named (it was empty)
    assert kit.contents() == before
    s = kit.cli("status", prefix=cmd)  # reading still works
    assert s.returncode == EXIT_OK and s.stdout.count("pristine ") == 2


def test_usage_error_exit_code(kit):
    r = kit.cli("frobnicate")
    assert r.returncode == EXIT_USAGE


def test_python_option_finds_the_install(kit):
    # PYTHONPATH puts the synthetic site first, so the probe in that interpreter finds its sglang/.
    r = subprocess.run([sys.executable, "-m", "sglang_ssd_stream", "patch", "status", "--python", sys.executable,
                        "--data-dir", str(kit.data), "--json"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": f"{kit.site}:{REPO}"})
    assert r.returncode == EXIT_OK, r.stderr
    assert json.loads(r.stdout)["site_packages"] == str(kit.site)


def test_kit_upgrade_with_a_new_patch_applies_only_the_new_group(kit):
    """A runtime patched by an older kit (fewer patches) is upgraded in place: whole groups
    already applied are kept, the new group is applied, and revert still restores everything."""
    from .conftest import A_PATCHED, A_PRISTINE, B_PATCHED, B_PRISTINE, HEADER, unified, write_series

    before = kit.contents()
    pdir = kit.data / "patches" / "sglang"
    (pdir / "0001-demo.patch").write_text(HEADER + unified("sglang/srt/a.py", A_PRISTINE, A_PATCHED))
    (pdir / "0002-more.patch").write_text(HEADER + unified("sglang/srt/managers/b.py", B_PRISTINE, B_PATCHED))
    write_series(kit.data, ["0001-demo", "0002-more"])
    old = {"engine": "sglang", "release": "0.5.23",
           "patches": ["0001-demo"],
           "files": [{"path": "sglang/srt/a.py", "pristine": sha(A_PRISTINE), "patched": sha(A_PATCHED),
                      "patches": ["0001-demo"]}]}
    kit.manifest_file().write_text(json.dumps(old))
    assert kit.cli("apply").returncode == EXIT_OK

    new = dict(old, patches=old["patches"] + ["0002-more"],
        files=old["files"] + [{"path": "sglang/srt/managers/b.py", "pristine": sha(B_PRISTINE),
                               "patched": sha(B_PATCHED), "patches": ["0002-more"]}])
    kit.manifest_file().write_text(json.dumps(new))
    r = kit.cli("apply")
    assert r.returncode == EXIT_OK, r.stderr
    assert "keep sglang/srt/a.py (already patched)" in r.stdout
    assert "patch sglang/srt/managers/b.py (0002-more)" in r.stdout
    assert kit.cli("verify").returncode == EXIT_OK
    assert kit.cli("revert").returncode == EXIT_OK
    assert kit.contents() == before


def test_apply_and_revert_say_each_action_once(kit):
    """Issue 43 item 6: the plan made before the transaction and the one made inside it were both reported."""
    for verb, action in (("apply", "patch "), ("revert", "restore ")):
        r = kit.cli(verb)
        assert r.returncode == EXIT_OK, r.stderr
        said = [line.strip() for line in r.stdout.splitlines() if line.strip().startswith(action)]
        assert len(said) == len(kit.files) and len(set(said)) == len(said), r.stdout
