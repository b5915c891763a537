"""One manifest serves Jetson Thor: for each pinned release, the x86_64 and aarch64 wheels carry
byte-identical target files, each equal to the manifest's pristine hash (and the watched functions
are the same on both); and each downloaded wheel is one the manifest records (SHA-256 and RECORD
digest), so `patch status` can trace an install of it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from sglang_ssd_stream.patching.engines import ENGINES
from sglang_ssd_stream.patching.manifest import known_manifests
from sglang_ssd_stream.patching.state import function_sha256
from sglang_ssd_stream.patching.wheels import fetch_wheel, wheel_file_bytes, wheel_record_digest


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
@pytest.mark.parametrize("engine_name", [pytest.param("sglang", marks=pytest.mark.sglang),
                                         pytest.param("vllm", marks=pytest.mark.vllm)])
def test_pinned_wheels_match_the_manifest(engine_name, arch):
    engine = ENGINES[engine_name]
    cache = Path(os.environ.get("SSD_STREAM_CACHE") or pytest.fail("run through scripts/test.sh"))
    manifest = next(m for m in known_manifests(engine) if m.release == engine.pinned)
    wheel = fetch_wheel(engine, manifest.release, arch, cache)
    for entry in manifest.files:
        data = wheel_file_bytes(wheel, entry.path)
        assert data is not None, f"{entry.path} is not in {wheel.name}"
        assert hashlib.sha256(data).hexdigest() == entry.pristine, f"{entry.path} differs in {wheel.name}"
    for w in manifest.watch:
        data = wheel_file_bytes(wheel, w.path)
        assert data is not None and function_sha256(data, w.function) == w.sha256, f"{w.id} differs in {wheel.name}"
    recorded = {w.file: w for w in manifest.wheels}
    assert wheel.name in recorded, f"{wheel.name} is not among the manifest's wheels"
    assert recorded[wheel.name].sha256 == hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert recorded[wheel.name].record == wheel_record_digest(wheel)
