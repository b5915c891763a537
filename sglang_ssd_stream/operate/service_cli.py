"""``service``: the file that runs the server as a host service (a systemd unit, or a compose file where
``side.service`` says so), or with ``--watch-unit`` the systemd unit that runs ``watch`` beside it."""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import EXIT_OK
from .cli_common import add_mtp_args, launch_profile

DEFAULT_UNIT = "qwen38-ssd-stream"


def unit_name(args) -> str:
    """The server unit's name, from one place: --name, else the -o file's (``qwen38.service`` -> qwen38; its
    watch unit ``qwen38-watch.service`` -> qwen38), else the default. systemd names a unit after its file, so
    an -o file that disagrees is refused: the watch unit's Wants=/After= and --unit would name a unit that
    was never written."""
    from .errors import ServeRefused

    suffix = "-watch.service" if getattr(args, "watch_unit", False) else ".service"
    name = getattr(args, "name", None)
    out = os.path.basename(getattr(args, "output", None) or "")
    if not out.endswith(".service"):  # stdout, or a file systemd would not load as it is: nothing to agree with
        return name or DEFAULT_UNIT
    stem = out[: -len(suffix)] if out.endswith(suffix) else ""
    want = f"{name or stem or DEFAULT_UNIT}{suffix}"
    if not stem:
        raise ServeRefused(f"-o {out} does not name the server unit: a watch unit's file is <server "
                           f"unit>-watch.service (qwen38-watch.service beside qwen38.service); write -o {want}"
                           if suffix != ".service" else f"-o {out} names no unit; write -o {want}")
    if name and name != stem:
        raise ServeRefused(f"--name {name} but -o {out}: systemd names the unit after its file, so the two "
                           f"disagree; drop --name, or write -o {want}")
    return stem


def cmd_service(args) -> int:
    if getattr(args, "side", None) is not None and args.side.service == "systemd":
        args.name = unit_name(args)
    elif not getattr(args, "name", None):
        args.name = DEFAULT_UNIT
    if args.watch_unit:
        return _watch_unit(args)
    return SERVICES[args.side.service][1](args)


def _watch_unit(args) -> int:
    """The systemd unit that runs `watch` beside the server (a host service for either engine)."""
    import getpass

    from .service import render_watch_unit

    profile = launch_profile(args)
    user = getattr(args, "user", None) or getpass.getuser()
    home, group = _unit_account(user, getattr(args, "home", None), getattr(args, "group", None))
    exe = args.cli or os.path.join(os.path.dirname(sys.executable), args.side.tool)
    host = getattr(args, "host", "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::", None) else host
    port = args.port or profile.port
    out = args.watch_dir or os.path.join(home, ".local", "state", args.side.tool, "watch")
    argv = [exe, "watch", "--url", f"http://{host}:{port}/v1", "--profile", profile.name,
            "--model", os.path.abspath(args.model), "--out", out]
    if args.side.service == "systemd":
        argv += ["--unit", args.name]
    else:
        argv += ["--container", args.name]
    if getattr(args, "api_key_file", None):
        argv += ["--api-key-file", os.path.abspath(args.api_key_file)]
    text = render_watch_unit(name=f"{args.name}-watch", server_unit=args.name if args.side.service == "systemd"
                             else None, description=f"watch of {args.name} (memory, KV, MTP acceptance; incident "
                             f"bundles)", user=user, group=group, home=home, exec_argv=argv)
    _emit(text, args.output)
    return EXIT_OK


def _compose(args) -> int:
    from .service import render_compose

    profile = launch_profile(args)
    text = render_compose(profile, args.side, service=args.name, image=args.image,
                          model_dir=os.path.abspath(args.model), cache_dir=os.path.abspath(args.cache_dir),
                          port=args.port, publish=args.publish, require_api_key=args.require_api_key,
                          allow_unauthenticated=args.allow_unauthenticated, served_names=tuple(args.served_name or ()),
                          gpus=tuple(args.gpus.split(",")) if args.gpus else None,
                          chat_template=os.path.abspath(args.chat_template) if args.chat_template else None)
    _emit(text, args.output)
    return EXIT_OK


def _systemd(args) -> int:
    from .launch import check_exposure
    from .service import render_systemd

    profile = launch_profile(args)
    check_exposure(args.host, args.api_key_file, args.allow_unauthenticated)
    exe = args.cli or os.path.join(os.path.dirname(sys.executable), args.side.tool)
    argv = [exe, "serve", "--profile", profile.name, "--model", os.path.abspath(args.model), "--host", args.host]
    if profile.speculative_flags:  # the decision made now, written down: the unit does not re-decide
        argv += ["--mtp", "on" if profile.drafts else "off"]
    if args.draft:
        argv += ["--draft", os.path.abspath(args.draft)]
    if args.port:
        argv += ["--port", str(args.port)]
    if args.api_key_file:
        argv += ["--api-key-file", os.path.abspath(args.api_key_file)]
    elif args.allow_unauthenticated:
        argv += ["--allow-unauthenticated"]
    for n in args.served_name or ():
        argv += ["--served-name", n]
    home, group = _unit_account(args.user, args.home, args.group)
    env = {"SGLANG_SSD_STREAM_HOME": args.data_dir} if args.data_dir else {}
    text = render_systemd(name=args.name, description=f"Qwen3.8 Flash-Next on {args.side.display} ({profile.name} "
                          f"profile)", user=args.user, group=group, workdir=args.workdir or home, home=home,
                          exec_argv=argv, environment=env)
    _emit(text, args.output)
    return EXIT_OK


