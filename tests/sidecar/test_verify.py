"""SHA-256 verification: real hashing, cached by (device, inode, size, mtime_ns, ctime_ns), read-only fallback."""

from __future__ import annotations

import hashlib
import json
import os
import time

import pytest

from sglang_ssd_stream.sidecar import (
    SidecarChecksumMismatch,
    SidecarTruncated,
    load_manifest,
    verify_sidecar,
)
from sglang_ssd_stream.sidecar import verify as verify_mod
from sglang_ssd_stream.sidecar.verify import CACHE_NAME, SERVE
from tests.threads import race


@pytest.fixture
def count_hashes(monkeypatch):
    calls = []
    real = verify_mod.sha256_file

    def counting(path, **kw):
        calls.append(str(path))
        return real(path, **kw)

    monkeypatch.setattr(verify_mod, "sha256_file", counting)
    return calls


def _clear_cache(art):
    (art / CACHE_NAME).unlink(missing_ok=True)


def test_verify_hashes_then_uses_cache(small, count_hashes, tmp_path):
    _, art = small
    _clear_cache(art)
    r1 = verify_sidecar(art, caller=SERVE, progress=False, cache_dir=tmp_path / "c")
    assert [c.status for c in r1.tables] == ["verified"] and len(count_hashes) == 1
    assert r1.cache_file == str(art / CACHE_NAME)
    doc = json.loads((art / CACHE_NAME).read_text())
    assert doc["manifest_sha256"] == hashlib.sha256((art / "ssd-stream.json").read_bytes()).hexdigest()
    entry = doc["tables"]["ple/layer-2.bin"]
    st = os.stat(art / "ple" / "layer-2.bin")
    assert entry == {"device": st.st_dev, "inode": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                     "ctime_ns": st.st_ctime_ns, "sha256": load_manifest(art).tables[0].sha256}
    r2 = verify_sidecar(art, progress=False, cache_dir=tmp_path / "c")
    assert [c.status for c in r2.tables] == ["cached"] and len(count_hashes) == 1
    r3 = verify_sidecar(art, progress=False, use_cache=False, cache_dir=tmp_path / "c")
    assert [c.status for c in r3.tables] == ["verified"] and len(count_hashes) == 2


def test_sha_mismatch_is_detected_and_not_cached(small, tmp_path):
    _, art = small
    table = art / "ple" / "layer-2.bin"
    verify_sidecar(art, caller=SERVE, progress=False, cache_dir=tmp_path / "c")  # cached success
    data = bytearray(table.read_bytes())
    data[12345] ^= 0x01
    table.write_bytes(bytes(data))  # same size, new mtime -> cache no longer applies
    expected = load_manifest(art).tables[0].sha256
    with pytest.raises(SidecarChecksumMismatch) as info:
        verify_sidecar(art, caller=SERVE, progress=False, cache_dir=tmp_path / "c")
    e = info.value
    assert e.actual == hashlib.sha256(bytes(data)).hexdigest() and e.expected == expected
    assert e.actual in str(e) and expected in str(e) and "ple/layer-2.bin" in str(e)
    assert "ple/layer-2.bin" not in json.loads((art / CACHE_NAME).read_text())["tables"]
    report = verify_sidecar(art, progress=False, raise_on_mismatch=False, cache_dir=tmp_path / "c")
    assert not report.ok and report.tables[0].status == "mismatch"
    data[12345] ^= 0x01
    table.write_bytes(bytes(data))
    assert verify_sidecar(art, progress=False, cache_dir=tmp_path / "c").tables[0].status == "verified"


def test_cache_for_another_sha_is_ignored(small, count_hashes, tmp_path):
    _, art = small
    assert verify_sidecar(art, progress=False, cache_dir=tmp_path / "c").tables[0].status == "cached"  # from build
    cache = json.loads((art / CACHE_NAME).read_text())
    cache["tables"]["ple/layer-2.bin"]["sha256"] = "0" * 64
    (art / CACHE_NAME).write_text(json.dumps(cache))
    assert verify_sidecar(art, progress=False, cache_dir=tmp_path / "c").tables[0].status == "verified"
    (art / CACHE_NAME).write_text("{damaged")
    assert verify_sidecar(art, progress=False, cache_dir=tmp_path / "c").tables[0].status == "verified"
    assert len(count_hashes) == 2


def test_no_verify_only_when_asked(small, count_hashes, caplog):
    _, art = small
    r = verify_sidecar(art, no_verify=True)
    assert [c.status for c in r.tables] == ["skipped"] and count_hashes == []
    assert "verification skipped" in caplog.text


