"""The host's and the server's facts from ``/proc`` and the cgroup tree: MemAvailable and swap
(``/proc/meminfo``), the server's process tree and its RSS (``/proc/<pid>/status``), who listens on a port
(``/proc/net/tcp{,6}``), the cgroup's memory and CPU throttling (v2, else v1)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ...checks.host import meminfo as host_meminfo


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
