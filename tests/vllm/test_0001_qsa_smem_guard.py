"""Patch 0001 (quantized QSA tiles fit shared memory) on a private copy of the real vLLM 0.33.0 install.

RED on pristine, GREEN patched, then a byte-exact revert; an unknown source state is refused.
"""

from __future__ import annotations

import os

from ..engine import outcomes_only

QSA = "vllm/models/qwen4_exp/nvidia/ops/qsa.py"
COMPILE = "tests/vllm/checks/check_0001_qsa_smem_guard.py"
INTERPRET = "tests/vllm/checks/check_0001_qsa_interpret.py"
# vLLM keeps Triton enabled without a driver only when CUDA_VISIBLE_DEVICES is empty.
COMPILE_ENV = {"TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
INTERPRET_ENV = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}

RED = {
    "test_fp8_launch_fits_shared_memory[prefill-300]",
    "test_fp8_launch_fits_shared_memory[decode-4096]",
    "test_fp8_launch_runs_the_measured_compile[prefill-300]",
    "test_fp8_launch_runs_the_measured_compile[decode-4096]",
    "test_fp8_warmup_profiles_fit_shared_memory",
}
GUARDS = {"test_bf16_tiles_unchanged", "test_fitting_fp8_tiles_unchanged", "test_warmup_covers_every_launch"}
RED_INTERPRETED = {"test_interpreted_launch_uses_fitted_tiles"}
GUARDS_INTERPRETED = {"test_interpreter_measures_nothing_and_keeps_the_table_tile"}


def test_red_on_pristine_green_when_patched(vllm_private, tmp_path):
    # One Triton cache for both compile runs: the patch leaves the kernels' source as it is, so the
    # patched run loads from disk what the pristine run compiled for the same tiles (the cache key
    # hashes the kernel's source, so a changed kernel would compile afresh). Within each run the
    # identity checks use Triton's in-memory JIT cache, as before.
    compile_env = {**COMPILE_ENV, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    vllm_private.ensure_pristine()
    red = vllm_private.run_checks(COMPILE, extra_env=compile_env)
    assert outcomes_only(red) == {**{t: "failed" for t in RED}, **{t: "passed" for t in GUARDS}}, red["__output__"]
    red_i = vllm_private.run_checks(INTERPRET, extra_env=INTERPRET_ENV)
    assert outcomes_only(red_i) == {**{t: "failed" for t in RED_INTERPRETED},
                                    **{t: "passed" for t in GUARDS_INTERPRETED}}, red_i["__output__"]

    vllm_private.ensure_patched()
    green = vllm_private.run_checks(COMPILE, extra_env=compile_env)
    assert outcomes_only(green) == {t: "passed" for t in RED | GUARDS}, green["__output__"]
    green_i = vllm_private.run_checks(INTERPRET, extra_env=INTERPRET_ENV)
    assert outcomes_only(green_i) == {t: "passed" for t in RED_INTERPRETED | GUARDS_INTERPRETED}, green_i["__output__"]


def test_apply_verify_revert_on_a_private_copy(vllm_private):
    vllm_private.ensure_pristine()
    pristine = {f["path"]: f["sha256"] for f in vllm_private.status()["files"]}
    assert pristine == {f["path"]: f["pristine"] for f in vllm_private.status()["files"]}

    applied = vllm_private.cli("apply")
    assert applied.returncode == 0, applied.stderr
    assert vllm_private.cli("verify").returncode == 0
    again = vllm_private.cli("apply")
    assert again.returncode == 0 and "already patched: nothing to do" in again.stdout

    reverted = vllm_private.cli("revert")
    assert reverted.returncode == 0, reverted.stderr
    assert {f["path"]: f["sha256"] for f in vllm_private.status()["files"]} == pristine
    assert vllm_private.cli("verify").returncode == 1


def test_unknown_source_state_is_refused(vllm_private):
    vllm_private.ensure_pristine()
    target = os.path.join(vllm_private.status()["site_packages"], QSA)
    original = open(target, "rb").read()
    edited = target + ".edited"
    with open(edited, "wb") as f:  # a new inode: the shared venv's file is never written
        f.write(original + b"# local edit\n")
    os.replace(edited, target)
    try:
        r = vllm_private.cli("apply")
        assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
        assert "Refusing to patch an unknown vllm source state" in r.stderr and "Nothing was changed" in r.stderr
        assert open(target, "rb").read() == original + b"# local edit\n"
        assert {f["state"] for f in vllm_private.status()["files"]} == {"unknown"}
    finally:
        with open(edited, "wb") as f:
            f.write(original)
        os.replace(edited, target)
    assert vllm_private.states() == {"pristine"}
