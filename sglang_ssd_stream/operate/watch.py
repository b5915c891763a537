"""``watch --url …``: the runtime memory and incident watch of write-up 000 §§2, 6-10.

The Thor rebooted (hardware watchdog, no OOM record, logs lost) with MemAvailable near 2 GB and its swap
full; a long session raised PyTorch's reserved memory by 1.47 GiB; sglang #37326 describes MTP acceptance
decaying to zero (47 -> 16 tok/s) until a restart. Every ``--interval`` seconds this samples

- the host: MemAvailable, swap, page cache (``/proc/meminfo``);
- the server's process tree: RSS (``/proc/<pid>/status``), its cgroup's memory and CPU throttling
  (write-up 004 lost 2,242 s to CFS throttling), and on discrete GPUs its device memory from NVML (the
  closest outside view of the allocator's reserved bytes, which neither engine exports);
- the PLE sidecar: how much of it is in the page cache (``mincore``; sampled every ``--sidecar-every``);
- the engine's metrics (the names its adapter hands in): KV usage, running requests, MTP accept
  length and rate, generated tokens per second; and whether the server answers ``/health``;

appends one JSON line per sample to ``<out>/watch.jsonl`` (rotated), warns at the profile's thresholds
(:class:`~.profiles.WatchLimits`), and writes an incident bundle when MemAvailable falls to the incident
level or the server stops answering: the last ``--window`` seconds of samples, the doctor's report, the
server's recent log lines, the kernel's OOM/Xid lines, host facts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import logging.handlers
import mmap
import os
import re
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .host import meminfo as host_meminfo
from .metrics import MetricNames, engine_sample, parse
from .profiles import WatchLimits

GIB = 1 << 30
DEFAULT_LIMITS = WatchLimits(mem_available_warn_gib=4.0, mem_available_incident_gib=2.0, kv_usage_warn=0.95,
                             why="no profile given: the kernel's OOM margin")
SUSTAIN = 3  # accept-length/rate warnings need this many consecutive samples with traffic
UNANSWERED = 2  # consecutive failed health checks that make an incident


# ----------------------------------------------------------------------------- host and process facts


def meminfo(proc: Path) -> dict[str, int]:
    return host_meminfo(proc / "meminfo")


def _status(proc: Path, pid: int) -> dict[str, str]:
    try:
        return dict(line.split(":", 1) for line in (proc / str(pid) / "status").read_text().splitlines() if ":" in line)
    except OSError:
        return {}


def process_tree(proc: Path, root: int) -> list[int]:
    """``root`` and its descendants (PPid from each /proc/<pid>/status)."""
    parent = {}
    for d in proc.iterdir() if proc.is_dir() else ():
        if d.name.isdigit():
            ppid = _status(proc, int(d.name)).get("PPid", "").strip()
            if ppid.isdigit():
                parent[int(d.name)] = int(ppid)
    tree, frontier = [root], [root]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier and p not in tree]
        tree += frontier
    return tree


def rss_bytes(proc: Path, pids: list[int]) -> int | None:
    total, seen = 0, False
    for pid in pids:
        v = _status(proc, pid).get("VmRSS", "").split()
        if v and v[0].isdigit():
            total += int(v[0]) * 1024
            seen = True
    return total if seen else None


def pid_listening(proc: Path, port: int) -> int | None:
    """The process holding a listening TCP socket on ``port`` (from /proc/net/tcp{,6} and fd links)."""
    inodes = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f[9])
    if not inodes:
        return None
    for d in sorted((p for p in proc.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
        try:
            for fd in (d / "fd").iterdir():
                m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
                if m and m.group(1) in inodes:
                    return int(d.name)
        except OSError:
            continue
    return None


def cgroup_stats(proc: Path, cgroup_root: Path, pid: int) -> dict:
    """Memory use/limit and CPU throttling of the cgroup holding ``pid`` (v2, else v1)."""
    paths = {}
    try:
        for line in (proc / str(pid) / "cgroup").read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3:
                for c in parts[1].split(",") if parts[1] else [""]:
                    paths[c] = parts[2].strip("/")
    except OSError:
        return {}

    def num(p: Path):
        try:
            text = p.read_text().strip()
        except OSError:
            return None
        return None if text in ("max", "") else int(text.split()[0])

    def stat(p: Path) -> dict:
        try:
            pairs = (line.split() for line in p.read_text().splitlines())
            return {f[0]: int(f[1]) for f in pairs if len(f) == 2}
        except (OSError, ValueError):
            return {}

    if "" in paths and (cgroup_root / "cgroup.controllers").exists():
        d = cgroup_root / paths[""]
        s = stat(d / "cpu.stat")
        return {"memory_bytes": num(d / "memory.current"), "memory_limit_bytes": num(d / "memory.max"),
                "throttled_s": s["throttled_usec"] / 1e6 if "throttled_usec" in s else None,
                "nr_throttled": s.get("nr_throttled")}
    out = {}
    if "memory" in paths:
        d = cgroup_root / "memory" / paths["memory"]
        limit = num(d / "memory.limit_in_bytes")
        out.update(memory_bytes=num(d / "memory.usage_in_bytes"),
                   memory_limit_bytes=limit if limit is not None and limit < (1 << 60) else None)  # v1: huge = none
    mount = next((cgroup_root / m for m in ("cpu,cpuacct", "cpu") if (cgroup_root / m).is_dir()), None)
    if "cpu" in paths and mount is not None:
        s = stat(mount / paths["cpu"] / "cpu.stat")
        out.update(throttled_s=s["throttled_time"] / 1e9 if "throttled_time" in s else None,
                   nr_throttled=s.get("nr_throttled"))
    return out


_libc = None


def resident_bytes(path: str | Path) -> int | None:
    """Bytes of ``path`` in the page cache (``mincore`` over a read-only mapping; nothing is read)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_long]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = ctypes.create_string_buffer(pages)
            if _libc.mincore(addr, size, vec) != 0:
                return None
            resident = sum(1 for b in vec.raw if b & 1)
            return min(resident * mmap.PAGESIZE, size)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


