"""Proof 3: a configuration the plugin must not serve stops the server before it serves.

- a bad ``VLLM_PLE_*`` value: the plugin refuses in the API server's ``register()``, before vLLM starts the
  engine, naming the variable and its value;
- a damaged sidecar (``VLLM_PLE_NO_VERIFY`` unset): a table cut short is caught by the size check of the
  plugin's preflight in the API server's ``register()``; a table of the right size with one flipped bit only by
  the SHA-256 check, which runs where a vLLM process first imports the qwen4_exp model module: here the model
  inspection subprocess the API server starts (``python -m vllm.model_executor.models.registry``), before the
  engine core exists and before the table class is swapped in. vLLM then stops with "failed to be inspected".
  Either way the kit's message names the table and the fault, and nothing is served.
"""

from __future__ import annotations

import re

from .conftest import BAD_KNOB, DAMAGED_TABLE

SERVED = ("Uvicorn running", "Application startup complete", "Starting vLLM API server")


def _refused(sc) -> None:
    assert sc.exit_code not in (None, 0), sc.log[-4000:]
    assert not any(mark in sc.log for mark in SERVED), sc.log[-4000:]
    assert sc.left_behind == {}, f"processes of the refused server outlived it: {sc.left_behind}"


def test_bad_knob_stops_startup_with_the_knob_named(bad_knob):
    sc = bad_knob
    _refused(sc)
    name, value = BAD_KNOB
    hits = [ln for ln in sc.log.splitlines() if ln.startswith("vllm-ple-offload plugin: PleSettingsError: ")
            and f"{name}={value!r} is not" in ln]
    assert hits, sc.log[-4000:]
    assert "(EngineCore" not in sc.log  # refused in the API server, before the engine core was started
    assert sc.ready_seconds < 120


def test_damaged_sidecar_stops_the_server_at_load(damaged_sidecar):
    how, damaged, sc = damaged_sidecar
    _refused(sc)
    assert "PreflightFailed: PLE preflight failed:" in sc.log, sc.log[-4000:]
    if how == "truncated":  # the size check (the preflight in register()); no hashing needed
        hits = sc.grep(rf"^\[error\] sidecar: PLE table {re.escape(f'{damaged}/{DAMAGED_TABLE}')} is truncated: "
                       rf"it has \d+ bytes, expected \d+$")
        assert sc.grep(r"^vllm-ple-offload plugin: PreflightFailed: PLE preflight failed:$")  # the plugin's own exit
    else:  # same size: only the SHA-256 check can see it (in the model inspection subprocess)
        hits = sc.grep(rf"\[error\] sidecar_sha: PLE table {re.escape(DAMAGED_TABLE)} \(layer 1\) has SHA-256 "
                       rf"[0-9a-f]{{64}}, expected [0-9a-f]{{64}}$")
        assert "Model architectures ['Qwen4ExpForConditionalGeneration'] failed to be inspected" in sc.log
    assert hits, sc.log[-4000:]
    assert "(EngineCore" not in sc.log  # refused before vLLM started the engine
    assert "StreamedPLEEmbedding" not in sc.log  # refused before the table class was swapped in
