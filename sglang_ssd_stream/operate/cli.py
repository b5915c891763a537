"""argparse mounting: ``add_operate_commands(subparsers, side)`` adds serve, plan, service,
update-model (where ``side.update_model``) and validate for the engine ``side`` describes
(:class:`.side.EngineSide`). Handlers return exit codes and raise KitError subclasses."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..errors import EXIT_OK, EXIT_USAGE

DEVICE_MEMORY_HOWTO = ("the GPU host, what CUDA reports: `python -c 'import torch; print(torch.cuda.mem_get_info()[1] "
                       "/ 2**30)'` (the Thor write-up's unified memory: 122.86); `nvidia-smi --query-gpu=memory.total "
                       "--format=csv,noheader` gives MiB (/ 1024), slightly more than CUDA reports")
DEVICE_MEMORY_HELP = ("memory the engine sees per device, GiB, for the memory fit and, without a pool size, the pool: "
                      + DEVICE_MEMORY_HOWTO)
DEFAULT_MODEL_REPO = "garnermccloud/Qwen3.8-Flash-Next-NVFP4-SSD-Stream"  # the prepared snapshot of write-up 000
DEFAULT_MODEL_REVISION = "main"  # update-model updates: the branch head, resolved to a commit and pinned


def _api_key(args) -> str | None:
    if getattr(args, "api_key_file", None):
        from ..errors import EnvironmentProblem

        try:
            return Path(args.api_key_file).read_text().strip() or None
        except OSError as exc:
            raise EnvironmentProblem(f"cannot read --api-key-file {args.api_key_file}: {exc.strerror}") from None
    return getattr(args, "api_key", None)


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


def _launch_profile(args):
    """The profile of ``--profile`` with ``--mtp`` applied; says why on stderr."""
    from .profiles import get_profile, with_mtp

    profile, why = with_mtp(get_profile(args.profile, args.side.name), args.mtp,
                            expected_context=args.expected_context, concurrency=args.concurrency)
    print(f"{args.side.tool}: {why}", file=sys.stderr)
    return profile


def cmd_serve(args, exec_fn=None) -> int:
    from .host import cpu_budget
    from .launch import build_launch
    from .preflight import preflight

    profile = _launch_profile(args)
    model, draft = _resolve_model(args)
    api_key = _api_key(args)
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
    sys.stdout.flush()
    sys.stderr.flush()
    (exec_fn or os.execvpe)(launch.argv[0], launch.argv, launch.env)
    return EXIT_OK  # only reached with an injected exec


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


def _profile_defaults(profile) -> dict:
    def get(*flags, default=None):
        for f in flags:
            if profile.has(f):
                return profile.value(f)
        return default

    spec = json.loads(get("--speculative-config", default="{}"))
    return {
        "context_length": int(get("--context-length", "--max-model-len")),
        "pool_tokens": int(get("--max-total-tokens")) if profile.has("--max-total-tokens") else None,
        "running": int(get("--max-running-requests", "--max-num-seqs")),
        "draft_steps": int(get("--speculative-num-steps", default=spec.get("num_speculative_tokens", 0))),
        "mamba_slots": int(get("--max-mamba-cache-size")) if profile.has("--max-mamba-cache-size") else None,
        "target_kv_dtype": get("--kv-cache-dtype", default="bfloat16"),
        "draft_kv_dtype": get("--speculative-draft-kv-cache-dtype", "--kv-cache-dtype", default="bfloat16"),
        "page_size": int(get("--page-size", default=1)),
        "mem_fraction": float(get("--mem-fraction-static", "--gpu-memory-utilization")),
        "tensor_parallel": int(get("--tensor-parallel-size", default=1)),
        "mamba_per_request": _mamba_per_request(profile, get),
    }


def _mamba_per_request(profile, get) -> int | None:
    """sglang's Mamba slots per running request for an SGLang profile; None (the draft rule) for vLLM."""
    if profile.engine != "sglang":
        return None
    from .capacity import mamba_slots_per_request_of

    return mamba_slots_per_request_of(get, profile.has)


