"""Host prerequisites on fake /proc, cgroup and /etc trees: CPU quota (v1 and v2), thread sizing, L4T, disk."""

from __future__ import annotations

import pytest

from sglang_ssd_stream.checks import host
from sglang_ssd_stream.checks.host import GIB, CpuBudget
from sglang_ssd_stream.findings import ERROR, OK, WARNING


def _v2(tmp_path, rel="/system.slice/qwen.service", levels=None):
    """A unified hierarchy: /proc/self/cgroup names ``rel``; ``levels`` maps a directory to its cpu.max."""
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(f"0::{rel}\n")
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu io memory\n")
    for d, value in (levels or {}).items():
        p = root / d.strip("/") if d != "/" else root
        p.mkdir(parents=True, exist_ok=True)
        (p / "cpu.max").write_text(value + "\n")
    return proc, root


def test_v2_quota_is_the_tightest_ancestor(tmp_path):
    proc, root = _v2(tmp_path, levels={"/system.slice": "800000 100000", "/system.slice/qwen.service": "max 100000",
                                       "/": "max 100000"})
    quota, source = host.cgroup_quota(proc_self=proc, cgroup_root=root)
    assert quota == 8.0 and source.endswith("system.slice/cpu.max")
    b = host.cpu_budget(proc_self=proc, cgroup_root=root, affinity=14)
    assert (b.cpus, b.quota_cpus) == (8.0, 8.0)


def test_v2_unlimited_and_a_container_namespace(tmp_path):
    proc, root = _v2(tmp_path, rel="/", levels={"/": "max 100000"})
    assert host.cgroup_quota(proc_self=proc, cgroup_root=root) == (None, "")
    proc, root = _v2(tmp_path / "c", rel="/", levels={"/": "1600000 100000"})  # docker --cpus 16, cgroupns
    assert host.cgroup_quota(proc_self=proc, cgroup_root=root)[0] == 16.0


def test_v1_cfs_quota(tmp_path):
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text("4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n0::/\n")
    d = tmp_path / "cgroup" / "cpu,cpuacct" / "docker" / "abc"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("1600000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    top = tmp_path / "cgroup" / "cpu,cpuacct"
    (top / "cpu.cfs_quota_us").write_text("-1\n")
    (top / "cpu.cfs_period_us").write_text("100000\n")
    assert host.cgroup_quota(proc_self=proc, cgroup_root=tmp_path / "cgroup")[0] == 16.0


def test_no_cgroup_at_all(tmp_path):
    assert host.cgroup_quota(proc_self=tmp_path / "none", cgroup_root=tmp_path / "none") == (None, "")


@pytest.mark.parametrize("affinity, quota, cap", [
    (76, 16.0, 12),  # write-up 004: 76 workers under a 16-CPU quota; 12 removed the throttling
    (14, None, 28),  # Thor without a quota: 003's 24 fetch threads stay
    (128, 2.5, 1),
    (128, 1.0, 1),
    (4, 64.0, 8),  # affinity is the tighter limit
])
def test_thread_cap(affinity, quota, cap):
    assert host.thread_cap(CpuBudget(affinity, quota, "x"))[0] == cap


def test_size_threads_lowers_defaults_and_profile_values_but_not_the_operators():
    budget = CpuBudget(76, 16.0, "cpu.max")
    knobs = {"SGLANG_SSD_STREAM_READ_WORKERS": 16, "VLLM_PLE_FETCH_WORKERS": None, "OTHER": None}
    changes, notes = host.size_threads({"VLLM_PLE_FETCH_WORKERS": "24"}, knobs, budget)
    assert changes == {"SGLANG_SSD_STREAM_READ_WORKERS": "12", "VLLM_PLE_FETCH_WORKERS": "12"}
    assert any("2,242 s" in n for n in notes)
    changes, _ = host.size_threads({"SGLANG_SSD_STREAM_READ_WORKERS": "40"}, knobs, budget,
                                   explicit={"SGLANG_SSD_STREAM_READ_WORKERS"})
    assert changes == {}
    assert host.size_threads({}, knobs, CpuBudget(14, None, ""))[0] == {}


def test_thread_findings():
    budget = CpuBudget(76, 16.0, "cpu.max")
    warn, ok = host.thread_findings({"A": 24, "B": 12}, budget)
    assert warn.level == WARNING and warn.fix == "export A=12 (serve sizes it when you leave it unset)"
    assert ok.level == OK


@pytest.mark.parametrize("line, name, level", [
    ("# R38 (release), REVISION: 4.0, GCID: 41, BOARD: generic, EABI: aarch64, DATE: Mon", "R38.4.0", OK),
    ("# R39 (release), REVISION: 2.0, GCID: 1, BOARD: generic, EABI: aarch64, DATE: x", "R39.2.0", WARNING),
    ("# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64", "R36.4.3", ERROR),
])
def test_tegra_release(tmp_path, line, name, level):
    f = tmp_path / "nv_tegra_release"
    f.write_text(line + "\n# KERNEL_VARIANT: oot\n")
    r = host.tegra_release(f)
    assert r.name() == name
    found = host.tegra_finding(r, {(38, 4): "write-up 000 (SGLang)"}, expected=True)
    assert found.level == level and (found.fix or level == OK)


def test_tegra_missing(tmp_path):
    assert host.tegra_release(tmp_path / "none") is None
    assert host.tegra_finding(None, {}, expected=False) is None
    assert host.tegra_finding(None, {}, expected=True).level == WARNING
    (tmp_path / "garbled").write_text("hello\n")
    assert host.tegra_finding(host.tegra_release(tmp_path / "garbled"), {}, expected=True).level == WARNING


def test_disk_finding_uses_the_nearest_existing_ancestor(tmp_path):
    free, at = host.free_bytes(tmp_path / "not" / "yet")
    assert at == str(tmp_path) and free > 0
    assert host.disk_finding("disk", tmp_path / "x", 1, "the model").level == OK
    short = host.disk_finding("disk", tmp_path, free + 100 * GIB, "the model", refuse=True)
    assert short.level == ERROR and "needs" in short.message
    assert host.disk_finding("disk", tmp_path, free + 100 * GIB, "the model").level == WARNING
