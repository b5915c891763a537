"""Every environment knob of both engines, declared once (stdlib only).

Each :class:`Knob` says its variable, kind, default, bounds and one line of doc; the SGLang settings
(``sglang/settings.py``), vLLM's (``vllm_ple_offload/env.py``), the launch profiles and the doctors take names,
defaults and bounds from here, and ``docs/configuration.md``'s knob tables are generated from it
(``python -m sglang_ssd_stream.knobs --write``; a test fails when they differ). The engine-neutral floors never
see a variable name: they are handed values.

A knob shared by both engines (the row cache, prompt-ahead prefetch, the sidecar, the SHA-256 opt-out, the
pristine-engine escape) is declared once by its suffix and gets each engine's prefix.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from .env_numbers import knob_int

SGLANG, VLLM = "sglang", "vllm"
PREFIX = {SGLANG: "SGLANG_SSD_STREAM_", VLLM: "VLLM_PLE_"}

INT, FLAG, CHOICE, PATH, PATHS = "int", "flag", "choice", "path", "paths"


class KnobError(ValueError):
    """A knob's value breaks its declaration (the message names the knob)."""


@dataclass(frozen=True)
class Knob:
    name: str
    kind: str  # int | flag (0/1) | choice | path | paths (os.pathsep-separated)
    doc: str  # one line: what it does (docs/configuration.md's "effect" column)
    default: int | str | bool | None = None  # None: unset means "not set" (the doc says what then happens)
    lo: int = 0
    hi: int = 0
    unit: str = ""  # follows the range in the out-of-range message (" MiB")
    what: str | None = None  # what a value is, for the not-a-number message
    choices: tuple[str, ...] = ()

    def parse(self, raw: str | None) -> int | str | bool | tuple[str, ...] | None:
        """``raw`` (None: unset) as this knob's value; KnobError naming the knob otherwise."""
        if raw is None:
            return self.default
        if self.kind == INT:
            try:
                return knob_int(self.name, raw, self.lo, self.hi, what=self.what, unit=self.unit)
            except ValueError as exc:
                raise KnobError(str(exc)) from None
        if self.kind == FLAG:
            if raw not in ("0", "1"):
                raise KnobError(f"{self.name}={raw!r} must be 0 or 1")
            return raw == "1"
        if self.kind == CHOICE:
            if raw not in self.choices:
                raise KnobError(f"{self.name}={raw!r}: expected one of {', '.join(self.choices)}")
            return raw
        if self.kind == PATHS:
            return tuple(r for r in raw.split(os.pathsep) if r)
        return raw

    def read(self, environ: Mapping[str, str]) -> int | str | bool | tuple[str, ...] | None:
        return self.parse(environ.get(self.name))

    def values(self) -> str:
        """The accepted values, for the doc table."""
        if self.kind == INT:
            default = "" if self.default is None else f"; default {self.default}"
            return f"{self.lo}–{self.hi:,}{self.unit}{default}"
        if self.kind == FLAG:
            return "`1` (default) or `0`" if self.default else "`1` or `0` (default)"
        if self.kind == CHOICE:
            return " \\| ".join(f"`{c}`" + (" (default)" if c == self.default else "") for c in self.choices)
        return "a path list (`:`-separated)" if self.kind == PATHS else "a path"


@dataclass(frozen=True)
class Retired:
    name: str
    why: str


@dataclass(frozen=True)
class _Shared:
    """A knob both engines read, declared by suffix (each engine adds its prefix and may say more)."""

    suffix: str
    kind: str
    doc: str
    extra: Mapping[str, str] = field(default_factory=dict)  # engine -> words added to the doc
    kwargs: Mapping[str, object] = field(default_factory=dict)

    def knob(self, engine: str) -> Knob:
        doc = self.doc + (" " + self.extra[engine] if engine in self.extra else "")
        return Knob(PREFIX[engine] + self.suffix, self.kind, doc, **self.kwargs)