def cmd_plan(args) -> int:
    from .capacity import load_geometry, plan, render, row_cache_budget, sessions_of

    profile = _launch_profile(args)
    d = _profile_defaults(profile)
    for key in ("context_length", "pool_tokens", "running", "draft_steps", "mamba_slots", "target_kv_dtype",
                "draft_kv_dtype", "page_size", "mem_fraction", "tensor_parallel"):
        v = getattr(args, key, None)
        if v is not None:
            d[key] = v
    if d["pool_tokens"] is None and args.device_memory_gib is None:
        from .errors import PlanRefused

        pool = dict(args.side.plan_flags).get("--max-total-tokens", "--max-total-tokens")
        raise PlanRefused(f"no pool size: pass {pool}, or --device-memory-gib (GiB per device) and the pool is "
                          f"what fits; find it on {DEVICE_MEMORY_HOWTO}")
    weights, weights_line = args.weights_gib, None
    if args.device_memory_gib is not None and weights is None:
        weights, weights_line = _plan_weights(args, d["draft_steps"])
    mem = {} if args.device_memory_gib is None else {"device_memory_gib": args.device_memory_gib,
                                                     "mem_fraction": d["mem_fraction"], "weights_gib": weights}
    d.pop("mem_fraction")
    from ..findings import ERROR
    from .engine_config import engine_config_finding

    loaded = engine_config_finding(args.model)
    if loaded is not None and loaded.level == ERROR:  # the engine would not start with it: no plan for it
        from .errors import ModelConfigError

        raise ModelConfigError(f"{loaded.message}; fix: {loaded.fix}")
    p = plan(load_geometry(args.model), **d, **mem)
    p.ple_row_cache = row_cache_budget(args.side.row_cache_knob, profile.env, os.environ,
                                       getattr(args, "row_cache_mb", None), args.side.row_cache_when)
    if args.json:
        doc = p.to_json()
        doc["sessions"] = {str(n): sessions_of(p, n) for n in args.sessions or ()}
        print(json.dumps(doc, indent=2))
        return EXIT_OK
    if weights_line:
        print(weights_line)
    print(render(p))
    if not mem:  # render() speaks of "the device fit below": say why there is none, and how to get it
        print("memory: no device fit without --device-memory-gib (GiB per device; `plan --help` says where to read "
              "it, 122.86 on Thor)")
    for n in args.sessions or ():
        print(f"sessions of {n:,} tokens at once: {sessions_of(p, n)}")
    return EXIT_OK


def _plan_weights(args, draft_steps: int) -> tuple[float, str]:
    """Resident weights (GiB) read from the indexes: the model's, plus the MTP draft's when the plan drafts
    and the engine loads the draft from its own directory (SGLang's NEXTN; vLLM's MTP layers live in the
    checkpoint's own index). Write-up 000 counts 8.08 GB of MTP weights beside 77.97 GB of the model."""
    from .capacity import GIB, weights_bytes
    from .errors import PlanRefused

    model = weights_bytes(args.model)
    if not draft_steps or not args.side.draft_option:
        why = "no speculative decoding" if not draft_steps else "MTP layers are in the model's own index"
        return model / GIB, f"weights: model {model / GIB:.2f} GiB ({why})"
    draft = args.draft or os.path.join(args.model, "mtp")
    if not os.path.isdir(draft):
        raise PlanRefused(f"the plan drafts {draft_steps} tokens with the MTP model, whose weights take memory too, "
                          f"but {draft} does not exist; pass --draft DIR (the prepared snapshot's mtp/), or "
                          f"--weights-gib for the total")
    extra = weights_bytes(draft)
    return (model + extra) / GIB, (f"weights: model {model / GIB:.2f} GiB + MTP draft {extra / GIB:.2f} GiB "
                                   f"({draft}) = {(model + extra) / GIB:.2f} GiB")


def _emit(text: str, output: str | None) -> None:
    if output is None:
        sys.stdout.write(text)
        return
    from .update import write_text_atomic

    write_text_atomic(output, text)
    print(f"wrote {output}", file=sys.stderr)


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

    profile = _launch_profile(args)
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

    profile = _launch_profile(args)
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

    profile = _launch_profile(args)
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


