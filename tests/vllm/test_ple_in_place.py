"""An in-place PLE sidecar in the real vLLM 0.33.0 install: check_ple_in_place.py in a fresh venv subprocess."""

from __future__ import annotations

from ..engine import outcomes_only

CHECK = "tests/vllm/checks/check_ple_in_place.py"
EXPECTED = {
    *(f"test_in_place_rows_are_the_checkpoint_rows[{b}-{d}-{c}]"
      for b in ("pread", "mmap") for d in ("bfloat16", "float8_e4m3fn") for c in ("0", "16")),
    *(f"test_a_tampered_region_is_refused_before_it_serves[{b}]" for b in ("pread", "mmap")),
    *(f"test_vllms_weight_iterator_maps_a_ple_shard_unless_loaded_eagerly[{s}]" for s in ("default", "eager")),
}


def test_in_place_sidecar_on_real_vllm(vllm):
    r = vllm.run_checks(CHECK)
    assert outcomes_only(r) == {t: "passed" for t in EXPECTED}, r["__output__"]
