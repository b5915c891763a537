"""`model fetch` (write-up 000 steps 2-3) against a local HTTP endpoint speaking the hub's API, with the real
huggingface_hub: pinned commits, allow_patterns, every file's hash, resume, links into the cache, counts."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import pytest

from sglang_ssd_stream.errors import EnvironmentProblem
from sglang_ssd_stream.operate import fetch as fetch_mod
from sglang_ssd_stream.operate.errors import ModelUpdateError
from sglang_ssd_stream.operate.fetch import DENSE_REPO, PREPARED_REPO, fetch_model
from sglang_ssd_stream.operate.update import read_state

from .hub_server import Hub, Repo

PLE = "model.language_model.layers.{l}.ple.ple_embedding.ngram_embedding"
DENSE_SHARDS = ["model-bf16-00001-of-00002.safetensors", "model-bf16-00002-of-00002.safetensors"]
EXPERTS = [f"layer-{i:02d}-experts-0.safetensors" for i in range(3)]
PLE_SHARDS = [f"model-plefp8-{k:05d}-of-00004.safetensors" for k in range(4)]
SCALE = "model-plefp8-scale.safetensors"
TABLE = "ple/qwen3.8-flash-next-ple-fp8.bin"
C_PREP, C_DENSE = "a" * 40, "b" * 40


def _safetensors(name: str) -> bytes:
    header = json.dumps({name: {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + b"\x80\x3e"


ROWS, COLS, PARTS = 4096, 160, 8  # layer 3's FP8 table: two of its eight shard tensors in each PLE shard file


def ple_table() -> bytes:
    return bytes((i * 31) % 251 for i in range(ROWS * COLS))


def _ple_shard_files(table: bytes) -> dict[str, bytes]:
    """The HN checkpoint's PLE shard files, real safetensors: tensors ``shard_{2k}``, ``shard_{2k+1}`` in file k."""
    import numpy as np
    import torch
    from safetensors.torch import save

    t = torch.from_numpy(np.frombuffer(table, np.uint8).copy()).view(torch.float8_e4m3fn).reshape(ROWS, COLS)
    size = ROWS // PARTS
    return {f: save({f"{PLE.format(l=3)}.shard_{j}.weight": t[j * size:(j + 1) * size].clone()
                     for j in (2 * k, 2 * k + 1)}) for k, f in enumerate(PLE_SHARDS)}


def repos(index_extra: dict | None = None) -> dict[str, Repo]:
    """The prepared snapshot (experts, MTP, sidecar, scale) and the HN checkpoint (configs, dense shards, and the
    expert and PLE shards and the scale the recipe does NOT download), shaped like write-up 000's."""
    rows, cols = ROWS, COLS
    table = ple_table()
    manifest = {"format": "sglang-ssd-stream", "version": 1, "tables": [
        {"layer": 3, "path": TABLE, "sha256": hashlib.sha256(table).hexdigest(), "dtype": "float8_e4m3fn",
         "rows": rows, "columns": cols, "row_start": 0, "bytes": rows * cols}]}
    prepared = {TABLE: table, SCALE: _safetensors(f"{PLE.format(l=3)}.weight_scale"),
                "ssd-stream.json": json.dumps(manifest).encode(), "config.json": b'{"model_type": "qwen4_exp"}',
                "mtp/config.json": b'{"model_type": "qwen4_exp_mtp"}', "mtp/model.safetensors": b"mtp" * 100}
    prepared.update({f: b"experts" + f.encode() for f in EXPERTS})
    wm = {f"model.language_model.layers.{i}.mlp.w{j}": DENSE_SHARDS[j % 2] for i in range(4) for j in range(3)}
    wm.update({f"model.language_model.layers.{i}.mlp.experts.w": EXPERTS[i] for i in range(3)})
    for k, f in enumerate(PLE_SHARDS):
        wm[f"{PLE.format(l=3)}.shard_{2 * k}.weight"] = f
        wm[f"{PLE.format(l=3)}.shard_{2 * k + 1}.weight"] = f
    wm[f"{PLE.format(l=3)}.weight_scale"] = SCALE
    wm.update(index_extra or {})
    config = {"model_type": "qwen4_exp", "text_config": {"split_ngram_parts": PARTS}}
    dense = {"config.json": json.dumps(config).encode(), "tokenizer.json": b"{}", "chat_template.jinja": b"{{x}}",
             "README.md": b"# HN", "model.safetensors.index.json": json.dumps({"weight_map": wm}).encode()}
    dense.update({f: b"dense" * 50 + f.encode() for f in DENSE_SHARDS})
    dense.update(_ple_shard_files(table))  # in the HN repo, not in the recipe's patterns (--in-place fetches them)
    dense[SCALE] = prepared[SCALE]
    dense.update({f: b"experts" + f.encode() for f in EXPERTS})  # identical to the prepared ones: not fetched
    lfs = lambda files: {p for p in files if p.endswith((".safetensors", ".bin"))}  # noqa: E731
    return {PREPARED_REPO: Repo(prepared, C_PREP, lfs(prepared)), DENSE_REPO: Repo(dense, C_DENSE, lfs(dense))}