def cmd_update_model(args) -> int:
    from .update import default_data_dir, update_model

    r = update_model(args.data_dir or default_data_dir(), args.repo, args.revision, progress=not args.quiet)
    if r.changed:
        print(f"Model updated: {r.old_revision or '(none)'} -> {r.new_revision}")
        print(f"snapshot: {r.snapshot} (older snapshots are kept; state.json's history lists them)")
    else:
        print(f"Model is current: {r.repo}@{r.new_revision}")
    return EXIT_OK


def cmd_validate(args) -> int:
    from .errors import ValidationFailed
    from .validate.runner import run_validation
    from .validate.suites import SUITES, Settings

    suites = [s for item in (args.suite or [",".join(SUITES)]) for s in item.split(",") if s]
    bad = [s for s in suites if s not in SUITES]
    if bad:
        print(f"validate: unknown suite(s) {', '.join(bad)}; known: {', '.join(SUITES)}", file=sys.stderr)
        return EXIT_USAGE
    context = args.context_length or _served_context(args)
    settings = Settings(context_length=context, pool_tokens=args.pool_tokens, answer_tokens=args.answer_tokens,
                        truncation_max_tokens=args.truncation_max_tokens, cycles=args.cycles, turns=args.turns,
                        soak_tokens=args.soak_tokens, continue_tokens=args.continue_tokens,
                        compact_tokens=args.compact_tokens, turn_tokens=args.turn_tokens,
                        canary_tokens=args.canary_tokens, kv_zero_wait_s=args.kv_wait,
                        lengths=tuple(args.lengths) if args.lengths else None, progress=not args.quiet)
    results = run_validation(args.url, args.model, settings, suites=suites, out_dir=args.out, api_key=_api_key(args),
                             timeout_s=args.timeout)
    for name, r in results["suites"].items():
        print(f"{name}: {r['status']}")
    print(f"report: {results['files']['markdown']}")
    if results["status"] != "pass":
        raise ValidationFailed(f"validation failed ({results.get('aborted') or 'see the report'}); "
                               f"{results['files']['markdown']}")
    return EXIT_OK


def _served_context(args) -> int:
    """``max_model_len`` from /v1/models (sglang and vLLM report it); refused when absent."""
    import httpx

    from .errors import ServerUnreachable
    from .validate.client import Client

    c = Client(args.url, args.model, api_key=_api_key(args), timeout_s=10)
    try:
        models = c.models()
    except httpx.HTTPStatusError as exc:  # it answers, but not with the model list
        code = exc.response.status_code
        fix = {401: "pass its key with --api-key-file", 403: "pass its key with --api-key-file",
               404: "check --url: the OpenAI base URL of the server, e.g. http://127.0.0.1:8000/v1"}.get(
                   code, "so the served context is unknown; pass --context-length")
        raise ServerUnreachable(f"{args.url}/models answered HTTP {code}; {fix}") from None
    except Exception as exc:  # noqa: BLE001 - refused, timed out, not HTTP at all: nothing to validate
        raise ServerUnreachable(f"the server at {args.url} is not answering ({type(exc).__name__}: {exc}); start "
                                f"it (`{args.side.tool} serve`) or fix --url, then run validate again") from None
    finally:
        c.close()
    served = [m.get("id") for m in models]
    if args.model not in served:
        from .errors import ModelNotServed

        raise ModelNotServed(f"{args.url} does not serve {args.model!r}; it serves: "
                             f"{', '.join(map(repr, served)) or 'nothing'}. Pass one of those to --model")
    for m in models:
        if m.get("id") == args.model and m.get("max_model_len"):
            return int(m["max_model_len"])
    raise ServerUnreachable(f"{args.url} does not report max_model_len for {args.model!r}; pass --context-length")


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


