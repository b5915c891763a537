"""``vllm-ple-offload sidecar profile`` for a TP rank (issue 27 item 2), against vLLM 0.33.0's real split.

The tiny qwen4_exp of the e2e suite has two PLE tables of different sizes (4,096 and 4,224 rows), so a TP rank
serves another range of each. vLLM's real ``Qwen4ExpNGramEmbedding`` of each PLE layer is built in every rank of a
real TP world (vLLM's distributed state on gloo, as ``check_tp_ple.py`` runs it); its ``shard_indices`` are the
ranges a server binds. The profile of each rank must name exactly those ranges, be read back by ``read_hot_file``
with them and refused with another rank's, and hold the corpus's hottest rows of its ranges; a TP size vLLM does not
split the tables over is refused (exit 3), never guessed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
CORPUS = ["The secret code number is 42. " * 40 + "Reply with the three numbers only.",
          "0123456789 the three numbers only " * 30, "Hyper-connections carry two streams. " * 25]


@pytest.fixture(scope="module")
def model_and_sidecar(tmp_path_factory):
    from tests.e2e.models import profile_inputs

    return profile_inputs(tmp_path_factory.mktemp("profile-tp"), CORPUS)


WORLDS = (4, 2)


def _engine_rank(rank: int, model: str, layers: list[int], ports: list[int], out: str) -> None:
    """One process in a real vLLM TP world of each size in :data:`WORLDS` that has its rank (one after the other):
    its ``shard_indices`` of each PLE layer's real embedding."""
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"  # a spawned child: the pytest process may not say so, and vLLM infers none
    import torch
    from transformers import AutoConfig
    from vllm.config import set_current_vllm_config

    from tests.vllm import harness

    cfg = AutoConfig.from_pretrained(model, local_files_only=True).text_config
    ne, _ = harness.modules()
    dense = sorted(cfg.ple_layer_ids)
    for world, port in zip(WORLDS, ports, strict=True):
        if rank >= world:
            continue
        got = {}
        with harness.distributed(world, rank, port), set_current_vllm_config(harness.vllm_config(cpu_offload=False)):
            for layer in layers:
                emb = ne.Qwen4ExpNGramEmbedding(cfg, int(cfg.ple_embed_dim), dense.index(layer + 1), 16,
                                                data_parallel_rank=0, params_dtype=torch.bfloat16,
                                                prefix=f"model.layers.{layer}.ple.ple_embedding").ngram_embedding
                got[layer] = [emb.org_vocab_size, emb.shard_indices.org_vocab_start_index,
                              emb.shard_indices.org_vocab_end_index]
        Path(out, f"tp{world}-rank{rank}.json").write_text(json.dumps(got))


@pytest.fixture(scope="module")
def engine_ranges(model_and_sidecar, tmp_path_factory) -> dict[int, list[dict[int, tuple[int, int]]]]:
    """For each TP size in :data:`WORLDS`: each rank's range of each table, as vLLM's real embedding binds it."""
    import torch.multiprocessing as mp

    from sglang_ssd_stream.sidecar.view import load_sidecar
    from tests.vllm import harness

    model, sidecar, _ = model_and_sidecar
    manifest = load_sidecar(sidecar)
    out = tmp_path_factory.mktemp("engine")
    mp.start_processes(_engine_rank, nprocs=max(WORLDS), start_method="spawn",
                       args=(str(model), [t.layer for t in manifest.tables],
                             [harness.free_port() for _ in WORLDS], str(out)))
    result = {}
    for world in WORLDS:
        ranks = [json.loads((out / f"tp{world}-rank{r}.json").read_text()) for r in range(world)]
        for t in manifest.tables:
            assert all(r[str(t.layer)][0] == t.rows for r in ranks)  # vLLM builds each table at the sidecar's size
        result[world] = [{int(k): (v[1], v[2]) for k, v in r.items()} for r in ranks]
    return result


