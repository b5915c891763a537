"""`watch` against a fake /proc and cgroup tree and a fake metrics endpoint. The SGLang /metrics text is
written by sglang 0.5.23's own SchedulerMetricsCollector (in a subprocess of this venv), so the names
watch reads are the ones the engine exports; vLLM's names are checked in tests/vllm/test_watch_metrics.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sglang_ssd_stream.operate import watch as W
from sglang_ssd_stream.operate.profiles import PROFILES
from sglang_ssd_stream.sglang.side import METRICS as SGLANG_METRICS
from vllm_ple_offload.metrics import METRICS as VLLM_METRICS

from .conftest import SIDES, write_model

GIB = 1 << 30
THOR = PROFILES["sglang", "thor"].watch

REAL_SGLANG_METRICS = r"""
import json, sys, types
from sglang.srt.observability import metrics_collector as mc
import prometheus_client
# the collector reads two scheduling settings from the published server context; nothing else is stood in
mc.get_schedule = lambda: types.SimpleNamespace(prefill_delayer_max_delay_passes=30,
    prefill_delayer_forward_passes_buckets=None, prefill_delayer_wait_seconds_buckets=None,
    enable_priority_scheduling=False)
c = mc.SchedulerMetricsCollector(labels={"model_name": "m", "engine_type": "unified", "tp_rank": 0, "pp_rank": 0,
                                         "moe_ep_rank": 1}, server_args=types.SimpleNamespace())
out = {}
for name, kw in json.loads(sys.argv[1]).items():
    kw["num_running_reqs"] = mc.QueueCount(total=kw.pop("running"))
    c.log_stats(mc.SchedulerStats(**kw))
    out[name] = prometheus_client.generate_latest().decode()
