"""SHA-256 of each file after every series patch that touches it, applied to one release's pristine files.

    python scripts/patched_hashes.py --site-packages <pristine venv site-packages> [--patches DIR] PATCH_ID...

The patches are applied in series order with the kit's own strict applier (exact context, hunks may sit
at another line offset, as in ``patch apply``); prints one JSON object {path: {pristine, patched, patches}}.
Feed it a pristine tree: a file whose pristine hash differs from the manifest's is a different release.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_ssd_stream.patching.diff import apply_file, load_patch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--site-packages", type=Path, required=True)
    ap.add_argument("--patches", type=Path, default=Path(__file__).resolve().parents[1] / "patches" / "sglang")
    ap.add_argument("ids", nargs="+", help="patch ids in series order (file names without .patch)")
    a = ap.parse_args()
    out: dict[str, dict] = {}
    data: dict[str, bytes] = {}
    for pid in a.ids:
        parsed = load_patch(a.patches / f"{pid}.patch", pid)
        for path, pf in parsed.files.items():
            if path not in data:
                data[path] = (a.site_packages / path).read_bytes()
                out[path] = {"pristine": hashlib.sha256(data[path]).hexdigest(), "patches": []}
            data[path], _ = apply_file(data[path], pf, path=path, find_offsets=True)
            out[path]["patches"].append(pid)
    for path in out:
        out[path]["patched"] = hashlib.sha256(data[path]).hexdigest()
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
