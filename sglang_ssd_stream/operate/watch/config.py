"""What a watch samples, how often, where it writes and what it judges by: :class:`WatchConfig`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..metrics import MetricNames
from ..profiles import WatchLimits
from .thresholds import DEFAULT_LIMITS


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
