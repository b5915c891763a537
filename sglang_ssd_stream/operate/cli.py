"""argparse mounting: ``add_operate_commands(subparsers, side)`` adds serve, plan, service,
update-model (where ``side.update_model``) and validate for the engine ``side`` describes
(:class:`.side.EngineSide`). Handlers return exit codes and raise KitError subclasses.

Each command family's parser and handlers live in their own module: ``serve_cli``, ``plan_cli``,
``service_cli``, ``update_cli``, ``validate_cli`` and ``watch.cli``; what several share in ``cli_common``."""

from __future__ import annotations

import argparse

from .plan_cli import add_plan_command
from .serve_cli import add_serve_command
from .service_cli import add_service_command
from .update_cli import add_update_command
from .validate_cli import add_validate_command


def add_operate_commands(subparsers, side) -> dict[str, argparse.ArgumentParser]:
    """Add the operate commands for the engine ``side`` describes; returns the parsers by name."""
    from .profiles import profiles_for
    from .watch import add_watch_command

    names = profiles_for(side.name)
    # allow_abbrev=False on every parser: the README's flags are the only spellings (a prefix like --out must not
    # stand in for --output)
    parsers = {"serve": add_serve_command(subparsers, side, names), "plan": add_plan_command(subparsers, side, names),
               "service": add_service_command(subparsers, side, names)}
    if side.update_model:
        parsers["update-model"] = add_update_command(subparsers, side)
    parsers["validate"] = add_validate_command(subparsers, side)
    parsers["watch"] = add_watch_command(subparsers, side)
    return parsers
