import os

import pytest

from sglang_ssd_stream.patching.engines import ENGINES

from ..engine import EngineVenv, engine_venv


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/sglang/" in str(item.fspath):
            item.add_marker(pytest.mark.sglang)


def _other_releases() -> dict[str, str]:
    """``SSD_STREAM_SGLANG_RELEASES="0.5.22=/venv/bin/python ..."`` (set by scripts/test.sh)."""
    pairs = (item.split("=", 1) for item in os.environ.get("SSD_STREAM_SGLANG_RELEASES", "").split())
    return {release: python for release, python in pairs}


@pytest.fixture(scope="session")
def sglang():
    """The pinned release's venv, pristine before and after the session."""
    eng = engine_venv("sglang")
    eng.ensure_pristine()
    yield eng
    eng.ensure_pristine()  # leave the cached venv as we found it


def pytest_generate_tests(metafunc):
    """``sglang_release`` runs a test once per release whose manifest lists the module's ``PATCH_ID``."""
    if "sglang_release" in metafunc.fixturenames:
        from sglang_ssd_stream.patching.manifest import known_manifests

        patch_id = metafunc.module.PATCH_ID
        listed = {m.release for m in known_manifests(ENGINES["sglang"]) if any(p.id == patch_id for p in m.patches)}
        releases = [r for r in [ENGINES["sglang"].pinned, *sorted(_other_releases())] if r in listed]
        metafunc.parametrize("sglang_release", releases, indirect=True)


@pytest.fixture
def sglang_release(request, sglang):
    """Each supported release: the pinned venv, or a source-overlay venv of an older release."""
    if request.param == ENGINES["sglang"].pinned:
        yield sglang
        return
    eng = EngineVenv("sglang", _other_releases()[request.param])
    eng.ensure_pristine()
    yield eng
    eng.ensure_pristine()
