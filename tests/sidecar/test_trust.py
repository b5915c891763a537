"""Issue 29 item 7: one loader and one trust rule for both engines and the CLI.

``load_sidecar`` is what SGLang's runtime and doctor, vLLM's doctor and embedding, ``sidecar verify``,
``model check-view``, preflight and ``watch`` call. Measured before: a ``.ssd-stream-view.json`` with
``"trusted_roots": ["/"]`` next to a table linked outside the artifact made both engines serve the
outside file; a symlink loop raised a raw ``OSError [Errno 40]``.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading

import numpy as np
import pytest

from sglang_ssd_stream.sidecar.errors import SidecarPathEscape, SidecarSizeMismatch
from sglang_ssd_stream.sidecar.view import MARKER_FORMAT, MARKER_NAME, load_sidecar
from tests.vllm.synthetic import random_table, write_sidecar, write_view

ROWS, ROW_BYTES = 64, 32


@pytest.fixture
def prepared(tmp_path):
    write_sidecar(tmp_path / "prepared", {3: ("float8_e4m3fn", random_table(ROWS, ROW_BYTES, 1)),
                                          5: ("float8_e4m3fn", random_table(ROWS, ROW_BYTES, 2))})
    return tmp_path / "prepared"


def _marker(view, **fields):
    doc = {"format": MARKER_FORMAT, "version": 1, "entries": ["ple", "ssd-stream.json"], **fields}
    (view / MARKER_NAME).write_text(json.dumps(doc))


def test_a_view_loads_through_its_prepared_snapshot(prepared, tmp_path):
    write_view(tmp_path / "view", prepared)
    m = load_sidecar(tmp_path / "view")
    assert [os.path.realpath(t.file) for t in m.tables] == [str(prepared / "ple" / f"layer-{n}.bin") for n in (3, 5)]


def test_a_marker_cannot_widen_the_trusted_roots(prepared, tmp_path):
    """The adversary's view: ``trusted_roots: ["/"]``, a table linked to a file outside, its sha in the manifest."""
    outside = tmp_path / "outside.bin"
    raw = random_table(ROWS, ROW_BYTES, 9).tobytes()
    outside.write_bytes(raw)
    art = tmp_path / "art"
    write_sidecar(art, {3: ("float8_e4m3fn", random_table(ROWS, ROW_BYTES, 1))})
    (art / "ple" / "layer-3.bin").unlink()
    (art / "ple" / "layer-3.bin").symlink_to(outside)
    doc = json.loads((art / "ssd-stream.json").read_text())
    doc["tables"][0]["sha256"] = hashlib.sha256(raw).hexdigest()
    (art / "ssd-stream.json").write_text(json.dumps(doc))
    _marker(art, trusted_roots=["/"])
    with pytest.raises(SidecarPathEscape):
        load_sidecar(art)
    _marker(art, trusted_roots=["/"], prepared=str(tmp_path))  # naming a parent as "prepared" grants nothing:
    with pytest.raises(SidecarPathEscape):  # it holds no identical manifest
        load_sidecar(art)


def test_a_view_whose_snapshot_manifest_differs_grants_nothing(prepared, tmp_path):
    write_view(tmp_path / "view", prepared)
    doc = json.loads((prepared / "ssd-stream.json").read_text())
    doc["tables"] = doc["tables"][:1]
    (prepared / "ssd-stream.json").write_text(json.dumps(doc))
    with pytest.raises(SidecarPathEscape):
        load_sidecar(tmp_path / "view")


def test_view_tables_must_resolve_to_the_snapshots_own_files(prepared, tmp_path):
    """Two layers' links swapped inside the prepared snapshot: every file is trusted, the pairing is not."""
    view = tmp_path / "view"
    write_view(view, prepared)
    a, b = view / "ple" / "layer-3.bin", view / "ple" / "layer-5.bin"
    a.unlink()
    b.unlink()
    a.symlink_to(prepared / "ple" / "layer-5.bin")
    b.symlink_to(prepared / "ple" / "layer-3.bin")
    with pytest.raises(SidecarPathEscape, match="not to the prepared snapshot's"):
        load_sidecar(view)


def test_operator_roots_are_the_only_widening(prepared, tmp_path):
    outside_dir = tmp_path / "elsewhere"
    outside_dir.mkdir()
    art = tmp_path / "art"
    write_sidecar(art, {3: ("float8_e4m3fn", random_table(ROWS, ROW_BYTES, 1))})
    os.replace(art / "ple" / "layer-3.bin", outside_dir / "layer-3.bin")
    (art / "ple" / "layer-3.bin").symlink_to(outside_dir / "layer-3.bin")
    with pytest.raises(SidecarPathEscape):
        load_sidecar(art)
    assert load_sidecar(art, extra_roots=[outside_dir]).tables[0].file.name == "layer-3.bin"


