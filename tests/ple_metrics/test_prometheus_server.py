"""A real Prometheus server (Debian's ``prometheus``) scrapes the kit's series from a multiprocess directory that
real row caches filled, served as the engines serve it, and answers the hit-rate query with the caches' own
ratio. (The e2e suite does the same against the real sglang server: tests/e2e/test_7_metrics.py.)"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from .prometheus_server import BINARY, HIT_RATE, Prometheus, skip_or_fail
from .test_ple_metrics import CHILD, run_child


def _serve(directory):
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=str(directory))  # what sglang's and vLLM's /metrics do
            body = generate_latest(registry)
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_real_prometheus_answers_the_hit_rate_of_the_row_caches(tmp_path):
    if BINARY is None:
        skip_or_fail()
    prom = tmp_path / "prom"
    prom.mkdir()
    got = run_child(CHILD, tmp_path, 4, "call", env_dir=prom)
    hits = sum(st["hits"] for st in got["stats"].values())
    lookups = sum(st["lookups"] for st in got["stats"].values())
    server = _serve(prom)
    p = Prometheus(f"127.0.0.1:{server.server_address[1]}", tmp_path / "prometheus")
    try:
        p.wait_ready()
        assert p.scalar_when("sum(ssd_stream_lookups_total)", lambda v: v > 0) == lookups
        assert p.scalar_when(HIT_RATE, lambda v: True) == pytest.approx(hits / lookups, rel=1e-12)
        by_layer = {r["metric"]["layer"]: float(r["value"][1]) for r in p.query(
            "sum by (layer) (ssd_stream_row_cache_hits_total) / sum by (layer) (ssd_stream_lookups_total)")}
        assert by_layer == {layer: pytest.approx(st["hits"] / st["lookups"]) for layer, st in got["stats"].items()}
    finally:
        p.stop()
        server.shutdown()
        server.server_close()


def _serve_negotiated(registry):
    """``registry`` served as the engines' /metrics serve it: prometheus_client's own ``make_asgi_app`` and
    ``make_wsgi_app`` pick the format from Prometheus's Accept header (``choose_encoder``), and Debian's Prometheus
    2.42 asks for OpenMetrics, where prometheus_client 0.26 writes ``sglang:token_usage`` as ``sglang_token_usage``."""
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import make_wsgi_app

    class Quiet(WSGIRequestHandler):
        def log_message(self, *a):
            pass

    server = make_server("127.0.0.1", 0, make_wsgi_app(registry), handler_class=Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_dashboards_engine_panels_find_the_engines_series_in_a_real_prometheus(tmp_path):
    """The KV and MTP panels read sglang's and vLLM's own series (names as their collectors register them: the
    names `watch` reads); each panel query, with the variables filled as scripts/grafana/render.py fills them for
    Grafana's, returns data from a real Prometheus that scraped them. A bare ``sglang:token_usage`` returned none."""
    import importlib.util
    import json
    import time
    from pathlib import Path

    from prometheus_client import CollectorRegistry, Counter, Gauge

    from sglang_ssd_stream.sglang.side import METRICS as SGLANG
    from vllm_ple_offload.metrics import METRICS as VLLM

    if BINARY is None:
        skip_or_fail()
    repo = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("render", repo / "scripts" / "grafana" / "render.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    registry = CollectorRegistry()
    for name in (SGLANG.kv_usage, SGLANG.accept_rate, SGLANG.accept_length, VLLM.kv_usage):
        Gauge(name, name, registry=registry).set(0.5)
    counters = [Counter(name.removesuffix("_total"), name, registry=registry)
                for name in (VLLM.accepted_total, VLLM.draft_tokens_total, VLLM.drafts_total)]
    dashboard = json.loads((repo / "scripts" / "grafana" / "ssd-stream-ple.json").read_text())
    engine_panels = [p for p in dashboard["panels"] if p["title"] in ("KV cache usage (engine)",
                                                                       "MTP acceptance (engine)")]
    exprs = [render.substitute(t["expr"], render.variables(dashboard, {}), step=1, scrape=1, span=60)
             for p in engine_panels for t in p["targets"]]
    assert len(exprs) == 6, exprs
    server = _serve_negotiated(registry)
    p = Prometheus(f"127.0.0.1:{server.server_address[1]}", tmp_path / "prometheus")
    missing = exprs
    try:
        p.wait_ready()
        began = time.time()
        deadline = time.monotonic() + 45
        more = 10  # half-second rises after every query answered: a few scrapes' rates for the range below
        while (missing or more) and time.monotonic() < deadline:
            for i, c in enumerate(counters):  # drafts, draft tokens and accepted tokens rise between scrapes
                c.inc(1 + i)
            time.sleep(0.5)
            more -= 0 if missing else 1
            missing = [e for e in exprs if not p.query(e)]
        assert not missing, missing
        # the whole dashboard drawn from the same Prometheus by scripts/grafana/render.py: the engine panels with
        # every series they name, the kit's (none served here) as "No data"
        out = tmp_path / "dashboard.png"
        shown = render.render(dashboard, p.url, began, time.time(), step=1, scrape=1,
                              values=render.variables(dashboard, {}), out=out, source="test")
        assert shown["KV cache usage (engine)"] == ["sglang", "vLLM"], shown
        assert sorted(shown["MTP acceptance (engine)"]) == ["sglang accept length", "sglang accept rate",
                                                            "vLLM accept length", "vLLM accept rate"], shown
        assert not shown["PLE row-cache hit rate"] and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        p.stop()
        server.shutdown()
        server.server_close()


def test_while_scraped_leaves_no_directory_behind(tmp_path, monkeypatch):
    """The scenarios' helper answers from a real Prometheus in a temporary directory of its own, removed after."""
    import tempfile
    import urllib.request

    from . import prometheus_server

    if BINARY is None:
        skip_or_fail()
    prom = tmp_path / "prom"
    prom.mkdir()
    run_child(CHILD, tmp_path, 2, "call", env_dir=prom)
    server = _serve(prom)
    made = tmp_path / "made"
    made.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(made))  # where mkdtemp puts it, for this test only
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout=10) as r:
            text = r.read().decode()
        out = prometheus_server.while_scraped(f"http://127.0.0.1:{server.server_address[1]}",
                                              lambda: {"metrics": text})
    finally:
        server.shutdown()
        server.server_close()
    assert out["prometheus"]["lookups"] > 0, out["prometheus"]
    assert list(made.iterdir()) == []
