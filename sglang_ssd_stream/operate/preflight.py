"""Checks run before ``serve`` execs the engine: our own file checks, then the adapter's doctor.

Everything is a :class:`~sglang_ssd_stream.findings.Finding`, so ``serve --dry-run`` can print the
whole verdict as a report on any machine (a CPU box included) and a real ``serve`` refuses on the
same errors. Our own checks are cheap and certain (files exist, the sidecar manifest loads with the
right sizes; no 47 GiB hash pass, the plugin does that with its cache). The engine's checks come
from the adapter (``side.preflight``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..errors import KitError
from ..findings import ERROR, LEVELS, OK, WARNING, Finding, errors_of, refusal_text
from ..paths import HOME_ENV, name_too_long
from .errors import ServeRefused

REFUSAL_HEADLINE = "doctor refused the launch:"


def _config_finding(check: str, kind: str, path: str | None) -> Finding:
    if path is None or not os.path.isfile(os.path.join(path, "config.json")):
        return Finding(ERROR, check, f"{kind} directory {path!r} has no config.json",
                       "pass the right --model/--draft, or build the view: sglang-ssd-stream model fetch")
    return Finding(OK, check, path)


def file_findings(profile, model: str, draft: str | None, env: dict | None = None) -> list[Finding]:
    """``env``: the launch's environment (default: this process's), for the engine's trusted sidecar roots."""
    from .engine_config import engine_config_finding

    out = [_config_finding("model", "model", model)]
    if profile.needs_draft:
        out.append(_config_finding("draft", "draft (MTP)", draft))
    for found, path, check in ((out[0], model, "model_config"), (out[-1], draft, "draft_config")):
        if found.level == OK and (check == "model_config" or profile.needs_draft):
            loaded = engine_config_finding(path, check)
            out += [loaded] if loaded else []
    home = (os.environ if env is None else env).get(HOME_ENV)
    too_long = home and name_too_long(home)
    if too_long:  # the engine's plugin would stop at its first use of the kit's data directory
        out.append(Finding(ERROR, "kit_home", f"{HOME_ENV}: {too_long}", f"set {HOME_ENV} to a shorter path, or "
                           f"unset it for ~/.cache/sglang-ssd-stream"))
    if profile.needs_sidecar and out[0].level == OK:
        from ..checks.sidecar import disk_use
        from ..sidecar.view import engine_trusted_roots, load_sidecar

        try:
            manifest = load_sidecar(model, extra_roots=engine_trusted_roots(profile.engine, env))
            out.append(Finding(OK, "sidecar", f"{model}/ssd-stream.json loads, sizes match; {disk_use(manifest)}"))
        except KitError as exc:  # Sidecar* (BadKitData) errors: the message names file and sizes
            out.append(Finding(ERROR, "sidecar", exc.message, "rebuild or re-download the sidecar "
                               "(sglang-ssd-stream model fetch verifies every file)"))
    return out


# The engines' settings that read every safetensors file of the model whole into memory at load (measured:
# docs/sidecar.md#serving-the-checkpoint-itself-no-view-needed); by default both map the files instead.
WHOLE_FILE_LOADS = {"sglang": ("--weight-loader-disable-mmap", None), "vllm": ("--safetensors-load-strategy", "eager")}


def _given(argv, flag: str, value: str | None) -> bool:
    argv = list(argv)
    for i, a in enumerate(argv):
        if value is None and a == flag:
            return True
        if value is not None and (a == f"{flag}={value}" or (a == flag and argv[i + 1:i + 2] == [value])):
            return True
    return False


