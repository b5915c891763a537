"""A runtime patched by an earlier kit (an older version of a patch, or fewer patches) is upgraded, not refused.

Measured before this change: CI's cached runtime, patched by the previous kit, made ``install.sh`` refuse
the upgrade ("unknown sglang source state ... tokenizer_manager.py has SHA-256 67878bcc…"), exit 2, and
the only way on was deleting the venv. The manifest now lists what earlier kits wrote (``earlier``);
such a file is ``outdated``, and apply rewrites it from the pristine backup the earlier apply stored.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from sglang_ssd_stream.errors import EXIT_BAD_KIT_DATA, EXIT_NOT_VERIFIED, EXIT_OK, EXIT_PENDING, EXIT_REFUSED
from sglang_ssd_stream.patching.guard import verdict

from .conftest import B_PATCHED, B_PRISTINE, REPO, run_cli, sha, snapshot

B = "sglang/srt/managers/b.py"
A = "sglang/srt/a.py"
B_EARLIER = B_PRISTINE.replace("return n - 5", "return (n - 5) // 32 * 32")  # an older version of 0001-demo
STATE = (".sglang-ssd-stream", "sglang")


def _list_earlier(kit, rel: str, text: str, patches=("0001-demo",)) -> None:
    path = kit.manifest_file()
    doc = json.loads(path.read_text())
    for f in doc["files"]:
        if f["path"] == rel:
            f.setdefault("earlier", []).append({"sha256": sha(text), "patches": list(patches)})
    path.write_text(json.dumps(doc))


def _earlier_tree(kit) -> None:
    """What an earlier kit leaves: its apply stored the pristine backups; b.py holds its older patch."""
    _list_earlier(kit, B, B_EARLIER)
    assert run_cli(kit, "apply")[0] == EXIT_OK
    kit.path(B).write_text(B_EARLIER)


def _backups(kit) -> set[str]:
    return {p.name for p in kit.site.joinpath(*STATE, "backups").iterdir()}


def test_status_and_verify_name_an_outdated_file_and_write_nothing(kit):
    _earlier_tree(kit)
    before = snapshot(kit.site)
    rc, out, err = run_cli(kit, "status")
    assert rc == EXIT_OK, err
    assert f"outdated  {B}" in out and "patch apply` rewrites it from the pristine backup" in out
    rc, out, _ = run_cli(kit, "verify")
    assert rc == EXIT_NOT_VERIFIED and f"{B} is outdated" in out
    rc, out, _ = run_cli(kit, "status", "--json")
    assert {f["path"]: f["state"] for f in json.loads(out)["files"]} == {A: "patched", B: "outdated"}
    assert snapshot(kit.site) == before


def test_apply_upgrades_from_the_pristine_backup(kit):
    _earlier_tree(kit)
    backups = _backups(kit)
    rc, out, err = run_cli(kit, "apply", "--dry-run")
    assert rc == EXIT_OK and f"would patch {B} (0001-demo) from its pristine backup" in out, (out, err)
    rc, out, err = run_cli(kit, "apply")
    assert rc == EXIT_OK, err
    assert "replacing an earlier kit's 0001-demo" in out and f"keep {A} (already patched)" in out
    assert kit.path(B).read_text() == B_PATCHED
    assert _backups(kit) == backups  # the earlier kit's bytes are not kept as a "pristine" backup
    assert run_cli(kit, "verify")[0] == EXIT_OK
    assert run_cli(kit, "revert")[0] == EXIT_OK
    assert {r: kit.path(r).read_text() for r in kit.files} == {r: p for r, (p, _q) in kit.files.items()}


def test_revert_restores_an_outdated_file(kit):
    _earlier_tree(kit)
    rc, out, err = run_cli(kit, "revert")
    assert rc == EXIT_OK, err
    assert f"restore {B} from backup" in out
    assert kit.path(B).read_text() == B_PRISTINE


def test_without_the_pristine_backup_the_upgrade_is_refused(kit):
    _earlier_tree(kit)
    kit.site.joinpath(*STATE, "backups", sha(B_PRISTINE)).unlink()
    before = snapshot(kit.site)
    rc, out, err = run_cli(kit, "apply")
    assert rc == EXIT_REFUSED and f"no backup of the pristine {B}" in err, (out, err)
    assert snapshot(kit.site) == before


def test_an_unlisted_state_is_still_unknown(kit):
    _earlier_tree(kit)
    kit.path(B).write_text(B_EARLIER + "# edited\n")
    before = snapshot(kit.site)
    rc, out, err = run_cli(kit, "apply")
    assert rc == EXIT_REFUSED and "Refusing to patch an unknown sglang source state" in err
    assert snapshot(kit.site) == before


def test_a_group_an_earlier_state_splits_is_refused(kit):
    """b.py's earlier state holds 0001-demo; a.py pristine lacks it: a half-applied group, as before."""
    _earlier_tree(kit)
    kit.path(A).write_text(kit.files[A][0])
    before = snapshot(kit.site)
    rc, out, err = run_cli(kit, "apply")
    assert rc == EXIT_REFUSED and "half-patched group 0001-demo" in err and f"{A} lacks it (pristine)" in err
    assert snapshot(kit.site) == before