@pytest.fixture
def hub(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    with Hub() as h:
        h.repos.update(repos())
        yield h


def _fetch(hub, tmp_path, **kw):
    return fetch_model(tmp_path / "view", tmp_path / "data", endpoint=hub.url, progress=False, log=lambda s: None,
                       **kw)


def test_fetch_builds_a_verified_view_of_links_into_the_cache(hub, tmp_path):
    r = _fetch(hub, tmp_path)
    view = Path(r.view)
    # the write-up's rule: every mapping but the 8 PLE shard ones; 2 dense + 3 expert shards + the scale file
    assert (r.mappings, r.shards, r.removed) == (16, 6, 8)
    assert (r.prepared.commit, r.dense.commit) == (C_PREP, C_DENSE)
    blobs = tmp_path / "data" / "huggingface" / "hub"
    for name in DENSE_SHARDS + EXPERTS + [SCALE, TABLE]:
        p = view / name
        assert p.is_symlink() and os.path.realpath(p).startswith(str(blobs)), name  # a link, never a copy
    # allow_patterns: the HN repo's PLE and expert shards were never requested
    for name in PLE_SHARDS + EXPERTS:
        assert not [g for g in hub.gets(name) if DENSE_REPO in g[1]], name
    assert hub.gets(DENSE_SHARDS[0]) and hub.gets(TABLE)
    st = read_state(tmp_path / "data")
    assert st["view"] == str(view) and st["model_revision"] == C_PREP
    assert st["fetch"]["prepared"] == {"repo": PREPARED_REPO, "commit": C_PREP}
    assert st["fetch"]["dense"]["commit"] == C_DENSE


def test_rerun_uses_the_pins_and_the_cache_and_rereads_nothing(hub, tmp_path, monkeypatch):
    _fetch(hub, tmp_path)
    hub.requests.clear()
    hashed = []
    real = fetch_mod._file_hash
    monkeypatch.setattr(fetch_mod, "_file_hash", lambda p, lfs, bar: hashed.append(p) or real(p, lfs, bar))
    r = _fetch(hub, tmp_path)
    assert not [x for x in hub.requests if "/revision/" in x[1]]  # the pinned commits were used
    assert not [x for x in hub.requests if x[0] == "GET" and "/resolve/" in x[1]]  # nothing downloaded again
    assert hashed == []  # unchanged blobs are not hashed again
    assert r.prepared.commit == C_PREP


def test_update_moves_the_pins_to_main(hub, tmp_path):
    _fetch(hub, tmp_path)
    new = "c" * 40
    hub.repos[DENSE_REPO].commit = new
    r = _fetch(hub, tmp_path)
    assert r.dense.commit == C_DENSE  # pinned: no drift without --update
    r = _fetch(hub, tmp_path, update=True)
    assert r.dense.commit == new and read_state(tmp_path / "data")["fetch"]["dense"]["commit"] == new


def test_a_dropped_connection_is_resumed_with_a_range_request(hub, tmp_path, monkeypatch):
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "DOWNLOAD_CHUNK_SIZE", 64 << 10)  # 10 MiB by default: the sidecar here is 640 KiB
    hub.drop_once[TABLE] = 100_000
    r = _fetch(hub, tmp_path)
    ranges = [rng for _, _, rng in hub.gets(TABLE) if rng]
    assert ranges == ["bytes=65536-"]  # the chunk written before the drop is kept, the rest asked for
    assert Path(r.view, TABLE).read_bytes() == hub.repos[PREPARED_REPO].files[TABLE]


def test_a_file_that_does_not_match_the_hubs_hash_is_refused(hub, tmp_path):
    repo = hub.repos[PREPARED_REPO]
    repo.published[EXPERTS[1]] = b"EXPERTS" + EXPERTS[1].encode()  # the tree lists other bytes, same size
    with pytest.raises(ModelUpdateError, match=rf"(?s){EXPERTS[1]}: SHA-256 [0-9a-f]{{64}}, the hub lists "
                                               rf"[0-9a-f]{{64}} \(blob .*blobs/"):
        _fetch(hub, tmp_path)
    assert read_state(tmp_path / "data") is None and not (tmp_path / "view").exists()


