"""``sidecar profile`` (issue 27 item 2): a hot file from a text corpus, so a first start is warm too.

The tiny qwen4_exp of the e2e suite (its real tokenizer and config through transformers) and its sidecar built by
the kit: the file holds each table's most looked-up rows of the corpus, with the sidecar's bytes, for the process
the engine will run; another model's sidecar and an empty corpus are refused.

A TP rank's rows of each table come from the engine's own split, passed in by the adapter: in the SGLang venv the
CLI's rule must give the ranges sglang 0.5.23's real ``Qwen4ExpNGramEmbedding`` binds at TP 2, 3 and 4 (the vLLM
venv checks vLLM's: ``tests/vllm/test_profile_tp.py``); a split the floor cannot trust is refused, never guessed."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
CORPUS = ["The secret code number is 42. " * 40 + "Reply with the three numbers only.",
          "0123456789 the three numbers only " * 30]


@pytest.fixture(scope="module")
def model_and_sidecar(tmp_path_factory):
    from tests.e2e.models import profile_inputs

    return profile_inputs(tmp_path_factory.mktemp("profile"), CORPUS)


def _cli(*args, home: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_ssd_stream", "sidecar", "profile", *map(str, args)],
                          capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(home), "SGLANG_SSD_STREAM_HOME": str(home / "kit"),
                               "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **env})


def _expected(model: Path, files, manifest, rows: int) -> dict[int, list[int]]:
    """Independently: the tokenizer, the config's hash, a Counter; most looked up first, ties by the lower id."""
    from transformers import AutoTokenizer

    from sglang_ssd_stream.sidecar.ngram import NGramHash

    cfg = json.loads((model / "config.json").read_text())["text_config"]
    tok = AutoTokenizer.from_pretrained(str(model))
    out = {}
    for table in manifest.tables:
        h = NGramHash.from_config(unigram_vocab_size=cfg["vocab_size"], eos_token_id=cfg["eos_token_id"],
                                  ngram_size=cfg["ngram_size"], heads_per_ngram=cfg["heads_per_ngram"],
                                  ngram_vocab_size_base=cfg["ngram_vocab_size_base"],
                                  ple_layer_index=sorted(cfg["ple_layer_ids"]).index(table.layer + 1))
        counts = Counter()
        for f in files:
            counts.update(h.ids(tok(Path(f).read_text(), add_special_tokens=False)["input_ids"]).reshape(-1).tolist())
        out[table.layer] = [i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:rows]]
    return out


