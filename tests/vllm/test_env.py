"""VLLM_PLE_* parsing (pure Python: our package only, no vLLM import)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_ssd_stream.errors import EXIT_USAGE
from vllm_ple_offload import env
from vllm_ple_offload.errors import PleSettingsError


def read(**kw):
    return env.read_settings({k: v for k, v in kw.items()})


def test_unset_means_off():
    assert env.read_settings({}) is None
    assert env.read_settings({"PATH": "/bin", "VLLM_PLUGINS": "x"}) is None


def test_zero_means_off():
    assert read(VLLM_PLE_CPU_OFFLOAD="0") is None


def test_switch_alone_selects_pinned_with_defaults():
    s = read(VLLM_PLE_CPU_OFFLOAD="1")
    assert (s.backend, s.sidecar, s.streaming, s.allow_unpatched) == (env.PINNED, None, False, False)
    assert (s.fetch_workers, s.rows_per_task) == (env.DEFAULT_FETCH_WORKERS, env.DEFAULT_ROWS_PER_TASK)


@pytest.mark.parametrize("backend", env.STREAMING_BACKENDS)
def test_streaming_backends(backend, tmp_path):
    s = read(VLLM_PLE_CPU_OFFLOAD="1", VLLM_PLE_OFFLOAD_BACKEND=backend, VLLM_PLE_SIDECAR=str(tmp_path),
             VLLM_PLE_FETCH_WORKERS="7", VLLM_PLE_ROWS_PER_TASK="100", VLLM_PLE_STATS_INTERVAL="50")
    assert (s.backend, s.sidecar, s.streaming) == (backend, Path(tmp_path), True)
    assert (s.fetch_workers, s.rows_per_task, s.stats_interval) == (7, 100, 50)
    assert backend in s.describe() and str(tmp_path) in s.describe()


def test_unknown_backend_names_the_choices():
    with pytest.raises(PleSettingsError, match=r"'nvme' is not a PLE backend; choose one of pinned, mmap, pread") as e:
        read(VLLM_PLE_CPU_OFFLOAD="1", VLLM_PLE_OFFLOAD_BACKEND="nvme")
    assert e.value.exit_code == EXIT_USAGE and isinstance(e.value, ValueError)


def test_backend_is_case_sensitive():
    with pytest.raises(PleSettingsError, match="not a PLE backend"):
        read(VLLM_PLE_CPU_OFFLOAD="1", VLLM_PLE_OFFLOAD_BACKEND="Pinned")


def test_the_old_backend_name_is_refused_with_the_new_one():
    with pytest.raises(PleSettingsError, match="is now called 'pread'.*VLLM_PLE_OFFLOAD_BACKEND=pread"):
        read(VLLM_PLE_CPU_OFFLOAD="1", VLLM_PLE_OFFLOAD_BACKEND="sidecar")


def test_unknown_variable_is_refused():
    with pytest.raises(PleSettingsError, match=r"unknown variable\(s\) VLLM_PLE_BACKEND"):
        read(VLLM_PLE_CPU_OFFLOAD="1", VLLM_PLE_BACKEND="sidecar")


@pytest.mark.parametrize("switch", [None, "0"])
def test_settings_without_the_switch_are_refused(switch):
    kw = {"VLLM_PLE_OFFLOAD_BACKEND": "pread"}
    if switch is not None:
        kw["VLLM_PLE_CPU_OFFLOAD"] = switch
    with pytest.raises(PleSettingsError, match="VLLM_PLE_OFFLOAD_BACKEND set while VLLM_PLE_CPU_OFFLOAD is"):
        env.read_settings(kw)


@pytest.mark.parametrize("value", ["yes", "true", "2", ""])
def test_bad_switch_value(value):
    with pytest.raises(PleSettingsError, match="VLLM_PLE_CPU_OFFLOAD=.* must be 0 or 1"):
        read(VLLM_PLE_CPU_OFFLOAD=value)


@pytest.mark.parametrize("backend", env.STREAMING_BACKENDS)
def test_streaming_needs_a_sidecar(backend):
    with pytest.raises(PleSettingsError, match=f"{backend} needs VLLM_PLE_SIDECAR"):
        read(VLLM_PLE_CPU_OFFLOAD="1", VLLM_PLE_OFFLOAD_BACKEND=backend)
    with pytest.raises(PleSettingsError, match=r"\(it is empty\)"):
        read(VLLM_PLE_CPU_OFFLOAD="1", VLLM_PLE_OFFLOAD_BACKEND=backend, VLLM_PLE_SIDECAR="")


@pytest.mark.parametrize("name", ["VLLM_PLE_SIDECAR", "VLLM_PLE_FETCH_WORKERS", "VLLM_PLE_ROWS_PER_TASK",
                                  "VLLM_PLE_STATS_INTERVAL", "VLLM_PLE_NO_VERIFY", "VLLM_PLE_ROW_CACHE_MB",
                                  "VLLM_PLE_PREFETCH_CHUNKS"])
def test_streaming_knobs_are_refused_with_pinned(name):
    with pytest.raises(PleSettingsError, match=f"{name} only apply to the mmap and pread backends"):
        env.read_settings({"VLLM_PLE_CPU_OFFLOAD": "1", name: "1"})


@pytest.mark.parametrize("name,value,match", [
    ("VLLM_PLE_FETCH_WORKERS", "0", "out of range 1..256"),
    ("VLLM_PLE_FETCH_WORKERS", "257", "out of range 1..256"),
    ("VLLM_PLE_FETCH_WORKERS", "24x", "is not an integer"),
    ("VLLM_PLE_ROWS_PER_TASK", "0", "out of range 1.."),
    ("VLLM_PLE_ROWS_PER_TASK", "1.5", "is not an integer"),
    ("VLLM_PLE_STATS_INTERVAL", "-1", "is out of range"),  # the one knob rule: a sign reaches the range check
    ("VLLM_PLE_ROW_CACHE_MB", "1048577", r"out of range 0..1048576"),
    ("VLLM_PLE_ROW_CACHE_MB", "1G", "is not an integer"),
    ("VLLM_PLE_PREFETCH_CHUNKS", "65", r"out of range 0..64"),
    ("VLLM_PLE_PREFETCH_CHUNKS", "-1", "is out of range"),
])
def test_bad_numbers(name, value, match, tmp_path):
    with pytest.raises(PleSettingsError, match=match):
        env.read_settings({"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": "pread",
                           "VLLM_PLE_SIDECAR": str(tmp_path), name: value})


# int() takes all of these (issue 16 item 7); the one rule is ASCII digits only, like the switches.
@pytest.mark.parametrize("value", ["1_6", "\u0668", "+8", " 8 ", "8 ", "", "\uff18", "0x10", "1e3"])
@pytest.mark.parametrize("name", ["VLLM_PLE_FETCH_WORKERS", "VLLM_PLE_ROWS_PER_TASK", "VLLM_PLE_STATS_INTERVAL",
                                  "VLLM_PLE_ROW_CACHE_MB", "VLLM_PLE_PREFETCH_CHUNKS"])
def test_numbers_are_ascii_digits_only(name, value, tmp_path):
    with pytest.raises(PleSettingsError, match=r"is not an integer .*\(ASCII digits only\)"):
        env.read_settings({"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": "mmap",
                           "VLLM_PLE_SIDECAR": str(tmp_path), name: value})


@pytest.mark.parametrize("name", ["VLLM_PLE_CPU_OFFLOAD", "VLLM_PLE_ALLOW_UNPATCHED"])
@pytest.mark.parametrize("value", [" 1", "1 ", "+1", "\u0661", "01", "true"])
def test_switches_follow_the_same_rule(name, value):
    kw = {"VLLM_PLE_CPU_OFFLOAD": "1", name: value}
    with pytest.raises(PleSettingsError, match="must be 0 or 1"):
        env.read_settings(kw)


def test_leading_zeros_are_digits(tmp_path):
    s = env.read_settings({"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": "mmap",
                           "VLLM_PLE_SIDECAR": str(tmp_path), "VLLM_PLE_FETCH_WORKERS": "08"})
    assert s.fetch_workers == 8


def test_no_verify_is_an_explicit_streaming_opt_out(tmp_path):
    base = {"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": "pread", "VLLM_PLE_SIDECAR": str(tmp_path)}
    assert env.read_settings(base).no_verify is False
    s = env.read_settings({**base, "VLLM_PLE_NO_VERIFY": "1"})
    assert s.no_verify is True and "sha256_check=off" in s.describe()
    with pytest.raises(PleSettingsError, match="VLLM_PLE_NO_VERIFY='yes' must be 0 or 1"):
        env.read_settings({**base, "VLLM_PLE_NO_VERIFY": "yes"})


@pytest.mark.parametrize("value,excluded", [
    (None, False), ("ple_offload", False), ("other,ple_offload", False), ("ple_offload,", False),
    ("", True), ("other", True), ("other, ple_offload", True), ("PLE_OFFLOAD", True), ("ple_offload ", True),
])
def test_plugin_allowlist_is_read_like_vllm(value, excluded):
    """vLLM 0.33 splits VLLM_PLUGINS on ',' and strips nothing (checks/check_plugin_off.py proves it on the loader)."""
    environ = {} if value is None else {"VLLM_PLUGINS": value}
    assert env.plugin_excluded(environ) is excluded


def test_fetch_round_bytes_is_the_knob_product(tmp_path):
    s = env.read_settings({"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": "pread",
                           "VLLM_PLE_SIDECAR": str(tmp_path), "VLLM_PLE_FETCH_WORKERS": "256",
                           "VLLM_PLE_ROWS_PER_TASK": "1048576"})
    assert env.fetch_round_bytes(s, 160) == 256 * 1048576 * 160 > env.MAX_FETCH_ROUND_BYTES


def test_allow_unpatched_flag():
    assert read(VLLM_PLE_CPU_OFFLOAD="1", VLLM_PLE_ALLOW_UNPATCHED="1").allow_unpatched
    with pytest.raises(PleSettingsError, match="VLLM_PLE_ALLOW_UNPATCHED='on' must be 0 or 1"):
        read(VLLM_PLE_CPU_OFFLOAD="1", VLLM_PLE_ALLOW_UNPATCHED="on")


def test_errors_pickle():
    import pickle

    err = PleSettingsError("x")
    assert pickle.loads(pickle.dumps(err)).message == "x"


def test_every_vllm_ple_variable_is_named_only_in_env_py():
    """One source of truth: no other module's code (docstrings aside) spells a VLLM_PLE_ name."""
    import ast
    import re

    pkg = Path(env.__file__).parent
    for path in sorted(pkg.glob("*.py")):
        if path.name == "env.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
                      and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        names = {m for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                 and id(n) not in docstrings for m in re.findall(r"VLLM_PLE_[A-Z_]+", n.value)}
        assert not names, f"{path.name} spells {sorted(names)}; use vllm_ple_offload.env"


