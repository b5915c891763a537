"""Output canaries: token-id 0 runs, NaN/Inf log-probabilities, degenerate repetition.

Why these three (write-up 000 §10): SGLang #36537 loops on token id 0, which is "!" in the
Qwen vocabulary; NaN logits surface as id 0 or as NaN log-probabilities; a long run of one
token is the cheapest sign of a broken state. Token ids are used when the server returns them
(``return_token_ids``), otherwise the streamed/log-prob tokens, otherwise characters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ZERO_TOKEN_TEXT = "!"  # Qwen tokenizers: id 0 decodes to "!"
MAX_ZERO_RUN = 8
MAX_IDENTICAL_RUN = 32
EMPTY_AFTER = 16  # this many generated tokens with nothing but whitespace is a broken state too


def longest_run(items) -> tuple[int, object]:
    best, best_item, run, prev = 0, None, 0, object()
    for it in items:
        run = run + 1 if it == prev else 1
        prev = it
        if run > best:
            best, best_item = run, it
    return best, best_item


@dataclass
class CanaryResult:
    unit: str  # "token_id" | "token" | "char"
    count: int
    longest_run: int
    zero_run: int
    nan_logprobs: int
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check(*, text: str, token_ids: list[int] | None = None, tokens: list[str] | None = None,
          logprobs: list[float] | None = None, max_identical_run: int = MAX_IDENTICAL_RUN,
          max_zero_run: int = MAX_ZERO_RUN, completion_tokens: int | None = None) -> CanaryResult:
    if token_ids is not None:
        unit, seq = "token_id", list(token_ids)
        zero = longest_run([t == 0 for t in seq] or [False])
        zero_run = zero[0] if zero[1] else 0
    elif tokens is not None:
        unit, seq = "token", list(tokens)
        zr = longest_run([t == ZERO_TOKEN_TEXT for t in seq] or [False])
        zero_run = zr[0] if zr[1] else 0
    else:
        unit, seq = "char", list(text)
        zr = longest_run([c == ZERO_TOKEN_TEXT for c in seq] or [False])
        zero_run = zr[0] if zr[1] else 0
    run, item = longest_run(seq)
    bad = sum(1 for lp in logprobs or () if lp is None or math.isnan(lp) or (math.isinf(lp) and lp > 0))
    problems = []
    if zero_run >= max_zero_run:
        problems.append(f"token-id-0 run of {zero_run} ({unit})")
    if bad:
        problems.append(f"{bad} NaN/+Inf log-probabilities")
    if run >= max_identical_run:
        problems.append(f"degenerate repetition: {item!r} x {run} ({unit})")
    if completion_tokens and completion_tokens >= EMPTY_AFTER and not text.strip() and not token_ids:
        problems.append(f"{completion_tokens} tokens produced no visible text")
    return CanaryResult(unit=unit, count=len(seq), longest_run=run, zero_run=zero_run, nan_logprobs=bad,
                        problems=problems)
