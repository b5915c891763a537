#!/usr/bin/env python3
"""Build the trimmed sglang tree that runs the QSA Triton kernels without installing sglang.

The GPU machine has torch 2.11 / triton 3.6 and cannot install sglang 0.5.23 (it pins torch
2.14); ../shared/reference/cpu-and-gpu-testing.md §5 lists the 14 files that are enough:
the unmodified ``srt/environ.py``, ``models/qwen4_exp_ple_table.py`` and seven ``qsa/*.py``,
empty package ``__init__``s, and three one-line shims for ``is_hip`` and
``is_batch_invariant_mode_enabled``. ``qsa.metadata`` and ``qsa.config`` also import msgspec
(carry it as a wheel if you import them); ``qsa.sparse_attn`` needs torch and triton only.

With ``--patch``, each named diff is applied in order to the copied files it touches, through
the kit's own strict applier (exact context, no offset), so the tree holds the patched kernels;
hunks for files outside the tree (e.g. the attention backend) are skipped and listed.

    python scripts/gpu/qsa_shim.py --site-packages SITE --out .gpu/qsa/shim-pristine
    python scripts/gpu/qsa_shim.py --site-packages SITE --out .gpu/qsa/shim-patched \\
        --patch patches/sglang/0002-qsa-fp8-kv-descales.patch \\
        --patch patches/sglang/0003-qsa-fp8-fast-kv-reads.patch

Prints one JSON line: the tree, and the SHA-256 of every file in it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QSA = "sglang/srt/layers/attention/qsa"
COPIED = [
    "sglang/srt/environ.py",
    "sglang/srt/models/qwen4_exp_ple_table.py",
    *(f"{QSA}/{name}.py" for name in
      ("fused_kv", "sparse_attn", "kernel", "graph_metadata", "mqa", "metadata", "config")),
]
# The real package __init__s pull in ~45 sglang modules and ~65 third-party packages.
SHIMS = {
    "sglang/__init__.py": "",
    f"{QSA}/__init__.py": "",
    "sglang/srt/utils/__init__.py": "from sglang.srt.utils.common import is_hip  # noqa: F401\n",
    "sglang/srt/utils/common.py": "def is_hip():\n    return False\n",
    "sglang/srt/batch_invariant_ops/__init__.py":
        "def is_batch_invariant_mode_enabled():\n    return False\n",
}


def build(site_packages: Path, out: Path, patches: list[Path]) -> dict:
    if out.exists():
        shutil.rmtree(out)
    files: dict[str, bytes] = {}
    for rel in COPIED:
        src = site_packages / rel
        if not src.is_file():
            raise SystemExit(f"{src} is missing: not an sglang 0.5.23 site-packages?")
        files[rel] = src.read_bytes()
    skipped = []
    if patches:
        sys.path.insert(0, str(REPO))
        from sglang_ssd_stream.patching.diff import apply_file, load_patch

        for path in patches:
            parsed = load_patch(path, path.stem)
            for rel, pf in parsed.files.items():
                if rel in files:
                    files[rel], _ = apply_file(files[rel], pf, path=rel)
                else:
                    skipped.append(f"{path.name}:{rel}")
    for rel, text in SHIMS.items():
        files[rel] = text.encode()
    for rel, data in files.items():
        dst = out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
    return {"tree": str(out), "patches": [p.name for p in patches], "skipped_hunks_for": skipped,
            "sha256": {rel: hashlib.sha256(data).hexdigest() for rel, data in sorted(files.items())}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--site-packages", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--patch", type=Path, action="append", default=[])
    args = ap.parse_args()
    print(json.dumps(build(args.site_packages, args.out, args.patch)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
