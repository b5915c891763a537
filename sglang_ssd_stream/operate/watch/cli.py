"""``watch``: argparse wiring, and the run a command line describes (the profile's limits and doctor, the
model's sidecar, the host facts of the incident bundles)."""

from __future__ import annotations

import os
import sys
from dataclasses import asdict
from pathlib import Path

from ...errors import EXIT_OK
from .config import WatchConfig
from .incident import driver_version
from .thresholds import DEFAULT_LIMITS
from .watcher import Watcher


def add_watch_command(subparsers, side):
    from ..profiles import profiles_for
    from . import __doc__ as package_doc  # the watch's own description, first paragraph

    w = subparsers.add_parser("watch", allow_abbrev=False,
                              help="sample memory, KV, MTP acceptance; JSONL + incident bundles",
                              description=package_doc.split("\n\n")[0])
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
    from ..profiles import get_profile

    profile = get_profile(args.profile, args.side.name) if args.profile else None
    sidecars = _sidecars(args.model, args.side.name)
    cfg = _watch_config(args, profile, sidecars, _doctor(args, profile))
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


def _sidecars(model: str | None, engine: str) -> tuple[str, ...]:
    """The model's PLE sidecar table files, to measure in the page cache (none without a sidecar); trusted as
    ``engine``'s server trusts them."""
    if not (model and Path(model, "ssd-stream.json").is_file()):
        return ()
    from ...sidecar.view import engine_trusted_roots, load_sidecar

    try:
        manifest = load_sidecar(model, extra_roots=engine_trusted_roots(engine), check_files=False)
        return tuple(str(f) for f in dict.fromkeys(f for t in manifest.tables for f in t.files))
    except Exception as exc:  # noqa: BLE001 - watch still runs; the doctor reports the sidecar
        print(f"watch: sidecar not measured: {exc}", file=sys.stderr)
        return ()


def _doctor(args, profile):
    """The adapter's findings for the profile's launch, for the incident bundles (None without a profile)."""
    if profile is None:
        return None

    def doctor():
        from ...findings import as_json
        from ..preflight import findings_for

        draft = os.path.join(args.model, "mtp") if args.model else None
        found = findings_for(args.side, profile, args.model or "", draft if profile.needs_draft else None,
                             dict(os.environ), report_errors=True)
        return as_json({}, found)

    return doctor


def _watch_config(args, profile, sidecars: tuple[str, ...], doctor) -> WatchConfig:
    from ...checks.host import cpu_budget, tegra_release
    from ..cli_common import read_api_key

    api_key = read_api_key(args)
    release = tegra_release()
    return WatchConfig(url=args.url, out=Path(args.out), limits=(profile.watch if profile and profile.watch
                                                                else DEFAULT_LIMITS),
                       metrics=args.side.metrics, interval_s=args.interval, window_s=args.window, pid=args.pid,
                       unit=args.unit, container=args.container,
                       log_file=Path(args.log_file) if args.log_file else None, sidecars=sidecars,
                       api_key=api_key, doctor=doctor,
                       host_facts={"l4t": release.name() if release else None, "cpu": asdict(cpu_budget()),
                                   "nvidia_driver": driver_version(),
                                   "profile": profile.name if profile else None})
