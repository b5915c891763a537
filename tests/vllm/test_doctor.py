"""``vllm-ple-offload doctor`` in the real vLLM venv (CPU platform, pristine vLLM).

The doctor checks the configuration the plugin sees: the same parser (bad or unknown variables,
the escape hatch), the allowlist that would keep vLLM from running the plugin at all, the
sidecar (sizes and SHA-256), the fetch round, the graph mode of the ``vllm serve`` flags after
``--``. Exit codes follow the kit's findings rule: 0 nothing refused, 2 refused, 64 usage.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from vllm_ple_offload import env as ple_env
from vllm_ple_offload.errors import PleSettingsError

from .synthetic import random_table, write_sidecar


def doctor(vllm, *args, **env):
    return subprocess.run([vllm.python, "-m", "vllm_ple_offload.cli", "doctor", *args], capture_output=True,
                          text=True, env=vllm.env(env), timeout=600)


def levels(doc) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in doc["findings"]:
        out.setdefault(f["check"], set()).add(f["level"])
    return out


def finding(doc, check) -> dict:
    [f] = [f for f in doc["findings"] if f["check"] == check]
    return f


@pytest.fixture
def sidecar(tmp_path):
    return write_sidecar(tmp_path / "sc", {3: ("bfloat16", random_table(64, 160, 0))})


def test_plugin_off_checks_vllm_as_it_will_run(vllm):
    """No VLLM_PLE_* variable: nothing is assumed (it used to check a pinned backend nobody asked for)."""
    r = doctor(vllm)
    assert r.returncode == 2, r.stderr[-2000:]  # the pristine vLLM of this venv: the kit's patches are missing
    assert r.stdout.startswith("vllm-ple-offload doctor: no VLLM_PLE_* variable\n")
    assert "[ok] ple_offload: no VLLM_PLE_* variable: the plugin is off" in r.stdout
    assert "[error] source: vllm 0.33.0 is not patched" in r.stdout and "vllm-ple-offload patch apply" in r.stdout
    assert "uva" not in r.stdout and "assumed" not in r.stdout
    assert "vllm-ple-offload doctor: 1 refusal(s)" in r.stderr


@pytest.mark.parametrize("bad", [
    {"VLLM_PLE_CPU_OFFLOAD": "yes"},
    {"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_BOGUS": "1"},
    {"VLLM_PLE_ALLOW_UNPATCHED": "1"},  # the escape hatch alone: the plugin refuses the half configuration
    {"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": "mmap", "VLLM_PLE_SIDECAR": "/x",
     "VLLM_PLE_FETCH_WORKERS": "+8"},
])
def test_the_doctor_refuses_what_the_plugin_refuses(vllm, bad):
    """One parser: the doctor's finding is the plugin's own message, and vLLM's real loader stops on it."""
    with pytest.raises(PleSettingsError) as parsed:
        ple_env.read_settings(bad)
    r = doctor(vllm, "--json", **bad)
    assert r.returncode == 2, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert finding(doc, "settings") == {"level": "error", "check": "settings", "message": parsed.value.message,
                                        "fix": "fix the VLLM_PLE_* variables "
                                               "(docs/configuration.md#vllm-side-vllm_ple_offload)"}
    assert doc["settings"]["error"] == parsed.value.message and doc["settings"]["plugin_enabled"] is False
    plugin = subprocess.run([vllm.python, "-c", "import vllm.plugins; vllm.plugins.load_general_plugins()"],
                            capture_output=True, text=True, env=vllm.env(bad), timeout=600)
    assert (plugin.returncode != 0
            and f"vllm-ple-offload plugin: PleSettingsError: {parsed.value.message}" in plugin.stderr)


