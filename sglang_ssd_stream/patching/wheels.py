"""Engine wheels: fetched without installing (``pip download --no-deps``), read as zip files, and
traced from an install back to the wheel it came from (``installed_origin``).

Used to check that one manifest serves both architectures and, later, for drift reports
over new releases. Downloads go to a cache directory and are reused.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import EnvironmentProblem
from .engines import Engine

if TYPE_CHECKING:
    from .manifest import Manifest

# pip matches --platform tags exactly, so name each manylinux level the engines publish
# (sglang: manylinux_2_34; vllm: manylinux_2_28, cp38-abi3).
MANYLINUX = ("manylinux_2_34", "manylinux_2_28", "manylinux_2_17", "manylinux2014")
PLATFORMS = {arch: [f"{tag}_{arch}" for tag in MANYLINUX] for arch in ("x86_64", "aarch64")}


def fetch_wheel(engine: Engine, release: str, arch: str, cache: Path, python: str = "3.11") -> Path:
    """Download (once) the ``engine==release`` wheel for ``arch``; returns its path."""
    dest = cache / "wheels" / f"{engine.name}-{release}-{arch}-py{python}"
    found = sorted(dest.glob("*.whl"))
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    # pip writes into a private directory beside ``dest`` and the wheel is renamed in whole: another process
    # fetching the same wheel (a second test run, a drift report) never globs a half-written one.
    with tempfile.TemporaryDirectory(prefix=".download-", dir=dest) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", *(a for tag in PLATFORMS[arch] for a in ("--platform", tag)),
               "--python-version", python, "--implementation", "cp", "-d", tmp, f"{engine.distribution}=={release}"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        got = sorted(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not got:
            raise EnvironmentProblem(f"could not download {engine.distribution}=={release} for {arch}: "
                                     f"{(r.stderr or r.stdout).strip()[-500:]}")
        os.replace(got[0], dest / got[0].name)
    return sorted(dest.glob("*.whl"))[0]


def wheel_file_bytes(wheel: Path, rel: str) -> bytes | None:
    """Contents of ``rel`` (a site-packages-relative path) inside ``wheel``; None when absent."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            return zf.read(rel)
        except KeyError:
            return None


# --- which wheel an install came from, read from its dist-info (never guessed)
#
# pip copies each wheel file's RECORD row (path, sha256, size) into the installed RECORD unchanged,
# except rows it rewrites or adds: files moved out of ``<name>.data/`` and scripts (written as
# ``../../../bin/...``), compiled ``.pyc`` files, and INSTALLER/REQUESTED/direct_url.json/RECORD
# itself. The digest of the remaining rows is therefore the same in the wheel and in every install
# of it, and differs for any other wheel (another build, another Python, a rebuilt or edited one).
_NOT_COPIED = {"RECORD", "RECORD.jws", "RECORD.p7s", "INSTALLER", "REQUESTED", "direct_url.json"}
MAX_RECORD_BYTES = 64 << 20


def record_rows(text: str, dist_info: str) -> list[tuple[str, str]]:
    """(path, ``sha256=...``) rows of a RECORD that an install copies verbatim from its wheel."""
    rows = []
    for n, row in enumerate(csv.reader(io.StringIO(text)), start=1):
        if not row:
            continue
        if len(row) != 3:
            raise ValueError(f"RECORD line {n} has {len(row)} fields, not 3")
        path, digest = row[0], row[1]
        top = path.split("/", 1)[0]
        if path.startswith(("../", "/")) or top.endswith(".data") or path.endswith(".pyc"):
            continue
        if top == dist_info and path[len(dist_info) + 1:] in _NOT_COPIED:
            continue
        rows.append((path, digest))
    return sorted(rows)


def record_digest(rows: list[tuple[str, str]]) -> str:
    return hashlib.sha256("\n".join(f"{p},{d}" for p, d in rows).encode()).hexdigest()


