"""``serve``: run the engine with a launch profile (the model from ``--model`` or the data dir's state.json;
preflight, then the engine as a child: :mod:`.supervise`); ``--dry-run`` prints the command and every finding a
real serve would refuse on."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from ..errors import EXIT_OK
from .cli_common import add_mtp_args, launch_profile, read_api_key


def add_serve_command(subparsers, side, names) -> argparse.ArgumentParser:
    s = subparsers.add_parser("serve", allow_abbrev=False,
                              help="run the engine with a launch profile (preflight, then the engine as a child: its "
                                   "death is a non-zero exit)")
    s.add_argument("--profile", required=True, choices=names)
    s.add_argument("--model", help="model directory (default: the snapshot in the data dir's state.json)")
    if side.draft_option:
        s.add_argument("--draft", help="NEXTN draft (MTP) directory (default: <model>/mtp)")
    s.add_argument("--data-dir", help="data dir holding state.json (default: $SGLANG_SSD_STREAM_HOME)")
    _net_args(s)
    add_mtp_args(s)
    s.add_argument("--dry-run", action="store_true",
                   help="print the exact command and every finding a real serve would refuse on, an open bind "
                        "without an API key included (shell comments), and exit 0; only a command line serve "
                        "cannot build at all is refused")
    s.add_argument("extra", nargs=argparse.REMAINDER, help="-- extra engine arguments")
    s.set_defaults(func=cmd_serve, side=side)
    return s


def _net_args(s) -> None:
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int)
    s.add_argument("--api-key")
    s.add_argument("--api-key-file", help="file holding the API key (keeps it out of shell history)")
    s.add_argument("--allow-unauthenticated", action="store_true",
                   help="allow a non-loopback bind without an API key (e.g. behind an authenticating proxy)")
    s.add_argument("--served-name", action="append", help="served model name alias for existing clients")


def _resolve_model(args) -> tuple[str, str | None]:
    from .errors import ServeRefused
    from .update import default_data_dir, read_state

    model = args.model
    if model is None:
        state = read_state(args.data_dir or default_data_dir())
        if state is None:
            raise ServeRefused("no --model and no state.json in the data dir; run `model fetch` (or update-model) "
                               "or pass --model")
        model = state.get("view") or state["snapshot"]  # `model fetch` records the view it built
    model = os.path.abspath(model)
    draft = args.draft if getattr(args, "draft", None) else os.path.join(model, "mtp")
    return model, os.path.abspath(draft)


def cmd_serve(args, exec_fn=None) -> int:
    from ..checks.host import cpu_budget
    from .launch import build_launch
    from .preflight import preflight

    profile = launch_profile(args)
    model, draft = _resolve_model(args)
    api_key = read_api_key(args)
    exposure = _exposure_finding(args.host, api_key, args.allow_unauthenticated) if args.dry_run else None
    launch = build_launch(profile, args.side, model=model, draft=draft if profile.needs_draft else None, host=args.host,
                          port=args.port, api_key=api_key, served_names=tuple(args.served_name or ()),
                          allow_unauthenticated=args.allow_unauthenticated or exposure is not None, extra=args.extra,
                          cpu=cpu_budget())
    for note in launch.notes:
        print(f"serve: {note}", file=sys.stderr)
    if args.dry_run:  # the command and the whole verdict, on any machine; a report, not a refusal
        from .preflight import findings_for, report_lines

        findings = [exposure] if exposure else []
        findings += findings_for(args.side, profile, model, draft if profile.needs_draft else None, launch.env,
                                 launch.argv, report_errors=True)
        print(launch.shell())
        print("\n".join(report_lines(findings)))
        return EXIT_OK
    preflight(args.side, profile, model, draft if profile.needs_draft else None, launch.env, launch.argv)
    with _metrics_env(launch) as env:
        sys.stdout.flush()
        sys.stderr.flush()
        if exec_fn is not None:  # tests: what would run
            exec_fn(launch.argv[0], launch.argv, env)
            return EXIT_OK
        from .supervise import supervise

        return supervise(launch.argv[0], launch.argv, env)


@contextlib.contextmanager
def _metrics_env(launch):
    """The launch's environment, with a new PROMETHEUS_MULTIPROC_DIR for this start where the side needs one
    (removed after the engine ended)."""
    from .metrics_dir import MULTIPROC_ENV, fresh_dir

    if not launch.fresh_metrics_dir:
        yield launch.env
        return
    with fresh_dir(launch.env) as env:
        print(f"serve: {MULTIPROC_ENV}={env[MULTIPROC_ENV]}: new for this start (the engine's processes merge their "
              f"metrics there), removed after the engine ends", file=sys.stderr)
        yield env


def _exposure_finding(host: str, api_key: str | None, allow_unauthenticated: bool):
    """The open bind a real serve refuses, as a dry run's finding (the report prints whatever it finds)."""
    from ..findings import ERROR, Finding
    from .errors import ServeRefused
    from .launch import check_exposure

    try:
        check_exposure(host, api_key, allow_unauthenticated)
    except ServeRefused:
        return Finding(ERROR, "exposure", f"--host {host} is not loopback and the launch has no API key: anyone who "
                       f"can reach it could use the model, so serve refuses it",
                       "pass --api-key-file FILE, bind --host 127.0.0.1, or --allow-unauthenticated if an "
                       "authenticating proxy guards it")
    return None
