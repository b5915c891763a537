"""The kit's series through the real sglang 0.5.23 hooks and sglang's own ``/metrics`` route (CPU).

Runs inside the sglang venv, in a process started with ``PROMETHEUS_MULTIPROC_DIR`` set (as sglang's launcher
sets it with ``--enable-metrics`` before it starts the schedulers). The model is loaded through the real
``load_weights`` hook (check_ple_row_cache.py's stand-ins), lookups go through the real ``gather`` hook, and the
scrape is sglang's own: ``add_prometheus_middleware`` mounted on an app, ``GET /metrics``. Every series is
compared with the row cache's own statistics.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.ple_metrics.scrape import samples as parse
from tests.ple_metrics.scrape import value

HERE = Path(__file__).resolve().parent


def _row_cache_checks():
    spec = importlib.util.spec_from_file_location("_check_ple_row_cache_base", HERE / "check_ple_row_cache.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


R = _row_cache_checks()
B = R.B
env = R.env  # the module's fixtures: the plugin loaded through sglang, a checkpoint and its sidecar
_small_staging = R._small_staging


def _scrape() -> dict:
    """``GET /metrics`` of an app carrying sglang's own metrics route: {(name, labels): value}."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from sglang.srt.utils.common import add_prometheus_middleware

    app = FastAPI()
    add_prometheus_middleware(app)
    return parse(TestClient(app).get("/metrics").text)


def test_series_in_sglangs_metrics_equal_the_row_caches_stats(env, monkeypatch, tmp_path):
    from prometheus_client import values

    from sglang_ssd_stream.ple_metrics import series as S
    from sglang_ssd_stream.sidecar.errors import SidecarRowOutOfRange

    assert os.environ.get("PROMETHEUS_MULTIPROC_DIR") and values.ValueClass._multiprocess
    monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(tmp_path / "kit"))
    model = R._load(env, monkeypatch, "9", tp=(1, 2))
    metrics = model._ssd_stream_metrics
    assert metrics is not None and metrics._thread is not None  # exported, the periodic publish running
    emb = model.ngram.ngram_embedding
    lookups = R._batches(env.q, model.ngram, 6, seed=3)
    for ids in lookups:
        B._gather(emb, ids)
    with pytest.raises(SidecarRowOutOfRange):
        B._gather(emb, torch.full((2, 16), B.ROWS + 3, dtype=torch.int64))
    metrics.publish()
    st = emb._ssd_stream.reader.stats
    samples = _scrape()
    lab = {"engine": "sglang", "layer": str(B.LAYER)}
    for s in S.ROW_CACHE_SERIES:
        if s.stat:
            assert value(samples, s.sample, **lab) == st[s.stat], (s.name, st)
    assert value(samples, S.HITS.sample, **lab) + value(samples, S.MISSES.sample, **lab) == st["lookups"] > 0
    assert value(samples, S.BYTES_READ.sample, **lab) == st["pages_read"] * 4096 > 0
    assert value(samples, S.ON_DEMAND.sample, **lab) + value(samples, S.AHEAD.sample, **lab) == st["rows_read"]
    assert value(samples, S.EXPOSED_SECONDS.sample, **lab) == len(lookups)  # the refused one waited for nothing
    assert value(samples, S.REFUSALS.sample, engine="sglang", reason="row_out_of_range") == 1
    # the ranks are sglang's parallel state's: the stand-in's load states TP rank 1 of 2 and no PP rank (empty), as
    # the hot file's role shows; a server's scheduler has both (the e2e scenario's tp_rank="0", pp_rank="0")
    ranks = {(dict(lab_)["tp_rank"], dict(lab_)["pp_rank"]) for (n, lab_) in samples if n == S.LOOKUPS.sample}
    assert ranks == {("1", "")} and model._ssd_stream_hot.path.name.endswith("-sglang-cpu-tp1.plehot"), ranks
    model._ssd_stream_hot.close()
