"""``vllm-ple-offload``: the vLLM-side command line (the patch core is shared with sglang-ssd-stream)."""

from __future__ import annotations

import sys

from sglang_ssd_stream import __version__
from sglang_ssd_stream.cli import _Parser
from sglang_ssd_stream.errors import KitError


def build_parser():
    from sglang_ssd_stream.operate import add_operate_commands
    from sglang_ssd_stream.patching.cli import add_patch_commands

    parser = _Parser(prog="vllm-ple-offload", description="Patches and PLE offload for Qwen3.8 Flash-Next on vLLM.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_patch_commands(sub, "vllm")
    add_operate_commands(sub, "vllm")  # serve, plan, service, validate
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KitError as exc:
        print(f"vllm-ple-offload: {exc.message}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