# ----------------------------------------------------------------------------- the declaration

ROW_CACHE_MAX_MB = 1 << 20  # 1 TiB: anything larger is a typo
PREFETCH_MAX_CHUNKS = 64
# chunks beyond the one being computed (H200: 1 hid cold chunks as well as 2 or better, benchmarks/row_cache/)
PREFETCH_DEFAULT_CHUNKS = 1

_SHARED = (
    _Shared("SIDECAR", PATH, "the sidecar's `ssd-stream.json` or its directory (a model view works too)",
            extra={SGLANG: "(unset: `<model-path>/ssd-stream.json` when present; `off` turns the PLE hooks off)",
                   VLLM: "for the `mmap`/`pread` backends"}),
    _Shared("TRUSTED_ROOTS", PATHS, "extra directories a sidecar's table links may resolve into (with their HF "
            "`blobs/`), for tables kept outside the artifact", extra={VLLM: "(`mmap`/`pread` only)"}),
    _Shared("NO_VERIFY", FLAG, "`1` skips the sidecar's one-time SHA-256 check (explicit choice; the doctor warns)",
            kwargs=dict(default=False)),
    _Shared("ROW_CACHE_MB", INT, "the PLE row cache ([sidecar.md](sidecar.md)): MiB of CUDA-registered host memory "
            "for all PLE layers of one process together (rows + metadata + read buffers), split evenly over the "
            "layers; `0`: no cache and no prompt-ahead prefetch; `ulimit -l` must allow it (the doctor checks)",
            extra={SGLANG: "(profiles: thor 1024, discrete-gpu 4096)", VLLM: "(`mmap`/`pread` only)"},
            kwargs=dict(default=1024, lo=0, hi=ROW_CACHE_MAX_MB, unit=" MiB",
                        what="an integer number of MiB (e.g. 1024; 0 turns the row cache off)")),
    _Shared("PREFETCH_CHUNKS", INT, "prefill chunks whose PLE rows are read into the row cache ahead of the chunk "
            "being computed (0: the scheduled chunk only)",
            extra={VLLM: "(refused with `VLLM_PLE_ROW_CACHE_MB=0`; runs in vLLM's V2 model runner)"},
            kwargs=dict(default=PREFETCH_DEFAULT_CHUNKS, lo=0, hi=PREFETCH_MAX_CHUNKS, unit=" chunks",
                        what="an integer number of prefill chunks ahead (e.g. 2; 0: the scheduled chunk only)")),
    # off by default: on the H200 at 12 ms steps it did not lower a verify step's exposure (256 rows, 80 % cached:
    # 8.9 % of the step against 9.6 % on demand, medians; worse at 16 rows); at 49 ms steps it did (2.4-4.2 %
    # against 4.5-5.1 %), so the thor profiles turn it on (docs/hot-file-measured.md)
    _Shared("PREFETCH_DRAFTS", FLAG, "with MTP, `1` reads each verify step's PLE rows into the row cache as soon as "
            "its draft tokens exist ([sidecar.md](sidecar.md)); unset or `0`: a verify step reads its misses when it "
            "looks them up. On the H200 it lowered a verify step's exposure only at Thor-class step times (49 ms, "
            "not 12 ms: [hot-file-measured.md](hot-file-measured.md)): off by default, on in the `thor` profiles",
            extra={VLLM: "(with a row cache only)"}, kwargs=dict(default=False)),
    _Shared("HOT_SHARE_PCT", INT, "the hot file ([hot-file.md](hot-file.md)): the part of each row cache, in "
            "percent, that the process's most-looked-up rows fill at start (read in one sequential pass) and that "
            "it writes back; `0`: no hot file. The default, the whole cache, read the fewest rows in the CPU "
            "measurement ([hot-file-measured.md](hot-file-measured.md))",
            extra={VLLM: "(with a row cache only)"},
            kwargs=dict(default=100, lo=0, hi=100, unit=" %", what="an integer percentage 0..100 (0: no hot file)")),
    _Shared("HOT_INTERVAL_S", INT, "seconds between hot-file writes while serving (a clean shutdown writes once "
            "more); `0`: only at shutdown",
            extra={VLLM: "(a stop, SIGTERM to the server or to its process group, is one: the plugin sets vLLM's "
                   "`VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS` when unset, so vLLM lets the worker end and "
                   "write; [hot-file.md](hot-file.md))"},
            kwargs=dict(default=600, lo=0, hi=86400, unit=" s")),
    _Shared("ALLOW_UNPATCHED", FLAG, "`1` lets the plugin run on a *pristine* (never an unknown) engine, with a "
            "warning", kwargs=dict(default=False)),
)

