"""The hash locks (hashes/locks/, written by scripts/lock.py): one per engine release x CPython 3.11-3.13
x x86_64/aarch64, every distribution pinned with its SHA-256, the kit's own dependencies included."""

from __future__ import annotations

import re

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

from sglang_ssd_stream.patching.engines import ENGINES
from sglang_ssd_stream.patching.manifest import known_manifests

from .conftest import REPO

LOCKS = REPO / "hashes" / "locks"
COMBOS = [(py, arch) for py in ("311", "312", "313") for arch in ("x86_64", "aarch64")]


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_lock(path) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes); refuses anything pip --require-hashes would not take."""
    text = path.read_text()
    body = re.sub(r"\\\n\s*", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    out = {}
    for line in filter(str.strip, body.splitlines()):
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)((?:\s+--hash=sha256:[0-9a-f]{64})+)\s*", line)
        assert m, f"{path.name}: not a pinned, hashed requirement: {line[:120]!r}"
        name = canon(m.group(1))
        assert name not in out, f"{path.name}: {name} twice"
        out[name] = (m.group(2), re.findall(r"[0-9a-f]{64}", m.group(3)))
    return out


def project():
    return tomllib.loads((REPO / "pyproject.toml").read_text())


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("py,arch", COMBOS)
def test_runtime_lock_pins_everything_with_hashes(engine, py, arch):
    pin = ENGINES[engine].pinned
    lock = parse_lock(LOCKS / f"{engine}-{pin}-py{py}-{arch}.txt")
    assert lock[canon(ENGINES[engine].distribution)][0] == pin
    proj = project()
    for spec in [*proj["project"]["dependencies"], *proj["build-system"]["requires"]]:
        req = Requirement(spec)
        assert canon(req.name) in lock, f"the kit's own dependency {req.name} is not locked"
        assert Version(lock[canon(req.name)][0]) in req.specifier, (req, lock[canon(req.name)])
    test = parse_lock(LOCKS / f"{engine}-{pin}-py{py}-{arch}.test.txt")
    assert not set(test) & set(lock), "the test extra repeats runtime packages (pip would see them twice)"
    for spec in proj["project"]["optional-dependencies"]["test"]:
        assert canon(Requirement(spec).name) in test | lock


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("py,arch", COMBOS)
def test_every_other_release_has_an_overlay_lock(engine, py, arch):
    for m in known_manifests(ENGINES[engine]):
        if m.release == ENGINES[engine].pinned:
            continue
        lock = parse_lock(LOCKS / f"{engine}-{m.release}-py{py}-{arch}.overlay.txt")
        assert list(lock) == [canon(ENGINES[engine].distribution)] and lock[canon(engine)][0] == m.release


def test_no_stray_locks():
    expected = set()
    for engine, e in ENGINES.items():
        for m in known_manifests(e):
            for py, arch in COMBOS:
                kinds = (".txt", ".test.txt") if m.release == e.pinned else (".overlay.txt",)
                expected |= {f"{engine}-{m.release}-py{py}-{arch}{k}" for k in kinds}
    assert {p.name for p in LOCKS.iterdir()} == expected


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_manifests_record_the_locked_engine_wheels(engine):
    """Each manifest names the wheels of its release, with the SHA-256 the locks allow."""
    e = ENGINES[engine]
    for m in known_manifests(e):
        kind = ".txt" if m.release == e.pinned else ".overlay.txt"
        allowed = set()
        for py, arch in COMBOS:
            allowed |= set(parse_lock(LOCKS / f"{engine}-{m.release}-py{py}-{arch}{kind}")[canon(e.distribution)][1])
        assert m.wheels, f"{m.source.name} records no wheel (scripts/lock.py --wheels)"
        assert {w.sha256 for w in m.wheels} <= allowed
        tags = {w.file.split("-", 2)[2] for w in m.wheels}
        assert any("x86_64" in t for t in tags) and any("aarch64" in t for t in tags), tags