STREAM = {"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": "mmap", "VLLM_PLE_SIDECAR": "/srv/ple"}


def test_streaming_gets_a_row_cache_and_prefetch_by_default():
    s = env.read_settings(STREAM)
    assert (s.row_cache_mb, s.row_cache_bytes, s.prefetch_chunks, s.prefetch) == (1024, 1 << 30, 1, True)
    assert "row_cache=1024 MiB prefetch_chunks=1" in s.describe()


def test_pinned_has_no_row_cache():
    s = read(VLLM_PLE_CPU_OFFLOAD="1")
    assert (s.row_cache_mb, s.row_cache_bytes, s.prefetch) == (0, 0, False)


def test_row_cache_and_window_knobs():
    s = env.read_settings({**STREAM, "VLLM_PLE_ROW_CACHE_MB": "256", "VLLM_PLE_PREFETCH_CHUNKS": "0"})
    assert (s.row_cache_bytes, s.prefetch_chunks, s.prefetch) == (256 << 20, 0, True)  # 0: the scheduled chunk only
    s = env.read_settings({**STREAM, "VLLM_PLE_ROW_CACHE_MB": "0"})
    assert (s.row_cache_bytes, s.prefetch) == (0, False) and "row_cache=off" in s.describe()


def test_prefetch_without_a_cache_is_refused():
    with pytest.raises(PleSettingsError, match="VLLM_PLE_PREFETCH_CHUNKS set while VLLM_PLE_ROW_CACHE_MB=0: "
                                               "prompt-ahead prefetch reads rows into the row cache, which is off"):
        env.read_settings({**STREAM, "VLLM_PLE_ROW_CACHE_MB": "0", "VLLM_PLE_PREFETCH_CHUNKS": "2"})


