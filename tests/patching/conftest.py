"""A synthetic engine install and kit data, so the core is tested without any engine."""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

A_PRISTINE = "".join(f"line {i}\n" for i in range(1, 41))
A_PATCHED = A_PRISTINE.replace("line 5\n", "line 5 patched\n").replace("line 30\n", "line 30\nline 30b\n")
B_PRISTINE = "def limit(n):\n    return n - 5\n\n\ndef other():\n    return 1\n"
B_PATCHED = B_PRISTINE.replace("return n - 5", "return (n - 5) // 64 * 64")


def sha(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def unified(path: str, old: str, new: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}"))


HEADER = ("Description: demo patch for the core tests\n  continued description line\n"
          "Origin: vendor\nForwarded: no\nTest: tests/patching/test_patch_core.py\n\n")


@dataclass
class Kit:
    site: Path
    data: Path
    files: dict[str, tuple[str, str]]  # rel path -> (pristine, patched)

    def path(self, rel: str) -> Path:
        return self.site / rel

    def contents(self) -> dict[str, bytes]:
        return {rel: self.path(rel).read_bytes() for rel in self.files}

    def manifest_file(self) -> Path:
        return self.data / "hashes" / "sglang-0.5.23.json"

    def diff_file(self) -> Path:
        return self.data / "patches" / "sglang" / "0001-demo.patch"

    def cli(self, *args: str, env_extra: dict | None = None, wrapper: str | None = None,
            prefix: list[str] = ()) -> subprocess.CompletedProcess:
        """Run the real CLI in a subprocess against this kit."""
        verb, *rest = args
        argv = ["patch", verb, "--site-packages", str(self.site), "--data-dir", str(self.data), *rest]
        env = {**os.environ, "PYTHONPATH": str(REPO), **(env_extra or {})}
        cmd = [*prefix, sys.executable, "-c", wrapper, *argv] if wrapper else [
            *prefix, sys.executable, "-m", "sglang_ssd_stream", *argv]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def write_kit(root: Path, release: str = "0.5.23") -> Kit:
    site = root / "site-packages"
    files = {"sglang/srt/a.py": (A_PRISTINE, A_PATCHED), "sglang/srt/managers/b.py": (B_PRISTINE, B_PATCHED)}
    for rel, (pristine, _) in files.items():
        p = site / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(pristine)
    (site / "sglang" / "__init__.py").write_text("")
    dist = site / f"sglang-{release}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {release}\n")
    data = root / "kitdata"
    (data / "patches" / "sglang").mkdir(parents=True)
    (data / "hashes").mkdir()
    diff = HEADER + "".join(unified(rel, old, new) for rel, (old, new) in sorted(files.items()))
    (data / "patches" / "sglang" / "0001-demo.patch").write_text(diff)
    manifest = {
        "engine": "sglang", "release": "0.5.23",
        "patches": [{"id": "0001-demo", "order": 1, "diff": "patches/sglang/0001-demo.patch", "upstream": "none"}],
        "files": [{"path": rel, "pristine": sha(old), "patched": sha(new), "patches": ["0001-demo"]}
                  for rel, (old, new) in sorted(files.items())],
    }
    (data / "hashes" / "sglang-0.5.23.json").write_text(json.dumps(manifest, indent=1))
    return Kit(site, data, files)


@pytest.fixture
def kit(tmp_path) -> Kit:
    return write_kit(tmp_path)
