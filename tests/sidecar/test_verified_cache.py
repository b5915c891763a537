"""Issue 38 item 2: the verified cache's one rule, both engines alike (docs/sidecar.md, "The verified cache").

Only a serving load and the sidecar's own writers record; every report (``sidecar verify``, the doctors) reads the
cache and writes nothing anywhere. A planted entry lets a changed table skip its SHA-256 only from a file that
nobody but the serving user or root could have written, for this very manifest: each other way in is refused.
The vLLM runtime's commands: tests/vllm/test_doctor.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_ssd_stream.sidecar import SidecarChecksumMismatch, load_manifest, verify_sidecar
from sglang_ssd_stream.sidecar.verify import CACHE_NAME, SERVE, file_key
from tests.fs_state import tree_state

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def data(tmp_path, monkeypatch):
    """The kit's data directory (the cache's fallback and its lock live there), empty."""
    d = tmp_path / "data"
    d.mkdir()
    monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(d))
    return d


def _change_bytes(art: Path) -> None:
    """One byte of the table flipped in place (same size, so only the SHA-256 tells)."""
    table = load_manifest(art).tables[0].file
    raw = bytearray(table.read_bytes())
    raw[12345] ^= 1
    table.write_bytes(bytes(raw))


def _prepare(art: Path, state: str) -> None:
    """The two states a writer would change: no cache at all (it would create one, and a lock), and the build's
    cache with the table changed since (it would drop the table's entry)."""
    if state == "no cache":
        (art / CACHE_NAME).unlink()
    else:
        _change_bytes(art)


# --------------------------------------------------------------------------------------------- reports write nothing


@pytest.mark.parametrize("state", ["no cache", "stale cache"])
def test_a_report_writes_nothing(small, data, tmp_path, state):
    """verify_sidecar as every report calls it: hashes and says so, records nothing, takes no lock; it reads what
    a serving load recorded."""
    _, art = small
    _prepare(art, state)
    before = tree_state(art, data)
    report = verify_sidecar(art, progress=False, raise_on_mismatch=False, cache_dir=tmp_path / "c")
    assert [t.status for t in report.tables] == (["verified"] if state == "no cache" else ["mismatch"])
    assert report.cache_file is None if state == "no cache" else report.cache_file == str(art / CACHE_NAME)
    assert tree_state(art, data) == before and not (tmp_path / "c").exists()
    if state == "no cache":
        assert verify_sidecar(art, caller=SERVE, progress=False).tables[0].status == "verified"
        before = tree_state(art, data)
        report = verify_sidecar(art, progress=False)
        assert report.tables[0].status == "cached" and report.cache_file == str(art / CACHE_NAME)
        assert tree_state(art, data) == before


def _kit(tmp_path: Path, data: Path, *argv: str, **env: str) -> subprocess.CompletedProcess:
    """The kit's CLI as a user runs it, in this runtime."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "SGLANG_SSD_STREAM_"))}
    environ.update({"HOME": str(home), "SGLANG_SSD_STREAM_HOME": str(data), "PYTHONPATH": str(REPO), **env})
    return subprocess.run([sys.executable, "-m", "sglang_ssd_stream", *argv], capture_output=True, text=True,
                          env=environ, cwd=REPO, timeout=600)


@pytest.mark.parametrize("state", ["no cache", "stale cache"])
@pytest.mark.parametrize("command", ["sidecar verify", "sidecar verify --use-cache", "doctor"])
def test_reporting_commands_write_nothing(small, data, tmp_path, command, state):
    """``sidecar verify`` (with and without the cache) and SGLang's doctor: they hash and report; the sidecar's
    directory and the data directory are as they were (no cache, no lock, no temporary file)."""
    _, art = small
    _prepare(art, state)
    before = tree_state(art, data)
    if command == "doctor":
        r = _kit(tmp_path, data, "doctor", "--json", SGLANG_SSD_STREAM_SIDECAR=str(art))
        [sha] = [f for f in json.loads(r.stdout)["findings"] if f["check"] == "sidecar_sha"]
        assert sha["level"] == ("ok" if state == "no cache" else "error"), sha
    else:
        r = _kit(tmp_path, data, *command.split(), str(art), "-q")
        assert r.returncode == (0 if state == "no cache" else 3), (r.returncode, r.stdout, r.stderr)
        assert r.stdout.rstrip().endswith("OK" if state == "no cache" else "FAILED"), r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    assert tree_state(art, data) == before, f"{command} wrote"


def test_sglangs_doctor_reads_what_its_plugin_records(small, data, monkeypatch):
    """The SGLang side in one process: the doctor's SHA-256 check hashes and writes nothing; the plugin's load of
    the sidecar it serves records; the doctor of a next process then answers from that record."""
    from sglang_ssd_stream.checks.sidecar import forget
    from sglang_ssd_stream.sglang import config
    from sglang_ssd_stream.sglang.doctor import check_sidecar

    _, art = small
    (art / CACHE_NAME).unlink()
    monkeypatch.setenv("SGLANG_SSD_STREAM_SIDECAR", str(art))
    env = {"SGLANG_SSD_STREAM_SIDECAR": str(art)}
    forget()
    before = tree_state(art, data)
    [_, sha] = check_sidecar(None, env, verify_sha=True)
    assert sha.level == "ok" and "no verified cache" in sha.message
    assert tree_state(art, data) == before
    assert [t.status for t in config.load(art).verify.tables] == ["verified"]  # the serving load
    assert (art / CACHE_NAME).is_file()
    forget()
    [_, sha] = check_sidecar(None, env, verify_sha=True)
    assert f"1 from the verified cache {art / CACHE_NAME}" in sha.message
    forget()


# ------------------------------------------------------------------------------------------ planted entries


def _plant(art: Path, cache: Path) -> None:
    """A forger's entry, written by hand into the kit's own cache format: the table (changed) is claimed verified,
    with its current key and the manifest's SHA-256."""
    doc = json.loads((art / CACHE_NAME).read_text())  # as the build recorded it
    t = load_manifest(art).tables[0]
    doc["tables"][t.path] = {**file_key(os.stat(t.file)), "sha256": t.sha256}
    cache.write_text(json.dumps(doc))
    os.chmod(cache, 0o600)


def _edit(cache: Path, **fields) -> None:
    doc = json.loads(cache.read_text())
    doc.update(fields)
    cache.write_text(json.dumps(doc))


def _other_owner(cache: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("only root can give a file to another user")
    os.chown(cache, 65534, 65534)


def _link(cache: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    cache.rename(target)
    cache.symlink_to(target)


# name: (spoil the planted file, make it one this user alone could have written for this manifest)
SPOILS = {
    "owned by another user": (_other_owner, lambda c, t: os.chown(c, os.geteuid(), os.getegid())),
    "group-writable": (lambda c, t: os.chmod(c, 0o620), lambda c, t: os.chmod(c, 0o600)),
    "world-writable": (lambda c, t: os.chmod(c, 0o602), lambda c, t: os.chmod(c, 0o600)),
    "a symlink": (_link, lambda c, t: (c.unlink(), (t / "elsewhere.json").rename(c))),
    "another manifest's": (lambda c, t: _edit(c, manifest_sha256=hashlib.sha256(b"another").hexdigest()),
                           lambda c, t: _edit(c, manifest_sha256=hashlib.sha256(
                               (c.parent / "ssd-stream.json").read_bytes()).hexdigest())),
}


@pytest.mark.parametrize("spoil", list(SPOILS))
def test_a_planted_entry_counts_only_from_a_file_only_this_user_could_write(small, data, tmp_path, spoil):
    """The table's bytes changed, then an entry planted with its new key: from a file another user could have
    written (or for another manifest) it is refused, by a report and by a serving load, and the changed table
    is hashed. The same entry in a file only this user (or root) could have written is believed: that is the
    rule's boundary, since whoever may write there may rewrite the manifest too (docs/sidecar.md)."""
    _, art = small
    cache = art / CACHE_NAME
    _change_bytes(art)
    _plant(art, cache)
    make_bad, make_good = SPOILS[spoil]
    make_bad(cache, tmp_path)
    with pytest.raises(SidecarChecksumMismatch):
        verify_sidecar(art, progress=False, cache_dir=tmp_path / "c")
    make_good(cache, tmp_path)  # the control: this very entry, and nothing else, made trustworthy
    assert verify_sidecar(art, progress=False, cache_dir=tmp_path / "c").tables[0].status == "cached"
    make_bad(cache, tmp_path)
    with pytest.raises(SidecarChecksumMismatch):
        verify_sidecar(art, caller=SERVE, progress=False, cache_dir=tmp_path / "c")
    assert not os.path.islink(cache) and os.stat(cache).st_mode & 0o077 == 0  # rewritten as this user's own
