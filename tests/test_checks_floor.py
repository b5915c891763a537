"""Issue 25 item 1: one checks floor under both doctors. The same host and row-cache budget give the same
findings from the SGLang doctor and the vLLM doctor (the engines differ only in the knob and process names).

Before the floor, SGLang's row-cache check only reported the budget: no locked-memory check (its rows are
registered with CUDA, as on vLLM) and no MemAvailable check for its scheduler processes.
"""

from __future__ import annotations

import dataclasses

import pytest

from sglang_ssd_stream.checks.memory import LockedMemory, locked_memory
from sglang_ssd_stream.findings import ERROR, OK, WARNING
from sglang_ssd_stream.sglang import doctor as sg
from vllm_ple_offload import doctor as vl
from vllm_ple_offload import env as vllm_env

GIB, MIB = 1 << 30, 1 << 20


def _sglang(locked: LockedMemory, avail: int | None, procs: int, mib: int):
    rc = {"variable": "SGLANG_SSD_STREAM_ROW_CACHE_MB", "mib": mib, "gib": mib / 1024, "source": "exported"}
    facts = sg.Facts(device=None, source=None, c_compiler=None, cxx_compiler=None, swap_bytes=None, swappiness=None,
                     journald_persistent=None, request=sg.Request(row_cache=rc, scheduler_processes=procs),
                     locked=locked, mem_available_bytes=avail)
    return {f.check: f for f in sg.check_row_cache(facts)}


def _vllm(locked: LockedMemory, avail: int | None, procs: int, mib: int):
    settings = vllm_env.read_settings({vllm_env.CPU_OFFLOAD: "1", vllm_env.BACKEND: vllm_env.MMAP,
                                       vllm_env.SIDECAR: "/x/ssd-stream.json", vllm_env.ROW_CACHE_MB: str(mib)})
    facts = vl.Facts(uva=True, platform="CudaPlatform", memlock_bytes=locked.limit_bytes,
                     cap_ipc_lock=locked.cap_ipc_lock, cap_sys_ptrace=False, yama_ptrace_scope=None,
                     seccomp_filter=False, mem_available_bytes=avail, worker_processes=procs)
    return {f.check: f for f in vl.check_row_cache(settings, facts)}


@pytest.mark.parametrize("locked, avail, procs, memlock, memory", [
    (LockedMemory(64 * 1024, False), 24 * GIB, 1, ERROR, OK),
    (LockedMemory(64 * 1024, True), 24 * GIB, 16, OK, WARNING),
    (LockedMemory(None, False), 24 * GIB, 24, OK, ERROR),
    (LockedMemory(8 * GIB, False), None, 2, OK, WARNING),
])
def test_both_doctors_judge_the_same_host_the_same(locked, avail, procs, memlock, memory):
    s, v = _sglang(locked, avail, procs, 1024), _vllm(locked, avail, procs, 1024)
    assert (s["memlock"].level, s["row_cache_memory"].level) == (memlock, memory)
    assert (v["memlock"].level, v["row_cache_memory"].level) == (memlock, memory)
    for check in ("memlock", "row_cache_memory"):
        neutral = [f.message.replace("scheduler process", "P").replace("worker process", "P")
                   .replace("SGLANG_SSD_STREAM_ROW_CACHE_MB", "K").replace("VLLM_PLE_ROW_CACHE_MB", "K")
                   for f in (s[check], v[check])]
        assert neutral[0] == neutral[1], neutral


def test_the_sglang_doctor_counts_every_scheduler_process():
    r = sg.request_from_argv(["--tp-size", "2", "--data-parallel-size", "3"], env={})
    assert r.scheduler_processes == 6
    assert sg.request_from_argv([], env={}).scheduler_processes == 1
    found = _sglang(LockedMemory(None, False), 10 * GIB, 6, 1024)["row_cache_memory"]
    assert found.level == WARNING and "6.00 GiB for 6 scheduler process(es)" in found.message


def test_this_hosts_locked_memory_is_read():
    locked = locked_memory({"CapEff": "0000000000004000"})  # bit 14: CAP_IPC_LOCK
    assert locked.cap_ipc_lock and dataclasses.replace(locked_memory({}), cap_ipc_lock=False).cap_ipc_lock is False


# ----------------------------------------------------------------------------- the sidecar, judged once


def _neutral(findings):
    return [(f.level, f.check, f.message.replace("SGLANG_SSD_STREAM_NO_VERIFY", "K").replace("VLLM_PLE_NO_VERIFY", "K"))
            for f in findings]


def _both_doctors(artifact, no_verify=False):
    from sglang_ssd_stream.checks import sidecar as floor

    floor.forget()  # each doctor as in its own process
    knob = {"SGLANG_SSD_STREAM_SIDECAR": str(artifact)}
    if no_verify:
        knob["SGLANG_SSD_STREAM_NO_VERIFY"] = "1"
    s = sg.check_sidecar(None, knob, verify_sha=True)
    floor.forget()
    settings = vllm_env.read_settings({vllm_env.CPU_OFFLOAD: "1", vllm_env.BACKEND: vllm_env.MMAP,
                                       vllm_env.SIDECAR: str(artifact), **({vllm_env.NO_VERIFY: "1"} if no_verify
                                                                          else {})})
    v = vl.check_sidecar(settings, None)
    if not no_verify and v[0].level != ERROR:
        v.append(vl.verify_sidecar_once(settings))
    return s, v


def _damage(artifact, how):
    table = next((artifact / "ple").glob("layer-*.bin"))
    data = bytearray(table.read_bytes())
    if how == "flipped":
        data[len(data) // 2] ^= 0x10
    else:
        data = data[:-4096]
    table.write_bytes(bytes(data))


@pytest.mark.parametrize("how, levels", [(None, [OK, OK]), ("flipped", [OK, ERROR]), ("truncated", [ERROR]),
                                         ("no-verify", [OK, WARNING])])
def test_both_doctors_judge_the_same_sidecar_the_same(tmp_path, how, levels):
    from sglang_ssd_stream.sidecar.build import build_sidecar
    from tests.sidecar.conftest import make_checkpoint

    ck = make_checkpoint(tmp_path / "ckpt", {2: ("float8_e4m3fn", 5003, 160)}, parts=8, files=2, seed=2)
    build_sidecar(ck.path, tmp_path / "artifact", progress=False)
    if how in ("flipped", "truncated"):
        _damage(tmp_path / "artifact", how)
    s, v = _both_doctors(tmp_path / "artifact", no_verify=how == "no-verify")
    assert [f.level for f in s] == levels, s
    assert _neutral(s) == _neutral(v), (s, v)
