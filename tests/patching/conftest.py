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
          "Origin: vendor\nBug: none (a synthetic patch)\nForwarded: no\nLast-Update: 2026-12-01\n"
          "Test: tests/patching/test_patch_core.py\n\n")


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
            prefix: list[str] = (), python: str = sys.executable) -> subprocess.CompletedProcess:
        """Run the real CLI in a subprocess against this kit."""
        verb, *rest = args
        argv = ["patch", verb, "--site-packages", str(self.site), "--data-dir", str(self.data), *rest]
        env = {**os.environ, "PYTHONPATH": str(REPO), **(env_extra or {})}
        cmd = [*prefix, python, "-c", wrapper, *argv] if wrapper else [
            *prefix, python, "-m", "sglang_ssd_stream", *argv]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def write_series(data: Path, ids: list[str], engine: str = "sglang") -> None:
    (data / "patches" / engine / "series").write_text("# test series\n" + "".join(f"{i}.patch\n" for i in ids))


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
    write_series(data, ["0001-demo"])
    manifest = {
        "engine": "sglang", "release": "0.5.23",
        "patches": ["0001-demo"],
        "files": [{"path": rel, "pristine": sha(old), "patched": sha(new), "patches": ["0001-demo"]}
                  for rel, (old, new) in sorted(files.items())],
    }
    (data / "hashes" / "sglang-0.5.23.json").write_text(json.dumps(manifest, indent=1))
    return Kit(site, data, files)


@pytest.fixture
def kit(tmp_path) -> Kit:
    return write_kit(tmp_path)


def run_cli(kit: Kit, *args: str) -> tuple[int, str, str]:
    """The real CLI in this process (fast; lets a test patch the transaction's fault seam)."""
    import contextlib
    import io

    from sglang_ssd_stream.cli import main

    verb, *rest = args
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["patch", verb, "--site-packages", str(kit.site), "--data-dir", str(kit.data), *rest])
    return rc, out.getvalue(), err.getvalue()


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``: kind, mode and, for files, bytes (symlinks: target). FIFOs are not opened."""
    import stat as st

    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            s = os.lstat(p)
            rel = str(p.relative_to(root))
            if st.S_ISREG(s.st_mode):
                out[rel] = ("file", st.S_IMODE(s.st_mode), s.st_uid, p.read_bytes())
            elif st.S_ISLNK(s.st_mode):
                out[rel] = ("link", os.readlink(p))
            else:
                out[rel] = (st.S_IFMT(s.st_mode), st.S_IMODE(s.st_mode), s.st_uid)
    return out


def record_steps(command: str) -> list[str]:
    """The write steps of ``command`` on a fresh synthetic kit, as the transaction's seam sees them."""
    import tempfile

    from sglang_ssd_stream.patching.transaction import Transaction

    with tempfile.TemporaryDirectory() as tmp:
        kit = write_kit(Path(tmp))
        if command == "revert":
            assert run_cli(kit, "apply")[0] == 0
        seen: list[str] = []
        real = Transaction._checkpoint
        Transaction._checkpoint = lambda self, step: seen.append(step)
        try:
            rc, out, err = run_cli(kit, command)
        finally:
            Transaction._checkpoint = real
        assert rc == 0, err
    return seen