def test_a_small_file_is_checked_by_its_git_blob_id(hub, tmp_path):
    hub.repos[DENSE_REPO].published["tokenizer.json"] = b"[]"
    with pytest.raises(ModelUpdateError, match=r"tokenizer.json: git blob id [0-9a-f]{40}, the hub lists"):
        _fetch(hub, tmp_path)


def test_network_filesystem_is_refused_before_anything_is_fetched(hub, tmp_path, monkeypatch):
    from sglang_ssd_stream.sidecar import storage

    monkeypatch.setattr(storage, "classify_disk", lambda p, **kw: storage.Disk(str(p), "nfs4", None, "network"))
    with pytest.raises(EnvironmentProblem, match=r"network filesystem \(nfs4\).*local NVMe"):
        _fetch(hub, tmp_path)
    assert hub.requests == [] and not (tmp_path / "data").exists()


def test_not_enough_disk_is_refused_before_downloading(hub, tmp_path, monkeypatch):
    from sglang_ssd_stream.checks import host

    monkeypatch.setattr(host, "free_bytes", lambda p: (1 << 20, str(p)))
    with pytest.raises(EnvironmentProblem, match=r"1\.0 GiB free|0\.0 GiB free.*180 GiB"):
        _fetch(hub, tmp_path)
    assert not [x for x in hub.requests if x[0] == "GET" and "/resolve/" in x[1]]


def test_view_counts_are_asserted_against_the_writeups_rule(tmp_path, monkeypatch):
    """A PLE-named tensor in a dense shard: the view drops it by name, the write-up's rule (by shard file) keeps
    it. The counts disagree and the fetch refuses instead of serving a different index."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    with Hub() as hub:
        hub.repos.update(repos({f"{PLE.format(l=7)}.shard_0.weight": DENSE_SHARDS[0]}))
        with pytest.raises(ModelUpdateError, match=r"serves 16 mappings over 6 shards \(9 PLE mappings removed\), "
                                                   r"but the dense index gives 17 over 6 \(8 removed\)"):
            _fetch(hub, tmp_path)
    assert read_state(tmp_path / "data") is None


def test_unknown_revision_and_unreachable_hub(hub, tmp_path):
    with pytest.raises(ModelUpdateError, match="RevisionNotFound"):
        _fetch(hub, tmp_path, dense_revision="v9")
    hub.down = True
    from sglang_ssd_stream.operate.errors import Offline

    with pytest.raises(Offline, match=r"did not answer for .*\(HTTP 503\); nothing was changed"):
        _fetch(hub, tmp_path)
    url = hub.url
    hub.__exit__()  # nothing listens there any more
    with pytest.raises(Offline, match=r"did not answer .*ConnectError"):
        fetch_model(tmp_path / "view", tmp_path / "data", endpoint=url, progress=False, log=lambda s: None)
    assert read_state(tmp_path / "data") is None


def test_cli_in_the_recipes_form(hub, tmp_path, monkeypatch, capsys):
    from sglang_ssd_stream.cli import main

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(tmp_path / "data"))
    assert main(["model", "fetch", "--out", str(tmp_path / "view"), "-q"]) == 0
    out = capsys.readouterr()
    assert f"model view: {tmp_path / 'view'}\n" in out.out and "counts match the dense index" in out.out
    assert f"prepared: {PREPARED_REPO}@{C_PREP}" in out.out
    assert f"prepared: {PREPARED_REPO}@{C_PREP} (main)" in out.err
    # serve without --model finds the view through state.json
    from sglang_ssd_stream.operate.serve_cli import _resolve_model

    class A:
        model, data_dir, draft = None, None, None

    assert _resolve_model(A())[0] == str(tmp_path / "view")


# ----------------------------------------------------------------------------- --in-place


def _region_rows(view: Path):
    """Every row of the view's layer-3 table as both readers serve it (mmap and pread, regions and all)."""
    import numpy as np

    from sglang_ssd_stream.sidecar import open_reader
    from sglang_ssd_stream.sidecar.view import load_sidecar

    table = load_sidecar(view).table(3)
    got = []
    for io in ("mmap", "pread"):
        out = np.zeros((table.rows, table.row_bytes), np.uint8)
        with open_reader(table, io, max_rows=table.rows, workers=1) as r:
            r.read_rows(np.arange(table.rows, dtype=np.int64), out)
        got.append(out.tobytes())
    assert got[0] == got[1]
    return table, got[0]


