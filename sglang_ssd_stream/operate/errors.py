"""Refusals of the operate commands, as :mod:`sglang_ssd_stream.errors` subclasses (exit codes there)."""

from __future__ import annotations

from ..errors import EXIT_NOT_VERIFIED, EXIT_USAGE, BadKitData, EnvironmentProblem, KitError


class ServeRefused(KitError):
    """A launch would be unsafe or inconsistent (open bind without a key, missing draft, bad override)."""


class PlanRefused(KitError):
    """A capacity plan cannot work on the stated hardware; the message gives the arithmetic."""


class ModelConfigError(BadKitData):
    """A model's config.json lacks a field the planner needs, or holds an impossible value."""


class ModelUpdateError(KitError):
    """A downloaded snapshot failed verification; the state file was left unchanged."""


class Offline(EnvironmentProblem):
    """The model hub cannot be reached (or HF_HUB_OFFLINE is set) and nothing local answers."""


class ServerUnreachable(EnvironmentProblem):
    """The OpenAI-compatible server did not answer at all (validation could not start)."""


class ValidationFailed(KitError):
    """At least one validation check failed; the report says which."""

    exit_code = EXIT_NOT_VERIFIED


class ModelNotServed(KitError):
    """--model names no model the server lists on /v1/models (a command-line mistake: the served ones are named)."""

    exit_code = EXIT_USAGE