def loader_findings(profile, model: str, argv) -> list[Finding]:
    """A warning when the launch makes the engine read the model's files whole while its index maps the PLE
    shards a sidecar streams (the checkpoint served itself): the tables the sidecar keeps on disk are read
    into memory at every start, one file at a time."""
    from ..sidecar._safetensors import read_header
    from ..sidecar.build import SHARD_TENSOR
    from ..sidecar.format import INDEX_NAME, MANIFEST_NAME
    from .capacity import weight_files

    flag, value = WHOLE_FILE_LOADS.get(profile.engine, (None, None))
    if flag is None or not model or not os.path.isfile(os.path.join(model, MANIFEST_NAME)) \
            or not _given(argv, flag, value):
        return []
    try:  # the index's names; a checkpoint of one file: its header's
        names = list(json.loads(Path(model, INDEX_NAME).read_text())["weight_map"]) \
            if os.path.isfile(os.path.join(model, INDEX_NAME)) else list(read_header(weight_files(model)[0]))
    except (KitError, OSError, ValueError, KeyError, TypeError):
        return []  # the model's own findings say what is wrong with its files
    ple = [n for n in names if SHARD_TENSOR.search(n) and "mtp" not in n]
    if not ple:
        return []  # a view: its index leaves the PLE shards out, so nothing of them is opened
    given = flag + (f" {value}" if value else "")
    return [Finding(WARNING, "loader", f"{given} makes {profile.engine} read every file of {model} whole into "
                    f"memory at load, the {len(ple)} PLE shard tensor(s) the sidecar streams included",
                    f"drop {given} (by default the engine maps the files and reads one row of each PLE shard), "
                    f"or serve a view without them: sglang-ssd-stream model build-view --dense {model} "
                    f"--prepared {model} --out VIEW")]


def run_doctor(side, profile, model: str, draft: str | None, env: dict, argv: list[str],
               *, report_errors: bool = False) -> list[Finding]:
    """The adapter's doctor sees the whole launch line (profile flags and extras); returns its findings.

    With ``report_errors`` a doctor that cannot run at all (the engine is not installed, …) becomes
    one error finding instead of the exception, for a report that must print on any machine.
    """
    try:
        return list(side.preflight(profile=profile.name, model=model, draft=draft, env=env, argv=argv) or [])
    except KitError as exc:
        if not report_errors:
            raise
        return [Finding(ERROR, "doctor", f"{side.display} doctor could not run: {exc.message}",
                        side.install_hint or None)]


def findings_for(side, profile, model: str, draft: str | None, env: dict, argv=(), *,
                 report_errors: bool = False) -> list[Finding]:
    """Our file checks, then the adapter's doctor (skipped when the model directory is unusable)."""
    from .metrics_dir import exported_dir_finding

    found = file_findings(profile, model, draft, env) + loader_findings(profile, model, argv)
    metrics_dir = exported_dir_finding(side, env)  # an exported one only: a fresh one is made at the start
    found += [metrics_dir] if metrics_dir else []
    doctor = run_doctor(side, profile, model, draft, env, list(argv), report_errors=report_errors)
    # SGLang's doctor loads the model's config and sidecar again: a check made above is said once, unless
    # the doctor's verdict is worse (its sidecar may be a knob's other file)
    ours = {f.check: LEVELS.index(f.level) for f in found}
    return found + [f for f in doctor if f.check not in ours or LEVELS.index(f.level) < ours[f.check]]


def preflight(side, profile, model: str, draft: str | None, env: dict, argv=()) -> list[str]:
    """Raise on anything that must stop the launch; return warnings (printed on stderr)."""
    findings = findings_for(side, profile, model, draft, env, argv)
    refusal = refusal_text(findings, REFUSAL_HEADLINE)
    if refusal:
        raise ServeRefused(refusal)
    warnings = [f"{f.check}: {f.message}" + (f" (fix: {f.fix})" if f.fix else "") for f in findings
                if f.level == WARNING]
    for w in warnings:
        print(f"preflight: warning: {w}", file=sys.stderr)
    return warnings


def report_lines(findings: list[Finding]) -> list[str]:
    """The findings as shell comments (a dry run's stdout stays a runnable script), then the verdict."""
    lines = []
    for f in findings:
        lines += ["# " + line for line in f.line().splitlines()]
    bad = errors_of(findings)
    lines.append(f"# a real serve would refuse here: {len(bad)} error(s) above" if bad
                 else "# preflight: nothing refused")
    return lines
