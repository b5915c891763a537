"""Issue 41: an in-place sidecar (``sidecar build --in-place``) serves the checkpoint's own shard regions with the
copied sidecar's guarantees: rows bit-identical to the copy and to the safetensors tensors through every Python
reader, SHA-256 per region at load (and the verified cache), the trust rule, change detection while serving,
refusal of a foreign checkpoint; and it refuses, naming the tensor, what cannot be served where it lies."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import PREFIX, make_checkpoint, shard_rows_via_safetensors
from test_cli import run

from sglang_ssd_stream.errors import EXIT_USAGE, KitError, RefusedSourceState
from sglang_ssd_stream.sidecar import (
    MappedReader,
    SidecarChanged,
    SidecarCheckpointError,
    SidecarChecksumMismatch,
    SidecarIOError,
    SidecarManifestError,
    SidecarPathEscape,
    SidecarReader,
    SidecarReaderUnusable,
    SidecarSizeMismatch,
    load_manifest,
)
from sglang_ssd_stream.sidecar.build import build_sidecar
from sglang_ssd_stream.sidecar.in_place import build_in_place
from sglang_ssd_stream.sidecar.verify import CACHE_NAME, REPORT, SERVE, verify_sidecar

FP8, BF16 = 3, 7
SETTLE_S = 0.05  # a write within one filesystem clock tick of the file's last one could keep its mtime


def _checkpoint(path: Path, *, files: int = 3, seed: int = 5):
    return make_checkpoint(path, {FP8: ("float8_e4m3fn", 20_011, 160), BF16: ("bfloat16", 3_001, 160)},
                           parts=16, files=files, seed=seed)


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """One checkpoint with its in-place manifest and a copied sidecar built from it: (ckpt, in place, copy)."""
    root = tmp_path_factory.mktemp("in_place")
    ck = _checkpoint(root / "ckpt")
    build_sidecar(ck.path, root / "copy", progress=False)
    build_in_place(ck.path, progress=False)
    return ck, load_manifest(ck.path), load_manifest(root / "copy")


@pytest.fixture
def fresh(tmp_path):
    """A checkpoint of its own with an in-place manifest (safe to write into): (ckpt, manifest)."""
    ck = _checkpoint(tmp_path / "ckpt", files=2, seed=9)
    build_in_place(ck.path, progress=False)
    return ck, load_manifest(ck.path)


def _ids(table, rng, n=4000):
    """Random ids plus every region's first and last row and duplicates, in a scattered order."""
    edges = [x for r in table.regions for x in (r.row_start, r.row_end - 1)]
    ids = np.concatenate([rng.integers(table.row_start, table.row_end, n), edges, edges[:7]]).astype(np.int64)
    rng.shuffle(ids)
    return ids


def _read(reader, ids):
    out = np.full((ids.size, reader.row_bytes), 0xA5, np.uint8)
    reader.read_rows(ids, out)
    return out


# ----------------------------------------------------------------------------- the manifest it writes


def test_build_writes_only_the_manifest_and_its_verified_cache(tmp_path):
    ck = _checkpoint(tmp_path / "ckpt")
    before = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in ck.path.iterdir()}
    result = build_in_place(ck.path, progress=False)
    after = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in ck.path.iterdir()}
    assert set(after) - set(before) == {"ssd-stream.json", CACHE_NAME}
    assert {k: after[k] for k in before} == before  # not a byte of the checkpoint written
    assert not [p for p in ck.path.iterdir() if p.name.endswith(".tmp")]
    doc = json.loads((ck.path / "ssd-stream.json").read_text())
    assert doc["version"] == 2 and [t["layer"] for t in doc["tables"]] == [FP8, BF16]
    fp8 = result.manifest.table(FP8)
    assert fp8.in_place and len(fp8.regions) == 16 and len(fp8.files) == 3  # one table over three shards
    assert [r.row_start for r in fp8.regions] == [k * 1251 for k in range(16)]
    assert all(r.file.parent == ck.path.resolve() and r.tensor.startswith(PREFIX.format(layer=FP8))
               for r in fp8.regions)
    assert result.scale_file is not None and "model-plefp8-scale" not in result.scale_file  # scales stay put
    assert result.verify is not None and [c.status for c in result.verify.tables] == ["cached", "cached"]


def test_a_serving_start_after_the_build_reads_nothing_and_a_report_writes_nothing(fresh):
    ck, manifest = fresh
    cache = ck.path / CACHE_NAME
    recorded = cache.read_bytes()
    assert all(c.status == "cached" for c in verify_sidecar(manifest, caller=SERVE, progress=False).tables)
    assert [c.status for c in verify_sidecar(manifest, caller=REPORT, use_cache=False, progress=False).tables] \
        == ["verified", "verified"]
    assert cache.read_bytes() == recorded


def test_existing_manifest_is_kept_without_force(fresh):
    ck, _ = fresh
    before = (ck.path / "ssd-stream.json").read_bytes()
    with pytest.raises(RefusedSourceState, match="already exists; pass --force"):
        build_in_place(ck.path, progress=False)
    assert (ck.path / "ssd-stream.json").read_bytes() == before
    build_in_place(ck.path, progress=False, force=True)
    assert (ck.path / "ssd-stream.json").read_bytes() == before  # same checkpoint, same manifest


