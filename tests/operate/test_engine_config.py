"""Issue 28 item 6: the model's config is loaded with the engine's own config class before a launch.

Measured before: the kit's own fixture config (256-dim heads fully rotated, a 128-dim QSA index head) passed
doctor, plan and `serve --dry-run` with "[ok] model", and transformers' Qwen4ExpConfig refused it at launch
(StrictDataclassClassValidationError ... rotary_dim=256, indexer_head_dim=128).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sglang_ssd_stream.findings import ERROR, OK
from sglang_ssd_stream.operate.engine_config import engine_config_finding
from sglang_ssd_stream.operate.preflight import file_findings
from sglang_ssd_stream.operate.profiles import PROFILES

from .conftest import write_model

pytest.importorskip("transformers")  # the runtime's own loader; a planning box without it claims nothing


def _fully_rotated(model):
    for cfg in (model / "config.json", model / "mtp" / "config.json"):
        doc = json.loads(cfg.read_text())
        doc["text_config"]["rope_parameters"]["partial_rotary_factor"] = 1.0
        cfg.write_text(json.dumps(doc))


def test_the_fixture_config_is_one_the_engine_accepts(tmp_path):
    model = write_model(tmp_path / "m")
    for path in (model, model / "mtp"):
        found = engine_config_finding(path)
        assert found.level == OK and "loads as Qwen4ExpConfig" in found.message, found


def test_a_config_the_engine_rejects_is_an_error_naming_the_field(tmp_path):
    model = write_model(tmp_path / "m")
    _fully_rotated(model)
    found = engine_config_finding(model)
    assert found.level == ERROR and "refuses" in found.message
    assert "rotary_dim=256, indexer_head_dim=128" in found.message, found.message
    checks = {f.check: f.level for f in file_findings(PROFILES["sglang", "thor"], str(model), str(model / "mtp"))}
    assert checks["model"] == OK and checks["model_config"] == ERROR and checks["draft_config"] == ERROR


def test_serve_dry_run_reports_it(tmp_path):
    import os
    import subprocess
    import sys

    model = write_model(tmp_path / "m")
    _fully_rotated(model)
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    r = subprocess.run([sys.executable, "-m", "sglang_ssd_stream", "serve", "--profile", "thor", "--model",
                        str(model), "--dry-run"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "# [error] model_config: transformers" in r.stdout and "rotary_dim=256" in r.stdout, r.stdout


def test_the_sglang_doctor_and_plan_load_it_too(tmp_path, monkeypatch):
    """doctor --model and plan judge the same config as serve (transformers' class), not only its JSON."""
    from sglang_ssd_stream.operate.errors import ModelConfigError
    from sglang_ssd_stream.sglang import doctor

    from .conftest import SIDES

    model = write_model(tmp_path / "m")
    _fully_rotated(model)
    monkeypatch.setattr(doctor, "gather_facts", lambda **kw: None)
    monkeypatch.setattr(doctor, "run_checks", lambda facts: [])
    _, findings = doctor.diagnose(model=str(model))
    (found,) = [f for f in findings if f.check == "model_config"]
    assert found.level == ERROR and "rotary_dim=256" in found.message

    import argparse

    from sglang_ssd_stream.operate import add_operate_commands

    p = argparse.ArgumentParser()
    add_operate_commands(p.add_subparsers(dest="command", required=True), SIDES["sglang"])
    args = p.parse_args(["plan", "--profile", "thor", "--model", str(model)])
    with pytest.raises(ModelConfigError, match="rotary_dim=256, indexer_head_dim=128"):
        args.func(args)
