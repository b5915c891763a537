"""What both doctors report: findings, their levels, and the one rule that turns them into an exit code.

A *finding* is one check's verdict with the fix it names. ``sglang-ssd-stream doctor``,
``vllm-ple-offload doctor``, both plugins' start-up guards and ``serve``'s preflight all speak
in findings, so a refusal reads the same wherever it is found.

The exit-code rule (README "Exit codes", written once here): a report with at least one
``error`` finding exits :data:`~sglang_ssd_stream.errors.EXIT_REFUSED` (2); warnings alone exit 0;
a command line the doctor cannot parse exits :data:`~sglang_ssd_stream.errors.EXIT_USAGE` (64).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, is_dataclass

from .errors import EXIT_OK, EXIT_REFUSED

ERROR, WARNING, OK = "error", "warning", "ok"
LEVELS = (ERROR, WARNING, OK)


@dataclass(frozen=True)
class Finding:
    level: str  # ERROR refuses, WARNING is printed, OK is the evidence that the check ran
    check: str  # short name of the check, e.g. "source", "memlock"
    message: str
    fix: str | None = None

    def __post_init__(self):
        if self.level not in LEVELS:
            raise ValueError(f"finding level {self.level!r} is not one of {LEVELS}")

    def line(self) -> str:
        return f"[{self.level}] {self.check}: {self.message}" + (f"\n    fix: {self.fix}" if self.fix else "")


def errors_of(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if f.level == ERROR]


def warnings_of(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if f.level == WARNING]


def exit_code(findings: Iterable[Finding]) -> int:
    """The doctors' exit code: 2 when anything is refused, else 0."""
    return EXIT_REFUSED if errors_of(findings) else EXIT_OK


def refusal_text(findings: Iterable[Finding], headline: str) -> str | None:
    """``headline`` and every error finding with its fix, or None when nothing is refused."""
    bad = errors_of(findings)
    return None if not bad else headline + "\n" + "\n".join(f.line() for f in bad)


def as_json(facts: object, findings: list[Finding], **extra) -> dict:
    """The doctors' ``--json`` document: facts (a dataclass or dict), findings, ``ok`` and ``exit_code``."""
    return {"facts": asdict(facts) if is_dataclass(facts) else facts,
            "findings": [asdict(f) for f in findings],
            "ok": not errors_of(findings), "exit_code": exit_code(findings), **extra}


def print_report(findings: list[Finding], *, tool: str) -> None:
    """One line per finding on stdout, then a summary naming the count of refusals on stderr."""
    import sys

    for f in findings:
        print(f.line())
    bad = errors_of(findings)
    print(f"{tool} doctor: {len(bad)} refusal(s)" if bad else f"{tool} doctor: nothing refused", file=sys.stderr)
