"""One sample: the host's memory, the server's process tree (RSS, cgroup, NVML device memory), the PLE
sidecar's page-cache residency, whether the server answers ``/health``, and the engine's metrics from
``/metrics`` (the names its adapter hands in) or the adapter's fallback."""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Sequence

from ..metrics import engine_sample, parse, ple_sample
from .config import WatchConfig
from .processes import cgroup_stats, meminfo, pid_listening, process_tree, rss_bytes
from .residency import Nvml, resident_bytes

GIB = 1 << 30


def _root(url: str) -> str:
    return re.sub(r"/v1/?$", "", url.rstrip("/"))


class Sampler:
    """Takes the samples of one watch: holds its HTTP client, NVML handle and the sidecar's last residency."""

    def __init__(self, cfg: WatchConfig, clock):
        import httpx

        self.cfg, self.clock = cfg, clock
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.http = httpx.Client(base_url=_root(cfg.url), timeout=min(max(cfg.interval_s, 1.0), 10.0), headers=headers)
        self.count = 0
        self.nvml = None
        self.sidecar_cache: dict[str, int | None] = {}

    def close(self) -> None:
        self.http.close()

    def server_pid(self) -> int | None:
        if self.cfg.pid:
            return self.cfg.pid
        if self.cfg.unit:
            try:
                r = subprocess.run(["systemctl", "show", "-p", "MainPID", "--value", self.cfg.unit],
                                   capture_output=True, text=True, timeout=5)
                if r.stdout.strip().isdigit() and int(r.stdout) > 0:
                    return int(r.stdout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        from urllib.parse import urlparse

        port = urlparse(self.cfg.url).port
        return pid_listening(self.cfg.proc, port) if port else None

    def sample(self, history: Sequence[dict]) -> dict:
        """The next sample; ``history`` (the samples kept so far, oldest first) gives the counters' last values."""
        cfg, now = self.cfg, self.clock()
        m = meminfo(cfg.proc)
        s: dict = {"t": round(now, 3), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))}
        if m:
            s["mem"] = {"available_gib": m.get("MemAvailable", 0) / GIB, "total_gib": m.get("MemTotal", 0) / GIB,
                        "cached_gib": m.get("Cached", 0) / GIB,
                        "swap_used_gib": (m.get("SwapTotal", 0) - m.get("SwapFree", 0)) / GIB,
                        "swap_total_gib": m.get("SwapTotal", 0) / GIB}
        pid = self.server_pid()
        if pid and (cfg.proc / str(pid)).is_dir():
            pids = process_tree(cfg.proc, pid)
            if self.nvml is None:
                self.nvml = Nvml()
            gpu = self.nvml.used_bytes(pids)
            s["server"] = {"pid": pid, "processes": len(pids), "rss_gib": (rss_bytes(cfg.proc, pids) or 0) / GIB,
                           "gpu_memory_gib": None if gpu is None else gpu / GIB,
                           "gpu_memory_note": None if gpu is not None else self.nvml.error or "no GPU process",
                           "cgroup": cgroup_stats(cfg.proc, cfg.cgroup_root, pid)}
        if cfg.sidecars and (self.count % max(cfg.sidecar_every, 1) == 0 or not self.sidecar_cache):
            self.sidecar_cache = {p: resident_bytes(p) for p in cfg.sidecars}
        if self.sidecar_cache:
            sizes = {p: os.path.getsize(p) for p in cfg.sidecars if os.path.exists(p)}
            res = [v for v in self.sidecar_cache.values() if v is not None]
            s["sidecar"] = {"page_cache_gib": sum(res) / GIB if res else None, "size_gib": sum(sizes.values()) / GIB,
                            "sampled": self.count % max(cfg.sidecar_every, 1) == 0}
        s.update(self.engine(now, history))
        self.count += 1
        return s

    def engine(self, now: float, history: Sequence[dict]) -> dict:
        import httpx

        out: dict = {}
        try:
            r = self.http.get("/health")
            out["answering"] = r.status_code < 500
            if not out["answering"]:
                out["error"] = f"/health: HTTP {r.status_code}"
        except httpx.HTTPError as exc:
            out["answering"], out["error"] = False, f"{type(exc).__name__}"
            return out
        names = self.cfg.metrics
        if names is None:
            out["engine"] = {"note": "this engine's adapter names no metrics"}
            return out
        prev = next((s for s in reversed(history) if s.get("engine", {}).get("counters")), None)
        try:
            r = self.http.get("/metrics")
            values = parse(r.text) if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            values = {}
        prev_ple = next((s for s in reversed(history) if s.get("ple", {}).get("totals")), None)
        out["ple"] = ple_sample(values, prev_ple.get("ple") if prev_ple else None,
                                now - prev_ple["t"] if prev_ple else None) or {
            "note": "no ssd_stream_* series at /metrics (docs/metrics.md says how each engine exports them)"}
        known = [n for n in (names.kv_usage, names.running, names.accept_length, names.drafts_total) if n]
        if any(n in values for n in known):
            out["engine"] = engine_sample(names, values, prev.get("engine") if prev else None,
                                          now - prev["t"] if prev else None)
            out["engine"]["source"] = "/metrics"
        elif names.fallback is not None:
            try:
                out["engine"] = names.fallback(lambda path: self.http.get(path).json())
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                out["engine"] = {"note": f"no engine metrics ({type(exc).__name__}); {names.enable_hint}"}
        else:
            out["engine"] = {"note": f"no engine metrics at /metrics; {names.enable_hint}"}
        return out