def test_a_manifest_that_cannot_be_written_is_an_environment_problem(tmp_path):
    from sglang_ssd_stream.errors import EnvironmentProblem

    ck = _checkpoint(tmp_path / "ckpt", files=1)
    (ck.path / "ssd-stream.json").mkdir()  # in the way of the rename, as a read-only directory would be
    with pytest.raises(EnvironmentProblem, match="cannot write .*ssd-stream.json.*copied one goes where -o says"):
        build_in_place(ck.path, progress=False, force=True)


# ----------------------------------------------------------------------------- bit-identical rows


@pytest.mark.parametrize("io", ["mmap", "pread"])
@pytest.mark.parametrize("workers", [1, 4])
def test_rows_equal_the_copy_and_the_safetensors_tensors(both, io, workers):
    ck, inplace, copy = both
    rng = np.random.default_rng(workers)
    cls = MappedReader if io == "mmap" else SidecarReader
    for layer in (FP8, BF16):
        ref = shard_rows_via_safetensors(ck.path, layer)
        t, c = inplace.table(layer), copy.table(layer)
        ids = _ids(t, rng)
        with cls(t, max_rows=1024, workers=workers) as r, cls(c, max_rows=1024, workers=workers) as rc:
            got = _read(r, ids)
            assert np.array_equal(got, _read(rc, ids)) and np.array_equal(got, ref[ids])


@pytest.mark.parametrize("io", ["mmap", "pread"])
def test_a_tp_rank_reads_its_rows_across_region_and_shard_boundaries(both, io):
    ck, inplace, _ = both
    t = inplace.table(FP8)
    ref = shard_rows_via_safetensors(ck.path, FP8)
    lo, hi = t.regions[3].row_start + 17, t.regions[9].row_start + 5  # ranks split inside regions
    ids = np.concatenate([_ids(t, np.random.default_rng(3), 2000), [lo - 1, lo, hi - 1, hi]]).astype(np.int64)
    cls = MappedReader if io == "mmap" else SidecarReader
    with cls(t, vocab_start=lo, vocab_end=hi, max_rows=512, workers=2) as r:
        got = _read(r, ids)
    inside = (ids >= lo) & (ids < hi)
    assert inside.sum() > 100 and (~inside).sum() > 100
    assert np.array_equal(got[inside], ref[ids[inside]]) and not got[~inside].any()


def test_512_shards_like_the_real_checkpoint(tmp_path):
    """split_ngram_parts = 512, as Qwen3.8 Flash-Next's: 512 regions of one table over 5 files, read as one."""
    from sglang_ssd_stream.sidecar.row_cache import RowCache, RowCacheConfig

    ck = make_checkpoint(tmp_path / "ck", {FP8: ("float8_e4m3fn", 512 * 7 - 3, 160)}, parts=512, files=5, seed=8)
    t = build_in_place(ck.path, progress=False).manifest.table(FP8)
    assert len(t.regions) == 512 and len(t.files) == 5
    ids = _ids(t, np.random.default_rng(9), 5000)
    for cls in (MappedReader, SidecarReader):
        with cls(t, max_rows=1024, workers=2) as r:
            assert np.array_equal(_read(r, ids), ck.tables[FP8][ids])
    with RowCache(MappedReader(t, max_rows=1024, workers=2), np.zeros((300, 160), np.uint8),
                  RowCacheConfig(workers=2, seed=2)) as c:
        assert np.array_equal(_read(c, ids), ck.tables[FP8][ids])


@pytest.mark.parametrize("io", ["mmap", "pread"])
def test_a_lookup_takes_the_shard_sizes_from_open_not_from_every_region(both, io, monkeypatch):
    """The sizes each shard must keep are derived from the regions once, when the reader opens: re-derived from
    512 regions before and after every lookup they cost 0.7 ms (3-4x a warm copied lookup of one token)."""
    import sglang_ssd_stream.sidecar.reader as reader_mod

    ck, inplace, _ = both
    t = inplace.table(FP8)
    cls = MappedReader if io == "mmap" else SidecarReader
    with cls(t, max_rows=64, workers=1) as r:
        def per_lookup(table):
            raise AssertionError("file sizes re-derived from the manifest's regions during a lookup")

        monkeypatch.setattr(reader_mod, "file_sizes", per_lookup)
        ids = np.array([0, t.rows - 1, t.regions[4].row_start], np.int64)
        assert np.array_equal(_read(r, ids), ck.tables[FP8][ids])


def test_a_table_in_one_region_reads_at_its_offset(tmp_path):
    """parts=1: each table is one tensor, at a non-zero offset of its shard: the one-region path."""
    ck = make_checkpoint(tmp_path / "ck", {FP8: ("float8_e4m3fn", 999, 160)}, parts=1, files=1, seed=4)
    t = build_in_place(ck.path, progress=False).manifest.table(FP8)
    assert len(t.regions) == 1 and t.regions[0].offset > 0
    ids = np.arange(999)[::-1].copy()
    for cls in (MappedReader, SidecarReader):
        with cls(t, max_rows=999, workers=1) as r:
            assert np.array_equal(_read(r, ids), ck.tables[FP8][ids])