def _unit_account(user: str, home: str | None, group: str | None) -> tuple[str, str]:
    """(home, group) of the unit's user. A user this host lacks has no home to look up: refused unless
    --home names it (a unit written for another host), never ``~user`` written literally."""
    import grp
    import pwd

    from .errors import ServeRefused

    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        pw = None
    if pw is None:
        if not home:
            raise ServeRefused(f"user {user!r} does not exist on this host, so its home directory is unknown; create "
                               f"it (sudo useradd -m {user}) or, for a unit meant for another host, pass --home "
                               f"(and --workdir)")
        print(f"service: warning: user {user!r} does not exist on this host; the unit uses --home {home} and "
              f"Group={group or user} as given", file=sys.stderr)
        return home, group or user
    if group is None:
        try:
            group = grp.getgrgid(pw.pw_gid).gr_name
        except KeyError:
            group = user
    return home or pw.pw_dir, group


def _emit(text: str, output: str | None) -> None:
    if output is None:
        sys.stdout.write(text)
        return
    from ..errors import EnvironmentProblem
    from ..patching.files import errno_text
    from .update import write_text_atomic

    try:
        write_text_atomic(output, text)
    except OSError as exc:  # the docs' /etc/systemd/system/… as a non-root user, a read-only or odd path
        raise EnvironmentProblem(f"cannot write {output}: {errno_text(exc)}; nothing was written (run as a user "
                                 f"who may write there, or pick another -o)") from None
    print(f"wrote {output}", file=sys.stderr)


def _systemd_args(v) -> None:
    v.add_argument("--name", help="the server unit's name, which the watch unit names too (default: the -o file's: "
                   "NAME.service, or NAME-watch.service with --watch-unit; else qwen38-ssd-stream)")
    v.add_argument("--user", required=True)
    v.add_argument("--group")
    v.add_argument("--home")
    v.add_argument("--workdir")
    v.add_argument("--draft")
    v.add_argument("--data-dir")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--api-key-file")
    v.add_argument("--cli", help="path of this CLI in the runtime (default: next to this Python)")


def _compose_args(v) -> None:
    from .service import DEFAULT_IMAGE, IMAGE_BUILD

    v.add_argument("--user", help="account of the watch unit (--watch-unit; default: you)")
    v.add_argument("--cli", help="path of this CLI on the host, for --watch-unit (default: next to this Python)")
    v.add_argument("--name", default="vllm_qwen3_8_flash_next")
    v.add_argument("--image", default=DEFAULT_IMAGE,
                   help=f"the engine image: this kit's hash-locked, patched and verified runtime (default "
                        f"{DEFAULT_IMAGE}, built by `{IMAGE_BUILD}`)")
    v.add_argument("--cache-dir", required=True, help="host directory for /root/.cache")
    v.add_argument("--publish", default="127.0.0.1", help="host address the port is published on")
    v.add_argument("--require-api-key", action="store_true", help="take VLLM_API_KEY from the host environment")
    v.add_argument("--gpus", help="GPU ids, comma-separated (default: 0 .. tensor parallel size - 1)")
    v.add_argument("--chat-template")


# side.service -> (its arguments, its handler, its help)
SERVICES = {"systemd": (_systemd_args, _systemd, "write a systemd unit"),
            "compose": (_compose_args, _compose, "write a compose file")}


def add_service_command(subparsers, side, names) -> argparse.ArgumentParser:
    add_args, _, what = SERVICES[side.service]
    v = subparsers.add_parser("service", help=what, allow_abbrev=False)
    v.add_argument("--profile", required=True, choices=names)
    v.add_argument("--model", required=True, help="model directory")
    v.add_argument("--served-name", action="append", help="served model name alias (repeatable on vLLM)")
    v.add_argument("--port", type=int)
    v.add_argument("--allow-unauthenticated", action="store_true")
    v.add_argument("-o", "--output", help="file to write (default: stdout)")
    add_args(v)
    add_mtp_args(v)
    v.add_argument("--watch-unit", action="store_true",
                   help="write the systemd unit that runs `watch` beside the server instead")
    v.add_argument("--watch-dir", help="where the watch unit keeps watch.jsonl and incident bundles "
                   "(default: ~user/.local/state/<tool>/watch)")
    v.set_defaults(func=cmd_service, side=side)
    return v
