"""The doctor's checks over injected facts (pure Python: no vLLM import, no GPU; the plugin and
``vllm-ple-offload doctor`` run the same checks). Checks that need vLLM's own code (its parser, its
graph modes) are in ``checks/check_doctor_launch.py``."""

from __future__ import annotations

import warnings

import pytest

from sglang_ssd_stream.checks.sidecar import forget as forget_sidecars
from sglang_ssd_stream.findings import errors_of
from vllm_ple_offload import doctor as preflight
from vllm_ple_offload import env
from vllm_ple_offload.doctor import ERROR, OK, WARNING, DiskFacts, Facts
from vllm_ple_offload.errors import PreflightFailed

GIB = 1 << 30
PINNED = env.PleSettings(backend="pinned", sidecar=None, fetch_workers=24, rows_per_task=2048, stats_interval=0,
                         allow_unpatched=False)
SIDECAR = env.PleSettings(backend="pread", sidecar=None, fetch_workers=24, rows_per_task=2048, stats_interval=0,
                          allow_unpatched=False)


def facts(**kw) -> Facts:
    base = dict(uva=True, platform="CudaPlatform", memlock_bytes=None, cap_ipc_lock=False, cap_sys_ptrace=False,
                yama_ptrace_scope=1, seccomp_filter=True, alloc_conf={}, disks=(), row_bytes={3: 160})
    base.update(kw)
    return Facts(**base)


def by_check(findings, check):
    return [f for f in findings if f.check == check]


def streaming(tmp_path, **extra):
    return env.read_settings({"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": "pread",
                              "VLLM_PLE_SIDECAR": str(tmp_path), **extra})


def test_healthy_machine_passes():
    findings = preflight.run_checks(PINNED, facts())
    assert not errors_of(findings)
    preflight.raise_on_errors(findings)  # does not raise


def test_no_uva_refuses_pinned_and_names_the_fix():
    findings = preflight.run_checks(PINNED, facts(uva=False, platform="CpuPlatform"))
    [uva] = by_check(findings, "uva")
    assert uva.level == ERROR and "CpuPlatform" in uva.message and "VLLM_PLE_OFFLOAD_BACKEND=pread" in uva.fix
    with pytest.raises(PreflightFailed, match="uva") as e:
        preflight.raise_on_errors(findings)
    assert e.value.exit_code == 4


def test_no_uva_only_warns_for_streaming():
    [uva] = by_check(preflight.run_checks(SIDECAR, facts(uva=False, platform="CpuPlatform")), "uva")
    assert uva.level == WARNING and "not a way to serve" in uva.message


def test_memlock_too_low_is_refused_with_the_fix(monkeypatch):
    from sglang_ssd_stream.checks.memory import LockedMemory
    from vllm_ple_offload import runtime_checks

    f = preflight.check_memlock(facts(memlock_bytes=64 << 10), 48 * GIB, "the PLE table")
    assert f.level == ERROR and "limit is 64 KiB" in f.message and "needs 48.00 GiB" in f.message
    assert "--ulimit memlock=-1" in f.fix and "LimitMEMLOCK=infinity" in f.fix
    monkeypatch.setattr(runtime_checks, "locked_memory", lambda: LockedMemory(64 << 10, False))
    with pytest.raises(PreflightFailed, match="memlock"):  # at allocation, from the floor's facts of this process
        preflight.require_memlock(48 * GIB, what="the PLE table")


def test_memlock_enough_unlimited_or_cap_ipc_lock_passes():
    assert preflight.check_memlock(facts(memlock_bytes=64 * GIB), 48 * GIB, "t").level == OK
    assert preflight.check_memlock(facts(memlock_bytes=None), 48 * GIB, "t").level == OK
    assert preflight.check_memlock(facts(memlock_bytes=64 << 10, cap_ipc_lock=True), 48 * GIB, "t").level == OK


