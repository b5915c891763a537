"""An in-place PLE sidecar on the real sglang 0.5.23 install (CPU): check_ple_in_place.py in the venv."""

from __future__ import annotations

from ..engine import outcomes_only

CHECK = "tests/sglang/checks/check_ple_in_place.py"
EXPECTED = {
    *(f"test_in_place_lookup_bit_identical_to_sglang_own_table[tp{t}-{d}-{io}]"
      for t in range(3) for d in ("float8_e4m3fn", "bfloat16") for io in ("mmap", "pread")),
    "test_a_tampered_region_is_refused_before_it_serves",
    *(f"test_in_place_through_the_row_cache_bit_identical[tp{t}]" for t in range(2)),
    *(f"test_sglangs_weight_iterator_maps_a_ple_shard_unless_mmap_is_disabled[{m}]"
      for m in ("default", "disable-mmap")),
}


def test_in_place_sidecar_on_real_sglang(sglang):
    sglang.ensure_pristine()  # the PLE hooks need no source patch
    r = sglang.run_checks(CHECK, extra_env={"SGLANG_SSD_STREAM_ALLOW_UNPATCHED": "1"})
    assert outcomes_only(r) == {t: "passed" for t in EXPECTED}, r["__output__"]