def test_healthy_streaming_configuration_passes_with_the_escape_hatch(vllm, sidecar):
    """VLLM_PLE_ALLOW_UNPATCHED is honoured (it used to be dropped); graphs off via the serve flags."""
    r = doctor(vllm, "--backend", "pread", "--sidecar", str(sidecar), "--json", "--", "--enforce-eager",
               VLLM_PLE_ALLOW_UNPATCHED="1")
    assert r.returncode == 0, (r.stdout, r.stderr[-2000:])
    doc = json.loads(r.stdout)
    assert doc["ok"] is True and doc["exit_code"] == 0
    assert doc["settings"] == {"variables": {"VLLM_PLE_ALLOW_UNPATCHED": "1", "VLLM_PLE_CPU_OFFLOAD": "1",
                                             "VLLM_PLE_OFFLOAD_BACKEND": "pread", "VLLM_PLE_SIDECAR": str(sidecar)},
                               "assumed": ["VLLM_PLE_CPU_OFFLOAD=1"], "plugin_enabled": True, "error": None,
                               "backend": "pread", "sidecar": str(sidecar)}
    lv = levels(doc)
    assert lv["source"] == {"warning"} and lv["watched_code"] == {"ok"}  # unpatched, accepted by the hatch
    assert lv["uva"] == {"warning"} and lv["sidecar"] == {"ok"} and lv["fetch_round"] == {"ok"}
    from sglang_ssd_stream.checks.sidecar import load_finding

    # from the gathered facts, the floor's own words, its disk line included
    assert finding(doc, "sidecar")["message"] == load_finding(sidecar)[0].message
    assert finding(doc, "sidecar")["message"].endswith("of table files on disk")
    assert finding(doc, "cudagraph_mode")["message"] == "NONE (from --enforce-eager)"
    assert finding(doc, "sidecar_sha")["level"] == "ok" and "1 table(s) match" in finding(doc, "sidecar_sha")["message"]
    assert doc["facts"]["platform"] == "CpuPlatform" and doc["facts"]["row_bytes"] == {"3": 160}