_SGLANG_ONLY = (
    Knob("SGLANG_SSD_STREAM_IO", CHOICE, "how sidecar rows are read: `mmap` (table mapped read-only, rows copied by "
         "threads; a media error kills the worker with SIGBUS) or `pread` (`preadv` into a fixed buffer; every I/O "
         "error a clear exception; slower warm)", default="mmap", choices=("mmap", "pread")),
    Knob("SGLANG_SSD_STREAM_READ_WORKERS", INT, "reader threads = reads in flight on a cold table (raise it on a "
         "disk whose IOPS grow with queue depth)", default=16, lo=1, hi=256),
    Knob("SGLANG_SSD_STREAM_PLE_MAX_TOKENS", INT, "tokens per lookup the staging is sized for (unset: "
         "`--chunked-prefill-size`, else 8192)", lo=1, hi=1 << 20),
    # h2d: a copy-engine H2D, then a device kernel; it hid a warm 2,048-token chunk behind a layer to 8-9 % of
    # the gather on the H200, where uva (the kernel reads pinned memory) left 25-27 % (benchmarks/sidecar/).
    Knob("SGLANG_SSD_STREAM_PLE_GATHER", CHOICE, "`h2d` (copy-engine H2D, then a device kernel) or `uva` (the "
         "kernel reads pinned staging; it competes with the layer for SMs and hides less)", default="h2d",
         choices=("h2d", "uva")),
    Knob("SGLANG_SSD_STREAM_HOME", PATH, "where the kit keeps its files (default `~/.cache/sglang-ssd-stream`): "
         "model snapshots, the hot files (`hot/`), the native host-node and row-cache libraries; a path the OS "
         "cannot name (a name over "
         "its limit) is refused naming the variable, by every command, serve's preflight and both plugins"),
    Knob("SGLANG_QSA_PREFILL_LOGITS_BUDGET_MB", INT, "cap on the QSA prefill top-k logits workspace per layer "
         "(upstream 128; Thor profile 32); top-k is per row, so tiling rows does not change the selection",
         lo=1, hi=1 << 16, unit=" MiB", what="an integer number of MiB (e.g. 32)"),
)

# The Thor write-up's measured optimum: 24 workers x 2,048 rows per task took 277 -> 10 us/row.
_VLLM_ONLY = (
    Knob("VLLM_PLE_CPU_OFFLOAD", FLAG, "`1` keeps the PLE table off the GPU (the switch; unset or `0`: the plugin "
         "does nothing and no other `VLLM_PLE_*` may be set)", default=False),
    Knob("VLLM_PLE_OFFLOAD_BACKEND", CHOICE, "`pinned` (the whole table in page-aligned registered host memory, "
         "vLLM's own lookup kernel), `mmap` (the shared mapped sidecar reader) or `pread` (the shared `preadv` "
         "reader: every I/O error an exception; formerly `sidecar`, refused with the new name)", default="pinned",
         choices=("pinned", "mmap", "pread")),
    Knob("VLLM_PLE_FETCH_WORKERS", INT, "row-gathering workers per table; workers × rows per task × row bytes is "
         "one fetch round and must stay ≤ 256 MiB", default=24, lo=1, hi=256),
    Knob("VLLM_PLE_ROWS_PER_TASK", INT, "rows per worker task (the Thor write-up's optimum with 24 workers)",
         default=2048, lo=1, hi=1 << 20),
    Knob("VLLM_PLE_STATS_INTERVAL", INT, "log the lookup timing split every N eager lookups (0: never)", default=0,
         lo=0, hi=1 << 30),
)