@pytest.mark.parametrize("odd", ["loop", "fifo", "directory", "device"])
def test_odd_table_files_are_refused_clearly_without_a_hang(prepared, odd):
    table = prepared / "ple" / "layer-3.bin"
    table.unlink()
    if odd == "loop":
        loop = prepared / "ple" / "loop"
        loop.symlink_to(table)
        table.symlink_to(loop)
    elif odd == "fifo":
        os.mkfifo(table)
    elif odd == "directory":
        table.mkdir()
    else:
        os.mknod(table, 0o644 | 0o020000, os.makedev(1, 3))  # a character device (/dev/null's numbers)
    outcome = {}

    def load():
        try:
            load_sidecar(prepared)
            outcome["loaded"] = True
        except Exception as exc:  # noqa: BLE001 - asserted below
            outcome["error"] = exc

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), f"load_sidecar hung on a {odd}"
    err = outcome.get("error")
    assert isinstance(err, (SidecarPathEscape, SidecarSizeMismatch)) or type(err).__name__.startswith("Sidecar"), \
        outcome
    assert "layer-3.bin" in str(err)


def test_every_user_loads_through_the_one_loader():
    """The call sites of issue 29: none of them calls load_manifest with roots of its own any more."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    users = ["sglang_ssd_stream/checks/sidecar.py", "sglang_ssd_stream/sglang/doctor.py",
             "vllm_ple_offload/doctor.py", "sglang_ssd_stream/sidecar/cli.py",
             "sglang_ssd_stream/operate/model_view.py", "sglang_ssd_stream/operate/preflight.py",
             "sglang_ssd_stream/operate/watch/cli.py"]
    for rel in users:
        text = (repo / rel).read_text()
        assert "load_sidecar" in text, rel
        assert "trusted_roots=" not in text.replace("_trusted_roots(prepared)", ""), rel
    # both plugins load through the floor's one per-process cache (checks/sidecar.py)
    assert "load_verified(" in (repo / "sglang_ssd_stream/sglang/config.py").read_text()
    assert "sha_finding(" in (repo / "vllm_ple_offload/runtime_checks.py").read_text()


def test_an_array_marker_field_is_not_a_grant(prepared, tmp_path):
    view = tmp_path / "view"
    write_view(view, prepared)
    _marker(view, prepared=[str(prepared)], trusted_roots=[str(prepared)])
    with pytest.raises(SidecarPathEscape):
        load_sidecar(view)


@pytest.mark.parametrize("odd", ["fifo", "symlink", "directory"])
@pytest.mark.parametrize("reader", ["pread", "mmap", "row-cache", "verify"])
def test_a_table_swapped_for_an_odd_file_after_load_is_refused_without_a_hang(prepared, tmp_path, odd, reader):
    from sglang_ssd_stream.sidecar import MappedReader, SidecarReader, verify_sidecar
    from sglang_ssd_stream.sidecar.errors import SidecarIOError
    from sglang_ssd_stream.sidecar.row_cache import RowCache, RowCacheConfig

    m = load_sidecar(prepared)
    table = m.tables[0]
    inner = MappedReader(table, max_rows=8, workers=1)  # opened before the swap: the row cache's own open is next
    moved = tmp_path / "moved.bin"
    os.replace(table.file, moved)
    if odd == "fifo":
        os.mkfifo(table.file)
    elif odd == "symlink":
        table.file.symlink_to(moved)  # a link where the real file was: not the file the manifest resolved
    else:
        table.file.mkdir()
    outcome = {}

    def open_it():
        try:
            if reader == "pread":
                SidecarReader(table, max_rows=8, workers=1).close()
            elif reader == "mmap":
                MappedReader(table, max_rows=8, workers=1).close()
            elif reader == "row-cache":
                RowCache(inner, np.zeros((8, table.row_bytes), np.uint8), RowCacheConfig(workers=1)).close()
            else:
                verify_sidecar(m, use_cache=False, progress=False)
            outcome["opened"] = True
        except Exception as exc:  # noqa: BLE001 - asserted below
            outcome["error"] = exc

    t = threading.Thread(target=open_it, daemon=True)
    t.start()
    t.join(20)
    inner.close()
    assert not t.is_alive(), f"{reader} hung on a {odd}"
    assert isinstance(outcome.get("error"), (SidecarIOError, SidecarPathEscape)), outcome
    assert table.file.name in str(outcome["error"])
