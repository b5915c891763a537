"""The loop: every ``interval_s`` one sample (:mod:`.sampler`), judged (:mod:`.thresholds`), appended to
``<out>/watch.jsonl`` (rotated), its alerts logged, and per incident check at most one bundle
(:mod:`.incident`) per cool-down."""

from __future__ import annotations

import json
import logging
import logging.handlers
import sys
import time
from collections import deque

from .config import WatchConfig
from .incident import write_bundle
from .sampler import Sampler
from .thresholds import alerts


class Watcher:
    def __init__(self, cfg: WatchConfig, *, clock=time.time, log=None):
        self.cfg, self.clock = cfg, clock
        self.log = log or (lambda line: print(line, file=sys.stderr))
        self.sampler = Sampler(cfg, clock)
        self.samples: deque = deque()
        self.last_incident: dict[str, float] = {}
        cfg.out.mkdir(parents=True, exist_ok=True)
        self.jsonl = logging.getLogger(f"sglang_ssd_stream.watch.{id(self)}")
        self.jsonl.propagate = False
        self.jsonl.setLevel(logging.INFO)
        handler = logging.handlers.RotatingFileHandler(cfg.out / "watch.jsonl", maxBytes=cfg.max_bytes,
                                                       backupCount=cfg.keep)
        handler.setFormatter(logging.Formatter("%(message)s"))
        self.jsonl.addHandler(handler)

    def close(self) -> None:
        self.sampler.close()
        for h in list(self.jsonl.handlers):
            h.close()
            self.jsonl.removeHandler(h)

    def step(self) -> dict:
        s = self.sampler.sample(self.samples)
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
                path = write_bundle(self.cfg, a, s, self.samples)
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