def test_regions_of_uneven_sizes_in_shuffled_file_order(tmp_path):
    """What a manifest may say beyond what the builder writes: regions of any size, in any byte order of one
    file, with gaps between them; every reader finds each row where its region puts it."""
    from sglang_ssd_stream.sidecar.format import SidecarTable, TableRegion
    from sglang_ssd_stream.sidecar.row_cache import RowCache, RowCacheConfig
    from sglang_ssd_stream.staging.native_read import NativeRead

    rb, sizes = 160, [5, 17, 1, 40, 9, 300, 2]
    raw = np.random.default_rng(3).integers(0, 256, (sum(sizes) * 2 + 50) * rb, np.uint8)
    f = tmp_path / "shard.bin"
    raw.tofile(f)
    slots = np.random.default_rng(4).permutation(len(sizes))  # region k's place among the regions in the file
    at, offsets = 24, {}
    for k in slots.tolist():  # laid out in shuffled order, a gap of 3 rows (+ 8 B) after each
        offsets[k], at = at, at + (sizes[k] + 3) * rb + 8
    starts = np.cumsum([0, *sizes])
    regions = tuple(TableRegion("shard.bin", f, offsets[k], int(starts[k]), sizes[k], sizes[k] * rb, "0" * 64,
                                raw.size, f"t{k}", 0) for k in range(len(sizes)))
    t = SidecarTable(0, "shard.bin", f, "0" * 64, "float8_e4m3fn", int(starts[-1]), rb, 0, int(starts[-1]) * rb,
                     regions)
    want = np.concatenate([raw[offsets[k]:offsets[k] + sizes[k] * rb].reshape(sizes[k], rb)
                           for k in range(len(sizes))])
    ids = np.random.default_rng(5).integers(0, t.rows, 3000)
    lo, hi = 10, 300
    for cls in (MappedReader, SidecarReader):
        with cls(t, max_rows=512, workers=2) as r:
            assert np.array_equal(_read(r, ids), want[ids])
        with cls(t, vocab_start=lo, vocab_end=hi, max_rows=512, workers=2) as r:
            out = np.zeros((ids.size, rb), np.uint8)
            NativeRead(r, ids, out, what="test").run()
            inside = (ids >= lo) & (ids < hi)
            assert np.array_equal(out[inside], want[ids[inside]]) and not out[~inside].any()
    cache = RowCache(MappedReader(t, max_rows=512, workers=2), np.zeros((50, rb), np.uint8),
                     RowCacheConfig(workers=2, wave_pages=4, seed=0))
    with cache:
        assert np.array_equal(_read(cache, ids), want[ids])


# ----------------------------------------------------------------------------- refusals at build


def _save(path: Path, tensors: dict, config: dict | None = None) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config or {"text_config": {"split_ngram_parts": 2}}))
    return path


def test_a_shard_written_while_it_is_hashed_is_refused(tmp_path, monkeypatch):
    """A download still writing the checkpoint: a shard whose stat moved while its regions were hashed is refused,
    naming it, and no manifest is written."""
    from sglang_ssd_stream.sidecar import in_place

    ck = _checkpoint(tmp_path / "ckpt", files=2, seed=11)
    real, written = in_place.sha256_file, []

    def hash_then_write(file, **kw):
        digest = real(file, **kw)
        if not written:  # the writer appends to the first shard once its first region is hashed
            with open(file, "ab") as f:
                f.write(b"\0")
            written.append(Path(file))
        return digest

    monkeypatch.setattr(in_place, "sha256_file", hash_then_write)
    with pytest.raises(SidecarCheckpointError, match=r"was written while its PLE regions were hashed") as err:
        build_in_place(ck.path, progress=False)
    assert written and str(written[0]) in str(err.value)
    assert not (ck.path / "ssd-stream.json").exists()


def test_a_dtype_the_engines_convert_is_refused_naming_the_tensor(tmp_path):
    import torch

    name = f"{PREFIX.format(layer=1)}.shard_1.weight"
    ck = _save(tmp_path / "f16", {f"{PREFIX.format(layer=1)}.shard_0.weight": torch.zeros(4, 8, dtype=torch.bfloat16),
                                  name: torch.zeros(4, 8, dtype=torch.float16)})
    with pytest.raises(SidecarCheckpointError, match=rf"PLE tensor {name} is float16.*would convert it"):
        build_in_place(ck, progress=False)
    assert not (ck / "ssd-stream.json").exists()


def test_a_dtype_other_than_the_config_declares_is_refused(tmp_path):
    import torch

    cfg = {"text_config": {"split_ngram_parts": 1, "ple_embedding_dtype": "float8_e4m3fn"}}
    ck = _save(tmp_path / "bf16", {f"{PREFIX.format(layer=1)}.shard_0.weight": torch.zeros(4, 8, dtype=torch.bfloat16)},
               cfg)
    with pytest.raises(SidecarCheckpointError, match=r"shard_0.weight is bfloat16, but the engines hold the table "
                                                     r"as float8_e4m3fn"):
        build_in_place(ck, progress=False)


def test_a_tensor_that_is_not_a_row_major_matrix_is_refused_naming_it(tmp_path):
    import torch

    name = f"{PREFIX.format(layer=1)}.shard_0.weight"
    ck = _save(tmp_path / "3d", {name: torch.zeros(4, 2, 4, dtype=torch.bfloat16)},
               {"text_config": {"split_ngram_parts": 1}})
    with pytest.raises(SidecarCheckpointError, match=rf"PLE tensor {name} has shape \[4, 2, 4\].*not a row-major"):
        build_in_place(ck, progress=False)


def test_a_shard_linked_from_outside_the_checkpoint_is_refused(tmp_path):
    ck = _checkpoint(tmp_path / "ckpt", files=2)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shard = ck.path / "model-00002-of-00002.safetensors"
    shutil.move(shard, elsewhere / shard.name)
    shard.symlink_to(elsewhere / shard.name)
    with pytest.raises(SidecarPathEscape, match="outside the artifact directory"):
        build_in_place(ck.path, progress=False)
    assert not (ck.path / "ssd-stream.json").exists()


