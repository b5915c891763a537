"""An incident bundle: the last window of samples, the alert with the limits and host facts, the doctor's
report, the server's recent log lines (its log file, journal or container), the kernel's OOM/Xid/watchdog
lines; and the NVIDIA driver's version the host facts name."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from .config import WatchConfig


def write_bundle(cfg: WatchConfig, alert: dict, sample: dict, samples: Iterable[dict]) -> Path:
    """The directory ``<out>/incident-<time>-<check>`` for ``alert`` in ``sample``, ``samples`` the window kept."""
    from ..update import write_text_atomic

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(sample["t"]))
    d = cfg.out / f"incident-{stamp}-{alert['check']}"
    d.mkdir(parents=True, exist_ok=True)
    write_text_atomic(d / "samples.jsonl", "".join(json.dumps(s, default=str) + "\n" for s in samples))
    write_text_atomic(d / "incident.json", json.dumps({"alert": alert, "limits": asdict(cfg.limits),
                                                       "url": cfg.url, "host": cfg.host_facts},
                                                      indent=1, default=str) + "\n")
    doctor = {"note": "no doctor: pass --profile (and --model) to include its report"}
    if cfg.doctor is not None:
        try:
            doctor = cfg.doctor()
        except Exception as exc:  # noqa: BLE001 - the bundle is written whatever the doctor does
            doctor = {"error": f"{type(exc).__name__}: {exc}"}
    write_text_atomic(d / "doctor.json", json.dumps(doctor, indent=1, default=str) + "\n")
    write_text_atomic(d / "server.log", server_log(cfg))
    write_text_atomic(d / "kernel.log", kernel_lines())
    return d


def server_log(cfg: WatchConfig, lines: int = 300) -> str:
    if cfg.log_file:
        try:
            with open(cfg.log_file, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - (1 << 20)))
                return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:]) + "\n"
        except OSError as exc:
            return f"cannot read {cfg.log_file}: {exc}\n"
    if cfg.unit:
        return _run(["journalctl", "-u", cfg.unit, "-n", str(lines), "--no-pager", "-o", "short-iso"])
    if cfg.container:
        return _run(["docker", "logs", "--tail", str(lines), "--timestamps", cfg.container])
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
