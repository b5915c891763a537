"""Patch drift: does each patch of the pinned manifest still hold on another engine release?

Per (patch, release) the class is one of:
  identical  every target file is byte-identical to the pinned pristine file: hashes carry over
  moved      the diff applies with exact context (at the same or another offset) to changed files:
             a candidate manifest is written, marked unreviewed
  upstream   the reverse diff applies: the change is already in that release; patch obsolete there
  conflict   neither applies: needs porting (the failing hunk is shown)
Watched functions (code we rely on without patching it) are reported as same/changed/missing.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import EnvironmentProblem
from .diff import HunkMismatch, apply_file, load_patch, upstream_status
from .manifest import Manifest, dump_manifest
from .state import SourceFunctions
from .wheels import fetch_wheel, wheel_file_bytes

IDENTICAL, MOVED, UPSTREAM, CONFLICT = "identical", "moved", "upstream", "conflict"


@dataclass
class FileDrift:
    path: str
    klass: str
    detail: str = ""
    offsets: list[int] = field(default_factory=list)


@dataclass
class PatchDrift:
    patch: str
    klass: str
    files: list[FileDrift]


@dataclass
class ReleaseDrift:
    release: str
    source: str  # wheel file name(s)
    patches: list[PatchDrift]
    watch: list[dict]
    arch_mismatch: list[str]
    candidate: dict | None  # manifest dict for moved/identical/upstream mixes, unreviewed

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for p in self.patches:
            counts[p.klass] = counts.get(p.klass, 0) + 1
        parts = [f"{n} {k}" for k, n in sorted(counts.items())]
        changed = [w["id"] for w in self.watch if w["state"] != "same"]
        if changed:
            parts.append(f"watched code changed: {', '.join(changed)}")
        if self.arch_mismatch:
            parts.append(f"x86_64/aarch64 differ: {', '.join(self.arch_mismatch)}")
        return ", ".join(parts) or "no patches"


def _classify_file(data: bytes | None, unchanged: bool, patch_files, rel: str) -> tuple[FileDrift, bytes | None]:
    """Classify one file for one patch; returns the drift and the patched bytes (when it applies)."""
    if data is None:
        return FileDrift(rel, CONFLICT, "file is absent in this release"), None
    pf = patch_files[rel]
    try:
        out, offsets = apply_file(data, pf, path=rel, find_offsets=True)
    except HunkMismatch as forward:
        try:
            apply_file(data, pf, path=rel, reverse=True, find_offsets=True)
        except HunkMismatch:
            return FileDrift(rel, CONFLICT, f"{forward.message}\n{forward.text}"), None
        return FileDrift(rel, UPSTREAM, "the patched text is already present"), None
    if unchanged:
        return FileDrift(rel, IDENTICAL, offsets=offsets), out
    moved = [o for o in offsets if o]
    detail = f"hunk offsets {offsets}" if moved else "file changed elsewhere; hunks apply in place"
    return FileDrift(rel, MOVED, detail, offsets), out


def analyse_release(manifest: Manifest, release: str, files: dict[str, bytes | None],
                    other_arch: dict[str, bytes | None] | None = None, source: str = "") -> ReleaseDrift:
    """``files``: site-packages-relative path -> bytes in that release (None: absent)."""
    current = dict(files)  # per file, after the patches classified so far (series order)
    results = []
    kept_patches = []
    for patch in manifest.patches:
        parsed = load_patch(manifest.diff_path(patch), patch.id)
        drifts = []
        for entry in (f for f in manifest.files if patch.id in f.patches):
            original = files.get(entry.path)
            unchanged = original is not None and hashlib.sha256(original).hexdigest() == entry.pristine
            drift, out = _classify_file(current.get(entry.path), unchanged, parsed.files, entry.path)
            drifts.append(drift)
            if out is not None:
                current[entry.path] = out
        classes = {d.klass for d in drifts}
        klass = (CONFLICT if CONFLICT in classes else UPSTREAM if classes == {UPSTREAM}
                 else IDENTICAL if classes == {IDENTICAL} else MOVED if classes <= {IDENTICAL, MOVED} else CONFLICT)
        results.append(PatchDrift(patch.id, klass, drifts))
        if klass in (IDENTICAL, MOVED):
            kept_patches.append(patch)

    parsed: dict[str, SourceFunctions] = {}

    def watched_sha256(path: str, function: str) -> str | None:  # each file parsed once
        if path not in parsed:
            parsed[path] = SourceFunctions(files[path])
        return parsed[path].sha256(function)

    watch = []
    for w in manifest.watch:
        data = files.get(w.path)
        got = watched_sha256(w.path, w.function) if data is not None else None
        state = "missing" if got is None else "same" if got == w.sha256 else "changed"
        watch.append({"id": w.id, "path": w.path, "function": w.function, "state": state, "why": w.why})

    mismatch = sorted(p for p in files if other_arch is not None and other_arch.get(p) != files[p])

    candidate = None
    if all(r.klass != CONFLICT for r in results):
        kept_ids = {p.id for p in kept_patches}
        candidate = {
            "engine": manifest.engine.name, "release": release,
            "patches": [p.id for p in kept_patches],
            "files": [{"path": e.path, "pristine": hashlib.sha256(files[e.path]).hexdigest(),
                       "patched": hashlib.sha256(current[e.path]).hexdigest(),
                       "patches": [p for p in e.patches if p in kept_ids]}
                      for e in manifest.files if any(p in kept_ids for p in e.patches)],
            "watch": [{"id": w.id, "path": w.path, "function": w.function,
                       "sha256": watched_sha256(w.path, w.function), "why": w.why}
                      for w in manifest.watch if files.get(w.path) is not None
                      and watched_sha256(w.path, w.function) is not None],
        }
    return ReleaseDrift(release, source, results, watch, mismatch, candidate)


def registry_releases(distribution: str) -> list[str]:
    """Releases the package index offers, newest first (``pip index versions``)."""
    r = subprocess.run([sys.executable, "-m", "pip", "index", "versions", distribution,
                        "--disable-pip-version-check"], capture_output=True, text=True, timeout=120)
    for line in r.stdout.splitlines():
        if line.startswith("Available versions:"):
            return [v.strip() for v in line.split(":", 1)[1].split(",") if v.strip()]
    raise EnvironmentProblem(f"the package index did not answer for {distribution}: {r.stderr.strip()[-300:]}")


def wheel_files(manifest: Manifest, wheel: Path) -> dict[str, bytes | None]:
    paths = {f.path for f in manifest.files} | {w.path for w in manifest.watch}
    return {p: wheel_file_bytes(wheel, p) for p in sorted(paths)}


def drift_report(manifest: Manifest, releases: list[str], cache: Path, out: Path,
                 wheels: list[Path] = ()) -> list[ReleaseDrift]:
    reports = []
    for release in releases:
        x86 = fetch_wheel(manifest.engine, release, "x86_64", cache)
        arm = fetch_wheel(manifest.engine, release, "aarch64", cache)
        reports.append(analyse_release(manifest, release, wheel_files(manifest, x86), wheel_files(manifest, arm),
                                       source=f"{x86.name}, {arm.name}"))
    for wheel in wheels:
        release = wheel.name.split("-")[1]
        reports.append(analyse_release(manifest, release, wheel_files(manifest, wheel), source=wheel.name))
    write_report(manifest, reports, out)
    return reports


def markdown(manifest: Manifest, reports: list[ReleaseDrift]) -> str:
    lines = [f"# Patch drift for {manifest.engine.name} (pinned manifest: {manifest.release})", "",
             "| patch | " + " | ".join(r.release for r in reports) + " |",
             "|---|" + "---|" * len(reports)]
    for i, patch in enumerate(manifest.patches):
        lines.append(f"| {patch.id} | " + " | ".join(r.patches[i].klass for r in reports) + " |")
    for w in manifest.watch:
        row = [next(x["state"] for x in r.watch if x["id"] == w.id) for r in reports]
        lines.append(f"| watch: {w.id} | " + " | ".join(row) + " |")
    lines += ["", "## Upstream status (from each patch's DEP-3 header)", ""]
    for patch in manifest.patches:
        lines.append(f"- {patch.id}: {upstream_status(load_patch(patch.diff, patch.id).header)}")
    lines += ["", "## Per release", ""]
    for r in reports:
        lines.append(f"- **{r.release}** ({r.source}): {r.summary()}")
        for p in r.patches:
            for f in p.files:
                if f.klass == CONFLICT:
                    lines.append(f"  - {p.patch} conflicts in `{f.path}`:\n\n```\n{f.detail}\n```")
    return "\n".join(lines) + "\n"


def write_report(manifest: Manifest, reports: list[ReleaseDrift], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "drift.md").write_text(markdown(manifest, reports))
    data = [{"release": r.release, "source": r.source, "summary": r.summary(), "arch_mismatch": r.arch_mismatch,
             "watch": r.watch,
             "patches": [{"patch": p.patch, "class": p.klass,
                          "files": [{"path": f.path, "class": f.klass, "detail": f.detail, "offsets": f.offsets}
                                    for f in p.files]} for p in r.patches]} for r in reports]
    (out / "drift.json").write_text(json.dumps(data, indent=1))
    for r in reports:
        if r.candidate and r.release != manifest.release:
            cand = dict(r.candidate, status="unreviewed: run the RED/GREEN tests against this release, then move "
                                              "this file (without this field) into hashes/")
            (out / f"{manifest.engine.name}-{r.release}.candidate.json").write_text(dump_manifest(cand))

