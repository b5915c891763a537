"""The ``model`` command group: ``build-view`` / ``check-view`` (:mod:`.model_view`) and ``fetch``
(:mod:`.fetch`, which builds on the view builder)."""

from __future__ import annotations


def add_model_commands(subparsers) -> dict:
    """Add every ``model`` verb to an argparse ``subparsers`` object; returns the parsers by name."""
    from .fetch import add_fetch_command
    from .model_view import add_model_view_commands

    return {**add_model_view_commands(subparsers), "fetch": add_fetch_command(subparsers)}