def test_hf_snapshot_links_into_blobs_are_trusted(tmp_path):
    """The layout the hub cache has: snapshot files are links into ../../blobs."""
    repo = tmp_path / "models--o--n"
    snap, blobs = repo / "snapshots" / "rev", repo / "blobs"
    ck = _checkpoint(snap, files=2)
    blobs.mkdir()
    for f in sorted(snap.glob("*.safetensors")):
        shutil.move(f, blobs / f"blob-{f.stem}")
        f.symlink_to(Path("../../blobs") / f"blob-{f.stem}")
    t = build_in_place(ck.path, progress=False).manifest.table(FP8)
    assert {f.parent for f in t.files} == {blobs.resolve()}
    with MappedReader(t, max_rows=64, workers=1) as r:
        assert np.array_equal(_read(r, np.arange(0, t.rows, 97)), ck.tables[FP8][::97])


# ----------------------------------------------------------------------------- refusals at load and while serving


def test_a_tampered_region_fails_its_sha256_at_load_naming_the_tensor(fresh):
    ck, manifest = fresh
    r = manifest.table(FP8).regions[5]
    st = os.stat(r.file)
    with open(r.file, "r+b") as f:
        f.seek(r.offset + 3 * manifest.table(FP8).row_bytes + 11)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 1]))
    os.utime(r.file, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime put back: ctime still moved
    with pytest.raises(SidecarChecksumMismatch, match=rf"tensor {r.tensor}: rows \[{r.row_start}, {r.row_end}\)"):
        verify_sidecar(load_manifest(ck.path), caller=SERVE, progress=False)


def test_a_change_elsewhere_in_a_shard_rehashes_its_regions_and_passes(fresh):
    """Another tensor of the same shard rewritten (same bytes): the regions are hashed again, not refused."""
    ck, manifest = fresh
    t = manifest.table(FP8)
    time.sleep(SETTLE_S)
    with open(t.regions[0].file, "r+b") as f:  # the header's first byte, written back unchanged
        b = f.read(1)
        f.seek(0)
        f.write(b)
    checks = verify_sidecar(load_manifest(ck.path), caller=SERVE, progress=False).tables
    assert checks[0].status == "verified" and checks[0].seconds > 0


def test_a_shard_of_another_size_is_refused_at_load(fresh):
    ck, manifest = fresh
    with open(manifest.table(BF16).regions[-1].file, "ab") as f:
        f.write(b"\0")
    with pytest.raises(SidecarSizeMismatch, match="the checkpoint changed since: rebuild it"):
        load_manifest(ck.path)


def test_a_foreign_checkpoint_is_refused(tmp_path, fresh):
    """The manifest of one checkpoint beside another of the same layout: every region's SHA-256 differs."""
    ck, _ = fresh
    other = _checkpoint(tmp_path / "other", files=2, seed=10)
    shutil.copy(ck.path / "ssd-stream.json", other.path / "ssd-stream.json")
    for f in other.path.glob("*.safetensors"):  # same sizes, and mtimes as recorded: only the bytes differ
        st = (ck.path / f.name).stat()
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(SidecarChecksumMismatch):
        verify_sidecar(load_manifest(other.path), caller=SERVE, progress=False)


@pytest.mark.parametrize("io", ["mmap", "pread"])
def test_a_shard_written_while_served_is_refused_for_good(fresh, io):
    ck, manifest = fresh
    t = manifest.table(FP8)
    ids = _ids(t, np.random.default_rng(1), 300)
    with (MappedReader if io == "mmap" else SidecarReader)(t, max_rows=512, workers=2) as r:
        assert np.array_equal(_read(r, ids), ck.tables[FP8][ids])
        time.sleep(SETTLE_S)
        other = next(r for r in t.regions if r.file != t.files[0])  # not the first file: every one is watched
        with open(other.file, "r+b") as f:  # the same bytes written back: a write all the same
            f.seek(other.offset)
            b = f.read(160)
            f.seek(other.offset)
            f.write(b)
        with pytest.raises(SidecarChanged, match=str(other.file)):
            _read(r, ids)
        with pytest.raises(SidecarReaderUnusable):
            _read(r, ids[:1])


def _manifest_doc(ck) -> dict:
    return json.loads((ck.path / "ssd-stream.json").read_text())


@pytest.mark.parametrize("edit,error,fragment", [
    (lambda d: d["tables"][0]["regions"].pop(4), SidecarManifestError, "regions tile the table's rows"),
    (lambda d: d["tables"][0]["regions"][2].update(offset=d["tables"][0]["regions"][1]["offset"]),
     SidecarManifestError, "overlap"),
    (lambda d: d["tables"][0]["regions"][0].update(offset=d["tables"][0]["regions"][0]["file_bytes"]),
     SidecarSizeMismatch, "beyond its file_bytes"),
    (lambda d: d["tables"][0]["regions"][0].update(path="../ckpt/x.safetensors"), SidecarPathEscape, "'..'"),
    (lambda d: d["tables"][0]["regions"][0].pop("sha256"), SidecarManifestError, "fields"),
    (lambda d: d["tables"][0]["regions"][0].update(file_mtime_ns=1), SidecarManifestError, "one size and mtime"),
    (lambda d: d["tables"][0].update(rows=d["tables"][0]["rows"] + 1), SidecarManifestError, "all of them"),
])
def test_manifest_rules(fresh, edit, error, fragment):
    ck, _ = fresh
    doc = _manifest_doc(ck)
    edit(doc)
    (ck.path / "ssd-stream.json").write_text(json.dumps(doc))
    with pytest.raises(error, match=fragment):
        load_manifest(ck.path)


def test_the_mapped_reader_maps_the_shard_files_side_by_side(both):
    """One address range for a table over three shard files (one gather per lookup, not one per file): every
    segment's view lies in the reader's one mapping; a view held past close() keeps it mapped, with the right rows."""
    ck, inplace, _ = both
    t = inplace.table(FP8)
    assert len(t.files) == 3
    r = MappedReader(t, max_rows=64, workers=1)
    (m,) = r._maps
    lo = np.frombuffer(m, np.uint8).ctypes.data
    views = r.mapped_views
    assert len(views) == len(t.regions)
    for v, reg in zip(views, t.regions, strict=True):
        assert lo <= v.ctypes.data and v.ctypes.data + v.nbytes <= lo + len(m)
        assert v.shape == (reg.rows, t.row_bytes)
    ids = np.array([reg.row_end - 1 for reg in t.regions], np.int64)
    assert np.array_equal(_read(r, ids), ck.tables[FP8][ids])
    r.close()
    for v, reg in zip(views, t.regions, strict=True):  # still mapped: the held views keep the mapping
        assert np.array_equal(v[-1], ck.tables[FP8][reg.row_end - 1])
    del views, v
    with pytest.raises(SidecarReaderUnusable, match="closed"):
        r.read_rows(ids, np.zeros((ids.size, t.row_bytes), np.uint8))


def _aligned_checkpoint(path: Path, files: int = 3, per_file: int = 2, rows: int = 997) -> np.ndarray:
    """PLE shard tensors only, consecutive, each file's data starting at a multiple of 32 bytes (its header padded
    with spaces, as the format allows): every row of every file lies at one residue modulo 160 once mapped side
    by side. Returns the table's bytes."""
    import struct

    rng = np.random.default_rng(11)
    table = rng.integers(0, 256, size=(files * per_file * rows, 160), dtype=np.uint8)
    path.mkdir(parents=True)
    weight_map = {}
    for i in range(files):
        header, data = {}, b""
        for j in range(per_file):
            k = i * per_file + j
            name = f"{PREFIX.format(layer=FP8)}.shard_{k}.weight"
            chunk = table[k * rows:(k + 1) * rows].tobytes()
            span = [len(data), len(data) + len(chunk)]
            header[name] = {"dtype": "F8_E4M3", "shape": [rows, 160], "data_offsets": span}
            data += chunk
            weight_map[name] = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        raw = json.dumps(header).encode()
        raw += b" " * (-(8 + len(raw)) % 32 + 32 * i)  # data at 32 × (something), a different page offset per file
        (path / weight_map[name]).write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({"model_type": "qwen4_exp",
                                                  "text_config": {"split_ngram_parts": files * per_file}}))
    return table