def wheel_record_digest(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/RECORD")]
        if len(names) != 1:
            raise EnvironmentProblem(f"{wheel.name} has {len(names)} dist-info RECORD files, not one")
        return record_digest(record_rows(zf.read(names[0]).decode("utf-8"), names[0].split("/")[0]))


@dataclass(frozen=True)
class WheelOrigin:
    state: str  # known | unknown | no-record | not-recorded
    message: str
    wheel: str | None = None  # file name of the matching wheel
    sha256: str | None = None
    rows: tuple = ()  # the RECORD rows (for a deep check)
    dist_info: str = ""

    def as_json(self) -> dict:
        return {"state": self.state, "message": self.message, "wheel": self.wheel, "sha256": self.sha256}


def _dist_info_name(site_fd: int, distribution: str, release: str) -> str | None:
    want = re.sub(r"[-_.]+", "-", distribution).lower()
    for name in os.listdir(site_fd):
        if not name.endswith(".dist-info"):
            continue
        dist, _, version = name[:-len(".dist-info")].rpartition("-")
        if re.sub(r"[-_.]+", "-", dist).lower() == want and version == release:
            return name
    return None


def installed_origin(site_packages: Path, manifest: Manifest) -> WheelOrigin:
    """Which of the manifest's wheels the installed engine came from, by its RECORD; refuses to guess."""
    from .files import NotAFile, errno_text, read_at
    from .state import open_site

    engine, release = manifest.engine, manifest.release
    if not manifest.wheels:
        return WheelOrigin("not-recorded", f"the {release} manifest records no wheel; cannot tell where this "
                                           f"{engine.name} came from")
    site_fd = open_site(site_packages)
    try:
        dist_info = _dist_info_name(site_fd, engine.distribution, release)
        if dist_info is None:
            return WheelOrigin("no-record", f"no {engine.distribution}-{release}.dist-info; cannot tell which "
                                            f"wheel this {engine.name} came from")
        dir_fd = os.open(dist_info, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=site_fd)
        try:
            raw, _ = read_at(dir_fd, "RECORD", what=f"{dist_info}/RECORD", limit=MAX_RECORD_BYTES)
        finally:
            os.close(dir_fd)
        rows = record_rows(raw.decode("utf-8"), dist_info)
    except (FileNotFoundError, NotAFile, UnicodeDecodeError, ValueError) as exc:
        return WheelOrigin("no-record", f"{engine.distribution} {release} has no usable RECORD ({exc}); cannot "
                                        f"tell which wheel it came from")
    except OSError as exc:
        return WheelOrigin("no-record", f"cannot read the {engine.distribution} RECORD: {errno_text(exc)}")
    finally:
        os.close(site_fd)
    digest = record_digest(rows)
    for w in manifest.wheels:
        if w.record == digest:
            return WheelOrigin("known", f"installed from {w.file} (SHA-256 {w.sha256}): its RECORD matches that "
                                        f"wheel's", w.file, w.sha256, tuple(rows), dist_info)
    return WheelOrigin("unknown", f"the installed {engine.distribution} {release} RECORD matches none of the "
                                  f"{len(manifest.wheels)} wheel(s) this kit knows for {release} (RECORD digest "
                                  f"{digest}): it was built or changed elsewhere", rows=tuple(rows),
                       dist_info=dist_info)


def check_record_files(site_packages: Path, origin: WheelOrigin, skip: set[str]) -> list[str]:
    """Hash every file the RECORD lists (except ``skip``) against it; returns the mismatches."""
    import base64

    from .files import NotAFile, errno_text, open_parent, read_at
    from .state import open_site

    bad = []
    site_fd = open_site(site_packages)
    try:
        for path, digest in origin.rows:
            if path in skip or not digest.startswith("sha256="):
                continue
            try:
                if path.startswith("/") or any(part in ("", ".", "..") for part in path.split("/")) \
                        or any(ord(c) < 32 for c in path):
                    raise ValueError("unsafe path in RECORD")
                dir_fd, name = open_parent(site_fd, path, what=path)
                try:
                    data, _ = read_at(dir_fd, name, what=path, limit=1 << 34)
                finally:
                    os.close(dir_fd)
            except FileNotFoundError:
                bad.append(f"{path} is missing")
                continue
            except (NotAFile, EnvironmentProblem, ValueError) as exc:
                bad.append(f"{path}: {exc}")
                continue
            except OSError as exc:
                bad.append(f"{path}: {errno_text(exc)}")
                continue
            got = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            if got != digest[len("sha256="):]:
                bad.append(f"{path} differs from its RECORD hash")
    finally:
        os.close(site_fd)
    return bad