class Nvml:
    """Device memory used by given processes, where NVML answers (discrete GPUs; Jetson has no NVML)."""

    def __init__(self):
        self.error = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nv = pynvml
        except Exception as exc:  # noqa: BLE001 - no driver, no library, Jetson: all mean "not available"
            self._nv, self.error = None, f"NVML unavailable ({type(exc).__name__})"

    def used_bytes(self, pids: list[int]) -> int | None:
        if self._nv is None:
            return None
        total, found = 0, False
        try:
            for i in range(self._nv.nvmlDeviceGetCount()):
                handle = self._nv.nvmlDeviceGetHandleByIndex(i)
                for p in self._nv.nvmlDeviceGetComputeRunningProcesses(handle):
                    if p.pid in pids and p.usedGpuMemory:
                        total += p.usedGpuMemory
                        found = True
        except Exception as exc:  # noqa: BLE001
            self.error = f"NVML query failed ({type(exc).__name__})"
            return None
        return total if found else None


# ----------------------------------------------------------------------------- configuration and alerts


@dataclass
class WatchConfig:
    url: str
    out: Path
    limits: WatchLimits = DEFAULT_LIMITS
    metrics: MetricNames | None = None
    interval_s: float = 10.0
    window_s: float = 600.0  # samples kept for an incident bundle
    pid: int | None = None
    unit: str | None = None  # systemd unit: MainPID and journal lines
    container: str | None = None  # a compose/docker container: its log lines
    log_file: Path | None = None
    sidecars: tuple[str, ...] = ()
    sidecar_every: int = 6
    proc: Path = Path("/proc")
    cgroup_root: Path = Path("/sys/fs/cgroup")
    api_key: str | None = None
    max_bytes: int = 64 << 20
    keep: int = 5
    incident_cooldown_s: float = 600.0
    doctor: Callable[[], dict] | None = None  # the adapter's report for the bundle
    host_facts: dict = field(default_factory=dict)


def _root(url: str) -> str:
    return re.sub(r"/v1/?$", "", url.rstrip("/"))