def test_the_mapped_reader_takes_rows_of_one_array_where_the_files_align(both, tmp_path):
    """Files whose rows lie at one residue modulo 32 are placed so all rows are one [n, 160] array (numpy.take, the
    copy's gather); files that do not (the test checkpoint's) are read through the window at any byte. Both serve
    the checkpoint's rows."""
    table = _aligned_checkpoint(tmp_path / "aligned")
    build_in_place(tmp_path / "aligned", progress=False)
    t = load_manifest(tmp_path / "aligned").table(FP8)
    assert len(t.files) == 3 and len({r.offset % 160 for r in t.regions}) > 1  # not aligned in the files
    ids = _ids(t, np.random.default_rng(3), 3000)
    with MappedReader(t, max_rows=4096, workers=1) as r:
        assert r._rows_at is not None
        assert np.array_equal(_read(r, ids), table[ids])
    with MappedReader(t, max_rows=4096, workers=3, inline_rows=0) as r:  # through the pool
        assert np.array_equal(_read(r, ids), table[ids])
    ck, inplace, _ = both
    with MappedReader(inplace.table(FP8), max_rows=4096, workers=1) as r:
        assert r._rows_at is None
        ids = _ids(inplace.table(FP8), np.random.default_rng(4), 3000)
        assert np.array_equal(_read(r, ids), ck.tables[FP8][ids])


@pytest.mark.parametrize("workers", [1, 4])
def test_the_pread_reader_reads_every_shard_file_in_one_wave(both, workers):
    """A lookup touching all three shard files is planned and read as one wave (its reads of every file in flight
    together), not file after file; the rows are the checkpoint's, at every region's first and last row."""
    ck, inplace, _ = both
    t = inplace.table(FP8)
    ids = np.array([x for reg in t.regions for x in (reg.row_start, reg.row_end - 1)], np.int64)
    with SidecarReader(t, max_rows=4096, workers=workers) as r:
        assert np.array_equal(_read(r, ids), ck.tables[FP8][ids])
        assert r.stats["waves"] == 1 and r.stats["reads"] >= len(t.files)


