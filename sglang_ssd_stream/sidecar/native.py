"""Compile a C source shipped in this package, once per machine: the one build rule of the kit's native code
(the row cache's ``sidecar/row_cache.c``, the captured read's ``staging/native_read.c``).

The library is built with the system C compiler (``$CC``, else ``cc``/``gcc``/``clang`` on PATH; not
Python's build-time ``CC``: a relocatable Python reports the compiler of the machine it was built
on) into ``$SGLANG_SSD_STREAM_HOME/native/<key>/``, keyed by the source, the compiler and its version,
the flags, the machine and its C library: a cache shared between hosts never hands one of them a
library built for another. It is compiled under a file lock
into a temporary name and renamed, so concurrent workers and a crash leave either no library or a
whole one.

Imports neither torch nor an engine.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..errors import EnvironmentProblem
from ..paths import HOME_ENV, data_dir

CFLAGS = ("-O2", "-std=c11", "-fPIC", "-shared", "-pthread")
C_COMPILERS = ("cc", "gcc", "clang")


class NativeBuildError(EnvironmentProblem):
    """A native library of this kit cannot be compiled or loaded on this machine."""


def compiler() -> list[str]:
    """``$CC``, else the first of :data:`C_COMPILERS` on PATH."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    for name in C_COMPILERS:
        if shutil.which(name):
            return [name]
    raise NativeBuildError(f"no C compiler on PATH ({', '.join(C_COMPILERS)}) and CC is not set")


@functools.lru_cache(maxsize=8)
def _compiler_identity(cc: tuple[str, ...]) -> str:
    try:
        out = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"  # build_library() then reports why the compiler cannot run
    return out.splitlines()[0] if out else "unknown"


def library_path(source: Path, name: str) -> Path:
    cc = tuple(compiler())
    parts = [*cc, _compiler_identity(cc), *CFLAGS, platform.machine(), *platform.libc_ver()]
    key = hashlib.sha256(source.read_bytes() + "\0".join(parts).encode())
    return data_dir() / "native" / key.hexdigest()[:16] / name


def build_library(source: Path, name: str, *, hint: str = "", what: str | None = None) -> Path:
    """Compile ``source`` into ``name`` unless this machine has it already; returns its path.

    ``what`` names the library in errors (default ``name``); ``hint`` (the way out) ends each of them."""
    from filelock import FileLock

    what = what or name
    try:
        path = library_path(source, name)
    except NativeBuildError as exc:  # no compiler
        raise NativeBuildError(f"{exc}{hint}") from None
    if path.is_file():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise NativeBuildError(f"cannot create {path.parent} for {what}: {exc.strerror or exc} "
                               f"(set {HOME_ENV} to a writable directory)") from exc
    with FileLock(str(path.parent / ".lock")):
        if path.is_file():
            return path  # another worker built it while we waited
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=path.parent)
        os.close(fd)
        cmd = [*compiler(), *CFLAGS, "-o", tmp, str(source)]
        try:
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise NativeBuildError(f"cannot run the C compiler ({shlex.join(cmd)}): {exc}{hint}") from exc
            if proc.returncode != 0:
                raise NativeBuildError(f"compiling {what} failed ({shlex.join(cmd)}):\n{proc.stderr.strip()}{hint}")
            os.chmod(tmp, 0o755)  # mkstemp made it 0600: other users of a shared cache must load it too
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):  # failed or interrupted: no half-built file stays behind
                os.unlink(tmp)
    return path
