"""A real Prometheus server (Debian's ``prometheus`` package) on loopback for a test: it scrapes one target every
second and answers PromQL over its HTTP API. Bounded: its start, each wait; ended (its process group) by
:meth:`Prometheus.stop`. ``BINARY`` is None where the package is not installed (``apt-get install prometheus``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

BINARY = shutil.which("prometheus")
MISSING = "Debian's prometheus package is not installed (apt-get install prometheus)"
# .ci/run installs the package and sets this: there a missing binary fails the tests that need it, never skips them
REQUIRED = os.environ.get("SSD_STREAM_REQUIRE_PROMETHEUS") == "1"
# A directory where while_scraped keeps what Prometheus stored and when the traffic ran (range.json), for
# scripts/grafana/render.py to draw the dashboard from a real server's run; unset: nothing kept
KEEP = os.environ.get("SSD_STREAM_KEEP_PROMETHEUS")


def skip_or_fail(reason: str = MISSING) -> None:
    """The test cannot run without the package: skipped, or failed where the run requires it."""
    import pytest

    (pytest.fail if REQUIRED else pytest.skip)(f"{reason} (SSD_STREAM_REQUIRE_PROMETHEUS=1)" if REQUIRED else reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, target: str | None, workdir: Path, *, metrics_path: str = "/metrics"):
        """``target``: ``host:port`` of the endpoint to scrape; None: none, to query what ``workdir/data`` holds
        (e.g. a copy of what :func:`while_scraped` kept)."""
        if BINARY is None:
            raise RuntimeError(MISSING)
        self.workdir, self.port = Path(workdir), _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        scrape = ("scrape_configs:\n"
                  f"  - job_name: engine\n    metrics_path: {metrics_path}\n"
                  f"    static_configs:\n      - targets: ['{target}']\n") if target else ""
        config.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n" + scrape)
        self.log = open(self.workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [BINARY, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 60.0) -> Prometheus:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.proc.returncode}: {self.log_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"prometheus not ready in {timeout:.0f} s: {self.log_text()[-2000:]}")

    def query(self, expr: str) -> list[dict]:
        """The instant vector of ``expr`` now (``[{"metric": {...}, "value": [t, "v"]}]``)."""
        q = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=10) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus query {expr!r}: {body}")
        return body["data"]["result"]

    def scalar_when(self, expr: str, ready, timeout: float = 30.0) -> float:
        """The single value of ``expr`` once ``ready(value)`` holds (each scrape a second apart), else TimeoutError."""
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            result = self.query(expr)
            if len(result) == 1:
                last = float(result[0]["value"][1])
                if ready(last):
                    return last
            time.sleep(0.5)
        raise TimeoutError(f"{expr!r} was {last} after {timeout:.0f} s")

    def log_text(self) -> str:
        self.log.flush()
        return (self.workdir / "prometheus.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        self.log.close()


HIT_RATE = "sum(ssd_stream_row_cache_hits_total) / sum(ssd_stream_lookups_total)"


def _total(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def while_scraped(url: str, run) -> dict:
    """``run()`` (a scenario's traffic, returning its results with the endpoint's text at idle under ``metrics``)
    while a real Prometheus scrapes ``url`` every second; adds ``prometheus``: what it answers for the lookups, the
    hit rate and the bytes read once it has scraped as many lookups as that text shows ({"skipped": ...} without
    the package, {"error": ...} when it failed: the scenario's other tests go on)."""
    import tempfile

    if BINARY is None:
        return {**run(), "prometheus": {"skipped": MISSING}}
    p = Prometheus(urllib.parse.urlsplit(url).netloc, Path(tempfile.mkdtemp(prefix="prometheus-")))
    began = None
    try:
        p.wait_ready()
        began = time.time()
        out = run()
        lookups = _total(out["metrics"], "ssd_stream_lookups_total")
        out["prometheus"] = {"lookups": p.scalar_when("sum(ssd_stream_lookups_total)", lambda v: v == lookups),
                             "hit_rate": p.scalar_when(HIT_RATE, lambda v: True), "query": HIT_RATE,
                             "bytes_read": p.scalar_when("sum(ssd_stream_disk_read_bytes_total)", lambda v: True)}
        return out
    except (OSError, RuntimeError, TimeoutError, ValueError) as exc:
        return {**locals().get("out", {}), "prometheus": {"error": f"{type(exc).__name__}: {exc}",
                                                          "log": p.log_text()[-2000:]}}
    finally:
        ended = time.time()
        p.stop()
        try:
            if KEEP and began is not None:
                _keep(p.workdir / "data", Path(KEEP), {"start": began, "end": ended, "target": url})
        finally:
            shutil.rmtree(p.workdir, ignore_errors=True)  # its own temporary directory: nothing is left in /tmp


def _keep(data: Path, dest: Path, run: dict) -> None:
    """Prometheus's stored data (stopped, so whole) and the traffic's time range, into a new ``dest``."""
    if dest.exists():
        raise FileExistsError(f"{KEEP=} exists: name a new directory")
    tmp = dest.with_name(dest.name + ".partial")
    shutil.copytree(data, tmp / "data")
    (tmp / "range.json").write_text(json.dumps(run))
    tmp.rename(dest)