def test_a_side_by_side_mapping_that_fails_is_a_clear_error_and_leaves_nothing_open(both, monkeypatch):
    """mmap refusing a file's span (MAP_FIXED at another address, or an error): SidecarIOError naming the table,
    its files closed and the reservation unmapped."""
    from sglang_ssd_stream.sidecar import mapped

    _, inplace, _ = both
    t = inplace.table(FP8)
    closed, owners = [], []
    real_close, real_mmap = mapped.TableFiles.close, mapped.mmap.mmap

    def spy_close(self):
        closed.append(self)
        return real_close(self)

    def spy_mmap(*a, **k):
        owners.append(real_mmap(*a, **k))
        return owners[-1]

    monkeypatch.setattr(mapped.TableFiles, "close", spy_close)
    monkeypatch.setattr(mapped.mmap, "mmap", spy_mmap)
    monkeypatch.setattr(mapped, "_libc_mmap", lambda: lambda *a: 0)  # never the address asked for
    with pytest.raises(SidecarIOError, match=rf"cannot map PLE table .* \({len(t.files)} file\(s\)\)"):
        MappedReader(t, max_rows=64, workers=1)
    assert len(closed) == 1 and len(owners) == 1 and owners[0].closed


def test_a_single_descriptor_is_refused_for_an_in_place_table(both):
    """`sidecar profile` and a copied table's callers take one descriptor; an in-place table has several."""
    _, inplace, _ = both
    with MappedReader(inplace.table(FP8), max_rows=64, workers=1) as r:
        with pytest.raises(SidecarReaderUnusable, match="single descriptor"):
            r.fileno()


@pytest.mark.parametrize("io", ["mmap", "pread"])
@pytest.mark.parametrize("workers", [1, 3])
def test_the_captured_native_read_of_regions(both, io, workers):
    """The CUDA host node's C read (staging/native_read.c) of an in-place table, on a rank split inside regions."""
    from sglang_ssd_stream.staging.native_read import NativeRead

    ck, inplace, _ = both
    t = inplace.table(FP8)
    lo, hi = t.regions[1].row_start + 3, t.regions[14].row_start + 2
    ids = _ids(t, np.random.default_rng(workers), 2000)
    out = np.full((ids.size, t.row_bytes), 0xA5, np.uint8)
    cls = MappedReader if io == "mmap" else SidecarReader
    with cls(t, vocab_start=lo, vocab_end=hi, max_rows=4096, workers=workers) as r:
        node = NativeRead(r, ids, out, what="PLE layer 3 sidecar read", inline_rows=0 if workers > 1 else None)
        node.run()
        inside = (ids >= lo) & (ids < hi)
        assert np.array_equal(out[inside], ck.tables[FP8][ids[inside]]) and not out[~inside].any()
        node.close()


_NATIVE_CHANGED = """
import sys, time, numpy as np
from sglang_ssd_stream.sidecar import load_manifest, open_reader
from sglang_ssd_stream.staging.native_read import NativeRead
t = load_manifest(sys.argv[1]).tables[0]
ids = np.arange(0, t.rows, 7, dtype=np.int64)
out = np.zeros((ids.size, t.row_bytes), np.uint8)
node = NativeRead(open_reader(t, sys.argv[2], max_rows=ids.size, workers=1), ids, out, what="PLE layer 3 read")
node.run()
print("FIRST", out.any())
time.sleep(0.05)
other = next(r for r in t.regions if r.file != t.files[0])
with open(other.file, "r+b") as f:
    f.seek(other.offset)
    b = f.read(8)
    f.seek(other.offset)
    f.write(b)
node.run()
print("CONTINUED")
"""