def test_every_refusal_at_once(vllm, sidecar):
    """A corrupted table, a 40 GiB fetch round, an allowlist without us, vLLM's default FULL graphs (pread)."""
    table = sidecar.parent / "ple" / "layer-3.bin"
    data = bytearray(table.read_bytes())
    data[len(data) // 2] ^= 1
    table.write_bytes(bytes(data))
    r = doctor(vllm, "--json", VLLM_PLE_CPU_OFFLOAD="1", VLLM_PLE_OFFLOAD_BACKEND="pread",
               VLLM_PLE_SIDECAR=str(sidecar), VLLM_PLE_ALLOW_UNPATCHED="1", VLLM_PLE_FETCH_WORKERS="256",
               VLLM_PLE_ROWS_PER_TASK="1048576", VLLM_PLUGINS="other")
    assert r.returncode == 2, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    bad = {f["check"] for f in doc["findings"] if f["level"] == "error"}
    assert bad == {"sidecar_sha", "fetch_round", "plugin_allowlist", "cudagraph_mode"}, doc["findings"]
    assert "has SHA-256" in finding(doc, "sidecar_sha")["message"]
    assert "256 x 1,048,576 x 160 B = 40.00 GiB" in finding(doc, "fetch_round")["message"]
    assert finding(doc, "fetch_round")["fix"].startswith("lower VLLM_PLE_ROWS_PER_TASK to at most 6,553")
    assert "VLLM_PLUGINS='other' does not name ple_offload" in finding(doc, "plugin_allowlist")["message"]
    assert finding(doc, "cudagraph_mode")["message"].startswith("cudagraph_mode=FULL_AND_PIECEWISE: pread PLE backend")
    assert "vLLM's default at -O2" in finding(doc, "cudagraph_mode")["message"]


def test_the_row_cache_is_accounted_per_worker_process(vllm, sidecar):
    """The default budget, and with a TP=2 line twice it against MemAvailable; a budget beyond the host is refused."""
    r = doctor(vllm, "--backend", "mmap", "--sidecar", str(sidecar), "--json", "--", "--enforce-eager",
               "--tensor-parallel-size", "2", VLLM_PLE_ALLOW_UNPATCHED="1")
    assert r.returncode == 0, (r.stdout, r.stderr[-2000:])
    doc = json.loads(r.stdout)
    assert doc["facts"]["worker_processes"] == 2 and doc["facts"]["mem_available_bytes"] > 0
    assert finding(doc, "row_cache")["message"].startswith("VLLM_PLE_ROW_CACHE_MB=1024 per worker process (1.00 GiB")
    assert "the row caches take 2.00 GiB for 2 worker process(es)" in finding(doc, "row_cache_memory")["message"]
    r = doctor(vllm, "--backend", "mmap", "--sidecar", str(sidecar), "--", "--enforce-eager",
               VLLM_PLE_ALLOW_UNPATCHED="1", VLLM_PLE_ROW_CACHE_MB="1048576")
    assert r.returncode == 2 and "[error] row_cache_memory: the row caches take 1024.00 GiB, but MemAvailable is " \
        "only" in r.stdout, r.stdout
    r = doctor(vllm, "--backend", "mmap", "--sidecar", str(sidecar), "--", "--enforce-eager",
               VLLM_PLE_ALLOW_UNPATCHED="1", VLLM_PLE_ROW_CACHE_MB="0")
    assert r.returncode == 0 and "[ok] row_cache: VLLM_PLE_ROW_CACHE_MB=0: no row cache" in r.stdout, r.stdout


def test_no_verify_is_reported_not_hidden(vllm, sidecar):
    r = doctor(vllm, "--backend", "mmap", "--sidecar", str(sidecar), "--", "-cc.cudagraph_mode=PIECEWISE",
               VLLM_PLE_ALLOW_UNPATCHED="1", VLLM_PLE_NO_VERIFY="1")
    assert r.returncode == 0, (r.stdout, r.stderr[-2000:])
    assert "[warning] sidecar_sha: VLLM_PLE_NO_VERIFY=1: the tables' SHA-256 is not checked" in r.stdout
    assert "[ok] cudagraph_mode: PIECEWISE (from --compilation-config)" in r.stdout


@pytest.mark.parametrize("state", ["no cache", "stale cache"])
def test_reporting_commands_write_nothing(vllm, sidecar, tmp_path, monkeypatch, state):
    """Issue 38 item 2 (docs/sidecar.md, "The verified cache"): the doctor and `sidecar verify` of the vLLM runtime
    hash and report; the sidecar's directory and the kit's data directory are as they were: no cache, no lock, no
    temporary file. "stale cache": what the plugin recorded, then the table changed (a writer would drop it)."""
    from sglang_ssd_stream.sidecar.verify import SERVE, verify_sidecar
    from tests.fs_state import tree_state

    data = tmp_path / "data"
    data.mkdir()
    monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(data))
    if state == "stale cache":
        verify_sidecar(sidecar, caller=SERVE, progress=False)
        table = sidecar.parent / "ple" / "layer-3.bin"
        table.write_bytes(table.read_bytes()[::-1])
    before = tree_state(sidecar.parent, data)
    r = doctor(vllm, "--backend", "pread", "--sidecar", str(sidecar), "--json", "--", "--enforce-eager",
               VLLM_PLE_ALLOW_UNPATCHED="1", SGLANG_SSD_STREAM_HOME=str(data))
    assert finding(json.loads(r.stdout), "sidecar_sha")["level"] == ("ok" if state == "no cache" else "error")
    assert tree_state(sidecar.parent, data) == before, "doctor wrote"
    r = subprocess.run([vllm.python, "-m", "sglang_ssd_stream", "sidecar", "verify", str(sidecar.parent), "-q"],
                       capture_output=True, text=True, env=vllm.env({"SGLANG_SSD_STREAM_HOME": str(data)}), timeout=600)
    assert r.returncode == (0 if state == "no cache" else 3), (r.stdout, r.stderr[-2000:])
    assert tree_state(sidecar.parent, data) == before, "sidecar verify wrote"


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_missing_or_truncated_sidecar_is_a_finding(vllm, sidecar, damage):
    if damage == "missing":
        path = sidecar.parent / "nowhere"
    else:
        table = sidecar.parent / "ple" / "layer-3.bin"
        table.write_bytes(table.read_bytes()[:-160])
        path = sidecar
    r = doctor(vllm, "--backend", "mmap", "--sidecar", str(path), "--", "--enforce-eager", VLLM_PLE_ALLOW_UNPATCHED="1")
    assert r.returncode == 2, r.stderr[-2000:]  # a refusal like any other (it was exit 3)
    assert "[error] sidecar: " in r.stdout and "Traceback" not in r.stderr
    assert ("sidecar manifest not found" if damage == "missing" else "layer-3.bin") in r.stdout


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "0", "lots"])
def test_table_gib_must_be_a_finite_size(vllm, value):
    r = doctor(vllm, "--table-gib", value, VLLM_PLE_CPU_OFFLOAD="1")
    assert r.returncode == 64 and "argument --table-gib" in r.stderr and "Traceback" not in r.stderr


