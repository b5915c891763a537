"""Issue 28 item 1, the doctor's half: what `serve --dry-run` judges is what the printed launch runs.

Measured before: with SGLANG_SSD_STREAM_ROW_CACHE_MB=abc exported, the launch kept `abc` (exported wins) but
the doctor judged the profile's 1024 ("[ok] row_cache: 1,024 MiB ... the profile's") and the note read
"serve: sized keeping the exported ...".
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .conftest import write_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def dry_run(model, tmp_path, **exported) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_SSD_STREAM_", "SGLANG_PLUGINS"))}
    env.update(HOME=str(tmp_path), PYTHONPATH=REPO, **exported)
    r = subprocess.run([sys.executable, "-m", "sglang_ssd_stream", "serve", "--profile", "thor", "--model", str(model),
                        "--dry-run"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr  # a dry run reports; it never refuses
    return r.stdout + r.stderr


@pytest.mark.parametrize("value, finding", [
    ("abc", "[error] row_cache: SGLANG_SSD_STREAM_ROW_CACHE_MB='abc' is not an integer number of MiB"),
    ("0", "[ok] row_cache: off (SGLANG_SSD_STREAM_ROW_CACHE_MB=0, exported)"),
    ("256", "[ok] row_cache: 256 MiB of registered host memory per scheduler process for all PLE layers "
            "(SGLANG_SSD_STREAM_ROW_CACHE_MB, exported)"),
])
def test_the_doctor_judges_the_exported_value_the_launch_keeps(tmp_path, value, finding):
    out = dry_run(write_model(tmp_path / "m"), tmp_path, SGLANG_SSD_STREAM_ROW_CACHE_MB=value)
    assert f"SGLANG_SSD_STREAM_ROW_CACHE_MB={value} " in out  # the printed command runs it
    assert f"serve: keeping the exported SGLANG_SSD_STREAM_ROW_CACHE_MB={value} (profile thor sets 1024)" in out
    assert finding in out, out
    if value == "abc":
        assert "a real serve would refuse here" in out


def test_without_an_export_the_profile_value_is_judged(tmp_path):
    out = dry_run(write_model(tmp_path / "m"), tmp_path)
    assert "(SGLANG_SSD_STREAM_ROW_CACHE_MB, the profile's)" in out and "keeping the exported" not in out
