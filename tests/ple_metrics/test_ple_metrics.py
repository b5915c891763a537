"""The kit's series (sglang_ssd_stream/ple_metrics) in prometheus_client's multiprocess mode, as the engines run it.

A child process with ``PROMETHEUS_MULTIPROC_DIR`` set (before anything imports prometheus_client, as sglang's
launcher and a vLLM started with it set do) serves lookups through real row caches and gathers and publishes; this
process reads that directory with prometheus_client's own ``MultiProcessCollector`` and parser, as the engines'
``/metrics`` does, and compares every series with the caches' own statistics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sglang_ssd_stream.ple_metrics import series as S

from .scrape import samples as parse
from .scrape import value

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(r"""
    import json, os, sys
    import numpy as np
    import torch
    from sglang_ssd_stream.ple_metrics.publish import for_process
    from sglang_ssd_stream.sidecar import SidecarReader
    from sglang_ssd_stream.sidecar.errors import SidecarRowOutOfRange
    from sglang_ssd_stream.sidecar.format import SidecarTable
    from sglang_ssd_stream.sidecar.row_cache import RowCache, RowCacheConfig
    from sglang_ssd_stream.staging.gather import SidecarGather

    tmp, rounds, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    ROWS, RB = 20_000, 160
    metrics = for_process("sglang", tp_rank=1, pp_rank=0)
    assert metrics is not None
    if how == "thread":
        metrics.start(0.05)
    layers = {}
    for layer in (3, 7):
        path = os.path.join(tmp, f"table{layer}.bin")
        rng = np.random.default_rng(layer)
        rng.integers(0, 256, ROWS * RB, dtype=np.uint8).tofile(path)
        table = SidecarTable(layer, os.path.basename(path), path, "0" * 64, "float8_e4m3fn", ROWS, 160, 0, ROWS * RB)
        reader = SidecarReader(table, vocab_start=0, vocab_end=ROWS // 2, max_rows=4096, workers=2)
        cache = RowCache(reader, np.zeros((3000, RB), np.uint8), RowCacheConfig(workers=2))
        gather = SidecarGather(cache, columns=160, is_fp8=True, capacity_rows=4096, device="cpu", mode="h2d",
                               output="raw")
        metrics.layer(layer, cache, gather)
        layers[layer] = (cache, gather)
    rng = np.random.default_rng(0)
    in_rank = dict.fromkeys(layers, 0)
    for r in range(rounds):
        for layer, (cache, gather) in layers.items():
            cache.prefetch(rng.integers(0, ROWS, 300))  # rows fetched ahead
            ids = rng.integers(0, 4000 if r % 2 else ROWS, 2048)  # warm and cold, other ranks' rows too
            gather.begin(torch.from_numpy(ids), torch.empty((2048, RB), dtype=torch.uint8))
            in_rank[layer] += int((ids < ROWS // 2).sum())
    cache, gather = layers[7]
    try:
        gather.begin(torch.tensor([ROWS + 5]), torch.empty((1, RB), dtype=torch.uint8))
    except SidecarRowOutOfRange:
        pass
    else:
        raise AssertionError("an id outside the table was served")
    cache.prefetch(np.arange(5000, 5100))  # after the last lookup: only a publish carries it
    if how == "thread":  # the daemon's publishes alone
        import time
        time.sleep(0.5)
    else:
        metrics.publish()
    print(json.dumps({"stats": {layer: c.stats for layer, (c, _) in layers.items()}, "in_rank": in_rank}))
""")


def run_child(script: str, tmp_path: Path, *args, env_dir: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k.lower() != "prometheus_multiproc_dir"}
    env.update(PYTHONPATH=str(REPO), HOME=str(tmp_path))
    if env_dir is not None:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(env_dir)
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path), *map(str, args)], env=env, capture_output=True,
                         text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def scrape(directory: Path) -> dict[tuple[str, frozenset], float]:
    """What the engines' ``/metrics`` serves from ``directory``: {(sample name, labels): value}."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    return parse(generate_latest(registry).decode())


def test_series_are_unique_prefixed_and_labelled():
    names = [s.name for s in S.ALL]
    assert len(names) == len(set(names)) and all(n.startswith("ssd_stream_") for n in names)
    for s in S.ALL:
        assert {"engine", "tp_rank", "pp_rank"} <= set(s.labels)
        assert (s.kind == "histogram") == (s.buckets is not None) and s.kind in ("counter", "histogram")
    from sglang_ssd_stream.sidecar.row_cache import STAT_NAMES

    assert {s.stat for s in S.ROW_CACHE_SERIES if s.stat} <= set(STAT_NAMES)


@pytest.mark.parametrize(("rounds", "how"), [(1, "call"), (6, "call"), (3, "thread")])
def test_series_equal_the_row_caches_stats(tmp_path, rounds, how):
    prom = tmp_path / "prom"
    prom.mkdir()
    got = run_child(CHILD, tmp_path, rounds, how, env_dir=prom)
    samples = scrape(prom)
    for layer, st in got["stats"].items():
        lab = {"engine": "sglang", "layer": layer, "tp_rank": 1, "pp_rank": 0}
        for s in S.ROW_CACHE_SERIES:
            if s.stat:
                assert value(samples, s.sample, **lab) == st[s.stat], (s.name, st)
        assert st["lookups"] == got["in_rank"][layer]  # this rank's rows of the forwards' lookups, no prefetch
        assert value(samples, S.HITS.sample, **lab) + value(samples, S.MISSES.sample, **lab) == st["lookups"] > 0
        assert value(samples, S.BYTES_READ.sample, **lab) == st["pages_read"] * 4096 > 0
        assert (value(samples, S.ON_DEMAND.sample, **lab) + value(samples, S.AHEAD.sample, **lab)
                == st["rows_read"] > st["prefetch_rows"] > 0)
        # one observation per served lookup: the refused one (layer 7) read nothing and waited for nothing
        assert value(samples, S.READ_SECONDS.sample, **lab) == rounds
        assert value(samples, S.EXPOSED_SECONDS.sample, **lab) == rounds
        assert value(samples, S.EXPOSED_SECONDS.name + "_sum", **lab) > 0
    proc = {"engine": "sglang", "tp_rank": 1, "pp_rank": 0}
    assert value(samples, S.REFUSALS.sample, **proc, reason="row_out_of_range") == 1
    assert value(samples, S.REFUSALS.sample, **proc, reason="table_changed") == 0


NOT_EXPORTED = textwrap.dedent(r"""
    import json, os, sys, logging
    if sys.argv[2] == "imported-first":
        import prometheus_client  # noqa: F401 - in memory: the mode is chosen at this import
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
    from sglang_ssd_stream.ple_metrics.publish import for_process, unavailable
    print(json.dumps({"why": unavailable(), "metrics": for_process("vllm", tp_rank=0, pp_rank=0) is not None,
                      "prometheus": "prometheus_client" in sys.modules}))
""")


@pytest.mark.parametrize("case", ["unset", "imported-first"])
def test_nothing_is_published_outside_multiprocess_mode(tmp_path, case):
    got = run_child(NOT_EXPORTED, tmp_path, case, env_dir=None)
    assert got["metrics"] is False
    if case == "unset":
        assert "PROMETHEUS_MULTIPROC_DIR is not set" in got["why"]
        assert got["prometheus"] is False  # the plugins stay free of it when the engine's metrics are off
    else:
        assert "imported before PROMETHEUS_MULTIPROC_DIR was set" in got["why"]
    assert not list(tmp_path.glob("*.db"))


def test_refusal_reasons_follow_the_sidecar_errors():
    from sglang_ssd_stream.sidecar import errors as E

    assert S.refusal_reason(E.SidecarChanged("x", path="p")) == "table_changed"
    assert S.refusal_reason(E.SidecarReaderUnusable("x", path="p")) == "reader_unusable"
    assert S.refusal_reason(E.SidecarIOError("x", path="p")) == "io_error"
    assert S.refusal_reason(ValueError("x")) is None
    assert set(S.REASONS) == {*S.REFUSAL_REASONS.values(), S.HOT_FILE_IGNORED}


HOT = textwrap.dedent(r"""
    import json, os, sys
    from pathlib import Path
    import numpy as np
    from sglang_ssd_stream.ple_metrics.publish import for_process
    from sglang_ssd_stream.sidecar import SidecarReader, load_manifest
    from sglang_ssd_stream.sidecar.hot_rows import HotRows
    from sglang_ssd_stream.sidecar.row_cache import RowCache, RowCacheConfig
    from tests.vllm.synthetic import random_table, write_sidecar

    tmp, step = Path(sys.argv[1]), sys.argv[2]
    if step == "first":
        write_sidecar(tmp / "art", {n: ("float8_e4m3fn", random_table(4000, 160, n)) for n in (2, 5)})
    manifest = load_manifest(tmp / "art")
    caches = {n: RowCache(SidecarReader(manifest.table(n), max_rows=4096), np.zeros((1000, 160), np.uint8),
                          RowCacheConfig(workers=2)) for n in (2, 5)}
    metrics = for_process("vllm", tp_rank=0, pp_rank=None)
    for n, c in caches.items():
        metrics.layer(n, c)
    hot = HotRows(manifest, caches, share=0.25, interval_s=0, role="t", path=tmp / "hot" / "p.plehot")
    loaded = hot.load()
    metrics.hot_loaded(hot)
    written = []
    if step == "first":
        for _ in range(2):
            for c in caches.values():
                c.read_rows(np.arange(100, 400), np.empty((300, 160), np.uint8))
        written.append(hot.write())
        for c in caches.values():
            c.read_rows(np.arange(2000, 2900), np.empty((900, 160), np.uint8))  # a new hot set: rewritten
            c.read_rows(np.arange(2000, 2900), np.empty((900, 160), np.uint8))
        written.append(hot.write())
    metrics.publish()
    print(json.dumps({"loaded": loaded, "written": written}))
""")


def test_hot_file_series_count_loads_writes_and_an_ignored_file(tmp_path):
    prom = tmp_path / "prom"
    prom.mkdir()
    first = run_child(HOT, tmp_path, "first", env_dir=prom)
    second = run_child(HOT, tmp_path, "second", env_dir=prom)  # the restart: another process, the same directory
    (tmp_path / "hot" / "p.plehot").write_bytes(b"not a hot file")
    third = run_child(HOT, tmp_path, "third", env_dir=prom)
    samples = scrape(prom)  # counters of the three processes, summed as the engines' endpoint sums them
    proc = {"engine": "vllm", "tp_rank": 0, "pp_rank": ""}
    assert first["loaded"] == 0 and all(first["written"]) and second["loaded"] == 500 and third["loaded"] == 0
    assert value(samples, S.HOT_WRITTEN.sample, **proc) == sum(first["written"]) == 1000
    assert value(samples, S.HOT_WRITE_SECONDS.sample, **proc) == 2
    assert value(samples, S.HOT_LOADED.sample, **proc) == 500
    assert value(samples, S.REFUSALS.sample, **proc, reason="hot_file_ignored") == 1  # the third; the first had none


def test_docs_list_every_series_with_its_labels_and_every_reason():
    text = (REPO / "docs" / "metrics.md").read_text()
    rows = {line.split("|")[1].strip().strip("`"): line for line in text.splitlines() if line.startswith("| `ssd_")}
    assert set(rows) == {s.sample if s.kind == "counter" else s.name for s in S.ALL}, sorted(rows)
    for s in S.ALL:
        row = rows[s.sample if s.kind == "counter" else s.name]
        assert f"| {s.kind} | {', '.join(s.labels)} |" in row, row
    for reason in S.REASONS:
        assert f"`{reason}`" in text, reason