def test_the_verify_step_fetch_is_on_with_a_cache_and_its_knob_turns_it_off():
    assert env.read_settings(STREAM).prefetch_drafts is False  # off by default (the H200 measurement)
    assert env.read_settings({**STREAM, "VLLM_PLE_PREFETCH_DRAFTS": "1"}).prefetch_drafts is True
    with pytest.raises(PleSettingsError, match="VLLM_PLE_PREFETCH_DRAFTS=1 while VLLM_PLE_ROW_CACHE_MB=0: a "
                                               "verify step's rows are read into the row cache, which is off; set "
                                               "VLLM_PLE_PREFETCH_DRAFTS=0"):
        env.read_settings({**STREAM, "VLLM_PLE_ROW_CACHE_MB": "0", "VLLM_PLE_PREFETCH_DRAFTS": "1"})
    # the thor profile sets it to 1: an operator who turns the cache off says 0 (exported values win)
    off = env.read_settings({**STREAM, "VLLM_PLE_ROW_CACHE_MB": "0", "VLLM_PLE_PREFETCH_DRAFTS": "0"})
    assert off.prefetch_drafts is False and off.row_cache_mb == 0
    with pytest.raises(PleSettingsError, match="VLLM_PLE_PREFETCH_DRAFTS='yes' must be 0 or 1"):
        env.read_settings({**STREAM, "VLLM_PLE_PREFETCH_DRAFTS": "yes"})