def _hottest_in(model: Path, files, manifest, ranges, rows: int) -> dict[int, list[int]]:
    """Independently: the tokenizer, the config's hash, a Counter of the ids in the rank's range."""
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
        lo, hi = ranges[table.layer]
        counts = Counter()
        for f in files:
            ids = h.ids(tok(Path(f).read_text(), add_special_tokens=False)["input_ids"]).reshape(-1).tolist()
            counts.update(i for i in ids if lo <= i < hi)
        out[table.layer] = [i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:rows]]
    return out


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_each_rank_profile_binds_the_ranges_vllm_serves(model_and_sidecar, engine_ranges, tmp_path, monkeypatch,
                                                        caplog, world):
    from sglang_ssd_stream.sidecar.hot_file import hot_file_path, read_hot_file
    from sglang_ssd_stream.sidecar.profile import build_profile
    from sglang_ssd_stream.sidecar.view import load_sidecar
    from vllm_ple_offload.cli import ple_rank_rows

    monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(tmp_path / "kit"))
    model, sidecar, files = model_and_sidecar
    manifest = load_sidecar(sidecar)
    want = engine_ranges[world]
    assert len({t.rows for t in manifest.tables}) == 2 and all(want[0][t.layer] != (0, t.rows) for t in manifest.tables)
    profiles = [build_profile(manifest, model, files, role=f"vllm-gpu{r}-tp{r}-pp0", rows=30, tp_rank=r,
                              tp_size=world, shard_rule=ple_rank_rows) for r in range(world)]
    for r, prof in enumerate(profiles):
        assert prof.row_range == want[r], (r, prof.row_range, want[r])
        assert prof.path == hot_file_path(manifest, want[r], f"vllm-gpu{r}-tp{r}-pp0")
        got = read_hot_file(prof.path, manifest, want[r], 1 << 30)
        assert got is not None
        hottest = _hottest_in(model, files, manifest, want[r], 30)
        for t in manifest.tables:
            ids, rows = got.layers.get(t.layer, (np.empty(0, np.int64), None))
            assert ids.tolist() == hottest[t.layer]
            if ids.size:
                table = np.fromfile(t.file, np.uint8).reshape(t.rows, t.row_bytes)
                np.testing.assert_array_equal(rows, table[ids])
        other = want[(r + 1) % world]
        caplog.clear()
        assert read_hot_file(prof.path, manifest, other, 1 << 30) is None and "another row range" in caplog.text


def _cli(*args, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_ple_offload.cli", "sidecar", "profile", *map(str, args)],
                          capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "HOME": str(home), "SGLANG_SSD_STREAM_HOME": str(home / "kit"),
                               "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"})


def test_a_split_vllm_refuses_is_refused(model_and_sidecar, tmp_path, monkeypatch):
    from sglang_ssd_stream.sidecar.profile import ProfileRefused, build_profile
    from sglang_ssd_stream.sidecar.view import load_sidecar
    from vllm_ple_offload.cli import ple_rank_rows

    monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(tmp_path / "kit"))
    model, sidecar, files = model_and_sidecar
    # 4,096 rows do not split over 3 ranks in vLLM (its divide() asserts): refused, and nothing written
    with pytest.raises(ProfileRefused, match="does not split layer 0's PLE table .* not divisible by 3"):
        build_profile(load_sidecar(sidecar), model, files, role="vllm-gpu2-tp2-pp0", rows=5, tp_rank=2, tp_size=3,
                      shard_rule=ple_rank_rows)
    assert not (tmp_path / "kit" / "hot").exists()


def test_the_cli_writes_the_file_its_rank_looks_for(model_and_sidecar, engine_ranges, tmp_path):
    from sglang_ssd_stream.sidecar.hot_file import hot_file_path
    from sglang_ssd_stream.sidecar.view import load_sidecar

    model, sidecar, files = model_and_sidecar
    manifest = load_sidecar(sidecar)
    want = engine_ranges[2][1]
    r = _cli(sidecar, "--model", model, "--corpus", *files, "--rows", 5, "--tp-size", 2, "--tp-rank", 1, "--gpu", 1,
             "--json", home=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["role"] == "vllm-gpu1-tp1-pp0" and (doc["tp_rank"], doc["tp_size"]) == (1, 2)
    assert {int(k): tuple(v) for k, v in doc["row_range"].items()} == want
    assert Path(doc["path"]) == tmp_path / "kit" / "hot" / hot_file_path(manifest, want, doc["role"]).name
    r = _cli(sidecar, "--model", model, "--corpus", *files, "--tp-size", 2, "--tp-rank", 2, home=tmp_path / "bad")
    assert r.returncode == 64 and "--tp-rank 2 is not a rank of --tp-size 2" in r.stderr, r.stderr