print(json.dumps(out))
"""
STATES = {"healthy": dict(running=2, token_usage=0.42, kv_used_tokens=233_000, spec_accept_length=2.84,
                          spec_accept_rate=0.61, gen_throughput=33.7),
          "decayed": dict(running=2, token_usage=0.97, kv_used_tokens=540_000, spec_accept_length=1.1,
                          spec_accept_rate=0.05, gen_throughput=16.4),
          "idle": dict(running=0, token_usage=0.0, kv_used_tokens=0, spec_accept_length=0.0, spec_accept_rate=0.0,
                       gen_throughput=0.0)}


@pytest.fixture(scope="module")
def sglang_texts():
    r = subprocess.run([sys.executable, "-c", REAL_SGLANG_METRICS, json.dumps(STATES)], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "SGLANG_SSD_STREAM_ALLOW_UNPATCHED": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


class Endpoint:
    """/health, /metrics and /v1/loads as the test sets them."""

    def __init__(self):
        self.health, self.metrics, self.loads, self.models = 200, "", None, None
        ep = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                if self.path == "/health":
                    code, body, ctype = ep.health, b"", "text/plain"
                elif self.path == "/metrics" and ep.metrics:
                    code, body, ctype = 200, ep.metrics.encode(), "text/plain"
                elif self.path == "/v1/models" and ep.models is not None:
                    code, body, ctype = 200, json.dumps({"object": "list", "data": ep.models}).encode(), "x/json"
                elif self.path.startswith("/v1/loads") and ep.loads is not None:
                    code, body, ctype = 200, json.dumps(ep.loads).encode(), "application/json"
                else:
                    code, body, ctype = 404, b"{}", "application/json"
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint():
    e = Endpoint()
    yield e
    e.close()


def fake_host(root: Path, port: int, *, avail_gib=20.0, swap_used_gib=0.0) -> tuple[Path, Path]:
    """/proc with meminfo, a server (pid 100) listening on ``port`` with a child (101), and a v2 cgroup."""
    proc, cg = root / "proc", root / "cgroup"
    (proc / "net").mkdir(parents=True)
    set_mem(proc, avail_gib, swap_used_gib)
    for pid, ppid, rss_kb in ((1, 0, 1000), (100, 1, 2 * 1024 * 1024), (101, 100, 1024 * 1024), (200, 1, 5000)):
        d = proc / str(pid)
        (d / "fd").mkdir(parents=True)
        (d / "status").write_text(f"Name:\tx\nPPid:\t{ppid}\nVmRSS:\t{rss_kb} kB\n")
        (d / "cgroup").write_text("0::/system.slice/qwen38-ssd-stream.service\n")
    os.symlink("socket:[4242]", proc / "100" / "fd" / "7")
    os.symlink("/dev/null", proc / "200" / "fd" / "0")
    (proc / "net" / "tcp").write_text(
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        f"   0: 0100007F:{port:04X} 00000000:0000 0A 00000000:00000000 00:00000000 00000000  0  0 4242 1\n"
        f"   1: 0100007F:{port + 1:04X} 00000000:0000 0A 00000000:00000000 00:00000000 00000000  0  0 999 1\n")
    d = cg / "system.slice" / "qwen38-ssd-stream.service"
    d.mkdir(parents=True)
    (cg / "cgroup.controllers").write_text("cpu memory\n")
    (d / "memory.current").write_text(str(90 * GIB) + "\n")
    (d / "memory.max").write_text("max\n")
    (d / "cpu.stat").write_text("usage_usec 100\nnr_throttled 12\nthrottled_usec 2242000000\n")
    return proc, cg


def set_mem(proc: Path, avail_gib: float, swap_used_gib: float = 0.0) -> None:
    kb = lambda g: int(g * 1024 * 1024)  # noqa: E731
    (proc / "meminfo").write_text(f"MemTotal: {kb(122.86)} kB\nMemFree: {kb(1)} kB\nMemAvailable: {kb(avail_gib)} kB\n"
                                  f"Cached: {kb(30)} kB\nSwapTotal: {kb(16)} kB\n"
                                  f"SwapFree: {kb(16 - swap_used_gib)} kB\n")


def watcher(tmp_path, endpoint, metrics=SGLANG_METRICS, **kw) -> W.Watcher:
    proc, cg = fake_host(tmp_path, endpoint.port)
    clock = iter(range(1000, 100000, 10))
    cfg = W.WatchConfig(url=endpoint.url, out=tmp_path / "out", limits=THOR, metrics=metrics, interval_s=0,
                        proc=proc, cgroup_root=cg, **kw)
    return W.Watcher(cfg, clock=lambda: next(clock), log=lambda line: None)


def test_a_sample_from_the_fake_host_and_sglangs_own_metrics(tmp_path, endpoint, sglang_texts):
    endpoint.metrics = sglang_texts["healthy"]
    w = watcher(tmp_path, endpoint)
    s = w.step()
    assert s["mem"]["available_gib"] == pytest.approx(20.0) and s["mem"]["swap_used_gib"] == 0
    srv = s["server"]
    assert (srv["pid"], srv["processes"]) == (100, 2) and srv["rss_gib"] == pytest.approx(3.0)  # parent + child
    assert srv["cgroup"] == {"memory_bytes": 90 * GIB, "memory_limit_bytes": None, "throttled_s": 2242.0,
                             "nr_throttled": 12}
    assert srv["gpu_memory_gib"] is None and srv["gpu_memory_note"]  # no NVML here: said, not guessed
    e = s["engine"]
    assert (e["kv_usage"], e["kv_used_tokens"], e["running"], e["accept_length"], e["accept_rate"]) == \
        (0.42, 233_000, 2, 2.84, 0.61)
    assert e["source"] == "/metrics" and s["alerts"] == [] and s["answering"] is True
    line = json.loads((tmp_path / "out" / "watch.jsonl").read_text().splitlines()[0])
    assert line["engine"]["kv_usage"] == 0.42 and line["server"]["pid"] == 100
    w.close()


def test_accept_length_decay_warns_only_when_sustained_with_traffic(tmp_path, endpoint, sglang_texts):
    """sglang #37326: acceptance decaying toward zero. One low sample is noise; three in a row with requests
    running is the decay. An idle server (accept length 0: no verify step) never warns."""
    w = watcher(tmp_path, endpoint)
    endpoint.metrics = sglang_texts["idle"]
    assert all(not w.step()["alerts"] for _ in range(4))
    endpoint.metrics = sglang_texts["decayed"]
    checks = [{a["check"] for a in w.step()["alerts"]} for _ in range(3)]
    assert checks[0] == checks[1] == {"kv_usage"}  # KV 97 % > 95 % warns at once
    assert checks[2] == {"kv_usage", "accept_length", "accept_rate"}
    w.close()


def test_low_memory_writes_one_incident_bundle(tmp_path, endpoint, sglang_texts):
    endpoint.metrics = sglang_texts["healthy"]
    log = tmp_path / "server.log"
    log.write_text("".join(f"line {i}\n" for i in range(1000)))
    w = watcher(tmp_path, endpoint, log_file=log, doctor=lambda: {"findings": [{"check": "swap"}]})
    w.step()
    set_mem(w.cfg.proc, 6.0, swap_used_gib=3.0)  # below 8 GiB: warn; swap 3 > 2 GiB: warn
    assert {a["check"]: a["level"] for a in w.step()["alerts"]} == {"mem_available": "warn", "swap": "warn"}
    set_mem(w.cfg.proc, 1.9, swap_used_gib=15.9)  # write-up 000's reboot: ~2 GB available, swap full
    s = w.step()
    assert any(a["level"] == "incident" and a["check"] == "mem_available" for a in s["alerts"])
    (bundle,) = [Path(p) for p in s["bundles"]]
    assert bundle.name.startswith("incident-") and bundle.name.endswith("-mem_available")
    samples = [json.loads(x) for x in (bundle / "samples.jsonl").read_text().splitlines()]
    assert [round(x["mem"]["available_gib"], 1) for x in samples] == [20.0, 6.0, 1.9]
    assert json.loads((bundle / "doctor.json").read_text()) == {"findings": [{"check": "swap"}]}
    assert (bundle / "server.log").read_text().splitlines()[-1] == "line 999"
    assert json.loads((bundle / "incident.json").read_text())["limits"]["mem_available_incident_gib"] == 4.0
    assert (bundle / "kernel.log").exists()
    assert "bundles" not in w.step()  # the same incident again within the cool-down: no second bundle
    w.close()


def test_a_server_that_stops_answering_is_an_incident(tmp_path, endpoint, sglang_texts):
    endpoint.metrics = sglang_texts["healthy"]
    w = watcher(tmp_path, endpoint)
    w.step()
    endpoint.health = 503
    first = w.step()
    assert [(a["check"], a["level"]) for a in first["alerts"]] == [("server", "warn")]
    second = w.step()
    assert [(a["check"], a["level"]) for a in second["alerts"]] == [("server", "incident")] and second["bundles"]
    endpoint.close()  # gone entirely: a connection error is the same verdict
    third = w.step()
    assert third["answering"] is False and third["error"] == "ConnectError"
    w.close()


def test_vllm_counters_become_interval_rates(tmp_path, endpoint):
    """vLLM exports counters only: acceptance over the interval from two samples."""
    def text(drafts, tokens, accepted, generated, kv, running):
        return (f"# TYPE vllm:kv_cache_usage_perc gauge\n"
                f"vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {kv}\n"
                f"# TYPE vllm:num_requests_running gauge\n"
                f"vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {running}\n"
                f"# TYPE vllm:spec_decode_num_drafts counter\n"
                f"vllm:spec_decode_num_drafts_total{{engine=\"0\",model_name=\"m\"}} {drafts}\n"
                f"# TYPE vllm:spec_decode_num_draft_tokens counter\n"
                f"vllm:spec_decode_num_draft_tokens_total{{engine=\"0\",model_name=\"m\"}} {tokens}\n"
                f"# TYPE vllm:spec_decode_num_accepted_tokens counter\n"
                f"vllm:spec_decode_num_accepted_tokens_total{{engine=\"0\",model_name=\"m\"}} {accepted}\n"
                f"# TYPE vllm:generation_tokens counter\n"
                f"vllm:generation_tokens_total{{engine=\"0\",model_name=\"m\"}} {generated}\n")

    w = watcher(tmp_path, endpoint, metrics=VLLM_METRICS)
    endpoint.metrics = text(1000, 2000, 1200, 5000, 0.3, 8)
    first = w.step()["engine"]
    assert first["accept_rate"] is None and first["kv_usage"] == 0.3  # one sample: no interval yet
    endpoint.metrics = text(1100, 2200, 1280, 5360, 0.31, 8)  # 100 verify steps, 200 drafts, 80 accepted in 10 s
    e = w.step()["engine"]
    assert e["accept_rate"] == pytest.approx(0.4) and e["accept_length"] == pytest.approx(1.8)
    assert e["gen_tokens_per_s"] == pytest.approx(36.0)
    endpoint.metrics = text(5, 10, 3, 20, 0.0, 0)  # the server restarted: counters fell, no negative rates
    assert w.step()["engine"]["accept_rate"] is None
    w.close()


def test_sglang_without_enable_metrics_falls_back_to_v1_loads(tmp_path, endpoint):
    endpoint.loads = {"loads": [{"num_used_tokens": 100, "max_total_num_tokens": 1000, "num_running_reqs": 1,
                                 "num_waiting_reqs": 0, "gen_throughput": 30.0,
                                 "speculative": {"accept_length": 2.5, "accept_rate": 0.5}}]}
    w = watcher(tmp_path, endpoint)
    e = w.step()["engine"]
    assert (e["kv_usage"], e["running"], e["accept_length"]) == (0.1, 1, 2.5) and "since start" in e["source"]
    endpoint.loads = None
    assert "--enable-metrics" in w.step()["engine"]["note"]
    w.close()


def test_jsonl_rotates(tmp_path, endpoint, sglang_texts):
    endpoint.metrics = sglang_texts["healthy"]
    w = watcher(tmp_path, endpoint, max_bytes=2000, keep=2)
    for _ in range(8):
        w.step()
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["watch.jsonl", "watch.jsonl.1", "watch.jsonl.2"]
    w.close()


def test_sidecar_page_cache_residency(tmp_path):
    f = tmp_path / "table.bin"
    f.write_bytes(os.urandom(1 << 20))
    r = W.resident_bytes(f)
    assert r is not None and 0 <= r <= 1 << 20
    f.read_bytes()
    assert W.resident_bytes(f) > 0  # just read: in the page cache
    assert W.resident_bytes(tmp_path / "absent") is None


def test_pid_listening_and_process_tree(tmp_path):
    proc, _ = fake_host(tmp_path, 8000)
    assert W.pid_listening(proc, 8000) == 100 and W.pid_listening(proc, 9999) is None
    assert sorted(W.process_tree(proc, 100)) == [100, 101]


def test_cgroup_v1(tmp_path):
    proc = tmp_path / "proc"
    (proc / "7").mkdir(parents=True)
    (proc / "7" / "cgroup").write_text("4:memory:/docker/x\n2:cpu,cpuacct:/docker/x\n")
    cg = tmp_path / "cg"
    (cg / "memory" / "docker" / "x").mkdir(parents=True)
    (cg / "memory" / "docker" / "x" / "memory.usage_in_bytes").write_text("1000\n")
    (cg / "memory" / "docker" / "x" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (cg / "cpu,cpuacct" / "docker" / "x").mkdir(parents=True)
    (cg / "cpu,cpuacct" / "docker" / "x" / "cpu.stat").write_text("nr_periods 5\nnr_throttled 3\n"
                                                                   "throttled_time 2000000000\n")
    assert W.cgroup_stats(proc, cg, 7) == {"memory_bytes": 1000, "memory_limit_bytes": None, "throttled_s": 2.0,
                                           "nr_throttled": 3}


def test_watch_command_end_to_end(tmp_path, endpoint, sglang_texts, capsys, monkeypatch):
    from sglang_ssd_stream.cli import main

    endpoint.metrics = sglang_texts["healthy"]
    model = write_model(tmp_path / "m")
    assert main(["watch", "--url", endpoint.url, "--profile", "thor", "--model", str(model), "--out",
                 str(tmp_path / "w"), "--interval", "0", "--samples", "2", "--pid", str(os.getpid())]) == 0
    lines = [json.loads(x) for x in (tmp_path / "w" / "watch.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and lines[0]["engine"]["kv_usage"] == 0.42
    assert lines[0]["server"]["pid"] == os.getpid() and lines[0]["server"]["rss_gib"] > 0  # this real process
    assert lines[0]["sidecar"]["size_gib"] > 0 and lines[0]["sidecar"]["page_cache_gib"] is not None
    assert "limits: write-up 000" in capsys.readouterr().err


def test_service_writes_the_watch_unit(capsys):
    import argparse

    from sglang_ssd_stream.operate import add_operate_commands

    p = argparse.ArgumentParser()
    add_operate_commands(p.add_subparsers(dest="command", required=True), SIDES["sglang"])
    args = p.parse_args(["service", "--profile", "thor", "--model", "/m", "--user", "u", "--home", "/h", "--cli",
                         "/c", "--watch-unit", "--host", "0.0.0.0", "--api-key-file", "/k"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert ("ExecStart=/c watch --url http://127.0.0.1:8000/v1 --profile thor --model /m --out "
            "/h/.local/state/sglang-ssd-stream/watch --unit qwen38-ssd-stream --api-key-file /k\n") in out
    assert "After=qwen38-ssd-stream.service\n" in out and "Restart=always\n" in out and "OOMScoreAdjust=-500\n" in out


def test_every_side_hands_in_metric_names():
    assert SIDES["sglang"].metrics is SGLANG_METRICS
    for names in (SGLANG_METRICS, VLLM_METRICS):
        assert names.kv_usage and names.running and names.enable_hint
    assert dataclasses.replace(SIDES["vllm"], metrics=VLLM_METRICS).metrics.drafts_total


def test_the_page_cache_measure_finds_tables_on_another_disk_as_the_server_trusts_them(tmp_path, monkeypatch, capsys):
    """watch measures the sidecar's tables in the page cache: tables linked to another disk are found when the
    engine's TRUSTED_ROOTS names it, and said not measured (watch goes on) when nothing does."""
    from sglang_ssd_stream.operate.watch.cli import _sidecars

    model = write_model(tmp_path / "m")
    disk2 = tmp_path / "disk2"
    disk2.mkdir()
    (model / "ple").rename(disk2 / "ple")
    (model / "ple").symlink_to(disk2 / "ple")
    monkeypatch.delenv("VLLM_PLE_TRUSTED_ROOTS", raising=False)
    assert _sidecars(str(model), "vllm") == ()
    assert "watch: sidecar not measured" in capsys.readouterr().err
    monkeypatch.setenv("VLLM_PLE_TRUSTED_ROOTS", str(disk2))
    assert _sidecars(str(model), "vllm") == (str(disk2 / "ple" / "layer-3.bin"),)


