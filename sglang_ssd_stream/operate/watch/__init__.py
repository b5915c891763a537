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
(:class:`~..profiles.WatchLimits`), and writes an incident bundle when MemAvailable falls to the incident
level or the server stops answering: the last ``--window`` seconds of samples, the doctor's report, the
server's recent log lines, the kernel's OOM/Xid lines, host facts.

Modules: ``processes`` (``/proc`` and cgroup facts), ``residency`` (page cache, NVML), ``sampler`` (one
sample), ``thresholds`` (the alerts), ``incident`` (the bundle), ``watcher`` (the loop), ``config``
(:class:`WatchConfig`), ``cli`` (the command).
"""

from .cli import add_watch_command, cmd_watch
from .config import WatchConfig
from .incident import KERNEL_PATTERN, driver_version, kernel_lines
from .processes import cgroup_stats, meminfo, pid_listening, process_tree, rss_bytes
from .residency import Nvml, resident_bytes
from .sampler import GIB
from .thresholds import DEFAULT_LIMITS, SUSTAIN, UNANSWERED, alerts
from .watcher import Watcher

__all__ = ["DEFAULT_LIMITS", "GIB", "KERNEL_PATTERN", "SUSTAIN", "UNANSWERED", "Nvml", "WatchConfig", "Watcher",
           "add_watch_command", "alerts", "cgroup_stats", "cmd_watch", "driver_version", "kernel_lines", "meminfo",
           "pid_listening", "process_tree", "resident_bytes", "rss_bytes"]
