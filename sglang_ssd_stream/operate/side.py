"""What the shared operate commands must know of an engine, handed in by that engine's adapter.

``operate/`` never branches on an engine's name and never imports an adapter: the SGLang CLI
mounts the commands with :data:`sglang_ssd_stream.sglang.side.SIDE`, the vLLM CLI with
:data:`vllm_ple_offload.side.SIDE`, and every difference between the two lives in those rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .metrics import MetricNames

# preflight(profile=, model=, draft=, env=, argv=) -> findings (sglang_ssd_stream.findings.Finding)
Preflight = Callable[..., list]


@dataclass(frozen=True)
class EngineSide:
    name: str  # "sglang" | "vllm": profiles.Profile.engine and hashes/<name>-<release>.json
    display: str  # "SGLang" | "vLLM", for people
    tool: str  # the CLI (for messages and service units)
    launcher: Callable[[str], list[str]]  # python of the runtime -> the engine's argv before the flags
    preflight: Preflight  # the adapter's doctor for a launch line
    service: str  # "systemd" (one host, the sglang-ssd-stream CLI runs it) | "compose" (a container)
    max_served_names: int | None = None  # sglang serves one --served-model-name; None: any number
    forbidden_env: tuple[tuple[str, str], ...] = ()  # inherited (variable, value) pairs a launch refuses
    draft_option: bool = False  # serve/service take --draft (a separate MTP directory)
    update_model: bool = False  # the prepared-snapshot updater (write-up 000) applies
    overlong: str = "truncate"  # a prompt over the window: truncated (SGLang) or refused with 400 (vLLM)
    install_hint: str = ""  # how to get the engine into the runtime when it is missing
    # Reader-thread variables serve sizes to the CPU budget (checks/host.py): (variable, the engine's default
    # when unset, or None when the knob only applies where the launch sets it).
    thread_knobs: tuple[tuple[str, int | None], ...] = ()
    metrics: MetricNames | None = None  # what `watch` reads from the engine's /metrics (operate/metrics.py)
    shown_env: tuple[str, ...] = ()  # prefixes of inherited variables the printed command shows (they act)
    # `plan` options named as this engine names them: (SGLang's flag, this engine's flag or a plan-only name).
    plan_flags: tuple[tuple[str, str], ...] = ()
    # The PLE row cache budget: (variable, MiB for all PLE layers of a process when unset); None: the engine's
    # adapter has no row cache. `plan` and the doctor count it as host memory.
    row_cache_knob: tuple[str, int] | None = None
    # Where the cache depends on another setting: (variable, its default, the values that have a cache),
    # e.g. vLLM's streamed backends (its default `pinned` table has none). None: always.
    row_cache_when: tuple[str, str, tuple[str, ...]] | None = None
    # serve gives the engine a new private PROMETHEUS_MULTIPROC_DIR per start (operate/metrics_dir.py): vLLM makes
    # none with one API server, so its workers' series (the kit's) would never reach /metrics. False: the engine
    # makes its own (sglang's --enable-metrics).
    fresh_metrics_dir: bool = False

    def engine_argv(self, python: str) -> list[str]:
        return self.launcher(python)


def console_script(name: str, *subcommand: str) -> Callable[[str], list[str]]:
    """The launcher of an engine started by its console script in the runtime's venv (``sglang serve``)."""
    return lambda python: [str(Path(python).parent / name), *subcommand]


def python_module(module: str) -> Callable[[str], list[str]]:
    """The launcher of an engine started as ``python -m module``."""
    return lambda python: [python, "-m", module]
