"""``sglang-ssd-stream``: the SGLang-side command line."""

from __future__ import annotations

import argparse
import sys

from . import __version__
from .errors import EXIT_ENVIRONMENT, EXIT_USAGE, KitError


class Parser(argparse.ArgumentParser):
    """argparse with the kit's usage exit code (both CLIs)."""

    def error(self, message):  # argparse's own exit code 2 would collide with "refused"
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from .operate import add_operate_commands
    from .operate.model_cli import add_model_commands
    from .patching.cli import add_patch_commands
    from .sglang.doctor import add_doctor_command
    from .sglang.hooks import ple_rank_rows
    from .sglang.side import SIDE as SGLANG_SIDE
    from .sidecar.cli import add_sidecar_commands

    parser = Parser(prog="sglang-ssd-stream",
                     description="Patches and PLE streaming for Qwen3.8 Flash-Next on SGLang.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    add_patch_commands(sub, "sglang")
    sidecar = sub.add_parser("sidecar", help="build and verify PLE sidecars")
    add_sidecar_commands(sidecar.add_subparsers(dest="verb", required=True, parser_class=Parser),
                         shard_rule=ple_rank_rows)  # the engine's TP split of the PLE tables, for profile
    model = sub.add_parser("model", help="fetch, build and check model views (checkpoint without PLE shards + sidecar)")
    add_model_commands(model.add_subparsers(dest="verb", required=True, parser_class=Parser))  # + fetch
    add_operate_commands(sub, SGLANG_SIDE)  # serve, plan, service, update-model, validate
    add_doctor_command(sub)
    return parser


def run_command(tool: str, command) -> int:
    """``command()``'s exit code; a kit error is its message and exit code, and an OSError no command
    turned into one (a path the OS refuses: read-only, a file where a folder is expected, a name over
    the OS limit) is exit 4 naming the errno and the path, never a traceback. Both CLIs end here."""
    try:
        return command()
    except KitError as exc:
        print(f"{tool}: {exc.message}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        from .patching.files import errno_text

        where = f" {exc.filename}" if exc.filename is not None else ""
        if exc.filename2 is not None:
            where += f" -> {exc.filename2}"
        print(f"{tool}: cannot use{where}: {errno_text(exc)}", file=sys.stderr)
        return EXIT_ENVIRONMENT


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command("sglang-ssd-stream", lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