def low_memlock(vllm, *args):
    """doctor with a real 64 KiB locked-memory limit and without CAP_IPC_LOCK (util-linux setpriv, prlimit)."""
    cmd = ["setpriv", "--bounding-set", "-ipc_lock", "prlimit", "--memlock=65536:65536",
           vllm.python, "-m", "vllm_ple_offload.cli", "doctor", "--json", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=vllm.env({"VLLM_PLE_CPU_OFFLOAD": "1"}), timeout=600)
    doc = json.loads(r.stdout)
    assert doc["facts"]["memlock_bytes"] == 65536 and doc["facts"]["cap_ipc_lock"] is False
    return r.returncode, finding(doc, "memlock")


def test_memlock_too_low_for_the_table(vllm):
    code, m = low_memlock(vllm, "--table-gib", "48")
    assert code == 2 and m["level"] == "error"
    assert m["message"] == "locked-memory limit is 64 KiB, but the PLE table needs 48.00 GiB pinned"
    assert "--ulimit memlock=-1" in m["fix"]


def test_memlock_with_unknown_table_size_warns(vllm):
    _, m = low_memlock(vllm)
    assert m["level"] == "warning" and "checked then" in m["message"]


def test_a_kit_home_over_the_os_limit_is_named_by_the_doctor_and_the_plugins_sidecar_check(vllm, sidecar, tmp_path):
    """Issue 43 item 2: the plugin's verified-cache lookup stopped the process on ENAMETOOLONG without naming
    SGLANG_SSD_STREAM_HOME; the doctor and the serving check now refuse naming it."""
    import os

    home = str(tmp_path / ("h" * (os.pathconf("/", "PC_NAME_MAX") + 1)))
    env = {"SGLANG_SSD_STREAM_HOME": home, "VLLM_PLE_ALLOW_UNPATCHED": "1"}
    r = doctor(vllm, "--backend", "pread", "--sidecar", str(sidecar), "--", "--enforce-eager", **env)
    assert "Traceback" not in r.stderr and r.returncode == 2, (r.stdout, r.stderr[-2000:])
    assert "SGLANG_SSD_STREAM_HOME=" in r.stdout and "over the OS limit" in r.stdout, r.stdout
    serving = subprocess.run(
        [vllm.python, "-c", "import os; from vllm_ple_offload import env, runtime_checks; "
         "runtime_checks.require_verified_sidecar(env.read_settings(dict(os.environ)))"],
        capture_output=True, text=True, timeout=600,
        env=vllm.env({**env, "VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": "pread",
                      "VLLM_PLE_SIDECAR": str(sidecar)}))
    assert serving.returncode != 0 and "PreflightFailed" in serving.stderr, serving.stderr[-2000:]
    assert "SGLANG_SSD_STREAM_HOME=" in serving.stderr and "over the OS limit" in serving.stderr, serving.stderr