def kit_series_text(per_layer: dict) -> str:
    """The kit's ``ssd_stream_*`` series as an engine's /metrics shows them: two PLE layers, made from the series
    table itself (sglang_ssd_stream/ple_metrics/series.py), ``per_layer`` the values of each layer."""
    import prometheus_client

    from sglang_ssd_stream.ple_metrics import series as S

    reg = prometheus_client.CollectorRegistry()
    made = {s.name: (prometheus_client.Counter if s.kind == "counter" else prometheus_client.Histogram)(
        s.name, s.doc, s.labels, registry=reg, **({"buckets": s.buckets} if s.buckets else {})) for s in S.ALL}
    for layer in ("3", "7"):
        lab = {"engine": "sglang", "layer": layer, "tp_rank": "0", "pp_rank": "0"}
        for key, series in (("lookups", S.LOOKUPS), ("hits", S.HITS), ("rows_read", S.ROWS_READ),
                            ("ahead", S.AHEAD), ("reads", S.READS), ("bytes", S.BYTES_READ)):
            made[series.name].labels(**lab).inc(per_layer[key])
        for _ in range(per_layer["exposed_n"]):
            made[S.EXPOSED_SECONDS.name].labels(**lab).observe(per_layer["exposed_s"] / per_layer["exposed_n"])
    made[S.REFUSALS.name].labels(engine="sglang", tp_rank="0", pp_rank="0", reason="row_out_of_range").inc(
        per_layer["refusals"])
    return prometheus_client.generate_latest(reg).decode()


