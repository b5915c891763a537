"""``vllm-ple-offload``: the vLLM-side command line (the patch core is shared with sglang-ssd-stream).

``patch status|verify|apply|revert|recover|drift`` come from the shared patch core and ``serve``, ``plan``,
``service``, ``validate`` from the shared operate commands; ``doctor`` runs the plugin's checks on
the configuration the plugin would see (the ``VLLM_PLE_*`` variables, parsed by the plugin's own
parser; ``--backend``/``--sidecar`` set those variables first) plus the sidecar's SHA-256 and, with
``-- <vllm serve flags>``, the graph-mode rule. Exit codes: the kit's findings rule (0 nothing
refused, 2 refused, 64 bad command line); 4 when this runtime has no vLLM.
"""

from __future__ import annotations

import json
import math
import sys

from sglang_ssd_stream import __version__
from sglang_ssd_stream.cli import Parser, run_command
from sglang_ssd_stream.errors import KitError


def _gib(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number of GiB above 0")
    return value


def ple_rank_rows(rows: int, rank: int, size: int, config) -> tuple[int, int]:
    """``sidecar profile``'s TP split (:data:`sglang_ssd_stream.sidecar.profile.ShardRule`): one rank's rows of a
    PLE table, by vLLM's own ``VocabParallelEmbedding`` constructor as ``Qwen4ExpPLEEmbedding`` runs it (padding:
    the config's ``make_ngram_vocab_size_divisible_by``; the group that splits the table: rank and size), built
    on the meta device. vLLM refuses a size that does not divide the table (an AssertionError, which profile
    reports as a refusal)."""
    from types import SimpleNamespace

    from .doctor import require_vllm

    require_vllm()
    import torch
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    group = SimpleNamespace(rank_in_group=rank, world_size=size)  # all the constructor reads of the ETP group
    with torch.device("meta"):
        emb = VocabParallelEmbedding(rows, 1, params_dtype=torch.bfloat16,
                                     padding_size=int(config.make_ngram_vocab_size_divisible_by),
                                     parallel_group=group)
    return emb.shard_indices.org_vocab_start_index, emb.shard_indices.org_vocab_end_index


def build_parser():
    import argparse

    from sglang_ssd_stream.operate import add_operate_commands
    from sglang_ssd_stream.patching.cli import add_patch_commands

    from . import env
    from .side import SIDE as VLLM_SIDE

    parser = Parser(prog="vllm-ple-offload", description="Patches and PLE offload for Qwen3.8 Flash-Next on vLLM.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    add_patch_commands(sub, "vllm")
    add_operate_commands(sub, VLLM_SIDE)  # serve, plan, service, validate
    from sglang_ssd_stream.sidecar.cli import add_profile_command

    sidecar = sub.add_parser("sidecar", help="PLE sidecar tools for vLLM (build and verify: sglang-ssd-stream sidecar)")
    add_profile_command(sidecar.add_subparsers(dest="verb", required=True, parser_class=Parser), "vllm",
                        ple_rank_rows)
    doctor = sub.add_parser(
        "doctor", help="check this machine and vLLM install for a PLE backend; every problem names its fix",
        description=f"The vLLM PLE plugin's checks on the configuration it would see: the {env.PREFIX}* variables "
                    f"(parsed by the plugin's own parser; --backend and --sidecar set them first, with "
                    f"{env.CPU_OFFLOAD}=1 when it is unset), {env.PLUGINS_ENV}, vLLM's source state, UVA, "
                    f"locked-memory limit, ptrace/expandable segments, the sidecar (sizes, SHA-256 reading its "
                    f"verified cache, never writing it; disk), the fetch round, the row cache budget "
                    f"({env.ROW_CACHE_MB}: memlock and MemAvailable, per worker process) and with "
                    f"`-- <vllm serve flags>` the CUDA-graph mode and the number of worker processes. "
                    f"Exit 0: nothing refused (warnings allowed); 2: a check refused; 4: no vLLM in this runtime; "
                    f"64: bad command line.")
    doctor.add_argument("--backend", choices=env.BACKENDS, help=f"set {env.BACKEND} for the check")
    doctor.add_argument("--sidecar", metavar="PATH", help=f"set {env.SIDECAR} for the check")
    doctor.add_argument("--table-gib", type=_gib, metavar="GIB",
                        help="bytes the pinned backend will pin per process (default: checked when vLLM loads)")
    doctor.add_argument("--json", action="store_true", help="print a JSON report on stdout")
    doctor.add_argument("serve_args", nargs=argparse.REMAINDER,
                        help="-- then the vllm serve flags of the launch (for the CUDA-graph mode; default: none, "
                             "i.e. vLLM's default mode)")
    doctor.set_defaults(func=run_doctor)
    return parser


def run_doctor(args) -> int:
    import os

    from sglang_ssd_stream.findings import as_json, exit_code, print_report

    from . import doctor, env

    environ = dict(os.environ)
    assumed = []
    if args.backend:
        environ[env.BACKEND] = args.backend
    if args.sidecar:
        environ[env.SIDECAR] = args.sidecar
    if (args.backend or args.sidecar) and env.CPU_OFFLOAD not in environ:
        environ[env.CPU_OFFLOAD] = "1"
        assumed.append(f"{env.CPU_OFFLOAD}=1")
    serve_args = list(args.serve_args or [])
    if serve_args[:1] == ["--"]:
        serve_args = serve_args[1:]
    need = int(args.table_gib * (1 << 30)) if args.table_gib else None
    d = doctor.diagnose(environ, argv=serve_args, need_bytes=need, verify_sha=True)
    checked = " ".join(f"{k}={environ[k]}" for k in env.present(environ)) or f"no {env.PREFIX}* variable"
    if args.json:
        settings_doc = {"variables": {k: environ[k] for k in env.present(environ)}, "assumed": assumed,
                        "plugin_enabled": d.settings is not None, "error": d.settings_error,
                        "backend": d.settings.backend if d.settings else None,
                        "sidecar": str(d.settings.sidecar) if d.settings and d.settings.sidecar else None}
        facts = doctor.facts_json(d.facts) if d.facts is not None else None
        print(json.dumps(as_json(facts, d.findings, settings=settings_doc), indent=1, default=str))
    else:
        how = f" (set for this check: {', '.join(assumed)})" if assumed else ""
        print(f"vllm-ple-offload doctor: {checked}{how}")
        print_report(d.findings, tool="vllm-ple-offload")
    return exit_code(d.findings)


def _patch_this_runtime(args) -> int:
    """``patch`` on this runtime's vLLM; without one, the install that brings it (as doctor and serve say),
    reported the patch core's way (``--json`` included)."""
    from sglang_ssd_stream.patching.cli import _report
    from sglang_ssd_stream.patching.engines import ENGINES

    from .doctor import require_vllm

    try:
        require_vllm()
    except KitError as exc:
        return _report(args, ENGINES["vllm"], None, exc, None)
    return args.func(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def command() -> int:
        if args.command in ("doctor", "serve"):  # both run vLLM's checks: without vLLM, say so (exit 4)
            from .doctor import require_vllm

            require_vllm()
        if args.command == "patch" and args.verb != "drift" and not (args.python or args.site_packages):
            return _patch_this_runtime(args)
        return args.func(args)

    return run_command("vllm-ple-offload", command)


if __name__ == "__main__":
    sys.exit(main())
