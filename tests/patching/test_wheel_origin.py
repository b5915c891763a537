"""`patch status` traces the installed engine back to a wheel the manifest records, by the RECORD pip
leaves in the dist-info, and refuses to guess when that does not match. The install is a real
`pip install --no-deps --target` of a synthetic wheel (offline)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sglang_ssd_stream.errors import EXIT_NOT_VERIFIED, EXIT_OK
from sglang_ssd_stream.patching.wheels import wheel_record_digest

from .conftest import Kit, run_cli, write_kit

WHEEL = "sglang-0.5.23-py3-none-any.whl"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(dest: Path, files: dict[str, bytes]) -> Path:
    dist = "sglang-0.5.23.dist-info"
    files = {**files, f"{dist}/METADATA": b"Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.23\n",
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
             f"{dist}/entry_points.txt": b"[console_scripts]\nsglang = sglang:main\n"}
    record = "".join(f"{p},sha256={_b64(d)},{len(d)}\n" for p, d in files.items()) + f"{dist}/RECORD,,\n"
    path = dest / WHEEL
    with zipfile.ZipFile(path, "w") as zf:
        for p, d in files.items():
            zf.writestr(p, d)
        zf.writestr(f"{dist}/RECORD", record)
    return path


@pytest.fixture
def installed(tmp_path) -> tuple[Kit, Path]:
    """The synthetic kit, its site-packages replaced by a real pip install of a wheel of the same files."""
    kit = write_kit(tmp_path / "kit")
    files = {rel: kit.path(rel).read_bytes() for rel in kit.files} | {"sglang/__init__.py": b"def main():\n    pass\n"}
    wheel = build_wheel(tmp_path, files)
    site = kit.site
    for p in sorted(site.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile",
                        "--disable-pip-version-check", "--target", str(site), str(wheel)],
                       capture_output=True, text=True, env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
    assert r.returncode == 0, r.stderr
    m = json.loads(kit.manifest_file().read_text())
    m["wheels"] = [{"file": WHEEL, "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
                    "record": wheel_record_digest(wheel)}]
    kit.manifest_file().write_text(json.dumps(m))
    return kit, wheel


def test_installed_from_the_known_wheel(installed):
    kit, wheel = installed
    rc, out, err = run_cli(kit, "status", "--json")
    assert rc == EXIT_OK, err
    origin = json.loads(out)["wheel"]
    assert origin["state"] == "known" and origin["wheel"] == WHEEL
    assert origin["sha256"] == hashlib.sha256(wheel.read_bytes()).hexdigest()
    # still known once patched: we change files, never the RECORD
    assert run_cli(kit, "apply")[0] == EXIT_OK
    rc, out, err = run_cli(kit, "status")
    assert f"wheel       installed from {WHEEL}" in out


def test_a_record_from_another_build_is_not_the_known_wheel(installed):
    kit, _ = installed
    record = next(kit.site.glob("sglang-*.dist-info")) / "RECORD"
    rows = record.read_text().splitlines()
    record.write_text("\n".join(r.replace("sglang/__init__.py,sha256=", "sglang/__init__.py,sha256=x") for r in rows))
    rc, out, err = run_cli(kit, "status", "--json")
    origin = json.loads(out)["wheel"]
    assert rc == EXIT_OK and origin["state"] == "unknown" and origin["wheel"] is None
    assert "matches none of the 1 wheel(s)" in origin["message"]


def test_no_record_no_guess(installed):
    kit, _ = installed
    (next(kit.site.glob("sglang-*.dist-info")) / "RECORD").unlink()
    origin = json.loads(run_cli(kit, "status", "--json")[1])["wheel"]
    assert origin["state"] == "no-record" and "cannot tell" in origin["message"]


def test_manifest_without_wheels_says_so(kit):
    origin = json.loads(run_cli(kit, "status", "--json")[1])["wheel"]
    assert origin["state"] == "not-recorded"


def test_deep_check_finds_a_file_changed_behind_the_record(installed):
    kit, _ = installed
    assert run_cli(kit, "apply")[0] == EXIT_OK
    rc, out, err = run_cli(kit, "verify", "--deep")
    assert rc == EXIT_OK and "every other file matches the engine's RECORD" in out, out
    (kit.site / "sglang" / "__init__.py").write_text("def main():\n    print('changed')\n")
    rc, out, err = run_cli(kit, "verify", "--deep")
    assert rc == EXIT_NOT_VERIFIED and "sglang/__init__.py differs from its RECORD hash" in out, out


def test_fetched_wheels_arrive_whole_beside_a_concurrent_fetch(tmp_path, monkeypatch):
    """Two processes fetching the same wheel into one cache (two test runs, a drift report) each get a whole
    wheel, the cache holds exactly one, and no download directory is left: pip writes into a private directory
    and the wheel is renamed into place. A local wheel directory stands in for the index."""
    from sglang_ssd_stream.patching.engines import ENGINES
    from sglang_ssd_stream.patching.wheels import fetch_wheel
    from tests.threads import race

    from ..test_install_sh import _wheel

    wheels = tmp_path / "index"
    wheels.mkdir()
    _wheel(wheels, "sglang", "9.9.9")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    cache = tmp_path / "cache"
    got = []
    errors = race(lambda: got.append(fetch_wheel(ENGINES["sglang"], "9.9.9", "x86_64", cache)), 2)
    assert not errors, errors
    dest = cache / "wheels" / "sglang-9.9.9-x86_64-py3.11"
    assert [p.name for p in dest.iterdir()] == ["sglang-9.9.9-py3-none-any.whl"]
    assert len(got) == 2 and all(zipfile.is_zipfile(p) and p.parent == dest for p in got)