@pytest.mark.parametrize("io", ["mmap", "pread"])
def test_the_native_read_stops_the_process_when_a_shard_is_written(fresh, io):
    import subprocess
    import sys

    ck, manifest = fresh
    other = next(r for r in manifest.table(FP8).regions if r.file != manifest.table(FP8).files[0])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), *sys.path])}
    p = subprocess.run([sys.executable, "-c", _NATIVE_CHANGED, str(ck.path), io], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 70 and "FIRST True" in p.stdout and "CONTINUED" not in p.stdout, p.stderr
    assert "SidecarChanged: the PLE table was written while it is served" in p.stderr and str(other.file) in p.stderr


# ----------------------------------------------------------------------------- the row cache


def _cache(table, capacity, io="mmap", **kw):
    from sglang_ssd_stream.sidecar.row_cache import RowCache, RowCacheConfig

    inner = (MappedReader if io == "mmap" else SidecarReader)(table, max_rows=2048, workers=2, **kw)
    return RowCache(inner, np.zeros((capacity, table.row_bytes), np.uint8),
                    RowCacheConfig(workers=3, wave_pages=16, seed=1))


@pytest.mark.parametrize("capacity", [64, 50_000])  # evicting all the time, and holding every row
def test_row_cache_rows_equal_the_copy_and_the_tensors(both, capacity):
    """Misses read by the C cache at each region's offset (small waves: many runs, pages shared by regions
    adjacent in a shard), hits served from memory, prefetched rows too."""
    ck, inplace, copy = both
    rng = np.random.default_rng(capacity)
    for layer in (FP8, BF16):
        ref = shard_rows_via_safetensors(ck.path, layer)
        t = inplace.table(layer)
        with _cache(t, capacity) as c, _cache(copy.table(layer), capacity, io="pread") as cc:
            c.prefetch(_ids(t, rng, 500))
            for _ in range(3):
                ids = _ids(t, rng, 3000)
                got = _read(c, ids)
                assert np.array_equal(got, ref[ids]) and np.array_equal(got, _read(cc, ids))
            assert c.stats["rows_read"] > 0 and c.stats["hits"] > 0


def test_row_cache_of_a_tp_rank_across_regions(both):
    ck, inplace, _ = both
    t = inplace.table(FP8)
    lo, hi = t.regions[2].row_start + 9, t.regions[11].row_start + 1
    ids = _ids(t, np.random.default_rng(8), 3000)
    with _cache(t, 256, io="pread", vocab_start=lo, vocab_end=hi) as c:
        got = _read(c, ids)
    inside = (ids >= lo) & (ids < hi)
    assert np.array_equal(got[inside], ck.tables[FP8][ids[inside]]) and not got[~inside].any()


def test_row_cache_refuses_a_shard_written_while_served(fresh):
    ck, manifest = fresh
    t = manifest.table(BF16)
    ids = _ids(t, np.random.default_rng(2), 200)
    with _cache(t, 32) as c:
        assert np.array_equal(_read(c, ids), ck.tables[BF16][ids])
        assert len(c.file_stats()) == len(t.files) == 2  # every shard it reads is watched
        time.sleep(SETTLE_S)
        other = next(r for r in t.regions if r.file != t.files[0])  # not the first file: every one is watched
        with open(other.file, "r+b") as f:
            f.seek(other.offset)
            b = f.read(64)
            f.seek(other.offset)
            f.write(b)
        with pytest.raises(SidecarChanged, match=rf"{other.file}.*written while it is served"):
            _read(c, ids)
        with pytest.raises(SidecarReaderUnusable):
            _read(c, ids[:1])


def _hot(manifest, cache, path):
    from sglang_ssd_stream.sidecar.hot_rows import HotRows

    return HotRows(manifest, {FP8: cache}, share=1.0, interval_s=0, role="test", path=path)


def test_the_hot_file_of_an_in_place_table_comes_back_without_a_disk_read(fresh, tmp_path):
    ck, manifest = fresh
    t = manifest.table(FP8)
    ids = _ids(t, np.random.default_rng(6), 400)
    with _cache(t, 4096) as c:
        _read(c, ids)
        assert _hot(manifest, c, tmp_path / "hot").write() == np.unique(ids).size
    with _cache(t, 4096) as c:
        assert _hot(manifest, c, tmp_path / "hot").load() == np.unique(ids).size  # every row checked, then placed
        got = _read(c, ids)
        assert c.stats["rows_read"] == 0 and np.array_equal(got, ck.tables[FP8][ids])


def test_a_hot_file_of_an_in_place_table_is_refused_once_a_shard_changes_or_its_rows_are_forged(fresh, tmp_path,
                                                                                                 caplog):
    from tests.hot_forgery import forge

    ck, manifest = fresh
    t = manifest.table(FP8)
    with _cache(t, 4096) as c:
        _read(c, _ids(t, np.random.default_rng(7), 400))
        _hot(manifest, c, tmp_path / "hot").write()
    forge(tmp_path / "hot", ck.path, dest=tmp_path / "forged")  # identities kept, rows inverted, sums redone
    with _cache(t, 4096) as c, caplog.at_level("WARNING"):
        assert _hot(manifest, c, tmp_path / "forged").load() == 0
    assert "differs from its table" in caplog.text
    time.sleep(SETTLE_S)
    other = next(r for r in t.regions if r.file != t.files[0])
    with open(other.file, "r+b") as f:  # the same bytes written back: the shard's ctime and mtime move
        b = f.read(8)
        f.seek(0)
        f.write(b)
    caplog.clear()
    with _cache(t, 4096) as c, caplog.at_level("WARNING"):
        assert _hot(manifest, c, tmp_path / "hot").load() == 0
    assert f"{other.file} is not the file its rows were read from" in caplog.text


def test_disk_is_counted_for_each_kind(both):
    """The doctors' sidecar finding says what each kind costs on disk (in place: the manifest alone; copied: the
    table files); `plan` leaves an in-place table out of the resident weights (it is streamed from the shards the
    index maps) and the doctor counts each shard file of the model once (its regions are not a second copy)."""
    from sglang_ssd_stream.checks.sidecar import load_finding
    from sglang_ssd_stream.operate.capacity import in_place_ple_bytes, weights_bytes
    from sglang_ssd_stream.sglang import doctor
    from sglang_ssd_stream.staging.host_memory import fmt_bytes

    ck, inplace, copy = both
    tables = sum(t.bytes for t in inplace.tables)
    assert tables == sum(t.bytes for t in copy.tables) > 1 << 20
    shards = {r.file for t in inplace.tables for r in t.regions}
    finding, _ = load_finding(ck.path)
    assert finding.message.endswith(
        f"in place: {fmt_bytes(inplace.path.stat().st_size)} on disk (the manifest; the {fmt_bytes(tables)} of "
        f"tables are regions of {len(shards)} checkpoint shard file(s))"), finding.message
    assert inplace.path.stat().st_size < 64 << 10
    finding, _ = load_finding(copy.root)
    assert finding.message.endswith(f"copied: {fmt_bytes(tables)} of table files on disk"), finding.message

    files = sum(f.stat().st_size for f in ck.path.glob("*.safetensors"))
    assert weights_bytes(ck.path) == files and in_place_ple_bytes(ck.path) == tables
    assert in_place_ple_bytes(copy.root) == 0  # a copied sidecar's tables are not in the index's files
    assert doctor._model_bytes(str(ck.path), []) == files  # not files + the regions again


def test_a_view_of_an_in_place_checkpoint(tmp_path):
    """`model build-view` with the checkpoint as both snapshots: the index leaves the PLE tensors out, so an engine
    loading the view never opens them; its manifest's regions resolve to the checkpoint's own shards, those that
    hold PLE tensors only included (9 files: several hold nothing else, as the real checkpoint's PLE shards)."""
    from sglang_ssd_stream.operate.model_view import build_view, check_view
    from sglang_ssd_stream.sidecar.view import load_sidecar

    ck = _checkpoint(tmp_path / "ckpt", files=9)
    build_in_place(ck.path, progress=False)
    view = tmp_path / "view"
    build_view(ck.path, ck.path, view)
    check_view(view)
    index = json.loads((view / "model.safetensors.index.json").read_text())["weight_map"]
    assert index and not [n for n in index if ".ngram_embedding.shard_" in n and "mtp" not in n]
    t = load_sidecar(view).table(FP8)
    assert t.in_place and {f.parent for f in t.files} == {ck.path.resolve()}
    with SidecarReader(t, max_rows=64, workers=1) as r:
        ids = np.arange(0, t.rows, 101, dtype=np.int64)
        assert np.array_equal(_read(r, ids), ck.tables[FP8][ids])


def test_build_view_in_place_reads_the_dense_snapshots_shards(tmp_path, capsys):
    """`model build-view --in-place` over a checkpoint with no sidecar: the view's own manifest names regions of
    the checkpoint's shards (links), nothing is written into the checkpoint, every row is the checkpoint's, and a
    rebuild keeps the manifest; a PLE shard the dense snapshot lacks is refused by name."""
    from sglang_ssd_stream.cli import main
    from sglang_ssd_stream.operate.model_view import ModelViewError, build_view
    from sglang_ssd_stream.sidecar.view import load_sidecar

    ck = _checkpoint(tmp_path / "ckpt", files=9)  # several files hold PLE shards only, as the real ones
    before = sorted(p.name for p in ck.path.iterdir())
    view = tmp_path / "view"
    assert main(["model", "build-view", "--dense", str(ck.path), "--prepared", str(ck.path), "--out", str(view),
                 "--in-place", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tables"]
    assert sorted(p.name for p in ck.path.iterdir()) == before  # no manifest, no cache in the checkpoint
    manifest = (view / "ssd-stream.json").read_bytes()
    for layer in (FP8, BF16):
        t = load_sidecar(view).table(layer)
        assert t.in_place and {f.parent for f in t.files} == {ck.path.resolve()}
        assert all((view / r.path).is_symlink() for r in t.regions)
        with SidecarReader(t, max_rows=64, workers=1) as r:
            ids = _ids(t, np.random.default_rng(layer), 500)
            assert np.array_equal(_read(r, ids), ck.tables[layer][ids])
    build_view(ck.path, ck.path, view, in_place=True)
    assert (view / "ssd-stream.json").read_bytes() == manifest

    index = json.loads((ck.path / "model.safetensors.index.json").read_text())["weight_map"]
    other = {f for n, f in index.items() if ".shard_" not in n or "mtp" in n}
    gone = sorted(set(index.values()) - other)[0]
    os.unlink(ck.path / gone)
    with pytest.raises(ModelViewError, match=rf"PLE shard {gone}, mapped in .*, is not in the dense snapshot"):
        build_view(ck.path, ck.path, tmp_path / "view2", in_place=True)


def test_sidecar_profile_of_an_in_place_checkpoint(tmp_path):
    """`sidecar profile` reads the corpus' hottest rows at their regions: the same ids and bytes as from the copy."""
    pytest.importorskip("transformers")
    from test_profile import CORPUS, _cli, _expected

    from sglang_ssd_stream.sidecar.hot_file import read_hot_file
    from sglang_ssd_stream.sidecar.view import load_sidecar
    from tests.e2e.models import profile_inputs

    model, sidecar, files = profile_inputs(tmp_path / "in", CORPUS)
    build_in_place(model, progress=False)
    r = _cli(model, "--model", model, "--corpus", *files, "--rows", 40, "--json", home=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    manifest, copy = load_sidecar(model), load_sidecar(sidecar)
    rng = {t.layer: (t.row_start, t.row_end) for t in manifest.tables}
    got = read_hot_file(json.loads(r.stdout)["path"], manifest, rng, 1 << 30)
    want = _expected(model, files, manifest, 40)
    for t in manifest.tables:
        assert t.in_place
        ids, rows = got.layers[t.layer]
        assert ids.tolist() == want[t.layer]
        with SidecarReader(copy.table(t.layer), max_rows=64, workers=1) as c:
            assert np.array_equal(rows, _read(c, ids))


# ----------------------------------------------------------------------------- the command


def test_cli_build_in_place(tmp_path, capsys):
    ck = _checkpoint(tmp_path / "ckpt", files=2)
    assert run(["build", "--in-place", str(ck.path), "--json", "-q", "--rows", "20011", "--layer", str(FP8)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tables"][0]["regions"] == 16 and len(doc["tables"][0]["files"]) == 2 and doc["verified"] is True
    assert [t.layer for t in load_manifest(ck.path).tables] == [FP8]
    assert run(["verify", str(ck.path), "--json", "-q"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]
    assert run(["verify", str(ck.path), "-q"]) == 0
    assert f"layer {FP8}: in place, 16 regions of 2 shard(s)  verified" in capsys.readouterr().out


@pytest.mark.parametrize("extra", [["-o", "somewhere"], ["--no-verify"]])
def test_cli_refuses_options_that_do_not_apply(tmp_path, extra):
    ck = _checkpoint(tmp_path / "ckpt", files=1)
    with pytest.raises(KitError, match="does not apply") as info:
        run(["build", "--in-place", str(ck.path), "-q", *extra])
    assert info.value.exit_code == EXIT_USAGE and not (ck.path / "ssd-stream.json").exists()
