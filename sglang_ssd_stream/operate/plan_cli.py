"""``plan``: the capacity plan of a launch profile for a model (KV per token, pool, Mamba slots, memory fit),
spoken in the engine's own flag names (``side.plan_flags``; SGLang's stay accepted, unlisted)."""

from __future__ import annotations

import argparse
import json
import os

from ..errors import EXIT_OK
from .cli_common import add_mtp_args, launch_profile

DEVICE_MEMORY_HOWTO = ("the GPU host, what CUDA reports: `python -c 'import torch; print(torch.cuda.mem_get_info()[1] "
                       "/ 2**30)'` (the Thor write-up's unified memory: 122.86); `nvidia-smi --query-gpu=memory.total "
                       "--format=csv,noheader` gives MiB (/ 1024), slightly more than CUDA reports")
DEVICE_MEMORY_HELP = ("memory the engine sees per device, GiB, for the memory fit and, without a pool size, the pool: "
                      + DEVICE_MEMORY_HOWTO)


def add_plan_command(subparsers, side, names) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="capacity plan: KV per token, pool, Mamba slots, memory fit",
                              allow_abbrev=False)
    p.add_argument("--profile", required=True, choices=names, help="take flag values from this profile")
    p.add_argument("--model", required=True, help="model directory or its config.json")
    p.add_argument("--draft", help="MTP draft directory; its weights count in the memory fit when the profile drafts "
                   "(default: <model>/mtp)")
    flag = dict(side.plan_flags).get  # the engine's own flag names
    p.add_argument(flag("--context-length", "--context-length"), type=int, dest="context_length")
    p.add_argument(flag("--max-total-tokens", "--max-total-tokens"), type=int, dest="pool_tokens",
                   help="KV pool in tokens (default: the profile's, else what fits the memory)")
    p.add_argument(flag("--max-running-requests", "--max-running-requests"), type=int, dest="running")
    p.add_argument(flag("--speculative-num-steps", "--speculative-num-steps"), type=int, dest="draft_steps")
    p.add_argument(flag("--max-mamba-cache-size", "--max-mamba-cache-size"), type=int, dest="mamba_slots")
    p.add_argument("--kv-cache-dtype", dest="target_kv_dtype")
    p.add_argument("--draft-kv-cache-dtype", dest="draft_kv_dtype")
    p.add_argument(flag("--page-size", "--page-size"), type=int, dest="page_size")
    p.add_argument("--tensor-parallel-size", type=int, dest="tensor_parallel")
    p.add_argument(flag("--mem-fraction", "--mem-fraction"), type=float, dest="mem_fraction",
                   help="static memory fraction (default: the profile's)")
    p.add_argument("--device-memory-gib", type=float, help=DEVICE_MEMORY_HELP)
    for sglang_flag, own in side.plan_flags:  # SGLang's names stay accepted, unlisted (scripts written before)
        dest = {a.option_strings[0]: a.dest for a in p._actions if a.option_strings}[own]
        p.add_argument(sglang_flag, type=float if dest == "mem_fraction" else int, dest=dest, help=argparse.SUPPRESS)
    p.add_argument("--weights-gib", type=float, help="resident weights per device (default: from the index)")
    if side.row_cache_knob:
        p.add_argument("--row-cache-mb", type=int, dest="row_cache_mb",
                       help=f"PLE row cache budget, MiB for all PLE layers (default: the profile's "
                            f"{side.row_cache_knob[0]}, else the environment's, else {side.row_cache_knob[1]})")
    p.add_argument("--sessions", type=int, action="append", metavar="TOKENS",
                   help="how many sessions of this many tokens fit at once (repeatable)")
    p.add_argument("--json", action="store_true")
    add_mtp_args(p)
    p.set_defaults(func=cmd_plan, side=side)
    return p


def _profile_defaults(profile) -> dict:
    def get(*flags, default=None):
        for f in flags:
            if profile.has(f):
                return profile.value(f)
        return default

    spec = json.loads(get("--speculative-config", default="{}"))
    return {
        "context_length": int(get("--context-length", "--max-model-len")),
        "pool_tokens": int(get("--max-total-tokens")) if profile.has("--max-total-tokens") else None,
        "running": int(get("--max-running-requests", "--max-num-seqs")),
        "draft_steps": int(get("--speculative-num-steps", default=spec.get("num_speculative_tokens", 0))),
        "mamba_slots": int(get("--max-mamba-cache-size")) if profile.has("--max-mamba-cache-size") else None,
        "target_kv_dtype": get("--kv-cache-dtype", default="bfloat16"),
        "draft_kv_dtype": get("--speculative-draft-kv-cache-dtype", "--kv-cache-dtype", default="bfloat16"),
        "page_size": int(get("--page-size", default=1)),
        "mem_fraction": float(get("--mem-fraction-static", "--gpu-memory-utilization")),
        "tensor_parallel": int(get("--tensor-parallel-size", default=1)),
        "mamba_per_request": _mamba_per_request(profile, get),
    }


