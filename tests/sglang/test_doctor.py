"""sglang-ssd-stream doctor: each rule on faked facts, the fact readers on fake /proc and /sys trees,
the CLI and the serve seam; plus one run of the real gather_facts() on this machine."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import pytest

from sglang_ssd_stream.checks import host
from sglang_ssd_stream.checks.memory import LockedMemory
from sglang_ssd_stream.errors import EXIT_OK, EXIT_REFUSED
from sglang_ssd_stream.patching.guard import Verdict
from sglang_ssd_stream.sglang import doctor
from sglang_ssd_stream.sglang.doctor import ERROR, GIB, OK, WARNING, Device, Disk, Facts, Request, run_checks

THOR = Device("NVIDIA Thor", (11, 0), 122 * GIB, integrated=True, pageable_memory_access=True)
H200 = Device("NVIDIA H200", (9, 0), 140 * GIB, integrated=False, pageable_memory_access=False)


def source(state: str, listing: str = "sglang/x.py=…") -> Verdict:
    return Verdict("sglang", state, "0.5.23", listing, files=7)


_TMP = {}


def _release_file(major: str, revision: str):
    """A /etc/nv_tegra_release as L4T writes it (kept in a module temp dir for the parametrised cases)."""
    import tempfile
    from pathlib import Path

    d = _TMP.setdefault("dir", Path(tempfile.mkdtemp(prefix="tegra-")))
    f = d / f"{major}-{revision}"
    f.write_text(f"# {major} (release), REVISION: {revision}, GCID: 1, BOARD: generic, EABI: aarch64, DATE: x\n")
    return f


def healthy(**changes) -> Facts:
    """A Thor set up as write-up 000 recommends."""
    base = Facts(device=THOR, source=source("patched"),
                 c_compiler="/usr/bin/cc", cxx_compiler="/usr/bin/c++", swap_bytes=16 * GIB, swappiness=10,
                 journald_persistent=True, sidecar_disks=(Disk("/nvme/ple.bin", "ext4", "nvme0n1", "nvme"),),
                 request=Request(quantization="modelopt_fp4", moe_runner_backend="flashinfer_cutlass"),
                 tegra=host.tegra_release(_release_file("R38", "4.0")),
                 locked=LockedMemory(None, False), mem_available_bytes=100 * GIB)
    return dataclasses.replace(base, **changes)


def request(**fields) -> Request:
    return dataclasses.replace(Request(quantization="modelopt_fp4", moe_runner_backend="flashinfer_cutlass"),
                               **fields)


def by_check(findings, check):
    return [f for f in findings if f.check == check]


def only(findings, check):
    (found,) = by_check(findings, check)
    return found


def test_a_healthy_thor_passes_clean():
    findings = run_checks(healthy())
    assert {f.level for f in findings} == {OK}, [f.line() for f in findings]


def test_every_refusal_and_warning_names_its_fix():
    cases = [healthy(source=source(s)) for s in ("pristine", "mixed", "unknown", "error")]
    cases += [healthy(device=None), healthy(c_compiler=None, cxx_compiler=None), healthy(swap_bytes=0),
              healthy(swappiness=60), healthy(journald_persistent=False),
              healthy(request=request(qsa_indexer_dtype="fp8_e4m3")),
              healthy(request=request(moe_runner_backend=None)),
              healthy(device=H200, request=request(ple_offload_backend="file")),
              healthy(request=request(memory_need_bytes=500 * GIB)),
              healthy(sidecar_disks=(Disk("/x", "nfs4", None, "network"),)),
              healthy(tegra=host.tegra_release(_release_file("R36", "4.3"))),
              healthy(cpu=host.CpuBudget(76, 16.0, "cpu.max"), read_workers=16),
              healthy(disk_space=(doctor.DiskSpace("/home", 10 * GIB, 29 * GIB, "caches"),))]
    seen = set()
    for facts in cases:
        for f in run_checks(facts):
            if f.level != OK:
                assert f.fix, f.line()
                seen.add(f.check)
    assert seen == {"source", "device", "compiler", "swap", "swappiness", "journald", "qsa_indexer_dtype",
                    "moe_runner_backend", "ple_offload_backend", "memory", "sidecar_disk", "l4t", "cpu_quota", "disk"}


# ----------------------------------------------------------------------------- source state


@pytest.mark.parametrize("state, allow, level, fix_words", [
    ("pristine", False, ERROR, "patch apply"),
    ("pristine", True, WARNING, "patch apply"),
    ("mixed", False, ERROR, "patch apply"),
    ("unknown", False, ERROR, "--force-reinstall"),
    ("unknown", True, ERROR, "--force-reinstall"),  # the escape hatch covers pristine only
    ("pending", False, ERROR, "patch recover"),
    ("error", False, ERROR, "--python"),
])
def test_source_state(state, allow, level, fix_words):
    found = only(run_checks(healthy(source=source(state),
                                    request=request(allow_unpatched=allow))), "source")
    assert found.level == level and fix_words in found.fix


# ----------------------------------------------------------------------------- device-dependent refusals


def test_no_cuda_device_is_refused_and_device_checks_are_skipped():
    findings = run_checks(healthy(device=None, request=request(qsa_indexer_dtype="fp8_e4m3",
                                                               ple_offload_backend="file",
                                                               memory_need_bytes=GIB)))
    assert only(findings, "device").level == ERROR and "no CUDA device" in only(findings, "device").message
    assert not by_check(findings, "qsa_indexer_dtype") + by_check(findings, "ple_offload_backend") + \
        by_check(findings, "memory") + by_check(findings, "swap")


@pytest.mark.parametrize("capability, level", [((11, 0), ERROR), ((12, 1), ERROR), ((12, 0), ERROR),
                                               ((10, 0), OK), ((9, 0), OK)])
def test_fp8_qsa_indexer_needs_sm90_or_sm100(capability, level):
    device = dataclasses.replace(THOR, capability=capability)
    found = only(run_checks(healthy(device=device, request=request(qsa_indexer_dtype="fp8_e4m3"))),
                 "qsa_indexer_dtype")
    assert found.level == level
    assert not by_check(run_checks(healthy(device=device)), "qsa_indexer_dtype")  # not requested: no finding


@pytest.mark.parametrize("access, skip, level", [(True, False, OK), (False, False, ERROR), (None, False, ERROR),
                                                 (False, True, WARNING), (None, True, WARNING)])
def test_ple_file_backend_needs_pageable_memory_access(access, skip, level):
    device = dataclasses.replace(H200, pageable_memory_access=access)
    found = only(run_checks(healthy(device=device, request=request(ple_offload_backend="file",
                                                                   ple_skip_device_check=skip))),
                 "ple_offload_backend")
    assert found.level == level
    if level != OK:
        assert found.fix == "--ple-offload-backend pinned"
    assert not by_check(run_checks(healthy(device=device, request=request(ple_offload_backend="pinned"))),
                        "ple_offload_backend")


def test_memory_need_against_device_memory_and_fraction():
    fits = only(run_checks(healthy(request=request(memory_need_bytes=100 * GIB, mem_fraction_static=0.95))), "memory")
    assert fits.level == OK
    short = only(run_checks(healthy(request=request(memory_need_bytes=120 * GIB, mem_fraction_static=0.95))),
                 "memory")
    assert short.level == ERROR and "120.00 GiB" in short.message and "115.90 GiB" in short.message
    refused = only(run_checks(healthy(request=request(memory_plan_error="a 9-token pool needs more"))), "memory")
    assert refused.level == ERROR and refused.message == "a 9-token pool needs more"
    assert not by_check(run_checks(healthy()), "memory")  # no pool requested: nothing to judge


def test_memory_need_from_a_model_dir(tmp_path):
    from sglang_ssd_stream.operate.capacity import kv_bytes_per_token

    config = {"num_hidden_layers": 4, "layer_types": ["full_attention"] * 4, "num_key_value_heads": 2,
              "head_dim": 256, "mtp_num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": config}))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * (1 << 20))
    argv = ["--context-length", "1024", "--max-total-tokens=4096", "--page-size", "64"]
    need, error = doctor.memory_need(str(tmp_path), argv)
    assert error is None and need == (1 << 20) + 4096 * kv_bytes_per_token(4, 2, 256, "bfloat16")
    assert doctor.memory_need(str(tmp_path), ["--context-length", "1024"]) == (None, None)  # no pool named
    need, error = doctor.memory_need(str(tmp_path), ["--context-length", "8192", "--max-total-tokens", "4096"])
    assert need is None and "exceeds the 4,096-token pool" in error
    (tmp_path / "config.json").write_text("{}")
    need, error = doctor.memory_need(str(tmp_path), argv)
    assert need is None and "num_hidden_layers" in error


def test_memory_need_counts_the_draft_model_when_the_launch_drafts(tmp_path):
    """Issue 17 item 3: NEXTN loads the MTP model from --speculative-draft-model-path; its weights count."""
    from sglang_ssd_stream.operate.capacity import kv_bytes_per_token

    config = {"num_hidden_layers": 4, "layer_types": ["full_attention"] * 4, "num_key_value_heads": 2,
              "head_dim": 256, "mtp_num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": config}))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * (1 << 20))
    draft = tmp_path / "mtp"
    draft.mkdir()
    (draft / "model.safetensors").write_bytes(b"\0" * (3 << 20))
    pool = ["--context-length", "1024", "--max-total-tokens", "4096"]
    spec = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--max-mamba-cache-size", "5",
            "--speculative-draft-model-path", str(draft)]
    need, error = doctor.memory_need(str(tmp_path), pool + spec)
    kv = 4096 * (kv_bytes_per_token(4, 2, 256, "bfloat16") + kv_bytes_per_token(1, 2, 256, "bfloat16"))
    assert error is None and need == (1 << 20) + (3 << 20) + kv
    need, _ = doctor.memory_need(str(tmp_path), pool + ["--speculative-draft-model-path", str(draft)])
    assert need == (1 << 20) + 4096 * kv_bytes_per_token(4, 2, 256, "bfloat16")  # not drafting: not loaded
    need, error = doctor.memory_need(str(tmp_path), pool + spec[:-1] + [str(tmp_path / "absent")])
    assert need is None and "absent" in error


# ----------------------------------------------------------------------------- host


@pytest.mark.parametrize("c, cxx, missing", [(None, "/usr/bin/c++", "C"), ("/usr/bin/cc", None, "C++"),
                                             (None, None, "C or C++")])
def test_missing_compiler_is_refused(c, cxx, missing):
    found = only(run_checks(healthy(c_compiler=c, cxx_compiler=cxx)), "compiler")
    assert found.level == ERROR and f"no {missing} compiler" in found.message and "build-essential" in found.fix


@pytest.mark.parametrize("kind", ["network", "hdd", "ssd", "memory", "unknown"])
def test_sidecar_off_nvme_is_warned(kind):
    found = only(run_checks(healthy(sidecar_disks=(Disk("/data/ple.bin", "xfs", "sdb", kind),))), "sidecar_disk")
    assert found.level == WARNING and found.fix == doctor.NVME_FIX


def test_sm110_nvfp4_moe_on_auto_is_warned():
    warn = only(run_checks(healthy(request=request(moe_runner_backend="auto"))), "moe_runner_backend")
    assert warn.level == WARNING and "flashinfer_cutlass" in warn.fix
    assert only(run_checks(healthy(request=request(moe_runner_backend=None))), "moe_runner_backend").level == WARNING
    assert not by_check(run_checks(healthy(device=H200, request=request(moe_runner_backend=None))),
                        "moe_runner_backend")
    assert not by_check(run_checks(healthy(request=request(moe_runner_backend=None, quantization=None))),
                        "moe_runner_backend")


def test_unified_memory_host_advice_from_the_thor_recipe():
    findings = run_checks(healthy(swap_bytes=2 * GIB, swappiness=60, journald_persistent=False))
    assert {f.check: f.level for f in findings if f.level != OK} == {"swap": WARNING, "swappiness": WARNING,
                                                                   "journald": WARNING}
    assert "/swapfile.thor" in only(findings, "swap").fix and "Storage=persistent" in only(findings, "journald").fix
    discrete = run_checks(healthy(device=H200, swap_bytes=0, swappiness=60, journald_persistent=False))
    assert not by_check(discrete, "swap") + by_check(discrete, "swappiness") + by_check(discrete, "journald")
    unknown = run_checks(healthy(swap_bytes=None, swappiness=None, journald_persistent=None))
    assert {f.level for f in unknown} == {OK}


# ----------------------------------------------------------------------------- fact readers


def test_request_from_argv_and_env():
    r = doctor.request_from_argv(["--model-path", "/m", "--qsa-indexer-dtype=fp8_e4m3", "--ple-offload-backend",
                                  "file", "--mem-fraction-static", "0.9", "--quantization", "modelopt_fp4",
                                  "--enable-multimodal"],
                                 {"SGLANG_SSD_STREAM_ALLOW_UNPATCHED": "1",
                                  "SGLANG_QWEN4_PLE_FILE_SKIP_DEVICE_CHECK": "true"})
    assert (r.qsa_indexer_dtype, r.ple_offload_backend, r.mem_fraction_static, r.quantization) == \
        ("fp8_e4m3", "file", 0.9, "modelopt_fp4")
    assert r.allow_unpatched and r.ple_skip_device_check and r.moe_runner_backend is None
    assert not doctor.request_from_argv([], {"SGLANG_SSD_STREAM_ALLOW_UNPATCHED": "yes"}).allow_unpatched


@pytest.fixture
def fake_host(tmp_path):
    """A mounts table and a sysfs tree: an NVMe partition, a SATA SSD, a spinning disk, NFS and tmpfs."""
    sys_root = tmp_path / "sys"
    for disk, rotational in (("nvme0n1", 0), ("sda", 0), ("sdb", 1)):
        (sys_root / "block" / disk / "queue").mkdir(parents=True)
        (sys_root / "block" / disk / "queue" / "rotational").write_text(f"{rotational}\n")
    for part, disk in (("nvme0n1p2", "nvme0n1"), ("sda1", "sda"), ("sdb1", "sdb")):
        real = sys_root / "devices" / disk / part
        real.mkdir(parents=True)
        (real / "partition").write_text("1\n")
        (sys_root / "class" / "block").mkdir(parents=True, exist_ok=True)
        os.symlink(real, sys_root / "class" / "block" / part)
    root = tmp_path.resolve() / "host"  # mount points under a real, symlink-free directory
    mounts = tmp_path / "mounts"
    mounts.write_text("\n".join([
        f"/dev/sdb1 {root} ext4 rw 0 0",
        f"/dev/nvme0n1p2 {root}/home ext4 rw 0 0",
        f"/dev/sda1 {root}/home/ssd\\040disk xfs rw 0 0",
        f"server:/export {root}/home/nfs nfs4 rw 0 0",
        f"tmpfs {root}/home/ram tmpfs rw 0 0",
        f"overlay {root}/home/ovl overlay rw 0 0",
    ]) + "\n")
    return root, dict(mounts_path=str(mounts), sys_root=str(sys_root))


@pytest.mark.parametrize("path, kind, device", [
    ("home/models/ple.bin", "nvme", "nvme0n1"),
    ("home/ssd disk/ple.bin", "ssd", "sda"),
    ("var/ple.bin", "hdd", "sdb"),
    ("home/nfs/ple.bin", "network", None),
    ("home/ram/ple.bin", "memory", None),
    ("home/ovl/ple.bin", "unknown", None),
])
def test_classify_disk(fake_host, path, kind, device):
    root, paths = fake_host
    disk = doctor.classify_disk(root / path, **paths)
    assert (disk.kind, disk.device) == (kind, device)


def test_classify_disk_without_a_mounts_table(tmp_path):
    assert doctor.classify_disk("/x", mounts_path=str(tmp_path / "none")).kind == "unknown"


@pytest.mark.parametrize("main, dropin, var_log, expected", [
    (None, None, False, None),  # no journald configuration at all
    ("[Journal]\n#Storage=auto\n", None, True, True),  # auto + /var/log/journal
    ("[Journal]\n", None, False, False),  # auto without /var/log/journal: volatile
    ("[Journal]\nStorage=volatile\n", "[Journal]\nStorage=persistent\n", False, True),  # drop-in wins
    ("[Journal]\nStorage=persistent\n", "[Journal]\nStorage=none\n", True, False),
])
def test_journald_persistence(tmp_path, main, dropin, var_log, expected):
    etc = tmp_path / "systemd"
    etc.mkdir()
    if main is not None:
        (etc / "journald.conf").write_text(main)
    if dropin is not None:
        (etc / "journald.conf.d").mkdir()
        (etc / "journald.conf.d" / "90-thor-llm.conf").write_text(dropin)
    if var_log:
        (tmp_path / "journal").mkdir()
    assert doctor.journald_persistent(etc, tmp_path / "journal") is expected


def test_gather_facts_on_this_machine():
    facts = doctor.gather_facts(sidecar_paths=[os.getcwd()])
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    assert (facts.device is not None) is has_cuda
    assert (facts.source.state in ("patched", "pristine", "mixed", "unknown", "pending", "error")
            and facts.source.listing)
    assert facts.sidecar_disks[0].path == os.getcwd()
    findings = run_checks(facts)
    if not has_cuda:
        assert only(findings, "device").message.startswith("no CUDA device")
    json.dumps(doctor.as_json(facts, findings))  # the --json report serialises


# ----------------------------------------------------------------------------- CLI and serve seam


def _cli(argv):
    parser = argparse.ArgumentParser()
    doctor.add_doctor_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["doctor", *argv])
    return args.func(args)


@pytest.mark.parametrize("facts, code", [(healthy(), EXIT_OK), (healthy(device=None), EXIT_REFUSED),
                                         (healthy(swap_bytes=GIB), EXIT_OK)])
def test_cli_exit_codes_and_json(monkeypatch, capsys, facts, code):
    seen = {}

    def fake_gather(**kw):
        seen.update(kw)
        return dataclasses.replace(facts, request=kw["request"])

    monkeypatch.setattr(doctor, "gather_facts", fake_gather)
    assert _cli(["--json", "--", "--quantization", "modelopt_fp4", "--moe-runner-backend", "flashinfer_cutlass"]) \
        == code
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is (code == EXIT_OK) and seen["request"].quantization == "modelopt_fp4"


def test_cli_text_lists_refusals(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "gather_facts", lambda **kw: healthy(c_compiler=None))
    assert _cli([]) == EXIT_REFUSED
    out = capsys.readouterr()
    assert "[error] compiler: no C compiler" in out.out and "fix: sudo apt-get install" in out.out
    assert "1 refusal" in out.err


def test_cli_profile_flags_reach_the_checks(monkeypatch):
    seen = {}
    monkeypatch.setattr(doctor, "gather_facts", lambda **kw: seen.setdefault("facts", healthy(request=kw["request"])))
    assert _cli(["--profile", "thor"]) == EXIT_OK
    r = seen["facts"].request
    assert (r.quantization, r.moe_runner_backend) == ("modelopt_fp4", "flashinfer_cutlass")


def test_preflight_seam_returns_the_launch_findings(monkeypatch):
    """``serve``'s seam returns the doctor's findings for the whole launch line; operate decides."""
    monkeypatch.setattr(doctor, "gather_facts", lambda **kw: healthy(swap_bytes=GIB, request=kw["request"]))
    findings = doctor.preflight(profile="thor", model=None, draft=None, env={})
    assert [f.check for f in findings if f.level == WARNING] == ["swap"]

    monkeypatch.setattr(doctor, "gather_facts", lambda **kw: healthy(request=kw["request"]))
    findings = doctor.preflight(profile="thor", model=None, draft=None, env={},
                                argv=["--qsa-indexer-dtype", "fp8_e4m3"])
    assert [f.check for f in findings if f.level == ERROR] == ["qsa_indexer_dtype"]


# ----------------------------------------------------------------------------- host prerequisites (issue 17)


@pytest.mark.parametrize("major, revision, level", [("R38", "4.0", OK), ("R39", "2.0", WARNING),
                                                    ("R36", "4.3", ERROR)])
def test_l4t_release_on_thor(major, revision, level):
    found = only(run_checks(healthy(tegra=host.tegra_release(_release_file(major, revision)))), "l4t")
    assert found.level == level
    if level != OK:
        assert "R38.4" in found.fix or "JetPack 7" in found.fix


def test_l4t_missing_is_warned_on_thor_only():
    assert only(run_checks(healthy(tegra=None)), "l4t").level == WARNING
    assert not by_check(run_checks(healthy(device=H200, tegra=None)), "l4t")


def test_reader_threads_against_the_cpu_quota():
    """Write-up 004: a pool larger than the cgroup quota is throttled; 16 readers under a 16-CPU quota
    are warned with the size serve would pick (12), and fit without a quota."""
    warn = only(run_checks(healthy(cpu=host.CpuBudget(76, 16.0, "cpu.max"), read_workers=16)), "cpu_quota")
    assert warn.level == WARNING and warn.fix.startswith("export SGLANG_SSD_STREAM_READ_WORKERS=12")
    assert only(run_checks(healthy(cpu=host.CpuBudget(14, None, ""), read_workers=16)), "cpu_quota").level == OK


def test_read_workers_from_the_launch_environment():
    assert doctor._read_workers({}) == 16
    assert doctor._read_workers({"SGLANG_SSD_STREAM_READ_WORKERS": "4"}) == 4
    assert doctor._read_workers({"SGLANG_SSD_STREAM_READ_WORKERS": "x"}) is None


def test_disk_space_for_the_recipe(tmp_path):
    """Before a model exists the data dir needs the recipe's 180 GiB; with one, $HOME needs the rest."""
    (before,) = doctor.disk_space(None, tmp_path / "data", str(tmp_path), None)
    assert before.need_bytes == 180 * GIB and before.path == str(tmp_path)
    (after,) = doctor.disk_space("/m", None, str(tmp_path), 151 * GIB)
    assert after.need_bytes == 29 * GIB and "151 GiB" in after.what
    assert doctor.disk_space("/m", None, str(tmp_path), None) == ()
    short = only(run_checks(healthy(disk_space=(dataclasses.replace(after, free_bytes=GIB),))), "disk")
    assert short.level == WARNING and "$SGLANG_SSD_STREAM_HOME" in short.fix
    assert only(run_checks(healthy(disk_space=(dataclasses.replace(after, free_bytes=30 * GIB),))), "disk").level == OK


