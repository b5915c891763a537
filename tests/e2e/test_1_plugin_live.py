"""Proof 1: our plugin and patches are live in the real server's processes.

- a pristine engine with the plugin installed refuses to start (no escape hatch set);
- on the patched engine the source guard ran in the scheduler process (its own log line, with its pid);
- an ordinary model (Qwen3) serves with the plugin installed and its PLE hooks armed: the hooks leave it
  alone (qwen4_exp is not even importable in that server: no CPU stand-in on its path);
- the QSA prefill budget knob is set in the scheduler and read by sglang's own row-chunk function during
  a real prefill (the CPU stand-in's probe logs the value that function read).
"""

from __future__ import annotations

import re

from .conftest import MAX_TOKENS, QSA_BUDGET_MB

SCHEDULER = "sglang::scheduler"
PATCHED_LINE = r"\[ok\] source: sglang 0\.5\.23: \d+ file\(s\) patched"


def test_pristine_engine_refuses_to_start(refused_pristine):
    sc = refused_pristine
    assert sc.exit_code not in (None, 0), sc.log[-3000:]
    assert "sglang-ssd-stream plugin" in sc.log and "refusing to start" in sc.log, sc.log[-3000:]
    assert sc.log.count("refusing to start") == 1, sc.log[-3000:]  # said once, not printed and raised
    assert "sglang 0.5.23 is not patched" in sc.log
    assert "sglang-ssd-stream patch apply" in sc.log and "SGLANG_SSD_STREAM_ALLOW_UNPATCHED=1" in sc.log
    assert "Uvicorn running" not in sc.log  # it never served
    assert sc.left_behind == {}, f"processes of the refused server outlived it: {sc.left_behind}"


def test_source_guard_ran_in_the_scheduler(qwen3_patched):
    sc = qwen3_patched
    assert any(t.startswith(SCHEDULER) for t in sc.pids.values()), sc.pids
    assert sc.pid_lines(PATCHED_LINE, SCHEDULER), sc.log[-4000:]
    assert sc.pid_lines(r"\[ok\] watched_code: \d+ watched sglang function\(s\) unchanged", SCHEDULER)
    # and in the launcher and the detokenizer: every process that loads plugins checks the source
    assert len({m.group(1) for m in re.finditer(r"plugin: pid (\d+): " + PATCHED_LINE, sc.log)}) == 3


def test_another_model_serves_with_the_plugin_installed(qwen3_patched):
    sc = qwen3_patched
    choice = sc.results["completion"]["choices"][0]
    assert choice["finish_reason"] == "length"
    assert sc.results["completion"]["usage"]["completion_tokens"] == MAX_TOKENS
    assert len(choice["logprobs"]["token_logprobs"]) == MAX_TOKENS
    # the plugin ran with its PLE hooks armed (SGLANG_SSD_STREAM_SIDECAR is not "off") ...
    assert "PLE sidecar hooks off" not in sc.log
    assert sc.pid_lines(r"PLE sidecar hooks armed: installed when sglang\.srt\.model_loader\.utils\."
                        r"get_model_architecture resolves a qwen4_exp model", SCHEDULER)
    # ... and left this model alone: no PLE hook was installed, qwen4_exp was never needed
    assert "PLE sidecar hooks installed" not in sc.log
    assert "Applied 1 hook(s) to sglang.srt.models.qwen4_exp" not in sc.log
    # without the CPU stand-in, sglang cannot import qwen4_exp here: the old plugin died on exactly that
    assert "ssd_stream_cpu_standin" not in sc.log
    assert re.search(r"Ignore import error when loading sglang\.srt\.models\.qwen4_exp\b", sc.log), sc.log[-3000:]


def test_qsa_budget_knob_took_effect_in_the_scheduler(qwen4_ram):
    sc = qwen4_ram
    set_lines = sc.pid_lines(rf"SGLANG_QSA_PREFILL_LOGITS_BUDGET_MB: .*_QSA_PREFILL_LOGITS_BUDGET_BYTES = "
                             rf"{QSA_BUDGET_MB} MiB", SCHEDULER)
    assert set_lines, sc.log[-4000:]
    read = sc.pid_lines(r"probe: QSA prefill row chunk sized with _QSA_PREFILL_LOGITS_BUDGET_BYTES=(\d+)", SCHEDULER)
    assert read, "sglang's QSA prefill never ran in the scheduler"
    assert read[0].endswith(f"={QSA_BUDGET_MB << 20}")  # not the built-in 128 MiB
