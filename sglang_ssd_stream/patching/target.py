"""Finding the engine install to patch: a site-packages directory and its release."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from ..errors import EnvironmentProblem, UnsupportedRelease
from .engines import Engine
from .files import errno_text

# Runs in the target interpreter; find_spec on a top-level package does not execute its __init__.
_PROBE = (
    "import importlib.util, json, sys\n"
    "spec = importlib.util.find_spec(sys.argv[1])\n"
    "print(json.dumps(list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else None))\n"
)


@dataclass(frozen=True)
class Target:
    engine: Engine
    site_packages: Path
    release: str | None  # from the distribution's metadata; None when there is none

    @property
    def package_dir(self) -> Path:
        return self.site_packages / self.engine.package

    def describe(self) -> str:
        rel = self.release or "unknown release"
        return f"{self.engine.name} {rel} at {self.site_packages}"


def installed_release(engine: Engine, site_packages: Path) -> str | None:
    """The release the distribution's metadata records; refused when several records disagree (a stale
    dist-info left beside the real one: which one the files belong to cannot be told from the names)."""
    versions = sorted({dist.version for dist in metadata.distributions(path=[str(site_packages)])
                       if (dist.metadata.get("Name") or "").lower().replace("_", "-") == engine.distribution})
    if len(versions) > 1:
        raise UnsupportedRelease(
            f"{site_packages} records several {engine.distribution} releases ({', '.join(versions)}): a stale "
            f"*.dist-info is left beside the installed one, so its release cannot be told; remove the stale one "
            f"(or reinstall: pip install --force-reinstall --no-deps {engine.distribution}==<the release you run>)")
    return versions[0] if versions else None


def from_site_packages(engine: Engine, site_packages: str | os.PathLike) -> Target:
    site = Path(site_packages).absolute()
    try:
        is_package = stat.S_ISDIR(os.stat(site / engine.package).st_mode)
        release = installed_release(engine, site) if is_package else None
    except FileNotFoundError:
        is_package = False
    except OSError as exc:
        raise EnvironmentProblem(f"cannot look into {site}: {errno_text(exc)}") from None
    if not is_package:
        raise EnvironmentProblem(f"no {engine.package}/ package in {site}; is {engine.name} installed there?")
    return Target(engine, site, release)


def from_this_process(engine: Engine) -> Target:
    """The install this interpreter imports ``engine`` from (no subprocess; used by the plugins)."""
    import importlib.util

    spec = importlib.util.find_spec(engine.package)
    if spec is None or not spec.submodule_search_locations:
        raise EnvironmentProblem(f"{engine.package} is not importable in {sys.executable}")
    return from_site_packages(engine, Path(list(spec.submodule_search_locations)[0]).parent)


def from_python(engine: Engine, python: str | os.PathLike | None = None) -> Target:
    """The site-packages that ``python`` (default: this interpreter) imports ``engine`` from."""
    exe = str(python or sys.executable)
    try:
        out = subprocess.run([exe, "-c", _PROBE, engine.package], capture_output=True, text=True,
                             timeout=120, check=True).stdout
    except FileNotFoundError:
        raise EnvironmentProblem(f"python {exe} does not exist") from None
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        raise EnvironmentProblem(f"could not ask {exe} where {engine.package} is: {exc}") from None
    locations = json.loads(out.strip().splitlines()[-1])
    if not locations:
        raise EnvironmentProblem(f"{exe} cannot import {engine.package}: it is not the {engine.name} runtime. The kit "
                                 f"builds that with ./install.sh --engine {engine.name} (or pass --python with that "
                                 f"runtime's interpreter)")
    return from_site_packages(engine, Path(locations[0]).parent)