def add_operate_commands(subparsers, side) -> dict[str, argparse.ArgumentParser]:
    """Add the operate commands for the engine ``side`` describes; returns the parsers by name."""
    from .profiles import profiles_for

    names = profiles_for(side.name)
    parsers = {}

    # allow_abbrev=False: the README's flags are the only spellings (a prefix like --out must not stand in for --output)
    s = subparsers.add_parser("serve", help="run the engine with a launch profile (preflight, then exec)",
                              allow_abbrev=False)
    s.add_argument("--profile", required=True, choices=names)
    s.add_argument("--model", help="model directory (default: the snapshot in the data dir's state.json)")
    if side.draft_option:
        s.add_argument("--draft", help="NEXTN draft (MTP) directory (default: <model>/mtp)")
    s.add_argument("--data-dir", help="data dir holding state.json (default: $SGLANG_SSD_STREAM_HOME)")
    _net_args(s)
    _mtp_args(s)
    s.add_argument("--dry-run", action="store_true",
                   help="print the exact command and every finding a real serve would refuse on, an open bind "
                        "without an API key included (shell comments), and exit 0; only a command line serve "
                        "cannot build at all is refused")
    s.add_argument("extra", nargs=argparse.REMAINDER, help="-- extra engine arguments")
    s.set_defaults(func=cmd_serve, side=side)
    parsers["serve"] = s

    p = subparsers.add_parser("plan", help="capacity plan: KV per token, pool, Mamba slots, memory fit",
                              allow_abbrev=False)
    p.add_argument("--profile", required=True, choices=names, help="take flag values from this profile")
    p.add_argument("--model", required=True, help="model directory or its config.json")
    p.add_argument("--draft", help="MTP draft directory; its weights count in the memory fit when the profile drafts "
                   "(default: <model>/mtp)")
    flag = dict(side.plan_flags).get  # the engine's own flag names
    p.add_argument(flag("--context-length", "--context-length"), type=int, dest="context_length")
    p.add_argument(flag("--max-total-tokens", "--max-total-tokens"), type=int, dest="pool_tokens",
                   help="KV pool in tokens (default: the profile's, else what fits the memory)")
    p.add_argument(flag("--max-running-requests", "--max-running-requests"), type=int, dest="running")
    p.add_argument(flag("--speculative-num-steps", "--speculative-num-steps"), type=int, dest="draft_steps")
    p.add_argument(flag("--max-mamba-cache-size", "--max-mamba-cache-size"), type=int, dest="mamba_slots")
    p.add_argument("--kv-cache-dtype", dest="target_kv_dtype")
    p.add_argument("--draft-kv-cache-dtype", dest="draft_kv_dtype")
    p.add_argument(flag("--page-size", "--page-size"), type=int, dest="page_size")
    p.add_argument("--tensor-parallel-size", type=int, dest="tensor_parallel")
    p.add_argument(flag("--mem-fraction", "--mem-fraction"), type=float, dest="mem_fraction",
                   help="static memory fraction (default: the profile's)")
    p.add_argument("--device-memory-gib", type=float, help=DEVICE_MEMORY_HELP)
    for sglang_flag, own in side.plan_flags:  # SGLang's names stay accepted, unlisted (scripts written before)
        dest = {a.option_strings[0]: a.dest for a in p._actions if a.option_strings}[own]
        p.add_argument(sglang_flag, type=float if dest == "mem_fraction" else int, dest=dest, help=argparse.SUPPRESS)
    p.add_argument("--weights-gib", type=float, help="resident weights per device (default: from the index)")
    if side.row_cache_knob:
        p.add_argument("--row-cache-mb", type=int, dest="row_cache_mb",
                       help=f"PLE row cache budget, MiB for all PLE layers (default: the profile's "
                            f"{side.row_cache_knob[0]}, else the environment's, else {side.row_cache_knob[1]})")
    p.add_argument("--sessions", type=int, action="append", metavar="TOKENS",
                   help="how many sessions of this many tokens fit at once (repeatable)")
    p.add_argument("--json", action="store_true")
    _mtp_args(p)
    p.set_defaults(func=cmd_plan, side=side)
    parsers["plan"] = p

    add_args, _, what = SERVICES[side.service]
    v = subparsers.add_parser("service", help=what, allow_abbrev=False)
    v.add_argument("--profile", required=True, choices=names)
    v.add_argument("--model", required=True, help="model directory")
    v.add_argument("--served-name", action="append", help="served model name alias (repeatable on vLLM)")
    v.add_argument("--port", type=int)
    v.add_argument("--allow-unauthenticated", action="store_true")
    v.add_argument("-o", "--output", help="file to write (default: stdout)")
    add_args(v)
    _mtp_args(v)
    v.add_argument("--watch-unit", action="store_true",
                   help="write the systemd unit that runs `watch` beside the server instead")
    v.add_argument("--watch-dir", help="where the watch unit keeps watch.jsonl and incident bundles "
                   "(default: ~user/.local/state/<tool>/watch)")
    v.set_defaults(func=cmd_service, side=side)
    parsers["service"] = v

    if side.update_model:
        u = subparsers.add_parser(
            "update-model", help="download, verify and switch to a prepared snapshot", allow_abbrev=False,
            description="Download the prepared snapshot (--repo at --revision, resolved to a commit) into the Hugging "
                        "Face cache under the data dir, verify its index and the PLE sidecar's SHA-256, then point "
                        "state.json at it (serve's default model). Older snapshots are kept; a failed download or "
                        "verification leaves state.json as it was. (`model fetch` also downloads the dense shards "
                        "and builds the model view.)")
        u.add_argument("--repo", default=DEFAULT_MODEL_REPO)
        u.add_argument("--revision", default=DEFAULT_MODEL_REVISION,
                       help="commit, tag or branch; the commit it resolves to is what state.json pins "
                            f"(default: {DEFAULT_MODEL_REVISION}, i.e. update to the newest, as write-up 000 step 2)")
        u.add_argument("--data-dir")
        u.add_argument("-q", "--quiet", action="store_true")
        u.set_defaults(func=cmd_update_model, side=side)
        parsers["update-model"] = u

    val = subparsers.add_parser("validate", help="run the validation suites against a running server",
                                allow_abbrev=False)
    val.add_argument("--url", required=True, help="OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    val.add_argument("--model", required=True, help="served model name")
    val.add_argument("--suite", action="append", help="needle,truncation,soak,matrix,canary (default: all)")
    val.add_argument("--context-length", type=int, help="default: max_model_len from /v1/models")
    val.add_argument("--pool-tokens", type=int, help="shared KV pool for the soak (default: the context)")
    val.add_argument("--lengths", type=int, nargs="+", help="needle prompt lengths (default: 1/8 .. 1 of the context)")
    val.add_argument("--answer-tokens", type=int, default=64)
    val.add_argument("--truncation-max-tokens", type=int, default=8)
    val.add_argument("--cycles", type=int, default=3)
    val.add_argument("--soak-tokens", type=int)
    val.add_argument("--continue-tokens", type=int, default=1024)
    val.add_argument("--compact-tokens", type=int, default=4096)
    val.add_argument("--turns", type=int, default=8)
    val.add_argument("--turn-tokens", type=int, default=512)
    val.add_argument("--canary-tokens", type=int, default=256)
    val.add_argument("--kv-wait", type=float, default=30.0, help="seconds to wait for KV to drain")
    val.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    val.add_argument("--api-key")
    val.add_argument("--api-key-file")
    val.add_argument("--out", default="validate-report")
    val.add_argument("-q", "--quiet", action="store_true")
    val.set_defaults(func=cmd_validate, side=side)
    parsers["validate"] = val

    from .watch import add_watch_command

    parsers["watch"] = add_watch_command(subparsers, side)
    return parsers


def _mtp_args(p) -> None:
    from .profiles import MTP_MODES

    p.add_argument("--mtp", choices=MTP_MODES, default=None,
                   help="speculative decoding with the MTP layer: on, off (drops the whole speculative setup), or "
                        "auto: the profile's measured rule by --expected-context and --concurrency (refused where "
                        "no rule was measured). Default: auto where a rule exists, else the profile's drafting")
    p.add_argument("--expected-context", type=int, metavar="TOKENS", help="typical prompt length of the workload")
    p.add_argument("--concurrency", type=int, metavar="N",
                   help="typical concurrent streams (default: the profile's running requests)")


def _net_args(s) -> None:
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int)
    s.add_argument("--api-key")
    s.add_argument("--api-key-file", help="file holding the API key (keeps it out of shell history)")
    s.add_argument("--allow-unauthenticated", action="store_true",
                   help="allow a non-loopback bind without an API key (e.g. behind an authenticating proxy)")
    s.add_argument("--served-name", action="append", help="served model name alias for existing clients")