def test_a_malformed_sidecar_manifest_is_a_finding_not_a_traceback(tmp_path, monkeypatch):
    monkeypatch.setattr(doctor, "gather_facts", lambda **kw: healthy(request=kw["request"]))
    (tmp_path / "ssd-stream.json").write_text("{not json")
    _, findings = doctor.diagnose(model=str(tmp_path), env={})
    found = only(findings, "sidecar")
    assert found.level == ERROR and "model fetch" in found.fix


def test_device_finding_reports_the_sm_count():
    """Write-up 001: a peer engine's cooperative launch assumed 128 SMs; sglang sizes QSA grids from the device,
    so the doctor records the count instead of judging it."""
    found = only(run_checks(healthy(device=dataclasses.replace(THOR, sm_count=20))), "device")
    assert found.level == OK and ", 20 SMs, unified memory" in found.message
    assert "SMs" not in only(run_checks(healthy()), "device").message


# ----------------------------------------------------------------------------- PLE row cache (issue 19)


def test_row_cache_budget_is_reported_and_counted_on_unified_memory():
    rc = {"variable": "SGLANG_SSD_STREAM_ROW_CACHE_MB", "mib": 1024, "gib": 1.0, "source": "the profile's"}
    found = only(run_checks(healthy(request=request(row_cache=rc))), "row_cache")
    assert found.level == OK and found.message.startswith("1,024 MiB of registered host memory per scheduler process")
    assert "unified memory: the KV cache cannot use it" in found.message
    assert "unified" not in only(run_checks(healthy(device=H200, request=request(row_cache=rc))), "row_cache").message
    # on unified memory the cache comes out of the device's memory: 115 GiB + 1 GiB > 115.90 GiB usable
    short = only(run_checks(healthy(request=request(row_cache=rc, memory_need_bytes=115 * GIB,
                                                    mem_fraction_static=0.95))), "memory")
    assert short.level == ERROR and "116.00 GiB" in short.message and "1024 MiB PLE row cache" in short.message
    assert "SGLANG_SSD_STREAM_ROW_CACHE_MB" in short.fix
    fits = only(run_checks(healthy(device=H200, request=request(row_cache=rc, memory_need_bytes=115 * GIB,
                                                                mem_fraction_static=0.95))), "memory")
    assert fits.level == OK  # a discrete GPU: host memory, not device memory
    off = only(run_checks(healthy(request=request(row_cache={**rc, "mib": 0}))), "row_cache")
    assert off.level == OK and off.message.startswith("off (SGLANG_SSD_STREAM_ROW_CACHE_MB=0")


def test_row_cache_from_the_profile_and_the_environment(monkeypatch):
    seen = {}
    monkeypatch.setattr(doctor, "gather_facts", lambda **kw: seen.setdefault("facts", healthy(request=kw["request"])))
    doctor.diagnose(profile="discrete-gpu", env={"SGLANG_SSD_STREAM_ROW_CACHE_MB": "8"})
    assert seen.pop("facts").request.row_cache["mib"] == 8  # the launch keeps what the operator exported
    doctor.diagnose(profile="discrete-gpu", env={})
    assert seen.pop("facts").request.row_cache["mib"] == 4096  # else the profile's
    doctor.diagnose(env={"SGLANG_SSD_STREAM_ROW_CACHE_MB": "8"})
    assert seen.pop("facts").request.row_cache == {"variable": "SGLANG_SSD_STREAM_ROW_CACHE_MB", "mib": 8,
                                                   "gib": 8 / 1024, "source": "exported"}
    _, findings = doctor.diagnose(env={"SGLANG_SSD_STREAM_ROW_CACHE_MB": "lots"})
    bad = only(findings, "row_cache")
    assert bad.level == ERROR and "SGLANG_SSD_STREAM_ROW_CACHE_MB='lots' is not an integer number of MiB" in bad.message
