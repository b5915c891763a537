import pytest

from ..engine import engine_venv


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/sglang/" in str(item.fspath):
            item.add_marker(pytest.mark.sglang)


@pytest.fixture(scope="session")
def sglang():
    eng = engine_venv("sglang")
    eng.ensure_pristine()
    yield eng
    eng.ensure_pristine()  # leave the cached venv as we found it