def _mamba_per_request(profile, get) -> int | None:
    """sglang's Mamba slots per running request for an SGLang profile; None (the draft rule) for vLLM."""
    if profile.engine != "sglang":
        return None
    from .capacity import mamba_slots_per_request_of

    return mamba_slots_per_request_of(get, profile.has)


def _model_folder(model: str) -> str:
    """--model as the folder: ``<dir>/config.json`` (the help offers it) is its folder; another file is refused,
    since the engine would load the folder's config.json, not that file."""
    if os.path.isfile(model):
        if os.path.basename(model) != "config.json":
            from .errors import ModelConfigError

            raise ModelConfigError(f"--model {model} is a file: pass the model's folder or its config.json")
        return os.path.dirname(os.path.abspath(model))
    return model


def cmd_plan(args) -> int:
    from .capacity import load_geometry, plan, row_cache_budget

    args.model = _model_folder(args.model)
    profile = launch_profile(args)
    d = _profile_defaults(profile)
    for key in ("context_length", "pool_tokens", "running", "draft_steps", "mamba_slots", "target_kv_dtype",
                "draft_kv_dtype", "page_size", "mem_fraction", "tensor_parallel"):
        v = getattr(args, key, None)
        if v is not None:
            d[key] = v
    if d["pool_tokens"] is None and args.device_memory_gib is None:
        from .errors import PlanRefused

        pool = dict(args.side.plan_flags).get("--max-total-tokens", "--max-total-tokens")
        raise PlanRefused(f"no pool size: pass {pool}, or --device-memory-gib (GiB per device) and the pool is "
                          f"what fits; find it on {DEVICE_MEMORY_HOWTO}")
    weights, weights_line = args.weights_gib, None
    if args.device_memory_gib is not None and weights is None:
        weights, weights_line = _plan_weights(args, d["draft_steps"])
    mem = {} if args.device_memory_gib is None else {"device_memory_gib": args.device_memory_gib,
                                                     "mem_fraction": d["mem_fraction"], "weights_gib": weights}
    d.pop("mem_fraction")
    from ..findings import ERROR
    from .engine_config import engine_config_finding

    loaded = engine_config_finding(args.model)
    if loaded is not None and loaded.level == ERROR:  # the engine would not start with it: no plan for it
        from .errors import ModelConfigError

        raise ModelConfigError(f"{loaded.message}; fix: {loaded.fix}")
    p = plan(load_geometry(args.model), **d, **mem)
    p.ple_row_cache = row_cache_budget(args.side.row_cache_knob, profile.env, os.environ,
                                       getattr(args, "row_cache_mb", None), args.side.row_cache_when)
    _print_plan(args, p, weights_line, fitted=bool(mem))
    return EXIT_OK


def _print_plan(args, p, weights_line: str | None, *, fitted: bool) -> None:
    """The plan as JSON (``--json``) or as text, with the sessions that fit at once."""
    from .capacity import render, sessions_of

    if args.json:
        doc = p.to_json()
        doc["sessions"] = {str(n): sessions_of(p, n) for n in args.sessions or ()}
        print(json.dumps(doc, indent=2))
        return
    if weights_line:
        print(weights_line)
    print(render(p))
    if not fitted:  # render() speaks of "the device fit below": say why there is none, and how to get it
        print("memory: no device fit without --device-memory-gib (GiB per device; `plan --help` says where to read "
              "it, 122.86 on Thor)")
    for n in args.sessions or ():
        print(f"sessions of {n:,} tokens at once: {sessions_of(p, n)}")


def _plan_weights(args, draft_steps: int) -> tuple[float, str]:
    """Resident weights (GiB) read from the indexes: the model's, plus the MTP draft's when the plan drafts
    and the engine loads the draft from its own directory (SGLang's NEXTN; vLLM's MTP layers live in the
    checkpoint's own index). Write-up 000 counts 8.08 GB of MTP weights beside 77.97 GB of the model."""
    from .capacity import GIB, in_place_ple_bytes, weights_bytes
    from .errors import PlanRefused

    streamed = in_place_ple_bytes(args.model)  # the checkpoint served in place: its PLE tables stay on disk
    model = weights_bytes(args.model) - streamed
    note = f"; PLE tables in place, {streamed / GIB:.2f} GiB streamed from its shards, not counted" if streamed else ""
    if not draft_steps or not args.side.draft_option:
        why = "no speculative decoding" if not draft_steps else "MTP layers are in the model's own index"
        return model / GIB, f"weights: model {model / GIB:.2f} GiB ({why}{note})"
    draft = args.draft or os.path.join(args.model, "mtp")
    if not os.path.isdir(draft):
        raise PlanRefused(f"the plan drafts {draft_steps} tokens with the MTP model, whose weights take memory too, "
                          f"but {draft} does not exist; pass --draft DIR (the prepared snapshot's mtp/), or "
                          f"--weights-gib for the total")
    extra = weights_bytes(draft)
    return (model + extra) / GIB, (f"weights: model {model / GIB:.2f} GiB + MTP draft {extra / GIB:.2f} GiB "
                                   f"({draft}) = {(model + extra) / GIB:.2f} GiB" + (f" ({note[2:]})" if note else ""))
