"""Turn a profile into the exact engine command line and environment; ``serve`` execs it."""

from __future__ import annotations

import ipaddress
import os
import shlex
import sys
from dataclasses import dataclass

from ..ple_metrics.publish import MULTIPROC_ENV
from .errors import ServeRefused
from .metrics_dir import needs_fresh_dir
from .profiles import DRAFT, MODEL, Profile
from .side import EngineSide

# Flags serve owns: letting `-- extra` set them would bypass the bind/key check or the preflight.
OWNED_FLAGS = frozenset({"--host", "--port", "--api-key", "--served-model-name", "--model-path", "--model",
                         "--speculative-draft-model-path", "--speculative-draft-model"})


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]  # the complete environment for exec
    profile_env: dict[str, str]  # shown by --dry-run: inherited variables the side names, profile's, sized
    notes: tuple[str, ...] = ()  # why serve sized what it sized (printed on stderr)
    # serve sets PROMETHEUS_MULTIPROC_DIR to a new empty directory at each start (metrics_dir.fresh_dir)
    fresh_metrics_dir: bool = False

    def shell(self) -> str:
        """The command as one shell line, API key masked."""
        shown, mask = [], False
        for a in self.argv:
            shown.append("'***'" if mask else shlex.quote(a))
            mask = a == "--api-key"
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.profile_env.items())
        if self.fresh_metrics_dir:  # what serve does at each start, as a shell does it
            prefix = (prefix + " " if prefix else "") + f'{MULTIPROC_ENV}="$(mktemp -d)"'
        return (prefix + " " if prefix else "") + " ".join(shown)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname may resolve anywhere


def check_exposure(host: str, api_key: str | None, allow_unauthenticated: bool) -> None:
    if not is_loopback(host) and not api_key and not allow_unauthenticated:
        raise ServeRefused(
            f"refusing to bind {host} without an API key: anyone who can reach it can use the model. "
            "Pass --api-key/--api-key-file, bind 127.0.0.1, or --allow-unauthenticated if a proxy guards it")


def _flag_name(arg: str) -> str:
    return arg.split("=", 1)[0]


def merge_extra(args: list[tuple[str, str | None]], extra: list[str]) -> list[tuple[str, str | None]]:
    """Drop profile flags that ``extra`` sets again (the engine would take the last; we show one)."""
    owned = sorted({_flag_name(a) for a in extra if _flag_name(a) in OWNED_FLAGS})
    if owned:
        raise ServeRefused(f"set {', '.join(owned)} through serve's own options, not after `--`")
    overridden = {_flag_name(a) for a in extra if a.startswith("--")}
    return [(f, v) for f, v in args if f not in overridden]


