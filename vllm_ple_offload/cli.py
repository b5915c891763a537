"""``vllm-ple-offload``: the vLLM-side command line (the patch core is shared with sglang-ssd-stream).

``patch status|verify|apply|revert|drift`` come from the shared patch core and ``serve``, ``plan``,
``service``, ``validate`` from the shared operate commands; ``doctor`` runs the
plugin's preflight and source-state guard for a configuration (the ``VLLM_PLE_*`` variables,
overridden by the options) and exits 0 when nothing is an error, 4 otherwise.
"""

from __future__ import annotations

import json
import sys

from sglang_ssd_stream import __version__
from sglang_ssd_stream.cli import Parser
from sglang_ssd_stream.errors import KitError


def build_parser():
    from sglang_ssd_stream.operate import add_operate_commands
    from sglang_ssd_stream.patching.cli import add_patch_commands

    from . import env
    from .side import SIDE as VLLM_SIDE

    parser = Parser(prog="vllm-ple-offload", description="Patches and PLE offload for Qwen3.8 Flash-Next on vLLM.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    add_patch_commands(sub, "vllm")
    add_operate_commands(sub, VLLM_SIDE)  # serve, plan, service, validate
    doctor = sub.add_parser(
        "doctor", help="check this machine and vLLM install for a PLE backend; every problem names its fix",
        description=f"Preflight of the vLLM PLE plugin: UVA, locked-memory limit, ptrace/expandable segments, "
                    f"sidecar disk, vLLM source state. Reads the {env.PREFIX}* variables; options override them. "
                    f"Exit 0: nothing refused (warnings allowed); 2: a check refused; 64: bad command line.")
    doctor.add_argument("--backend", choices=env.BACKENDS, help=f"backend to check (default: {env.BACKEND} or "
                        f"{env.DEFAULT_BACKEND})")
    doctor.add_argument("--sidecar", metavar="PATH", help=f"ssd-stream.json or its directory (default: {env.SIDECAR})")
    doctor.add_argument("--table-gib", type=float, metavar="GIB",
                        help="bytes the pinned backend will pin per process (default: checked when vLLM loads)")
    doctor.add_argument("--json", action="store_true", help="print a JSON report on stdout")
    doctor.set_defaults(func=run_doctor)
    return parser


def run_doctor(args) -> int:
    import os

    from sglang_ssd_stream.findings import as_json, exit_code
    from sglang_ssd_stream.patching.guard import verdict

    from . import doctor, env

    environ = dict(os.environ)
    assumed = environ.get(env.CPU_OFFLOAD) != "1"
    if assumed:  # plugin off: check what turning it on would need
        environ = {k: v for k, v in environ.items() if not k.startswith(env.PREFIX)}
        environ[env.CPU_OFFLOAD] = "1"
    if args.backend:
        environ[env.BACKEND] = args.backend
        if args.backend == env.PINNED:
            for k in (env.SIDECAR, env.FETCH_WORKERS, env.ROWS_PER_TASK, env.STATS_INTERVAL):
                environ.pop(k, None)
    if args.sidecar:
        environ[env.SIDECAR] = args.sidecar
    settings = env.read_settings(environ)
    need = int(args.table_gib * (1 << 30)) if args.table_gib else None
    facts = doctor.gather_facts(settings)
    findings = verdict("vllm").findings(allow_unpatched=settings.allow_unpatched)
    findings += doctor.run_checks(settings, facts, need_bytes=need)
    if args.json:
        settings_doc = {"backend": settings.backend, "sidecar": str(settings.sidecar) if settings.sidecar else None,
                        "plugin_enabled": not assumed}
        print(json.dumps(as_json(doctor.facts_json(facts), findings, settings=settings_doc), indent=1, default=str))
    else:
        from sglang_ssd_stream.findings import print_report

        state = "assumed (the plugin is off)" if assumed else "from the environment"
        print(f"vllm-ple-offload doctor: {settings.describe()} ({state})")
        print_report(findings, tool="vllm-ple-offload")
    return exit_code(findings)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KitError as exc:
        print(f"vllm-ple-offload: {exc.message}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