def alerts(sample: dict, limits: WatchLimits, history: list[dict]) -> list[dict]:
    """Threshold crossings of one sample: {level: warn|incident, check, message}."""
    out = []
    mem = sample.get("mem") or {}
    avail = mem.get("available_gib")
    if avail is not None:
        if avail < limits.mem_available_incident_gib:
            out.append({"level": "incident", "check": "mem_available", "message":
                        f"MemAvailable {avail:.2f} GiB < {limits.mem_available_incident_gib:g} GiB ({limits.why})"})
        elif avail < limits.mem_available_warn_gib:
            out.append({"level": "warn", "check": "mem_available", "message":
                        f"MemAvailable {avail:.2f} GiB < {limits.mem_available_warn_gib:g} GiB ({limits.why})"})
    swap = mem.get("swap_used_gib")
    if limits.swap_used_warn_gib is not None and swap is not None and swap > limits.swap_used_warn_gib:
        out.append({"level": "warn", "check": "swap", "message":
                    f"swap used {swap:.2f} GiB > {limits.swap_used_warn_gib:g} GiB"})
    eng = sample.get("engine") or {}
    if eng.get("kv_usage") is not None and eng["kv_usage"] > limits.kv_usage_warn:
        out.append({"level": "warn", "check": "kv_usage", "message":
                    f"KV pool {eng['kv_usage'] * 100:.1f} % used > {limits.kv_usage_warn * 100:g} %"})
    if not sample.get("answering", True):
        failed = 1 + sum(1 for _ in _tail_while(history, lambda s: not s.get("answering", True)))
        level = "incident" if failed >= UNANSWERED else "warn"
        out.append({"level": level, "check": "server", "message": f"server does not answer ({sample.get('error')}); "
                    f"{failed} sample(s) in a row"})
    for key, limit, what in (("accept_length", limits.accept_length_warn, "MTP accept length"),
                             ("accept_rate", limits.accept_rate_warn, "MTP accept rate")):
        if limit is None:
            continue
        streak = [s for s in [sample] + list(_tail_while(history, lambda s, key=key, limit=limit: _low(s, key, limit)))]
        if _low(sample, key, limit) and len(streak) >= SUSTAIN:
            out.append({"level": "warn", "check": key, "message":
                        f"{what} {eng[key]:.2f} < {limit:g} for {len(streak)} samples with requests running "
                        f"(sglang #37326: acceptance decaying to zero until a restart)"})
    return out


def _low(sample: dict, key: str, limit: float) -> bool:
    eng = sample.get("engine") or {}
    v = eng.get(key)
    return bool(eng.get("running")) and v is not None and 0 < v < limit  # 0: no verify step in the interval


def _tail_while(history: list[dict], pred):
    for s in reversed(history):
        if not pred(s):
            return
        yield s


# ----------------------------------------------------------------------------- the watcher


