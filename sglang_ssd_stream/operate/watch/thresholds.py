"""The judgement of one sample: its threshold crossings against the profile's limits
(:class:`~..profiles.WatchLimits`), each a warning or an incident (MemAvailable at the incident level, the server
not answering twice in a row); MTP acceptance warns only when low for several samples with requests running."""

from __future__ import annotations

from ..profiles import WatchLimits

DEFAULT_LIMITS = WatchLimits(mem_available_warn_gib=4.0, mem_available_incident_gib=2.0, kv_usage_warn=0.95,
                             why="no profile given: the kernel's OOM margin")
SUSTAIN = 3  # accept-length/rate warnings need this many consecutive samples with traffic
UNANSWERED = 2  # consecutive failed health checks that make an incident


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