def test_in_place_serves_the_dense_shards_where_they_lie(hub, tmp_path):
    """`--in-place`: the HN checkpoint's PLE shards are downloaded instead of the prepared snapshot's copied
    table, and the view's manifest names regions of them (links into the cache); the rows it serves are the
    table's, the index and its counts are the write-up's, and the first serving start hashes nothing."""
    from sglang_ssd_stream.sidecar.verify import SERVE, verify_sidecar
    from sglang_ssd_stream.sidecar.view import load_sidecar

    r = _fetch(hub, tmp_path, in_place=True)
    view = Path(r.view)
    assert (r.mappings, r.shards, r.removed) == (16, 6, 8)  # the same served index as the copied way
    assert hub.gets(TABLE) == []  # the copied table was never asked for
    assert hub.gets("ssd-stream.json")  # its manifest was (to know which files to leave out)
    for name in PLE_SHARDS + [SCALE]:
        assert [g for g in hub.gets(name) if DENSE_REPO in g[1]], name
    assert not (view / TABLE).exists()
    table, rows = _region_rows(view)
    assert table.in_place and len(table.regions) == PARTS and rows == ple_table()
    dense = Path(read_state(tmp_path / "data")["fetch"]["dense"]["snapshot"])
    blobs = tmp_path / "data" / "huggingface" / "hub" / f"models--{DENSE_REPO.replace('/', '--')}" / "blobs"
    for reg in table.regions:
        assert reg.file == Path(os.path.realpath(dense / reg.path)) and reg.file.parent == blobs.resolve()
        assert (view / reg.path).is_symlink()
    index = json.loads((view / "model.safetensors.index.json").read_text())["weight_map"]
    assert not [n for n in index if ".shard_" in n] and index[f"{PLE.format(l=3)}.weight_scale"] == SCALE
    assert os.path.realpath(view / SCALE) == os.path.realpath(dense / SCALE)  # the checkpoint's own scale
    st = read_state(tmp_path / "data")
    assert st["fetch"]["ple"] == "in-place" and "model-plefp8-*.safetensors" in st["fetch"]["dense"]["patterns"]
    report = verify_sidecar(load_sidecar(view), caller=SERVE)
    assert [c.status for c in report.tables] == ["cached"]  # the build's hashes were recorded


def test_in_place_rerun_hashes_and_downloads_nothing_and_the_way_can_change(hub, tmp_path, monkeypatch):
    from sglang_ssd_stream.sidecar import in_place
    from sglang_ssd_stream.sidecar.view import load_sidecar

    _fetch(hub, tmp_path, in_place=True)
    manifest = (tmp_path / "view" / "ssd-stream.json").read_bytes()
    hub.requests.clear()
    hashed = []
    real = in_place.sha256_file
    monkeypatch.setattr(in_place, "sha256_file", lambda *a, **k: hashed.append(a) or real(*a, **k))
    _fetch(hub, tmp_path, in_place=True)
    assert hashed == [] and not [x for x in hub.requests if x[0] == "GET" and "/resolve/" in x[1]]
    assert (tmp_path / "view" / "ssd-stream.json").read_bytes() == manifest  # the same commits: kept
    _fetch(hub, tmp_path)  # the copied way: the prepared table is fetched, the manifest is the prepared one's
    assert hub.gets(TABLE) and not load_sidecar(tmp_path / "view").table(3).in_place
    assert read_state(tmp_path / "data")["fetch"]["ple"] == "copied"
    _fetch(hub, tmp_path, in_place=True)  # and back: built again from the dense shards (hashed once more)
    assert hashed and load_sidecar(tmp_path / "view").table(3).in_place
    assert _region_rows(tmp_path / "view")[1] == ple_table()


