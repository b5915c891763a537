#!/usr/bin/env python3
"""A realistic PLE row-id stream: real code through a real byte-level BPE, hashed by the real n-gram function.

No Qwen vocabulary is available offline, so a byte-level BPE is trained with ``tokenizers`` on half of
a Python standard library's files (``.py`` sources; ``pydoc_data/topics.py`` carries the language
reference docs) and the other half is tokenized: split by the SHA-256 of each file's relative path, so
the tokenizer never saw the text it encodes. Each held-out file is one request (a prompt, its history
starting at EOS like a new request's), in an order shuffled with ``--seed``. The tokens are hashed by
:func:`sglang_ssd_stream.sidecar.ngram.qwen38_flash_next` (PLE index 0, proved bit-exact against both
engines) into the real table's id space, 320,001,536 rows: 16 ids per token.

Writes to ``--out-dir`` (not the repository: ~300 MB for the default corpus) ``tokens.npy`` (uint32),
``starts.npy`` (int64: first token of each request, and the total at the end) and ``ids.npy``
(uint32 ``[tokens, 16]``); and to ``--stats`` the stream's statistics as JSON: size, chars per token,
the id-frequency curve (rank/frequency at log-spaced ranks, fitted Zipf exponent), the compulsory-miss
fraction (distinct rows / lookups), distinct growth, and the distinct 4 KiB pages of the real layout
(what a page cache must hold to reach the same compulsory floor).

Run in a venv that has ``tokenizers`` (either engine venv does)::

    nice -n 10 $(scripts/engine-venv.sh sglang) scripts/ple_trace.py \
        --corpus /root/.pyenv/versions/3.12.1/lib/python3.12 --out-dir /var/tmp/ple-trace \
        --stats benchmarks/row_cache/trace.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang_ssd_stream.sidecar.ngram import qwen38_flash_next  # noqa: E402

ROW_BYTES = 160  # FP8 row of Qwen3.8 Flash-Next's PLE table
PAGE = 4096
EOS_TEXT = "<|endoftext|>"


def corpus_files(root: Path) -> list[Path]:
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)
    if not files:
        raise SystemExit(f"{root}: no .py files (expected a Python standard library directory)")
    return files


def held_out(root: Path, p: Path) -> bool:
    return bool(hashlib.sha256(str(p.relative_to(root)).encode()).digest()[0] & 1)


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def train_bpe(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def zipf_fit(counts_desc: np.ndarray, lo: int, hi: int) -> float:
    """Least-squares slope of log(frequency) on log(rank) over ranks [lo, hi): the Zipf exponent s."""
    hi = min(hi, counts_desc.size)
    if hi - lo < 10:
        return float("nan")
    ranks = np.unique(np.geomspace(lo, hi - 1, 200).astype(np.int64))
    x, y = np.log(ranks), np.log(counts_desc[ranks - 1].astype(np.float64))
    return float(-np.polyfit(x, y, 1)[0])


def frequency_curve(values: np.ndarray) -> dict:
    """Rank-frequency of ``values``, the share of lookups the hottest rows take, and reuse counts."""
    uniq, first, counts = np.unique(values, return_index=True, return_counts=True)
    n, d = values.size, uniq.size
    desc = np.sort(counts)[::-1]
    ranks = sorted({int(r) for r in np.geomspace(1, d, 25).astype(np.int64)} | {d})
    cum = np.cumsum(desc)
    share = {f"top_{p}": float(cum[max(0, int(d * p / 100) - 1)] / n) for p in (0.1, 1, 10, 50)}
    k_counts = {str(k): int((counts == k).sum()) for k in (1, 2, 3, 4)}
    k_counts["5+"] = int((counts >= 5).sum())
    firsts = np.sort(first)
    checkpoints = sorted({int(c) for c in np.geomspace(1000, n, 20).astype(np.int64)} | {n})
    return {
        "lookups": int(n), "distinct": int(d), "compulsory_fraction": d / n,
        "zipf_exponent_head": zipf_fit(desc, 1, 1000),
        "zipf_exponent_body": zipf_fit(desc, 100, int((counts >= 2).sum())),
        "rank_frequency": [[r, int(desc[r - 1])] for r in ranks],
        "share_of_lookups_to_hottest_percent_of_rows": share,
        "rows_seen_k_times": k_counts,
        "one_hit_wonder_fraction_of_rows": float((counts == 1).sum() / d),
        "distinct_after_lookups": [[c, int(np.searchsorted(firsts, c))] for c in checkpoints],
    }


def distinct_pages(ids: np.ndarray) -> int:
    start = ids.astype(np.int64) * ROW_BYTES
    return int(np.unique(np.concatenate([start // PAGE, (start + ROW_BYTES - 1) // PAGE])).size)


def save_trace(out_dir: Path, tokens: np.ndarray, starts: np.ndarray, h) -> np.ndarray:
    """Hash each request's tokens (from an EOS history) with ``h`` and save ``tokens.npy``, ``starts.npy`` and
    ``ids.npy`` in ``out_dir``; returns the ids ``[tokens, heads]``."""
    ids = np.empty((tokens.size, h.ngram_heads), np.uint32)
    for a, b in zip(starts[:-1], starts[1:], strict=False):  # each request starts from an EOS history
        ids[a:b] = h.ids(tokens[a:b])
    out_dir.mkdir(parents=True, exist_ok=True)
    np.save(out_dir / "tokens.npy", tokens)
    np.save(out_dir / "starts.npy", starts)
    np.save(out_dir / "ids.npy", ids)
    return ids


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, required=True, help="a Python standard library directory")
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--stats", type=Path, required=True)
    ap.add_argument("--vocab-size", type=int, default=151_643, help="BPE vocabulary asked for (Qwen's regular tokens)")
    ap.add_argument("--seed", type=int, default=0, help="request order")
    ap.add_argument("--max-files", type=int, default=0, help="use only this many held-out files (0: all)")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    root = args.corpus.resolve()
    files = corpus_files(root)
    train = [p for p in files if not held_out(root, p)]
    trace = [p for p in files if held_out(root, p)]
    order = np.random.default_rng(args.seed).permutation(len(trace))
    trace = [trace[i] for i in order]
    if args.max_files:
        trace = trace[:args.max_files]
    tok = train_bpe([read(p) for p in train], args.vocab_size)
    texts = [read(p) for p in trace]
    enc = tok.encode_batch(texts)
    lens = np.array([len(e.ids) for e in enc], dtype=np.int64)
    tokens = np.concatenate([np.asarray(e.ids, dtype=np.uint32) for e in enc])
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)

    h = qwen38_flash_next()
    ids = save_trace(args.out_dir, tokens, starts, h)

    flat = ids.reshape(-1)
    stats = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "corpus": str(root), "python": platform.python_version(),
        "tokenizer": {"kind": "byte-level BPE (tokenizers)", "vocab_asked": args.vocab_size,
                      "vocab_trained": tok.get_vocab_size(), "train_files": len(train),
                      "train_bytes": int(sum(p.stat().st_size for p in train))},
        "requests": len(trace), "tokens": int(tokens.size), "chars": int(sum(len(t) for t in texts)),
        "chars_per_token": sum(len(t) for t in texts) / max(1, tokens.size),
        "hash": {"rows": h.rows, "rows_per_token": h.ngram_heads, "ple_layer_index": 0,
                 "eos_token_id": h.eos_token_id, "multipliers": list(h.multipliers)},
        "tokens_curve": frequency_curve(tokens),
        "ids_curve": frequency_curve(flat),
        "distinct_pages_real_layout": distinct_pages(np.unique(flat)),
        "row_bytes": ROW_BYTES,
        "seconds": None,
    }
    stats["distinct_row_bytes"] = stats["ids_curve"]["distinct"] * ROW_BYTES
    stats["distinct_page_bytes"] = stats["distinct_pages_real_layout"] * PAGE
    stats["seconds"] = round(time.perf_counter() - t0, 1)
    args.stats.parent.mkdir(parents=True, exist_ok=True)
    args.stats.write_text(json.dumps(stats, indent=1) + "\n")
    c = stats["ids_curve"]
    print(f"{stats['requests']} requests, {tokens.size} tokens ({stats['chars_per_token']:.2f} chars/token), "
          f"{c['lookups']} lookups, {c['distinct']} distinct rows: compulsory {c['compulsory_fraction']:.3f}, "
          f"Zipf s = {c['zipf_exponent_body']:.2f}; pages {stats['distinct_pages_real_layout']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
