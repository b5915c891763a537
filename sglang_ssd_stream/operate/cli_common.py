"""What several operate commands share: the API key they read (``--api-key-file``, else ``--api-key``), the
launch profile with ``--mtp`` applied, and the ``--mtp``/``--expected-context``/``--concurrency`` arguments."""

from __future__ import annotations

import sys
from pathlib import Path


def read_api_key(args) -> str | None:
    if getattr(args, "api_key_file", None):
        from ..errors import EnvironmentProblem

        try:
            return Path(args.api_key_file).read_text().strip() or None
        except OSError as exc:
            raise EnvironmentProblem(f"cannot read --api-key-file {args.api_key_file}: {exc.strerror}") from None
    return getattr(args, "api_key", None)


def launch_profile(args):
    """The profile of ``--profile`` with ``--mtp`` applied; says why on stderr."""
    from .profiles import get_profile, with_mtp

    profile, why = with_mtp(get_profile(args.profile, args.side.name), args.mtp,
                            expected_context=args.expected_context, concurrency=args.concurrency)
    print(f"{args.side.tool}: {why}", file=sys.stderr)
    return profile


def add_mtp_args(p) -> None:
    from .profiles import MTP_MODES

    p.add_argument("--mtp", choices=MTP_MODES, default=None,
                   help="speculative decoding with the MTP layer: on, off (drops the whole speculative setup), or "
                        "auto: the profile's measured rule by --expected-context and --concurrency (refused where "
                        "no rule was measured). Default: auto where a rule exists, else the profile's drafting")
    p.add_argument("--expected-context", type=int, metavar="TOKENS", help="typical prompt length of the workload")
    p.add_argument("--concurrency", type=int, metavar="N",
                   help="typical concurrent streams (default: the profile's running requests)")