def test_the_hot_file_holds_the_corpus_hottest_rows_for_the_serving_process(model_and_sidecar, tmp_path):
    from sglang_ssd_stream.sidecar.hot_file import hot_file_path, read_hot_file
    from sglang_ssd_stream.sidecar.view import load_sidecar

    model, sidecar, files = model_and_sidecar
    r = _cli(sidecar, "--model", model, "--corpus", *files, "--rows", 40, "--json", home=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    manifest = load_sidecar(sidecar)
    rng = {t.layer: (t.row_start, t.row_start + t.rows) for t in manifest.tables}  # the tables differ in size
    assert len(set(rng.values())) == 2
    assert doc["role"] == "sglang-gpu0-tp0-pp0" and doc["row_range"] == {str(k): list(v) for k, v in rng.items()}
    monkey_home = tmp_path / "kit"
    path = Path(doc["path"])
    assert path.parent == monkey_home / "hot" and path.name == hot_file_path(manifest, rng, doc["role"]).name
    got = read_hot_file(path, manifest, rng, 1 << 30)
    want = _expected(model, files, manifest, 40)
    assert set(got.layers) == {t.layer for t in manifest.tables}
    for t in manifest.tables:
        ids, rows = got.layers[t.layer]
        assert ids.tolist() == want[t.layer] and doc["rows"][str(t.layer)] == len(want[t.layer]) == 40
        table_bytes = np.fromfile(t.file, np.uint8).reshape(t.rows, t.row_bytes)
        np.testing.assert_array_equal(rows, table_bytes[ids - t.row_start])


def test_the_vllm_cli_names_its_own_process(model_and_sidecar, tmp_path):
    from sglang_ssd_stream.sidecar.view import load_sidecar

    model, sidecar, files = model_and_sidecar
    r = subprocess.run([sys.executable, "-m", "vllm_ple_offload.cli", "sidecar", "profile", str(sidecar), "--model",
                        str(model), "--corpus", str(files[0]), "--rows", "5", "--gpu", "1", "--json"],
                       capture_output=True, text=True, timeout=600, cwd=REPO,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO),
                            "SGLANG_SSD_STREAM_HOME": str(tmp_path / "kit"), "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    whole = {str(t.layer): [0, t.rows] for t in load_sidecar(sidecar).tables}  # TP 1: each whole table
    assert doc["role"] == "vllm-gpu1-tp0-pp0" and (doc["tp_rank"], doc["tp_size"]) == (0, 1)
    assert doc["row_range"] == whole and all(n <= 5 for n in doc["rows"].values())
    assert doc["path"].endswith("-vllm-gpu1-tp0-pp0.plehot")


def _split(rows: int, rank: int, size: int) -> tuple[int, int]:
    return rank * rows // size, (rank + 1) * rows // size


def _refuse_4096_over_3(rows, rank, size, cfg):
    assert rows % size == 0, f"{rows} is not divisible by {size}"  # as vLLM's divide() refuses
    return _split(rows, rank, size)


def _missing_engine(rows, rank, size, cfg):
    raise ModuleNotFoundError("No module named 'vllm'")


@pytest.mark.parametrize("rule,size,error,why", [
    (None, 2, "ProfileRefused", "does not know the engine's TP split"),
    (_refuse_4096_over_3, 3, "ProfileRefused", "does not split layer 0's PLE table (4096 rows) over TP 3: 4096 is not "
                                               "divisible by 3"),
    (lambda rows, r, n, cfg: (0, rows) if r == 0 else (rows, rows), 2, "ProfileRefused", "leaves rank 1 no rows"),
    (lambda rows, r, n, cfg: (_split(rows, r, n)[0], _split(rows, r, n)[1] - 1), 2, "ProfileRefused",
     "does not tile it"),  # a gap: rows no rank serves
    (lambda rows, r, n, cfg: (0, rows), 2, "ProfileRefused", "does not tile it"),  # every rank everything
    (lambda rows, r, n, cfg: (r * rows, (r + 1) * rows), 2, "ProfileRefused", "does not tile it"),  # past the end
    (_missing_engine, 2, "EnvironmentProblem", "needs the engine in this runtime: No module named 'vllm'"),
])
def test_a_split_the_floor_cannot_trust_is_refused(model_and_sidecar, rule, size, error, why):
    from sglang_ssd_stream.sidecar.profile import model_hashes, rank_ranges
    from sglang_ssd_stream.sidecar.view import load_sidecar

    model, sidecar, _ = model_and_sidecar
    manifest = load_sidecar(sidecar)
    with pytest.raises(Exception) as got:
        rank_ranges(manifest, model_hashes(model, manifest), None, tp_rank=size - 1, tp_size=size, shard_rule=rule)
    assert type(got.value).__name__ == error and why in str(got.value), got.value


def test_tp_1_serves_each_whole_table_and_a_rank_outside_the_size_is_a_usage_error(model_and_sidecar, tmp_path):
    from sglang_ssd_stream.sidecar.profile import model_hashes, rank_ranges
    from sglang_ssd_stream.sidecar.view import load_sidecar

    model, sidecar, files = model_and_sidecar
    manifest = load_sidecar(sidecar)

    def never(*a):
        raise AssertionError("TP 1 needs no engine")

    assert rank_ranges(manifest, model_hashes(model, manifest), None, tp_rank=0, tp_size=1, shard_rule=never) == {
        t.layer: (0, t.rows) for t in manifest.tables}
    for args, why in ((["--tp-size", "2", "--tp-rank", "2"], "--tp-rank 2 is not a rank of --tp-size 2"),
                      (["--tp-rank", "-1"], "--tp-rank -1 is not a rank of --tp-size 1"),
                      (["--tp-size", "0"], "0: expected >= 1")):
        r = _cli(sidecar, "--model", model, "--corpus", *files, *args, home=tmp_path)
        assert r.returncode == 64 and why in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "kit" / "hot").exists()


