"""Run one function on several threads at once, for the tests that race two or more callers."""

from __future__ import annotations

import threading


def race(fn, n: int) -> list[BaseException]:
    """Call ``fn()`` on ``n`` threads started together; returns what each raised (empty: none did)."""
    errors: list[BaseException] = []

    def run():
        try:
            fn()
        except Exception as exc:  # reported to the caller
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors
