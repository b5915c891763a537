"""One manifest serves Jetson Thor: the pinned release's x86_64 and aarch64 wheels carry
byte-identical target files, each equal to the manifest's pristine hash."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from sglang_ssd_stream.patching.engines import ENGINES
from sglang_ssd_stream.patching.manifest import known_manifests
from sglang_ssd_stream.patching.wheels import fetch_wheel, wheel_file_bytes


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_pinned_wheels_match_the_manifest(arch):
    engine = ENGINES["sglang"]
    cache = Path(os.environ.get("SSD_STREAM_CACHE") or pytest.fail("run through scripts/test.sh"))
    manifest = next(m for m in known_manifests(engine) if m.release == engine.pinned)
    wheel = fetch_wheel(engine, manifest.release, arch, cache)
    for entry in manifest.files:
        data = wheel_file_bytes(wheel, entry.path)
        assert data is not None, f"{entry.path} is not in {wheel.name}"
        assert hashlib.sha256(data).hexdigest() == entry.pristine, f"{entry.path} differs in {wheel.name}"