def test_an_earlier_state_that_lacked_the_patch_is_whole_with_pristine_files(kit):
    """A kit with fewer patches: b.py held only 0000-older, so a pristine a.py does not split 0001-demo."""
    _list_earlier(kit, B, B_EARLIER, patches=("0000-older",))
    assert run_cli(kit, "apply")[0] == EXIT_OK
    assert run_cli(kit, "revert")[0] == EXIT_OK
    kit.path(B).write_text(B_EARLIER)
    rc, out, err = run_cli(kit, "apply")
    assert rc == EXIT_OK, err
    assert run_cli(kit, "verify")[0] == EXIT_OK


def test_a_journal_that_started_from_an_earlier_state_is_recovered(kit):
    """A killed upgrade: the journal says before = the earlier state; recovery restores pristine."""
    _earlier_tree(kit)
    journal = kit.site.joinpath(*STATE, "journal.json")
    journal.write_text(json.dumps({"version": 1, "op": "apply", "engine": "sglang", "release": "0.5.23", "files": [
        {"path": B, "before": sha(B_EARLIER), "after": sha(B_PATCHED), "pristine": sha(B_PRISTINE)}]}))
    kit.path(B).write_text(B_PATCHED)  # killed after the rename, before the commit point
    assert run_cli(kit, "status")[0] == EXIT_PENDING
    rc, out, err = run_cli(kit, "recover")
    # a.py keeps 0001-demo while b.py goes back to pristine: the group would be split, so it is refused
    assert rc == EXIT_REFUSED and "patch group 0001-demo mixed" in err, (out, err)
    kit.path(A).write_text(kit.files[A][0])
    kit.site.joinpath(*STATE, "journal.json").write_text(json.dumps({
        "version": 1, "op": "apply", "engine": "sglang", "release": "0.5.23", "files": [
            {"path": A, "before": sha(kit.files[A][0]), "after": sha(kit.files[A][1]),
             "pristine": sha(kit.files[A][0])},
            {"path": B, "before": sha(B_EARLIER), "after": sha(B_PATCHED), "pristine": sha(B_PRISTINE)}]}))
    rc, out, err = run_cli(kit, "recover")
    assert rc == EXIT_OK, err
    assert kit.path(B).read_text() == B_PRISTINE
    assert run_cli(kit, "apply")[0] == EXIT_OK and run_cli(kit, "verify")[0] == EXIT_OK


def test_a_journal_may_not_claim_an_earlier_state_as_its_result(kit):
    _earlier_tree(kit)
    kit.site.joinpath(*STATE, "journal.json").write_text(json.dumps({
        "version": 1, "op": "apply", "engine": "sglang", "release": "0.5.23", "files": [
            {"path": B, "before": sha(B_PATCHED), "after": sha(B_EARLIER), "pristine": sha(B_PRISTINE)}]}))
    rc, out, err = run_cli(kit, "status")
    assert rc == EXIT_REFUSED and "are not the manifest's" in err


def test_the_runtime_guard_calls_it_outdated_and_names_the_fix(kit):
    _earlier_tree(kit)
    v = verdict("sglang", site_packages=kit.site, root=kit.data)
    assert v.state == "outdated", v
    (finding,) = [f for f in v.findings() if f.check == "source"]
    assert finding.level == "error" and "earlier version of this kit's patches" in finding.message
    assert "patch apply" in finding.fix


@pytest.mark.parametrize("earlier, why", [
    ([{"sha256": "x" * 64, "patches": ["0001-demo"]}], "is not a lowercase hex SHA-256"),
    ([{"sha256": sha(B_PATCHED), "patches": ["0001-demo"]}], "must all differ"),
    ([{"sha256": sha(B_EARLIER), "patches": []}], "must list patch ids"),
    ([{"sha256": sha(B_EARLIER)}], "missing field"),
    ([{"sha256": sha(B_EARLIER), "patches": ["0001-demo"], "note": 1}], "unknown field"),
    ({"sha256": sha(B_EARLIER)}, "expected a list"),
])
def test_a_malformed_earlier_list_is_bad_kit_data(kit, earlier, why):
    doc = json.loads(kit.manifest_file().read_text())
    doc["files"][1]["earlier"] = earlier
    kit.manifest_file().write_text(json.dumps(doc))
    rc, out, err = run_cli(kit, "status")
    assert rc == EXIT_BAD_KIT_DATA and why in err, (rc, err)


def test_every_state_the_kit_ever_shipped_is_listed():
    """scripts/earlier_states.py --check over this repository's history: a changed patch without its
    earlier hashes would strand every runtime the previous kit patched."""
    shallow = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--is-shallow-repository"],
                             capture_output=True, text=True)
    if shallow.returncode != 0 or shallow.stdout.strip() == "true":
        pytest.skip("no git history here (not a clone, or a shallow one)")
    r = subprocess.run(["python3", str(REPO / "scripts" / "earlier_states.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
