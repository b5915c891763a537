"""List in each manifest the patched states earlier kits wrote (``files[].earlier``), from git history.

    python scripts/earlier_states.py           # add what history shows and the manifests lack
    python scripts/earlier_states.py --check   # exit 1 when a manifest lacks a state history shows

A runtime patched by an earlier kit holds files whose hash the current manifest would not know; with
``earlier`` they are a known state (``outdated``) that ``patch apply`` rewrites from the pristine backup
instead of refusing the whole upgrade. Run it whenever a patch changes or a patch is added to a file
(the pre-change manifest must be committed first: history is the source).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sglang_ssd_stream.patching.manifest import dump_manifest  # noqa: E402


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout


def history_states(rel: str) -> dict[tuple[str, str], dict[str, list[str]]]:
    """{(path, pristine): {patched sha: patches}} over every commit that changed the manifest ``rel``."""
    out: dict[tuple[str, str], dict[str, list[str]]] = {}
    for commit in git("log", "--format=%H", "--", rel).split():
        try:
            doc = json.loads(git("show", f"{commit}:{rel}"))
        except (subprocess.CalledProcessError, json.JSONDecodeError):
            continue
        for f in doc.get("files", []):
            out.setdefault((f["path"], f["pristine"]), {}).setdefault(f["patched"], list(f["patches"]))
    return out


def missing_states(rel: str, doc: dict) -> dict[str, list[dict]]:
    """Per file path, the earlier states history shows and ``doc`` does not list."""
    seen = history_states(rel)
    out = {}
    for f in doc["files"]:
        listed = {f["patched"], *(e["sha256"] for e in f.get("earlier", []))}
        new = [{"sha256": sha, "patches": patches}
               for sha, patches in seen.get((f["path"], f["pristine"]), {}).items() if sha not in listed]
        if new:
            out[f["path"]] = new
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="report only; exit 1 when a state is missing")
    a = ap.parse_args()
    if git("rev-parse", "--is-shallow-repository").strip() == "true":
        print("earlier_states: a shallow clone has no history to read; fetch it (git fetch --unshallow)",
              file=sys.stderr)
        return 2
    lacking = 0
    for path in sorted((REPO / "hashes").glob("*.json")):
        rel = path.relative_to(REPO).as_posix()
        doc = json.loads(path.read_text())
        new = missing_states(rel, doc)
        for file, states in new.items():
            for s in states:
                lacking += 1
                print(f"{rel}: {file}: earlier state {s['sha256']} ({', '.join(s['patches'])})")
        if new and not a.check:
            for f in doc["files"]:
                if f["path"] in new:
                    f["earlier"] = f.get("earlier", []) + new[f["path"]]
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            with os.fdopen(fd, "w") as out:
                out.write(dump_manifest(doc))
            os.replace(tmp, path)
    if a.check and lacking:
        print(f"{lacking} earlier state(s) missing: run python scripts/earlier_states.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
