"""``vllm-ple-offload doctor`` in the real vLLM venv (CPU platform, pristine vLLM)."""

from __future__ import annotations

import json
import subprocess

from .synthetic import random_table, write_sidecar


def doctor(vllm, *args, **env):
    return subprocess.run([vllm.python, "-m", "vllm_ple_offload.cli", "doctor", *args], capture_output=True,
                          text=True, env=vllm.env(env), timeout=600)


def test_pinned_on_a_cpu_platform_fails_and_names_the_fixes(vllm):
    r = doctor(vllm)
    assert r.returncode == 4, r.stderr[-2000:]
    assert "backend=pinned (assumed (the plugin is off))" in r.stdout
    assert "[error] uva:" in r.stdout and "use VLLM_PLE_OFFLOAD_BACKEND=pread" in r.stdout
    assert "[error] source_state:" in r.stdout and "vllm-ple-offload patch apply" in r.stdout
    assert r.stdout.rstrip().endswith("FAILED: fix the errors above")


def test_streaming_backend_passes_with_warnings(vllm, tmp_path):
    manifest = write_sidecar(tmp_path, {3: ("bfloat16", random_table(64, 8, 0))})
    r = doctor(vllm, "--backend", "pread", "--sidecar", str(manifest), "--json", VLLM_PLE_CPU_OFFLOAD="1",
               VLLM_PLE_ALLOW_UNPATCHED="1")
    assert r.returncode == 0, (r.stdout, r.stderr[-2000:])
    doc = json.loads(r.stdout)
    assert doc["ok"] is True and doc["settings"] == {"backend": "pread", "sidecar": str(manifest),
                                                     "plugin_enabled": True}
    levels = {}
    for f in doc["findings"]:
        levels.setdefault(f["check"], set()).add(f["level"])
    assert levels["uva"] == {"warning"} and levels["source_state"] == {"warning", "ok"}  # unpatched; watch intact
    assert "sidecar_disk" in levels and "error" not in set().union(*levels.values())
    assert doc["facts"]["platform"] == "CpuPlatform"


def low_memlock(vllm, *args):
    """doctor with a real 64 KiB locked-memory limit and without CAP_IPC_LOCK (util-linux setpriv, prlimit)."""
    cmd = ["setpriv", "--bounding-set", "-ipc_lock", "prlimit", "--memlock=65536:65536",
           vllm.python, "-m", "vllm_ple_offload.cli", "doctor", "--json", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=vllm.env(), timeout=600)
    doc = json.loads(r.stdout)
    assert doc["facts"]["memlock_bytes"] == 65536 and doc["facts"]["cap_ipc_lock"] is False
    [m] = [f for f in doc["findings"] if f["check"] == "memlock"]
    return r.returncode, m


def test_memlock_too_low_for_the_table(vllm):
    code, m = low_memlock(vllm, "--table-gib", "48")
    assert code == 4 and m["level"] == "error"
    assert m["message"] == "locked-memory limit is 64 KiB, but the PLE table needs 48.00 GiB pinned"
    assert "--ulimit memlock=-1" in m["fix"]


def test_memlock_with_unknown_table_size_warns(vllm):
    _, m = low_memlock(vllm)
    assert m["level"] == "warning" and "checked then" in m["message"]


def test_bad_settings_are_a_usage_error(vllm):
    r = doctor(vllm, VLLM_PLE_CPU_OFFLOAD="1", VLLM_PLE_OFFLOAD_BACKEND="pread")
    assert r.returncode == 64 and "needs VLLM_PLE_SIDECAR" in r.stderr


def test_missing_sidecar(vllm, tmp_path):
    r = doctor(vllm, "--backend", "mmap", "--sidecar", str(tmp_path / "none"))
    assert r.returncode == 3 and "sidecar manifest not found" in r.stderr