def _sglang_ranges(model: Path, manifest, size: int, table_dir: Path) -> list[dict[int, tuple[int, int]]]:
    """Each rank's rows of each table as sglang's real ``Qwen4ExpNGramEmbedding`` (its offloaded table, whose
    ``shard_indices`` the serving hook binds) is built at TP ``size``: the rank set through sglang's own override,
    as tests/sglang/checks/check_ple_hook.py builds it."""
    from sglang.srt.configs.qwen4_exp import Qwen4ExpTextConfig
    from sglang.srt.models.qwen4_exp import Qwen4ExpNGramEmbedding
    from sglang.srt.runtime_context import get_parallel

    text = json.loads((model / "config.json").read_text())["text_config"]
    cfg = Qwen4ExpTextConfig(**{**text, "ple_offload_embedding": True, "ple_offload_backend": "file",
                                "ple_offload_dir": str(table_dir)})
    dense = sorted(text["ple_layer_ids"])
    out = []
    for rank in range(size):
        got = {}
        with get_parallel().override(tp_rank=rank, tp_size=size, attn_tp_rank=rank, attn_tp_size=size,
                                     moe_tp_rank=rank, moe_tp_size=size):
            for t in manifest.tables:
                emb = Qwen4ExpNGramEmbedding(cfg, cfg.ple_embed_dim, ple_layer_index=dense.index(t.layer + 1))
                e = emb.ngram_embedding
                assert type(e).__name__ == "Qwen4ExpPinnedHostEmbedding" and e.org_vocab_size == t.rows
                got[t.layer] = (e.shard_indices.org_vocab_start_index, e.shard_indices.org_vocab_end_index)
        out.append(got)
    return out


def test_each_sglang_rank_profile_binds_the_ranges_sglang_serves(model_and_sidecar, tmp_path, monkeypatch, caplog):
    pytest.importorskip("sglang")
    from sglang_ssd_stream.cli import build_parser
    from sglang_ssd_stream.sidecar.hot_file import hot_file_path, read_hot_file
    from sglang_ssd_stream.sidecar.profile import build_profile
    from sglang_ssd_stream.sidecar.view import load_sidecar

    monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(tmp_path / "kit"))
    model, sidecar, files = model_and_sidecar
    manifest = load_sidecar(sidecar)
    rule = build_parser().parse_args(["sidecar", "profile", str(sidecar), "--model", str(model), "--corpus",
                                      str(files[0])]).shard_rule  # the rule the sglang CLI passes in
    assert rule is not None, "sglang_ssd_stream/cli.py mounts `sidecar profile` without sglang's TP split"
    (tmp_path / "tables").mkdir()
    for size in (2, 3, 4):
        want = _sglang_ranges(model, manifest, size, tmp_path / "tables")
        if size == 3:  # sglang pads 4,096 rows to 4,224 (a multiple of 64 x 3): its last rank serves fewer
            assert [w[0] for w in want] == [(0, 1408), (1408, 2816), (2816, 4096)]
        for rank in range(size):
            role = f"sglang-gpu{rank}-tp{rank}-pp0"
            prof = build_profile(manifest, model, files, role=role, rows=30, tp_rank=rank, tp_size=size,
                                 shard_rule=rule)
            assert prof.row_range == want[rank], (size, rank, prof.row_range, want[rank])
            assert prof.path == hot_file_path(manifest, want[rank], role)
            got = read_hot_file(prof.path, manifest, want[rank], 1 << 30)
            assert got is not None and got.layers
            for layer, (ids, _) in got.layers.items():
                assert ((ids >= want[rank][layer][0]) & (ids < want[rank][layer][1])).all()
            caplog.clear()
            assert read_hot_file(prof.path, manifest, want[(rank + 1) % size], 1 << 30) is None
            assert "another row range" in caplog.text


def test_another_models_sidecar_and_an_empty_corpus_are_refused(model_and_sidecar, tmp_path):
    from tests.vllm.synthetic import random_table, write_sidecar

    model, sidecar, files = model_and_sidecar
    other = write_sidecar(tmp_path / "other", {1: ("bfloat16", random_table(64, 128, 0)),
                                              2: ("bfloat16", random_table(64, 128, 1))})
    r = _cli(other.parent, "--model", model, "--corpus", *files, home=tmp_path)
    assert r.returncode == 3 and "another model's sidecar" in r.stderr, r.stderr[-2000:]  # bad kit data
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = _cli(sidecar, "--model", model, "--corpus", empty, home=tmp_path)
    assert r.returncode == 3 and "no text to profile" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "kit" / "hot").exists() or not any((tmp_path / "kit" / "hot").iterdir())