def test_the_shared_knobs_are_declared_once_for_both_engines():
    """The row cache and prefetch knobs of both engines come from one declaration: same default and bounds."""
    from sglang_ssd_stream.knobs import knob

    for suffix in ("ROW_CACHE_MB", "PREFETCH_CHUNKS", "PREFETCH_DRAFTS"):
        s, v = knob("sglang", suffix), knob("vllm", suffix)
        assert (s.default, s.lo, s.hi, s.unit) == (v.default, v.lo, v.hi, v.unit) and v.name == "VLLM_PLE_" + suffix
    assert {env.ROW_CACHE_MB, env.PREFETCH_CHUNKS, env.PREFETCH_DRAFTS} <= set(env.KNOWN) & set(env.STREAMING_ONLY)


def test_the_hot_file_needs_a_row_cache():
    with pytest.raises(PleSettingsError, match="VLLM_PLE_HOT_SHARE_PCT=30 while VLLM_PLE_ROW_CACHE_MB=0: the hot "
                                               "file fills the row cache, which is off"):
        env.read_settings({**STREAM, "VLLM_PLE_ROW_CACHE_MB": "0", "VLLM_PLE_HOT_SHARE_PCT": "30"})
    s = env.read_settings({**STREAM, "VLLM_PLE_HOT_SHARE_PCT": "30", "VLLM_PLE_HOT_INTERVAL_S": "0"})
    assert (s.hot_share_pct, s.hot_interval_s) == (30, 0)
    assert env.read_settings(STREAM).hot_share_pct == 100  # on by default, the whole cache (measured)
    assert env.read_settings({**STREAM, "VLLM_PLE_ROW_CACHE_MB": "0"}).hot_share_pct == 0  # nothing to fill
    assert env.read_settings({**STREAM, "VLLM_PLE_ROW_CACHE_MB": "0", "VLLM_PLE_HOT_SHARE_PCT": "0"}).hot_share_pct == 0
    with pytest.raises(PleSettingsError, match="only apply to the mmap and pread backends"):
        env.read_settings({"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_HOT_SHARE_PCT": "30"})


def test_the_hot_file_gets_a_stop_that_can_write_it(capsys):
    """vLLM 0.33 kills its engine at a stop without waiting (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS unset): with the
    hot file on, the plugin sets vLLM's own bound so the worker reaches its exit (the e2e proves the write)."""
    from vllm_ple_offload.activate import allow_stop_write

    environ: dict = {}
    assert allow_stop_write(env.read_settings(STREAM), environ)
    assert environ == {"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": str(env.STOP_GRACE_S)}
    assert "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=30 " in capsys.readouterr().err
    operator = {"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "7"}
    assert not allow_stop_write(env.read_settings(STREAM), operator)  # the operator's value wins
    assert operator == {"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "7"}
    for off in ({**STREAM, "VLLM_PLE_HOT_SHARE_PCT": "0"}, {**STREAM, "VLLM_PLE_ROW_CACHE_MB": "0"}):
        environ = {}
        assert not allow_stop_write(env.read_settings(off), environ) and environ == {}  # no file: vLLM's default
