"""``sidecar profile`` (issue 27 item 2): a hot file from a text corpus, so a first start is warm too.

The tiny qwen4_exp of the e2e suite (its real tokenizer and config through transformers) and its sidecar built by
the kit: the file holds each table's most looked-up rows of the corpus, with the sidecar's bytes, for the process
the engine will run; another model's sidecar and an empty corpus are refused."""

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
    from sglang_ssd_stream.sidecar.build import build_sidecar
    from tests.e2e.models import make_qwen4_exp

    root = tmp_path_factory.mktemp("profile")
    model = make_qwen4_exp(root / "model")
    build_sidecar(model, root / "sidecar", progress=False)
    files = []
    for i, text in enumerate(CORPUS):
        (root / f"doc{i}.txt").write_text(text)
        files.append(root / f"doc{i}.txt")
    return model, root / "sidecar", files


def _cli(*args, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_ssd_stream", "sidecar", "profile", *map(str, args)],
                          capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(home), "SGLANG_SSD_STREAM_HOME": str(home / "kit"),
                               "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})


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
    model, sidecar, files = model_and_sidecar
    r = subprocess.run([sys.executable, "-m", "vllm_ple_offload.cli", "sidecar", "profile", str(sidecar), "--model",
                        str(model), "--corpus", str(files[0]), "--rows", "5", "--tp-rank", "1", "--gpu", "1",
                        "--row-range", "0", "100", "--json"], capture_output=True, text=True, timeout=600, cwd=REPO,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO),
                            "SGLANG_SSD_STREAM_HOME": str(tmp_path / "kit"), "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["role"] == "vllm-gpu1-tp1-pp0" and set(map(tuple, doc["row_range"].values())) == {(0, 100)}
    assert all(n <= 5 for n in doc["rows"].values()) and "-rows0-100-vllm-gpu1-tp1-pp0" in doc["path"]


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
