"""The kit's one atomic writer (atomic_file.py): whole or not at all, nothing left behind."""

from __future__ import annotations

import os
import stat

import pytest

from sglang_ssd_stream import atomic_file


def test_a_clean_write_replaces_the_file(tmp_path):
    p = tmp_path / "sub" / "f.json"
    atomic_file.write_atomic(p, "one")
    atomic_file.write_atomic(p, b"two")
    assert p.read_bytes() == b"two" and sorted(x.name for x in p.parent.iterdir()) == ["f.json"]


def test_a_failure_mid_write_leaves_the_old_file_and_no_temp(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt), atomic_file.replacing(p) as f:
        f.write(b"half")
        raise KeyboardInterrupt  # a signal turned into an exception
    assert p.read_bytes() == b"old" and sorted(x.name for x in tmp_path.iterdir()) == ["f"]


def test_a_failed_rename_leaves_the_old_file(tmp_path, monkeypatch):
    p = tmp_path / "f"
    p.write_bytes(b"old")

    def no_space(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(atomic_file.os, "replace", no_space)
    with pytest.raises(OSError, match="No space"):
        atomic_file.write_atomic(p, b"new")
    monkeypatch.undo()
    assert p.read_bytes() == b"old" and sorted(x.name for x in tmp_path.iterdir()) == ["f"]


def test_durable_syncs_the_data_then_the_directory_and_mode_is_applied(tmp_path, monkeypatch):
    synced, real = [], os.fsync
    monkeypatch.setattr(atomic_file.os, "fsync", lambda fd: (synced.append(stat.S_ISDIR(os.fstat(fd).st_mode)),
                                                             real(fd)))
    with atomic_file.replacing(tmp_path / "lib.so", mode=0o755) as f:
        f.write(b"x")
    assert synced == [False, True]
    assert stat.S_IMODE((tmp_path / "lib.so").stat().st_mode) == 0o755
    synced.clear()
    atomic_file.write_atomic(tmp_path / "cache", b"y", durable=False)
    assert synced == []