def test_an_in_place_view_is_bound_to_the_dense_snapshot_region_for_region(hub, tmp_path):
    """The marker's "ple": "in-place" grants the dense snapshot only for the files its own index maps each region's
    tensor to: a region pointed at another of its shards, or the marker set on a copied view, is refused."""
    from sglang_ssd_stream.sidecar.errors import SidecarPathEscape
    from sglang_ssd_stream.sidecar.view import MARKER_NAME, load_sidecar

    r = _fetch(hub, tmp_path, in_place=True)
    view = Path(r.view)
    doc = json.loads((view / "ssd-stream.json").read_text())
    a, b = doc["tables"][0]["regions"][0], doc["tables"][0]["regions"][2]
    assert (a["path"], b["path"]) == (PLE_SHARDS[0], PLE_SHARDS[1])
    for k in ("path", "offset", "sha256", "file_bytes", "file_mtime_ns"):  # rows 0-511 served from shard_2's
        a[k], b[k] = b[k], a[k]  # bytes and back: self-consistent (each hash is of the bytes it names)
    (view / "ssd-stream.json").write_text(json.dumps(doc))
    with pytest.raises(SidecarPathEscape, match=rf"view region {PLE_SHARDS[1]} \(.*shard_0.weight\) is not where "
                                               rf"the dense snapshot's index .* maps that tensor \({PLE_SHARDS[0]}\)"):
        load_sidecar(view)

    copied = Path(_fetch(hub, tmp_path / "c").view)
    marker = json.loads((copied / MARKER_NAME).read_text())
    load_sidecar(copied)
    # the marker alone grants nothing: saying "in place" drops the prepared snapshot's grant, and the dense one
    # holds no file of the copied table
    (copied / MARKER_NAME).write_text(json.dumps({**marker, "ple": "in-place"}))
    with pytest.raises(SidecarPathEscape, match=rf"table path '{TABLE}' resolves to .*models--garnermccloud--.*/blobs"
                                               r"/[0-9a-f]{64}, outside the artifact directory .*symlink escape"):
        load_sidecar(copied)


def test_in_place_refuses_a_prepared_manifest_that_lists_no_tables(hub, tmp_path):
    hub.repos[PREPARED_REPO].files["ssd-stream.json"] = b'{"format": "sglang-ssd-stream"}'
    with pytest.raises(ModelUpdateError, match=r"its ssd-stream.json does not list its tables .*Nothing was "
                                               r"downloaded"):
        _fetch(hub, tmp_path, in_place=True)
    assert read_state(tmp_path / "data") is None and not (tmp_path / "view").exists()
    assert not [g for g in hub.requests if g[0] == "GET" and "/resolve/" in g[1] and "ssd-stream" not in g[1]]


def test_cli_in_place(hub, tmp_path, monkeypatch, capsys):
    from sglang_ssd_stream.cli import main

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(tmp_path / "data"))
    assert main(["model", "fetch", "--in-place", "--out", str(tmp_path / "view"), "-q"]) == 0
    out = capsys.readouterr()
    assert "PLE tables: in place, regions of the dense checkpoint's own shards (no copy)" in out.out
    assert "(its 1 copied PLE table file(s) left out: --in-place)" in out.err


def test_in_place_leaves_out_nothing_without_a_prepared_manifest_and_says_when_the_hub_is_down(hub, tmp_path,
                                                                                             monkeypatch):
    """`sidecar_tables`: a prepared snapshot without ssd-stream.json has no copied table to leave out; a hub that
    does not answer is `Offline`, naming the file, and nothing is kept."""
    from sglang_ssd_stream.operate.errors import Offline
    from sglang_ssd_stream.operate.fetch import sidecar_tables

    cache = tmp_path / "cache"
    assert sidecar_tables(PREPARED_REPO, C_PREP, cache, endpoint=hub.url, progress=False) == (TABLE,)
    del hub.repos[PREPARED_REPO].files["ssd-stream.json"]
    assert sidecar_tables(PREPARED_REPO, C_PREP, tmp_path / "c2", endpoint=hub.url, progress=False) == ()
    import socket
    import types

    from huggingface_hub.utils import _http

    # huggingface_hub's own back-off between its retries (about 20 s) is not what this checks
    monkeypatch.setattr(_http, "time", types.SimpleNamespace(sleep=lambda s: None))
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(Offline, match=r"did not give ssd-stream.json of .*\(LocalEntryNotFoundError\); nothing was "
                                      r"changed"):
        sidecar_tables(PREPARED_REPO, C_PREP, tmp_path / "c3", endpoint=url, progress=False)
    assert not list((tmp_path / "c3").rglob("ssd-stream.json"))


def test_an_in_place_view_whose_manifest_no_longer_loads_is_built_again(hub, tmp_path, monkeypatch):
    """A re-run keeps the old view's manifest only while it loads: an unreadable one is built again from the
    dense shards (hashed once more), and the view serves the table's rows."""
    from sglang_ssd_stream.sidecar import in_place
    from sglang_ssd_stream.sidecar.view import load_sidecar

    _fetch(hub, tmp_path, in_place=True)
    (tmp_path / "view" / "ssd-stream.json").write_text("{not json")
    hashed = []
    real = in_place.sha256_file
    monkeypatch.setattr(in_place, "sha256_file", lambda *a, **k: hashed.append(a) or real(*a, **k))
    _fetch(hub, tmp_path, in_place=True)
    assert len(hashed) == PARTS and load_sidecar(tmp_path / "view").table(3).in_place
    assert _region_rows(tmp_path / "view")[1] == ple_table()
