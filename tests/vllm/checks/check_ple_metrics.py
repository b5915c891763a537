"""The kit's series through the real vLLM 0.33.0 plugin and vLLM's own ``/metrics`` route (CPU platform, TP=1 on
gloo).

Runs inside the vLLM venv, in a process started with ``PROMETHEUS_MULTIPROC_DIR`` set (as vLLM itself sets it for
``--api-server-count`` > 1, or an operator before ``vllm serve``): the real embedding (vLLM's class selection, our
``StreamedPLEEmbedding`` and its row cache) publishes, lookups go through vLLM's ``start_prefetch`` /
``finalize_prefetch``, and the scrape is vLLM's: ``attach_router`` (its registry from ``get_prometheus_registry``)
on an app, ``GET /metrics``. Every series is compared with the row cache's own statistics; vLLM's own series are
still there beside them.
"""

from __future__ import annotations

import os

import pytest

from tests.ple_metrics.scrape import samples as parse
from tests.ple_metrics.scrape import value
from tests.vllm import harness
from tests.vllm.checks.check_row_cache import lookups, runners, settings, sidecar  # noqa: F401 - fixtures


@pytest.fixture(scope="module", autouse=True)
def tp1():
    with harness.distributed(1):
        yield


def _scrape() -> dict:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.serve.instrumentator.metrics import attach_router

    app = FastAPI()
    attach_router(app)
    return parse(TestClient(app).get("/metrics").text)


def test_series_in_vllms_metrics_equal_the_row_caches_stats(tmp_path, monkeypatch, runners):  # noqa: F811
    from prometheus_client import Counter, values

    from sglang_ssd_stream.ple_metrics import series as S
    from sglang_ssd_stream.ple_metrics.publish import for_process

    assert os.environ.get("PROMETHEUS_MULTIPROC_DIR") and values.ValueClass._multiprocess
    cfg = harness.text_config()
    _, _, manifest = sidecar(tmp_path, cfg)
    harness.load_plugins(monkeypatch, settings("mmap", manifest, "64"))
    model = harness.build(cfg)
    emb = model.ngram_embedding
    done = lookups(model) + lookups(model)
    metrics = for_process("vllm", tp_rank=None, pp_rank=None)  # the process's one (the arguments are not used again)
    assert metrics is not None and metrics._thread is not None and emb._gather.observer is metrics.layers[
        emb.table.layer]
    metrics.publish()
    Counter("vllm:stand_in_requests", "an engine series beside ours", registry=None).inc()
    st = emb.row_cache.stats
    samples = _scrape()
    lab = {"engine": "vllm", "layer": str(emb.table.layer), "tp_rank": "0", "pp_rank": "0"}
    for s in S.ROW_CACHE_SERIES:
        if s.stat:
            assert value(samples, s.sample, **lab) == st[s.stat], (s.name, st)
    assert value(samples, S.LOOKUPS.sample, **lab) == sum(ids.numel() for _, ids in done)
    assert value(samples, S.HITS.sample, **lab) + value(samples, S.MISSES.sample, **lab) == st["lookups"]
    assert value(samples, S.BYTES_READ.sample, **lab) == st["pages_read"] * 4096 > 0
    assert value(samples, S.ON_DEMAND.sample, **lab) + value(samples, S.AHEAD.sample, **lab) == st["rows_read"]
    assert value(samples, S.EXPOSED_SECONDS.sample, **lab) == len(done)
    assert value(samples, S.READ_SECONDS.sample, **lab) == len(done)
    assert value(samples, "vllm:stand_in_requests_total") == 1  # the engine's own series, in the same scrape
    emb.row_cache.close()  # a reader closed under the model (as after a fatal read): the next lookup is refused
    ids, qsl, ctx = harness.ngram_batch(0)
    with pytest.raises(Exception) as refused:
        model.start_prefetch(ids, qsl, ctx)
    assert type(refused.value).__name__ == "SidecarReaderUnusable", refused.value
    assert value(_scrape(), S.REFUSALS.sample, engine="vllm", reason="reader_unusable") == 1