class Watcher:
    def __init__(self, cfg: WatchConfig, *, clock=time.time, log=None):
        import httpx

        self.cfg, self.clock = cfg, clock
        self.log = log or (lambda line: print(line, file=sys.stderr))
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.http = httpx.Client(base_url=_root(cfg.url), timeout=min(max(cfg.interval_s, 1.0), 10.0), headers=headers)
        self.samples: deque = deque()
        self.count = 0
        self.last_incident: dict[str, float] = {}
        self.nvml = None
        self.sidecar_cache: dict[str, int | None] = {}
        cfg.out.mkdir(parents=True, exist_ok=True)
        self.jsonl = logging.getLogger(f"sglang_ssd_stream.watch.{id(self)}")
        self.jsonl.propagate = False
        self.jsonl.setLevel(logging.INFO)
        handler = logging.handlers.RotatingFileHandler(cfg.out / "watch.jsonl", maxBytes=cfg.max_bytes,
                                                       backupCount=cfg.keep)
        handler.setFormatter(logging.Formatter("%(message)s"))
        self.jsonl.addHandler(handler)

    def close(self) -> None:
        self.http.close()
        for h in list(self.jsonl.handlers):
            h.close()
            self.jsonl.removeHandler(h)

    # -- one sample

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

    def sample(self) -> dict:
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
        s.update(self.engine(now))
        self.count += 1
        return s

    def engine(self, now: float) -> dict:
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
        prev = next((s for s in reversed(self.samples) if s.get("engine", {}).get("counters")), None)
        try:
            r = self.http.get("/metrics")
            values = parse(r.text) if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            values = {}
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

    # -- the loop

    def step(self) -> dict:
        s = self.sample()
        history = list(self.samples)
        s["alerts"] = alerts(s, self.cfg.limits, history)
        self.samples.append(s)
        while self.samples and self.samples[0]["t"] < s["t"] - self.cfg.window_s:
            self.samples.popleft()
        self.jsonl.info(json.dumps(s, separators=(",", ":"), default=str))
        for a in s["alerts"]:
            self.log(f"watch: {a['level']}: {a['check']}: {a['message']}")
        incidents = [a for a in s["alerts"] if a["level"] == "incident"]
        for a in incidents:
            last = self.last_incident.get(a["check"])
            if last is None or s["t"] - last >= self.cfg.incident_cooldown_s:
                self.last_incident[a["check"]] = s["t"]
                path = self.bundle(a, s)
                s.setdefault("bundles", []).append(str(path))
                self.log(f"watch: incident bundle {path}")
        return s

    def run(self, *, max_samples: int | None = None, sleep=time.sleep) -> None:
        n = 0
        while max_samples is None or n < max_samples:
            t0 = self.clock()
            self.step()
            n += 1
            if max_samples is not None and n >= max_samples:
                break
            sleep(max(0.0, self.cfg.interval_s - (self.clock() - t0)))

    # -- incidents

    def bundle(self, alert: dict, sample: dict) -> Path:
        from .update import write_text_atomic

        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(sample["t"]))
        d = self.cfg.out / f"incident-{stamp}-{alert['check']}"
        d.mkdir(parents=True, exist_ok=True)
        write_text_atomic(d / "samples.jsonl", "".join(json.dumps(s, default=str) + "\n" for s in self.samples))
        write_text_atomic(d / "incident.json", json.dumps({"alert": alert, "limits": asdict(self.cfg.limits),
                                                           "url": self.cfg.url, "host": self.cfg.host_facts},
                                                          indent=1, default=str) + "\n")
        doctor = {"note": "no doctor: pass --profile (and --model) to include its report"}
        if self.cfg.doctor is not None:
            try:
                doctor = self.cfg.doctor()
            except Exception as exc:  # noqa: BLE001 - the bundle is written whatever the doctor does
                doctor = {"error": f"{type(exc).__name__}: {exc}"}
        write_text_atomic(d / "doctor.json", json.dumps(doctor, indent=1, default=str) + "\n")
        write_text_atomic(d / "server.log", self.server_log())
        write_text_atomic(d / "kernel.log", kernel_lines())
        return d

    def server_log(self, lines: int = 300) -> str:
        if self.cfg.log_file:
            try:
                with open(self.cfg.log_file, "rb") as f:
                    f.seek(0, os.SEEK_END)
                    f.seek(max(0, f.tell() - (1 << 20)))
                    return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:]) + "\n"
            except OSError as exc:
                return f"cannot read {self.cfg.log_file}: {exc}\n"
        if self.cfg.unit:
            return _run(["journalctl", "-u", self.cfg.unit, "-n", str(lines), "--no-pager", "-o", "short-iso"])
        if self.cfg.container:
            return _run(["docker", "logs", "--tail", str(lines), "--timestamps", self.cfg.container])
        return "no --unit, --container or --log-file: the server's log lines are not collected\n"


def _run(argv: list[str]) -> str:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=20)
        return r.stdout + (f"\n[{argv[0]} exited {r.returncode}: {r.stderr.strip()}]\n" if r.returncode else "")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"[{argv[0]} failed: {exc}]\n"


def driver_version(proc: Path = Path("/proc")) -> str | None:
    """The NVIDIA kernel driver's version line (write-up 001's peers disagreed on a crash across 595.84 and
    595.91.07: an incident without it cannot be compared)."""
    try:
        return (proc / "driver" / "nvidia" / "version").read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        return None


KERNEL_PATTERN = re.compile(r"oom|out of memory|xid|nvrm|watchdog|hung task|nvgpu", re.I)