SGLANG_KNOBS: dict[str, Knob] = {k.name: k for k in (*(s.knob(SGLANG) for s in _SHARED), *_SGLANG_ONLY)}
VLLM_KNOBS: dict[str, Knob] = {k.name: k for k in (*_VLLM_ONLY[:2], *(s.knob(VLLM) for s in _SHARED),
                                                    *_VLLM_ONLY[2:])}
KNOBS = {SGLANG: SGLANG_KNOBS, VLLM: VLLM_KNOBS}

# Knobs of earlier versions: refused at start, so nobody believes they still act.
RETIRED = {SGLANG: (Retired("SGLANG_SSD_STREAM_SWITCH_INTERVAL_US",
                            "reads captured in CUDA graphs are native host nodes now and need no GIL"),),
           VLLM: ()}


def knob(engine: str, suffix: str) -> Knob:
    """The engine's knob with ``suffix`` (``knob("vllm", "ROW_CACHE_MB").name == "VLLM_PLE_ROW_CACHE_MB"``)."""
    return KNOBS[engine][PREFIX[engine] + suffix]


def by_name(name: str) -> Knob:
    for table in KNOBS.values():
        if name in table:
            return table[name]
    raise KeyError(name)


def refusals(engine: str, environ: Mapping[str, str]) -> list[str]:
    """Every value of ``engine``'s knobs in ``environ`` that its declaration refuses, and every retired knob set
    (the doctor lists them all; a plugin stops at the first)."""
    out = [f"{r.name} is no longer used ({r.why}); unset it" for r in RETIRED[engine] if r.name in environ]
    for k in KNOBS[engine].values():
        try:
            k.read(environ)
        except KnobError as exc:
            out.append(str(exc))
    return out


# ----------------------------------------------------------------------------- the doc tables

_BEGIN, _END = "<!-- knobs:{engine} (generated by python -m sglang_ssd_stream.knobs --write) -->", "<!-- /knobs -->"


def table_markdown(engine: str) -> str:
    rows = ["| variable | values | effect |", "|---|---|---|"]
    rows += [f"| `{k.name}` | {k.values()} | {k.doc} |" for k in KNOBS[engine].values()]
    return "\n".join(rows)


def render_doc(text: str) -> str:
    """``text`` with each engine's generated table block replaced by the declaration's."""
    for engine in KNOBS:
        begin = _BEGIN.format(engine=engine)
        head, sep, rest = text.partition(begin)
        if not sep:
            raise ValueError(f"the doc has no {begin!r} block")
        _, sep, tail = rest.partition(_END)
        if not sep:
            raise ValueError(f"the {engine} knob block has no {_END!r}")
        text = f"{head}{begin}\n{table_markdown(engine)}\n{_END}{tail}"
    return text


def _doc_path() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "configuration.md")


def main(argv: list[str]) -> int:
    path = _doc_path()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    new = render_doc(text)
    if argv == ["--write"]:
        if new != text:
            from .atomic_file import write_atomic

            write_atomic(path, new)
        return 0
    if argv == ["--check"]:
        if new != text:
            print(f"{path}: the knob tables differ from sglang_ssd_stream/knobs.py; run "
                  "python -m sglang_ssd_stream.knobs --write", file=sys.stderr)
            return 1
        return 0
    print("usage: python -m sglang_ssd_stream.knobs --check | --write", file=sys.stderr)
    return 64


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
