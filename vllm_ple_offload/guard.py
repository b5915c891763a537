"""Source-state guard: is the installed vLLM one whose internals this plugin was verified on?

Two questions, both answered from ``hashes/vllm-<release>.json`` through the shared patch core
(the manifest is the only place a hash is written):

1. The files our patches touch are all patched (or all pristine, with
   ``VLLM_PLE_ALLOW_UNPATCHED=1``); unknown or half-patched states are always refused.
2. Every ``watch`` entry (vLLM functions the backend swap relies on without patching them, e.g.
   ``Qwen4ExpNGramEmbedding.__init__`` reading the class name at construction time) still has
   the recorded source hash. A changed function means the swap is unverified there.
"""

from __future__ import annotations

from pathlib import Path

from . import env
from .preflight import ERROR, OK, WARNING, Finding


def source_state_findings(settings: env.PleSettings, *, site_packages: Path | None = None,
                          root: Path | None = None) -> list[Finding]:
    from sglang_ssd_stream.errors import KitError
    from sglang_ssd_stream.patching import commands
    from sglang_ssd_stream.patching.drift import function_sha256
    from sglang_ssd_stream.patching.engines import ENGINES
    from sglang_ssd_stream.patching.state import PATCHED, PRISTINE
    from sglang_ssd_stream.patching.target import from_site_packages, from_this_process

    engine = ENGINES["vllm"]
    try:
        target = from_site_packages(engine, site_packages) if site_packages else from_this_process(engine)
        report = commands.status(target, root)
    except KitError as exc:
        return [Finding(ERROR, "source_state", exc.message, "install the vLLM release this kit pins "
                        f"(vllm=={engine.pinned}) or a kit release that knows yours")]
    findings = []
    states = {f.state for f in report.files}
    listing = ", ".join(f"{f.entry.path}={f.state}" for f in report.files)
    if report.pending_recovery:
        findings.append(Finding(ERROR, "source_state", "an interrupted patch transaction is pending",
                                "run `vllm-ple-offload patch apply` (or `patch revert`) with write access"))
    elif states == {PATCHED} or not report.files:
        findings.append(Finding(OK, "source_state", f"vllm {target.release}: patched ({listing or 'no patch files'})"))
    elif states == {PRISTINE} and settings.allow_unpatched:
        findings.append(Finding(WARNING, "source_state", f"vllm {target.release} is UNPATCHED ({listing}); running "
                                f"because {env.ALLOW_UNPATCHED}=1", "`vllm-ple-offload patch apply`"))
    else:
        findings.append(Finding(ERROR, "source_state", f"vllm {target.release} is not in the patched state ({listing})",
                                f"`vllm-ple-offload patch apply`"
                                + (f" (or {env.ALLOW_UNPATCHED}=1 to run on a pristine vLLM)" if states == {PRISTINE}
                                   else "; unknown or half-patched files are never used")))
    for w in report.manifest.watch:
        try:
            got = function_sha256((target.site_packages / w.path).read_bytes(), w.function)
        except (OSError, SyntaxError, UnicodeDecodeError) as exc:
            got, detail = None, f"unreadable ({exc})"
        else:
            detail = "missing" if got is None else f"has SHA-256 {got}"
        if got != w.sha256:
            findings.append(Finding(ERROR, "source_state", f"{w.path}:{w.function} {detail}, expected {w.sha256}; "
                                    f"the PLE backend swap relies on it ({w.why})",
                                    f"install vllm=={report.manifest.release} as released"))
    if report.manifest.watch and all(f.level != ERROR for f in findings):
        findings.append(Finding(OK, "source_state", f"{len(report.manifest.watch)} watched vLLM functions unchanged"))
    return findings
