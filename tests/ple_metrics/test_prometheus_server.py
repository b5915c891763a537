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