def test_memlock_unknown_size_warns_at_plugin_start():
    [m] = by_check(preflight.run_checks(PINNED, facts(memlock_bytes=8 << 20)), "memlock")
    assert m.level == WARNING and "checked then" in m.message


def test_memlock_is_not_checked_for_streaming():
    assert not by_check(preflight.run_checks(SIDECAR, facts(memlock_bytes=64 << 10)), "memlock")


@pytest.mark.parametrize("conf_var", preflight.ALLOC_CONF_VARS)
def test_ptrace_denied_with_fd_import_is_refused(conf_var):
    findings = preflight.run_checks(PINNED, facts(alloc_conf={conf_var: "expandable_segments:True"}))
    [p] = by_check(findings, "ptrace")
    assert p.level == ERROR and "pidfd_getfd" in p.message and "seccomp" in p.message
    assert "--cap-add SYS_PTRACE" in p.fix and "never --privileged" in p.fix
    assert "privileged: true" not in p.fix


def test_ptrace_denied_by_yama_names_the_scope():
    f = facts(alloc_conf={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, seccomp_filter=False,
              yama_ptrace_scope=2)
    [p] = by_check(preflight.run_checks(PINNED, f), "ptrace")
    assert p.level == ERROR and "ptrace_scope is 2" in p.message


def test_expandable_segments_with_ptrace_is_a_warning():
    f = facts(alloc_conf={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:true"},
              cap_sys_ptrace=True)
    findings = preflight.run_checks(PINNED, f)
    assert not by_check(findings, "ptrace")
    [x] = by_check(findings, "expandable_segments")
    assert x.level == WARNING and x.fix == "remove expandable_segments:True"


def test_expandable_segments_false_is_fine():
    f = facts(alloc_conf={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert not f.expandable_segments
    [x] = by_check(preflight.run_checks(PINNED, f), "expandable_segments")
    assert x.level == OK


def test_ptrace_permission_facts():
    assert facts(cap_sys_ptrace=True).ptrace_permitted
    assert facts(yama_ptrace_scope=0, seccomp_filter=False).ptrace_permitted
    assert facts(yama_ptrace_scope=None, seccomp_filter=False).ptrace_permitted
    assert not facts(yama_ptrace_scope=0, seccomp_filter=True).ptrace_permitted
    assert not facts(yama_ptrace_scope=1, seccomp_filter=False).ptrace_permitted


@pytest.mark.parametrize("kind,level", [("network", WARNING), ("hdd", WARNING), ("nvme", OK), ("unknown", OK)])
def test_sidecar_disk(kind, level):
    disk = DiskFacts("/models/ple/layer-3.bin", "nfs4" if kind == "network" else "ext4", kind)
    [d] = by_check(preflight.run_checks(SIDECAR, facts(disks=(disk,))), "sidecar_disk")
    assert d.level == level
    if level == WARNING:
        assert d.fix == "copy the artifact to a local NVMe disk"


@pytest.mark.parametrize("fstype,kind", [("nfs4", "network"), ("tmpfs", "memory"), ("overlay", "unknown")])
def test_sidecar_disks_use_the_shared_classification(tmp_path, monkeypatch, fstype, kind):
    """vLLM's preflight classifies with the same code as sglang's doctor (sidecar.storage)."""
    import numpy as np

    from sglang_ssd_stream.sidecar import storage
    from tests.vllm.synthetic import write_sidecar

    man = write_sidecar(tmp_path / "art", {3: ("bfloat16", np.zeros((4, 8), np.uint8))})
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nsrc {(tmp_path / 'art').resolve()} {fstype} rw 0 0\n")
    monkeypatch.setattr(storage, "MOUNTS_PATH", str(mounts))
    s = env.read_settings({"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": "mmap",
                           "VLLM_PLE_SIDECAR": str(man)})
    from sglang_ssd_stream.sidecar.errors import SidecarWarning

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        [disk] = preflight.sidecar_disks(s)
    network_warnings = [w for w in seen
                        if issubclass(w.category, SidecarWarning) and "network filesystem" in str(w.message)]
    assert len(network_warnings) == (kind == "network")  # the manifest's warning agrees with the classification
    assert (disk.fstype, disk.kind) == (fstype, kind)
    assert storage.classify_disk(disk.path).kind == kind


def test_sidecar_missing_is_refused(tmp_path):
    from sglang_ssd_stream.sidecar.errors import SidecarManifestError

    s = env.read_settings({"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": "pread",
                           "VLLM_PLE_SIDECAR": str(tmp_path / "nowhere")})
    with pytest.raises(SidecarManifestError, match="sidecar manifest not found"):
        preflight.sidecar_disks(s)


def test_sidecar_disks_classify_every_table(tmp_path):
    import numpy as np

    from tests.vllm.synthetic import write_sidecar

    man = write_sidecar(tmp_path, {3: ("bfloat16", np.zeros((4, 8), np.uint8)),
                                   7: ("bfloat16", np.ones((4, 8), np.uint8))})
    s = env.read_settings({"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLE_OFFLOAD_BACKEND": "mmap",
                           "VLLM_PLE_SIDECAR": str(man)})
    disks = preflight.sidecar_disks(s)
    assert [d.path.rsplit("/", 1)[-1] for d in disks] == ["layer-3.bin", "layer-7.bin"]


def test_sidecar_that_does_not_load_is_a_finding(tmp_path):
    """A missing or truncated sidecar is an error finding (exit 2), not an exception (it was exit 3)."""
    s = streaming(tmp_path / "nowhere")
    f = preflight.Facts(uva=True, platform="CudaPlatform", memlock_bytes=None, cap_ipc_lock=False, cap_sys_ptrace=False,
                        yama_ptrace_scope=None, seccomp_filter=False, **preflight._sidecar_facts(s))
    [side] = by_check(preflight.run_checks(s, f), "sidecar")
    assert side.level == ERROR and "sidecar manifest not found" in side.message
    assert "sglang-ssd-stream sidecar verify" in side.fix


def test_truncated_table_is_a_finding(tmp_path):
    import numpy as np

    from tests.vllm.synthetic import write_sidecar

    man = write_sidecar(tmp_path / "art", {3: ("bfloat16", np.zeros((64, 8), np.uint8))})
    table = tmp_path / "art" / "ple" / "layer-3.bin"
    table.write_bytes(table.read_bytes()[:-8])
    found = preflight._sidecar_facts(streaming(man))
    assert "truncated" in found["sidecar_error"] or "bytes" in found["sidecar_error"]


@pytest.mark.parametrize("workers,rows,row,knob", [
    (24, 2048, 160, None),  # the Thor default: 7.5 MiB
    (128, 2048, 1 << 10, None),  # exactly the limit
    (256, 1 << 20, 160, "VLLM_PLE_ROWS_PER_TASK to at most 6,553"),  # the 40 GiB case
    (256, 4096, 1 << 10, "VLLM_PLE_FETCH_WORKERS to at most 64"),  # workers raised further than rows
])
def test_fetch_round_is_bounded_and_names_the_knob(tmp_path, workers, rows, row, knob):
    s = streaming(tmp_path, VLLM_PLE_FETCH_WORKERS=str(workers), VLLM_PLE_ROWS_PER_TASK=str(rows))
    ok = knob is None
    assert (env.fetch_round_bytes(s, row) <= env.MAX_FETCH_ROUND_BYTES) is ok
    [f] = by_check(preflight.run_checks(s, facts(row_bytes={3: row, 7: 16})), "fetch_round")  # the widest table
    assert f.level == (OK if ok else ERROR)
    assert f"{workers} x {rows:,} x {row} B" in f.message  # the same product env.fetch_round_bytes computes
    if not ok:
        assert knob in f.fix
        # the value named fits
        fitted = dict(VLLM_PLE_FETCH_WORKERS=str(workers), VLLM_PLE_ROWS_PER_TASK=str(rows))
        name, value = knob.split(" to at most ")
        fitted[name] = value.replace(",", "")
        assert env.fetch_round_bytes(streaming(tmp_path, **fitted), row) <= env.MAX_FETCH_ROUND_BYTES


def test_fetch_round_not_checked_for_pinned():
    assert not by_check(preflight.run_checks(PINNED, facts(row_bytes={3: 160})), "fetch_round")


def test_no_verify_is_reported(tmp_path):
    s = streaming(tmp_path, VLLM_PLE_NO_VERIFY="1")
    [w] = by_check(preflight.run_checks(s, facts(row_bytes={3: 160})), "sidecar_sha")
    assert w.level == WARNING and "VLLM_PLE_NO_VERIFY=1" in w.message and "corrupted row would be served" in w.message
    assert not by_check(preflight.run_checks(streaming(tmp_path), facts(row_bytes={3: 160})), "sidecar_sha")


def test_verify_once_per_process_and_refuses_a_flipped_byte(tmp_path, monkeypatch):
    """The shared verifier with its verified cache; one byte flipped mid-table is an error finding. The doctor's
    check reads the cache and writes nothing; the plugin's (require_verified_sidecar) records it (issue 38 item 2)."""
    import numpy as np

    from sglang_ssd_stream.sidecar import verify
    from tests.vllm.synthetic import random_table, write_sidecar

    monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(tmp_path / "data"))
    man = write_sidecar(tmp_path / "art", {3: ("bfloat16", random_table(512, 32, 1))})
    calls = []
    real = verify.verify_sidecar
    monkeypatch.setattr(verify, "verify_sidecar", lambda *a, **k: calls.append(1) or real(*a, **k))
    ok = preflight.verify_sidecar_once(streaming(man), progress=False)
    assert ok.level == OK and "1 table(s) match" in ok.message and "no verified cache" in ok.message
    assert preflight.verify_sidecar_once(streaming(man), progress=False) is ok and len(calls) == 1  # once per process
    assert sorted(p.name for p in (tmp_path / "art").iterdir()) == ["ple", "ssd-stream.json"]  # the doctor's: no record
    assert not (tmp_path / "data").exists()  # nor a lock
    preflight.require_verified_sidecar(streaming(man))  # the plugin's: hashes (a report stands in for no load) ...
    assert len(calls) == 2 and (tmp_path / "art" / ".ssd-stream-verified.json").is_file()  # ... and records
    forget_sidecars()
    again = preflight.verify_sidecar_once(streaming(man), progress=False)
    assert "1 from the verified cache" in again.message  # the next process: the cache, no re-read

    bad = write_sidecar(tmp_path / "bad", {3: ("bfloat16", random_table(512, 32, 1))})
    table = tmp_path / "bad" / "ple" / "layer-3.bin"
    data = bytearray(table.read_bytes())
    data[len(data) // 2] ^= 0xFF
    table.write_bytes(bytes(data))
    f = preflight.verify_sidecar_once(streaming(bad), progress=False)
    assert f.level == ERROR and "has SHA-256" in f.message and "never serve it with VLLM_PLE_NO_VERIFY=1" in f.fix
    with pytest.raises(PreflightFailed, match=r"\[error\] sidecar_sha: PLE table ple/layer-3.bin"):
        preflight.require_verified_sidecar(streaming(bad))
    skipped = preflight.verify_sidecar_once(streaming(bad, VLLM_PLE_NO_VERIFY="1"), progress=False)
    assert skipped.level == WARNING  # the explicit opt-out
    del np


@pytest.mark.parametrize("environ,level", [
    ({}, None),
    ({"VLLM_PLUGINS": "other"}, None),  # no VLLM_PLE_*: nothing to lose
    ({"VLLM_PLE_CPU_OFFLOAD": "1"}, OK),
    ({"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLUGINS": "other,ple_offload"}, OK),
    ({"VLLM_PLE_CPU_OFFLOAD": "yes", "VLLM_PLUGINS": "other"}, ERROR),  # the silent case
    ({"VLLM_PLE_CPU_OFFLOAD": "1", "VLLM_PLUGINS": ""}, ERROR),
])
def test_plugin_allowlist(environ, level):
    f = preflight.check_plugin_allowed(environ)
    assert (f.level if f else None) == level
    if level == ERROR:
        assert "never runs this plugin" in f.message and "add ple_offload to VLLM_PLUGINS" in f.fix


def test_json_report_says_ok():
    from sglang_ssd_stream.findings import as_json

    f = facts()
    doc = as_json(preflight.facts_json(f), preflight.run_checks(PINNED, f))
    assert doc["ok"] is True and doc["facts"]["ptrace_permitted"] is False


def test_a_model_views_sidecar_loads_like_on_sglang(tmp_path):
    """A view's tables are links into the prepared snapshot its marker trusts; anything else still escapes."""
    import numpy as np

    from sglang_ssd_stream.sidecar.errors import SidecarPathEscape
    from tests.vllm.synthetic import random_table, write_sidecar, write_view

    write_sidecar(tmp_path / "prepared", {3: ("bfloat16", random_table(64, 8, 0))})
    view = write_view(tmp_path / "view", tmp_path / "prepared")
    facts = preflight._sidecar_facts(streaming(view))
    assert facts.get("sidecar_error") is None and facts["row_bytes"] == {3: 8}
    assert preflight.verify_sidecar_once(streaming(view), progress=False).level == OK
    (tmp_path / "view" / ".ssd-stream-view.json").unlink()  # no marker: the links escape the artifact
    with pytest.raises(SidecarPathEscape):
        preflight.load_sidecar(view)
    del np


def test_a_table_outside_the_artifact_loads_from_a_named_root(tmp_path):
    """The doctor's facts and the SHA-256 check load a table linked to another disk only with
    VLLM_PLE_TRUSTED_ROOTS naming it; without, the refusal names the knob."""
    from sglang_ssd_stream.sidecar.errors import SidecarPathEscape
    from tests.vllm.synthetic import random_table, write_sidecar

    manifest = write_sidecar(tmp_path / "sc", {3: ("bfloat16", random_table(64, 8, 0))})
    disk2 = tmp_path / "disk2"
    disk2.mkdir()
    link = tmp_path / "sc" / "ple" / "layer-3.bin"
    link.rename(disk2 / link.name)
    link.symlink_to(disk2 / link.name)
    refused = preflight._sidecar_facts(streaming(manifest))
    assert "symlink escape" in refused["sidecar_error"] and "VLLM_PLE_TRUSTED_ROOTS" in refused["sidecar_error"]
    assert preflight.verify_sidecar_once(streaming(manifest), progress=False).level == ERROR
    with pytest.raises(SidecarPathEscape):
        preflight.load_sidecar(manifest)
    trusted = streaming(manifest, VLLM_PLE_TRUSTED_ROOTS=str(disk2))
    facts = preflight._sidecar_facts(trusted)
    assert facts.get("sidecar_error") is None and facts["row_bytes"] == {3: 8}
    assert preflight.verify_sidecar_once(trusted, progress=False).level == OK
    assert [f.level for f in preflight.check_sidecar(trusted, None)] == [OK]


def test_fetch_pool_is_judged_against_the_cpu_quota():
    """Write-up 004: 76 pool threads under a 16-CPU cgroup quota were throttled for 2,242 s."""
    from sglang_ssd_stream.checks.host import CpuBudget

    quota16 = CpuBudget(affinity=64, quota_cpus=16.0, source="/sys/fs/cgroup/cpu.max")
    (found,) = by_check(preflight.run_checks(SIDECAR, facts(cpu=quota16)), "cpu_quota")
    assert found.level == WARNING and "VLLM_PLE_FETCH_WORKERS=24" in found.message
    assert found.fix == "export VLLM_PLE_FETCH_WORKERS=12 (serve sizes it when you leave it unset)"
    roomy = CpuBudget(affinity=64, quota_cpus=None, source=None)
    assert by_check(preflight.run_checks(SIDECAR, facts(cpu=roomy)), "cpu_quota")[0].level == OK
    assert by_check(preflight.run_checks(PINNED, facts(cpu=quota16)), "cpu_quota") == []  # no pool with pinned


def test_l4t_release_on_a_jetson():
    from sglang_ssd_stream.checks.host import TegraRelease

    ran = TegraRelease(39, 2, 0, "# R39 (release), REVISION: 2.0")
    old = TegraRelease(36, 4, 0, "# R36 (release), REVISION: 4.0")
    assert by_check(preflight.run_checks(PINNED, facts(tegra=ran)), "l4t")[0].level == OK
    assert by_check(preflight.run_checks(PINNED, facts(tegra=old)), "l4t")[0].level == ERROR
    assert by_check(preflight.run_checks(PINNED, facts()), "l4t") == []  # not a Jetson: nothing to say


# ----------------------------------------------------------------------------- row cache


def test_row_cache_off_is_said(tmp_path):
    [f] = by_check(preflight.run_checks(streaming(tmp_path, VLLM_PLE_ROW_CACHE_MB="0"), facts()), "row_cache")
    assert f.level == OK and "VLLM_PLE_ROW_CACHE_MB=0: no row cache and no prompt-ahead prefetch" in f.message
    assert not by_check(preflight.run_checks(PINNED, facts()), "row_cache")  # the pinned table needs none


def test_row_cache_budget_is_checked_against_memlock(tmp_path):
    s = streaming(tmp_path)  # the default: 1024 MiB
    memlock = [f for f in preflight.run_checks(s, facts(memlock_bytes=64 << 20)) if f.check == "memlock"]
    assert [f.level for f in memlock] == [ERROR]
    assert "64.0 MiB" in memlock[0].message and "the PLE row cache (VLLM_PLE_ROW_CACHE_MB=1024 per worker process) " \
        "needs 1.00 GiB pinned" in memlock[0].message and "--ulimit memlock=-1" in memlock[0].fix
    ok = [f for f in preflight.run_checks(s, facts(memlock_bytes=2 * GIB)) if f.check == "memlock"]
    assert [f.level for f in ok] == [OK]
    # no UVA (a CPU platform): the rows are plain memory, nothing is locked
    assert not [f for f in preflight.run_checks(s, facts(uva=False, memlock_bytes=1 << 20)) if f.check == "memlock"]


@pytest.mark.parametrize("avail_gib,procs,level,text", [
    (24, 1, OK, "the row caches take 1.00 GiB of MemAvailable 24.00 GiB"),
    (24, 16, WARNING, "the row caches take 16.00 GiB for 16 worker process(es), more than half of MemAvailable"),
    (24, 24, ERROR, "the row caches take 24.00 GiB for 24 worker process(es), but MemAvailable is only 24.00 GiB"),
    (0.5, 1, ERROR, "but MemAvailable is only 512.0 MiB"),
    (None, 1, WARNING, "MemAvailable is unknown here"),
])
def test_row_cache_budget_against_mem_available(tmp_path, avail_gib, procs, level, text):
    f = facts(mem_available_bytes=None if avail_gib is None else int(avail_gib * GIB), worker_processes=procs)
    [mem] = by_check(preflight.run_checks(streaming(tmp_path), f), "row_cache_memory")
    assert mem.level == level and text in mem.message
    if level != OK:
        assert "lower VLLM_PLE_ROW_CACHE_MB (0 turns the cache off)" in mem.fix


def test_mem_available_is_read_from_meminfo(tmp_path):
    p = tmp_path / "meminfo"
    p.write_text("MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   12345678 kB\n")
    assert preflight._mem_available(str(p)) == 12345678 * 1024
    p.write_text("MemTotal: 1 kB\n")
    assert preflight._mem_available(str(p)) is None and preflight._mem_available(str(tmp_path / "none")) is None
