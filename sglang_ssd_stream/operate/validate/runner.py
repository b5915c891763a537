"""Run the selected suites and write the report; the exit code says pass (0), fail (1) or no server (4)."""

from __future__ import annotations

import time

from ..errors import ServerUnreachable
from . import report
from .client import Client
from .suites import RUNNERS, SUITES, Run, Settings, calibrate


def run_validation(url: str, model: str, settings: Settings, *, suites=SUITES, out_dir: str = "validate-report",
                   api_key: str | None = None, timeout_s: float = 600.0, on_event=None) -> dict:
    unknown = [s for s in suites if s not in RUNNERS]
    if unknown:
        raise ValueError(f"unknown suite(s) {unknown}; known: {', '.join(SUITES)}")
    client = Client(url, model, api_key=api_key, timeout_s=timeout_s)
    run = Run(client=client, settings=settings, on_event=on_event)
    results = {"url": url, "model": model, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "settings": settings.__dict__, "suites": {}}
    try:
        try:
            results["calibration"] = calibrate(run)
        except Exception as exc:  # noqa: BLE001 - no answer at all: nothing can be validated
            raise ServerUnreachable(f"{url} did not answer a 1-token request for model {model!r}: {exc}; check that "
                                    f"the server is up at that --url and serves --model {model!r} ({url}/models "
                                    f"lists what it serves), then run validate again") from None
        for name in suites:
            t0 = time.monotonic()
            try:
                results["suites"][name] = RUNNERS[name](run)
            except Exception as exc:  # noqa: BLE001 - one broken suite must not lose the others' results
                results["suites"][name] = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "checks": []}
            results["suites"][name]["seconds"] = time.monotonic() - t0
            run.event("suite", suite=name, result=results["suites"][name])
    finally:
        client.close()
    results["aborted"] = run.dead
    results["kv_samples"] = run.kv_samples
    states = {r["status"] for r in results["suites"].values()}
    results["status"] = "pass" if states <= {"pass", "unknown"} and not run.dead else "fail"
    results["files"] = report.write(results, out_dir)
    return results
