"""One rule for numeric knobs on both engines (issue 25 item 2): ASCII digits within each knob's bounds.

Measured before: SGLang's knobs took '٨' as 8, '1_6' as 16, '+8', ' 8 ' and '8\\n'; READ_WORKERS=100000 was
accepted (one cold lookup spawned 3,680 threads) and PLE_MAX_TOKENS=10**30 reached the staging allocation.
"""

from __future__ import annotations

import pytest

from sglang_ssd_stream import knobs
from sglang_ssd_stream.env_numbers import ascii_int
from sglang_ssd_stream.sglang import config
from vllm_ple_offload import env as vllm_env
from vllm_ple_offload.errors import PleSettingsError

# "-0" is refused like "+8" (issue 43 item 6): a sign on zero is an odd export, not a number
ODD = ["٨", "1_6", "+8", "-0", "-00", " 8 ", "8\n", "", "8.0", "0x10", "８"]


@pytest.mark.parametrize("raw", ODD)
def test_the_rule_refuses_what_int_would_take_or_is_not_a_number(raw):
    with pytest.raises(ValueError):
        ascii_int(raw)


def test_the_rule_reads_plain_digits():
    assert [ascii_int(r) for r in ("0", "8", "0016", "1048576")] == [0, 8, 16, 1 << 20]
    # signed: a negative value reaches the knob's range check (SGLang's messages say "out of range")
    assert ascii_int("-3", signed=True) == -3
    for raw in ("--3", "-", "- 3", "-+3", "-٨", "-0", "-000"):
        with pytest.raises(ValueError):
            ascii_int(raw, signed=True)


@pytest.mark.parametrize("raw", ODD)
def test_every_numeric_knob_parser_refuses_odd_values_naming_itself(raw):
    numeric = [k for table in knobs.KNOBS.values() for k in table.values() if k.kind == knobs.INT]
    assert len(numeric) == 14  # 7 per engine
    for k in numeric:
        with pytest.raises(ValueError, match=k.name):
            k.parse(raw)
    with pytest.raises(PleSettingsError, match="VLLM_PLE_FETCH_WORKERS"):
        vllm_env.read_settings({"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_FETCH_WORKERS": raw})


@pytest.mark.parametrize("name, raw", [(config.WORKERS_ENV, "100000"), (config.WORKERS_ENV, "0"),
                                       (config.WORKERS_ENV, "1_6"), (config.MAX_TOKENS_ENV, str(10**30)),
                                       (config.MAX_TOKENS_ENV, " 8 ")])
def test_sglang_plugin_refuses_at_start_naming_the_knob(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=name):
        config.validate_env()


def test_sglang_reader_knobs_in_range_pass(monkeypatch):
    monkeypatch.setenv(config.WORKERS_ENV, "256")
    monkeypatch.setenv(config.MAX_TOKENS_ENV, "4096")
    config.validate_env()
    assert config.read_workers() == 256