def test_tables_on_another_disk_are_profiled_from_a_root_the_server_would_trust(model_and_sidecar, tmp_path):
    """A sidecar whose tables are links to another disk: refused as the server refuses it (naming the knobs), and
    profiled with --trusted-root or the engine's SGLANG_SSD_STREAM_TRUSTED_ROOTS."""
    import shutil

    from sglang_ssd_stream.sidecar.view import load_sidecar

    model, sidecar, files = model_and_sidecar
    manifest = load_sidecar(sidecar)
    links = tmp_path / "links"
    links.mkdir()
    shutil.copy(manifest.path, links / manifest.path.name)
    for t in manifest.tables:
        (links / t.path).parent.mkdir(parents=True, exist_ok=True)
        (links / t.path).symlink_to(t.file)
    disk = str(Path(manifest.tables[0].file).parent)
    r = _cli(links, "--model", model, "--corpus", *files, "--rows", 5, home=tmp_path)
    assert r.returncode == 3 and "symlink escape" in r.stderr and "SGLANG_SSD_STREAM_TRUSTED_ROOTS" in r.stderr, \
        r.stderr[-2000:]
    r = _cli(links, "--model", model, "--corpus", *files, "--rows", 5, "--trusted-root", disk, home=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    r = _cli(links, "--model", model, "--corpus", *files, "--rows", 5, home=tmp_path,
             SGLANG_SSD_STREAM_TRUSTED_ROOTS=disk)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("how", ["in place, mtime put back", "renamed over"])
def test_a_table_written_while_it_is_profiled_leaves_no_hot_file(model_and_sidecar, tmp_path, monkeypatch, how):
    """Issue 38 item 1: the file is bound to the table its rows were read from. A table rewritten in place during the
    read (its mtime put back: the reader's size/mtime check cannot see it) or renamed over (the old inode's ctime
    moves with its link count) could have given rows of either content: refused, nothing written. Before, the
    file was bound to the table at its path when written, so the in-place case carried wrong rows."""
    import shutil

    from sglang_ssd_stream.sidecar import SidecarReader
    from sglang_ssd_stream.sidecar.hot_file import read_hot_file
    from sglang_ssd_stream.sidecar.profile import ProfileRefused, build_profile
    from sglang_ssd_stream.sidecar.view import load_sidecar
    from tests.hot_forgery import restore_by_rename, rewrite_in_place

    monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(tmp_path / "kit"))
    model, sidecar, files = model_and_sidecar
    copy = tmp_path / "sidecar"
    shutil.copytree(sidecar, copy)
    manifest = load_sidecar(copy)
    table = Path(manifest.tables[-1].file)
    right = table.read_bytes()
    read_rows = SidecarReader.read_rows

    def read_then_change(self, ids, out):
        got = read_rows(self, ids, out)
        if Path(self.table.file) == table and table.read_bytes() == right:  # once, after the first read
            if how == "renamed over":
                restore_by_rename(table, right)  # the same bytes, another inode
            else:
                rewrite_in_place(table, bytes(b ^ 0xFF for b in right))
        return got

    monkeypatch.setattr(SidecarReader, "read_rows", read_then_change)
    with pytest.raises(ProfileRefused, match=rf"PLE table {table} \(layer \d+\) changed while it was profiled "
                                             r"\(.*ctime_ns.*\); no hot file written"):
        build_profile(manifest, model, files, role="sglang-cpu", rows=40)
    assert not (tmp_path / "kit" / "hot").exists() or not any((tmp_path / "kit" / "hot").iterdir())
    # the control: the same profile of the table left alone is written, and loads
    monkeypatch.setattr(SidecarReader, "read_rows", read_rows)
    restore_by_rename(table, right)
    manifest = load_sidecar(copy)
    prof = build_profile(manifest, model, files, role="sglang-cpu", rows=40)
    assert read_hot_file(prof.path, manifest, prof.row_range, 1 << 30) is not None


@pytest.mark.parametrize("where", ["kit_home_is_a_file", "kit_home_read_only", "out_is_a_folder"])
def test_a_cache_dir_that_cannot_be_written_is_exit_4_as_the_help_says(model_and_sidecar, tmp_path, where):
    """Issue 43 item 2: the help promises exit 4 on an I/O error; a read-only cache dir gave a traceback.
    Root writes through mode bits, so read-only is a place the kernel refuses: a file where the folder must be,
    and /proc (no new entries there for anyone)."""
    model, sidecar, files = model_and_sidecar
    extra, env = [], {}
    if where == "kit_home_is_a_file":
        (tmp_path / "kit").write_text("a file where the kit's data directory should be\n")
    elif where == "kit_home_read_only":
        env["SGLANG_SSD_STREAM_HOME"] = "/proc/sglang-ssd-stream-test"
    else:
        extra = ["-o", tmp_path]
    r = _cli(sidecar, "--model", model, "--corpus", *files, "--rows", 40, *extra, home=tmp_path, **env)
    assert "Traceback" not in r.stderr and r.returncode == 4, (r.returncode, r.stderr[-3000:])
    assert not list(tmp_path.glob("**/*.hot*")), "nothing written"