def test_the_kits_series_become_the_ple_part_of_a_sample_and_of_an_incident(tmp_path, endpoint, sglang_texts):
    first = dict(lookups=1000, hits=600, rows_read=400, ahead=100, reads=50, bytes=50 * 4096, exposed_n=4,
                 exposed_s=0.004, refusals=0)
    then = dict(lookups=3000, hits=2200, rows_read=800, ahead=400, reads=90, bytes=90 * 4096 + 10 * 2**20,
                exposed_n=14, exposed_s=0.024, refusals=1)
    w = watcher(tmp_path, endpoint)
    endpoint.metrics = sglang_texts["healthy"] + kit_series_text(first)
    p = w.step()["ple"]
    assert p["totals"]["lookups"] == 2000 and "hit_rate" not in p  # two layers summed; one sample: no interval
    assert p["totals"]["exposed_lookups"] == 8 and p["totals"]["exposed_s"] == pytest.approx(0.008)  # histograms too
    endpoint.metrics = sglang_texts["healthy"] + kit_series_text(then)
    p = w.step()["ple"]  # 10 s later (the test clock)
    assert p["hit_rate"] == pytest.approx(2 * 1600 / (2 * 2000)) and p["lookups_per_s"] == pytest.approx(400.0)
    assert p["disk_mib_per_s"] == pytest.approx(2 * (40 * 4096 + 10 * 2**20) / 10 / 2**20)
    assert p["disk_reads_per_s"] == pytest.approx(8.0) and p["ahead_share"] == pytest.approx(300 / 400)
    assert p["exposed_ms_per_lookup"] == pytest.approx(2.0) and p["new_refusals"] == 1
    endpoint.metrics = sglang_texts["healthy"] + kit_series_text(first)  # a restart: counters fell, no negative rate
    assert "hit_rate" not in w.step()["ple"]
    endpoint.metrics = sglang_texts["healthy"]  # an engine without the kit's series: said so
    assert "ssd_stream_" in w.step()["ple"]["note"]
    set_mem(tmp_path / "proc", 1.0)  # below Thor's incident line: a bundle, whose samples carry the PLE part
    bundles = w.step().get("bundles")
    assert bundles
    kept = [json.loads(line) for line in (Path(bundles[0]) / "samples.jsonl").read_text().splitlines()]
    assert any(s["ple"].get("hit_rate") for s in kept)
    w.close()