def kernel_lines() -> str:
    """The kernel's OOM / GPU (Xid, NVRM, nvgpu) / watchdog lines (dmesg needs permission on some hosts)."""
    text = _run(["dmesg", "-T"])
    hits = [line for line in text.splitlines() if KERNEL_PATTERN.search(line)]
    return "\n".join(hits[-200:]) + "\n" if hits else "(no OOM, Xid or watchdog lines in dmesg)\n" + text[-2000:]


# ----------------------------------------------------------------------------- command line


def add_watch_command(subparsers, side):
    from .profiles import profiles_for

    w = subparsers.add_parser("watch", allow_abbrev=False,
                              help="sample memory, KV, MTP acceptance; JSONL + incident bundles",
                              description=__doc__.split("\n\n")[0])
    w.add_argument("--url", required=True, help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    w.add_argument("--profile", choices=profiles_for(side.name), help="thresholds (and the doctor's launch) of this "
                   "profile (default: the kernel's OOM margin only)")
    w.add_argument("--model", help="model directory: the sidecar to measure in the page cache, the doctor's inputs")
    w.add_argument("--out", default="watch", help="directory for watch.jsonl and incident-*/ (default: ./watch)")
    w.add_argument("--interval", type=float, default=10.0, help="seconds between samples (default 10)")
    w.add_argument("--window", type=float, default=600.0, help="seconds of samples an incident bundle keeps")
    w.add_argument("--pid", type=int, help="the server's main PID (default: --unit's, else who listens on the port)")
    w.add_argument("--unit", help="the server's systemd unit: its MainPID and journal lines")
    w.add_argument("--container", help="the server's container (compose): its log lines")
    w.add_argument("--log-file", help="the server's log file (instead of the journal)")
    w.add_argument("--api-key-file")
    w.add_argument("--samples", type=int, help="stop after this many samples (default: run until stopped)")
    w.set_defaults(func=cmd_watch, side=side)
    return w


def cmd_watch(args) -> int:
    from ..errors import EXIT_OK, EnvironmentProblem
    from .host import cpu_budget, tegra_release
    from .profiles import get_profile

    profile = get_profile(args.profile, args.side.name) if args.profile else None
    sidecars: tuple[str, ...] = ()
    if args.model and Path(args.model, "ssd-stream.json").is_file():
        from ..sidecar.view import load_sidecar

        try:
            sidecars = tuple(str(t.file) for t in load_sidecar(args.model, check_files=False).tables)
        except Exception as exc:  # noqa: BLE001 - watch still runs; the doctor reports the sidecar
            print(f"watch: sidecar not measured: {exc}", file=sys.stderr)

    doctor = None
    if profile is not None:
        def doctor():
            from ..findings import as_json
            from .preflight import findings_for

            draft = os.path.join(args.model, "mtp") if args.model else None
            found = findings_for(args.side, profile, args.model or "", draft if profile.needs_draft else None,
                                 dict(os.environ), report_errors=True)
            return as_json({}, found)

    api_key = None
    if args.api_key_file:
        try:
            api_key = Path(args.api_key_file).read_text().strip() or None
        except OSError as exc:
            raise EnvironmentProblem(f"cannot read --api-key-file {args.api_key_file}: {exc.strerror}") from None
    release = tegra_release()
    cfg = WatchConfig(url=args.url, out=Path(args.out), limits=(profile.watch if profile and profile.watch
                                                               else DEFAULT_LIMITS),
                      metrics=args.side.metrics, interval_s=args.interval, window_s=args.window, pid=args.pid,
                      unit=args.unit, container=args.container,
                      log_file=Path(args.log_file) if args.log_file else None, sidecars=sidecars,
                      api_key=api_key, doctor=doctor,
                      host_facts={"l4t": release.name() if release else None, "cpu": asdict(cpu_budget()),
                                  "nvidia_driver": driver_version(),
                                  "profile": profile.name if profile else None})
    w = Watcher(cfg)
    print(f"watch: {args.url} every {args.interval:g} s -> {cfg.out}/watch.jsonl (limits: {cfg.limits.why})",
          file=sys.stderr)
    try:
        w.run(max_samples=args.samples)
    except KeyboardInterrupt:
        pass
    finally:
        w.close()
    return EXIT_OK