def effective_value(profile_args: list[tuple[str, str | None]], extra: list[str], flag: str) -> str | None:
    """The value ``flag`` ends up with (extra wins); None when unset or a bare switch."""
    for i, a in enumerate(extra):
        if a == flag and i + 1 < len(extra):
            return extra[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    for f, v in profile_args:
        if f == flag:
            return v
    return None


def check_mamba_slots(profile_args, extra) -> None:
    """sglang caps running requests to Mamba slots // its per-request ratio (capacity.mamba_slots_per_request):
    refused before launch instead of silently running fewer (000 §9: 4 requests -> 16 slots)."""
    from .capacity import mamba_slots_needed, mamba_slots_per_request_of

    def num(flag):
        v = effective_value(profile_args, extra, flag)
        return None if v is None else int(v)

    def has(flag):
        return any(a == flag for a in extra) or any(f == flag for f, _ in profile_args)

    running, slots = num("--max-running-requests"), num("--max-mamba-cache-size")
    if running is None or slots is None:
        return
    per = mamba_slots_per_request_of(lambda f: effective_value(profile_args, extra, f), has)
    need = mamba_slots_needed(running, per)
    if slots < need:
        raise ServeRefused(
            f"--max-mamba-cache-size {slots} admits only {slots // per} of --max-running-requests {running}: "
            f"sglang holds {per} Mamba state slot(s) per request with this radix-cache setup, so {need} are needed")


# Engine plugin lists a profile names its plugin in: an export may add plugins, never drop ours.
PLUGIN_LISTS = ("SGLANG_PLUGINS", "VLLM_PLUGINS")


def _fill(value: str | None, model: str, draft: str | None) -> str | None:
    if value == MODEL:
        return model
    if value == DRAFT:
        return draft
    return value


def build_launch(profile: Profile, side: EngineSide, *, model: str, draft: str | None = None, host: str = "127.0.0.1",
                 port: int | None = None, api_key: str | None = None, served_names: tuple[str, ...] = (),
                 allow_unauthenticated: bool = False, extra: list[str] | tuple[str, ...] = (),
                 python: str = sys.executable, base_env: dict | None = None, cpu=None) -> Launch:
    """The command line and environment of ``profile`` on ``side``.

    ``cpu`` (an :class:`~.host.CpuBudget`) sizes the side's reader-thread variables that the operator did
    not export; None leaves them as the profile and the engine have them."""
    check_exposure(host, api_key, allow_unauthenticated)
    extra = list(extra)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    args = merge_extra(list(profile.args), extra)
    check_mamba_slots(args, extra)
    names = tuple(served_names) or ((profile.default_served_name,) if profile.default_served_name else ())
    if profile.engine != side.name:
        raise ServeRefused(f"profile {profile.name} is for {profile.engine}, not {side.name}")
    if side.max_served_names is not None and len(names) > side.max_served_names:
        count = "one" if side.max_served_names == 1 else str(side.max_served_names)
        raise ServeRefused(f"{side.name} serves {count} --served-model-name; put a gateway in front for more aliases")
    env = dict(os.environ if base_env is None else base_env)
    for var, bad in side.forbidden_env:
        if bad in env.get(var, ""):
            raise ServeRefused(f"{var}={env[var]} breaks PLE CUDA IPC (pidfd_getfd: Operation not permitted); "
                               f"unset it")
    shown = {k: v for k, v in env.items() if side.shown_env and k.startswith(side.shown_env) and k not in profile.env}
    explicit = set(env)  # what the operator exported stays as set (the doctor judges it)
    notes = []
    profile_env = {}
    for k, v in profile.env.items():
        v = _fill(v, model, draft)
        if k in PLUGIN_LISTS and k in explicit and env[k] and v not in env[k].split(","):  # empty: all
            raise ServeRefused(f"the exported {k}={env[k]} leaves out {v}: without it the kit's plugin (its start-up "
                               f"guard and the sidecar) does not load; unset {k} or add {v}")
        if k in explicit and env[k] != v:  # exported wins: comparing settings is what exporting is for
            notes.append(f"keeping the exported {k}={env[k]} (profile {profile.name} sets {v})")
            profile_env[k] = env[k]
        else:
            profile_env[k] = v
    env.update(profile_env)
    sized = {}
    if cpu is not None and side.thread_knobs:
        from ..checks.host import size_threads

        sized, sized_notes = size_threads(env, dict(side.thread_knobs), cpu, explicit)
        notes += [f"sized {note}" for note in sized_notes]
        env.update(sized)

    argv = side.engine_argv(python)
    for flag, value in args:
        value = _fill(value, model, draft)
        argv.append(flag)
        if value is not None:
            argv.append(value)
    argv += ["--host", host, "--port", str(port or profile.port)]
    if api_key:
        argv += ["--api-key", api_key]
    if names:
        argv += ["--served-model-name", *names]
    argv += extra
    return Launch(argv=argv, env=env, profile_env={**shown, **profile_env, **sized}, notes=tuple(notes),
                  fresh_metrics_dir=needs_fresh_dir(side, env))
