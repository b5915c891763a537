"""``validate``: run the validation suites (:mod:`.validate`) against a running server; the context length
defaults to what the server reports in ``/v1/models``."""

from __future__ import annotations

import argparse
import sys

from ..errors import EXIT_OK, EXIT_USAGE
from .cli_common import read_api_key


def add_validate_command(subparsers, side) -> argparse.ArgumentParser:
    val = subparsers.add_parser("validate", help="run the validation suites against a running server",
                                allow_abbrev=False)
    val.add_argument("--url", required=True, help="OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    val.add_argument("--model", required=True, help="served model name")
    val.add_argument("--suite", action="append", help="needle,truncation,soak,matrix,canary (default: all)")
    val.add_argument("--context-length", type=int, help="default: max_model_len from /v1/models")
    val.add_argument("--pool-tokens", type=int, help="shared KV pool for the soak (default: the context)")
    val.add_argument("--lengths", type=int, nargs="+", help="needle prompt lengths (default: 1/8 .. 1 of the context)")
    val.add_argument("--answer-tokens", type=int, default=64)
    val.add_argument("--truncation-max-tokens", type=int, default=8)
    val.add_argument("--cycles", type=int, default=3)
    val.add_argument("--soak-tokens", type=int)
    val.add_argument("--continue-tokens", type=int, default=1024)
    val.add_argument("--compact-tokens", type=int, default=4096)
    val.add_argument("--turns", type=int, default=8)
    val.add_argument("--turn-tokens", type=int, default=512)
    val.add_argument("--canary-tokens", type=int, default=256)
    val.add_argument("--kv-wait", type=float, default=30.0, help="seconds to wait for KV to drain")
    val.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    val.add_argument("--api-key")
    val.add_argument("--api-key-file")
    val.add_argument("--out", default="validate-report")
    val.add_argument("-q", "--quiet", action="store_true")
    val.set_defaults(func=cmd_validate, side=side)
    return val


def cmd_validate(args) -> int:
    from .errors import ValidationFailed
    from .validate.runner import run_validation
    from .validate.suites import SUITES, Settings

    suites = [s for item in (args.suite or [",".join(SUITES)]) for s in item.split(",") if s]
    bad = [s for s in suites if s not in SUITES]
    if bad:
        print(f"validate: unknown suite(s) {', '.join(bad)}; known: {', '.join(SUITES)}", file=sys.stderr)
        return EXIT_USAGE
    context = args.context_length or _served_context(args)
    settings = Settings(context_length=context, pool_tokens=args.pool_tokens, answer_tokens=args.answer_tokens,
                        truncation_max_tokens=args.truncation_max_tokens, cycles=args.cycles, turns=args.turns,
                        soak_tokens=args.soak_tokens, continue_tokens=args.continue_tokens,
                        compact_tokens=args.compact_tokens, turn_tokens=args.turn_tokens,
                        canary_tokens=args.canary_tokens, kv_zero_wait_s=args.kv_wait,
                        lengths=tuple(args.lengths) if args.lengths else None, progress=not args.quiet,
                        overlong=args.side.overlong)
    results = run_validation(args.url, args.model, settings, suites=suites, out_dir=args.out,
                             api_key=read_api_key(args), timeout_s=args.timeout)
    for name, r in results["suites"].items():
        print(f"{name}: {r['status']}")
    print(f"report: {results['files']['markdown']}")
    if results["status"] != "pass":
        raise ValidationFailed(f"validation failed ({results.get('aborted') or 'see the report'}); "
                               f"{results['files']['markdown']}")
    return EXIT_OK


def _served_context(args) -> int:
    """``max_model_len`` from /v1/models (sglang and vLLM report it); refused when absent."""
    import httpx

    from .errors import ServerUnreachable
    from .validate.client import Client

    c = Client(args.url, args.model, api_key=read_api_key(args), timeout_s=10)
    try:
        models = c.models()
    except httpx.HTTPStatusError as exc:  # it answers, but not with the model list
        code = exc.response.status_code
        fix = {401: "pass its key with --api-key-file", 403: "pass its key with --api-key-file",
               404: "check --url: the OpenAI base URL of the server, e.g. http://127.0.0.1:8000/v1"}.get(
                   code, "so the served context is unknown; pass --context-length")
        raise ServerUnreachable(f"{args.url}/models answered HTTP {code}; {fix}") from None
    except Exception as exc:  # noqa: BLE001 - refused, timed out, not HTTP at all: nothing to validate
        raise ServerUnreachable(f"the server at {args.url} is not answering ({type(exc).__name__}: {exc}); start "
                                f"it (`{args.side.tool} serve`) or fix --url, then run validate again") from None
    finally:
        c.close()
    served = [m.get("id") for m in models]
    if args.model not in served:
        from .errors import ModelNotServed

        raise ModelNotServed(f"{args.url} does not serve {args.model!r}; it serves: "
                             f"{', '.join(map(repr, served)) or 'nothing'}. Pass one of those to --model")
    for m in models:
        if m.get("id") == args.model and m.get("max_model_len"):
            return int(m["max_model_len"])
    raise ServerUnreachable(f"{args.url} does not report max_model_len for {args.model!r}; pass --context-length")