def test_truncated_during_verify(small, tmp_path):
    _, art = small
    m = load_manifest(art)
    os.truncate(m.tables[0].file, 1000)
    with pytest.raises(SidecarTruncated, match="1000 bytes, expected 800480"):
        verify_sidecar(m, progress=False, use_cache=False, cache_dir=tmp_path / "c")


def test_read_only_artifact_dir_falls_back_to_cache_dir(small, count_hashes, tmp_path):
    """Root ignores permission bits, so make the cache path unwritable for root: a directory sits there."""
    _, art = small
    _clear_cache(art)
    (art / CACHE_NAME).mkdir()
    fallback = tmp_path / "fallback"
    r1 = verify_sidecar(art, caller=SERVE, progress=False, cache_dir=fallback)
    assert r1.tables[0].status == "verified" and r1.cache_file.startswith(str(fallback))
    r2 = verify_sidecar(art, caller=SERVE, progress=False, cache_dir=fallback)
    assert r2.tables[0].status == "cached" and len(count_hashes) == 1
    assert not [p for p in art.iterdir() if p.name.endswith(".tmp")]  # no temp litter


def test_default_fallback_is_under_home(small, monkeypatch, tmp_path):
    _, art = small
    _clear_cache(art)
    monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(tmp_path / "home"))
    real = verify_mod._write_cache

    def refuse_artifact_dir(path, *rest):
        if path.parent == art:
            raise PermissionError(13, "Read-only file system", str(path))
        return real(path, *rest)

    monkeypatch.setattr(verify_mod, "_write_cache", refuse_artifact_dir)
    r = verify_sidecar(art, caller=SERVE, progress=False)
    assert r.cache_file.startswith(str(tmp_path / "home" / "sidecar-verify"))
    assert verify_sidecar(art, progress=False).tables[0].status == "cached"


def test_nowhere_writable_still_verifies(small, monkeypatch, caplog, tmp_path):
    _, art = small

    def refuse(path, *rest):
        raise PermissionError(13, "Read-only file system", str(path))

    monkeypatch.setattr(verify_mod, "_write_cache", refuse)
    r = verify_sidecar(art, caller=SERVE, progress=False, use_cache=False, cache_dir=tmp_path / "c")
    assert r.ok and r.cache_file is None and "could not record verification" in caplog.text


def test_concurrent_verifiers_hash_once(small, count_hashes, tmp_path):
    _, art = small
    _clear_cache(art)
    results = []
    errors = race(lambda: results.append(
        verify_sidecar(art, caller=SERVE, progress=False, cache_dir=tmp_path / "c").tables[0].status), 3)
    assert errors == [] and sorted(results) == ["cached", "cached", "verified"] and len(count_hashes) == 1


def test_in_place_edit_with_mtime_restored_is_rehashed(small, count_hashes, tmp_path):
    """Issue 15 item 8: flip a byte in place, put the mtime back with os.utime: the ctime still moved."""
    _, art = small
    _clear_cache(art)
    table = art / "ple" / "layer-2.bin"
    assert verify_sidecar(art, caller=SERVE, progress=False, cache_dir=tmp_path / "c").tables[0].status == "verified"
    st = os.stat(table)
    time.sleep(0.01)  # a ctime tick
    with open(table, "r+b") as f:  # in place: same inode, same size
        f.seek(12345)
        byte = f.read(1)
        f.seek(12345)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(table, ns=(st.st_atime_ns, st.st_mtime_ns))
    now = os.stat(table)
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    assert now.st_ctime_ns != st.st_ctime_ns
    with pytest.raises(SidecarChecksumMismatch):
        verify_sidecar(art, progress=False, cache_dir=tmp_path / "c")
    assert len(count_hashes) == 2  # hashed again, not "cached"


def test_cache_of_the_old_key_is_not_trusted(small, count_hashes, tmp_path):
    """A version-1 cache (no device, no ctime) is a miss, whatever it says."""
    _, art = small
    st = os.stat(art / "ple" / "layer-2.bin")
    (art / CACHE_NAME).write_text(json.dumps({"version": 1, "tables": {"ple/layer-2.bin": {
        "inode": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
        "sha256": load_manifest(art).tables[0].sha256}}}))
    assert verify_sidecar(art, progress=False, cache_dir=tmp_path / "c").tables[0].status == "verified"
    assert len(count_hashes) == 1
