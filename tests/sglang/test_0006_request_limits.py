"""Patch 0006 on the real sglang install of every release in the manifest: RED on pristine, GREEN patched."""

from __future__ import annotations

from ..engine import assert_red_green

PATCH_ID = "0006-request-limits"
CHECK = "tests/sglang/checks/check_0006_request_limits.py"

# Pristine sglang accepts each of these (DID NOT RAISE), or answers with its source paths.
RED = ({f"test_bad_n_refused[{i}]" for i in ("1e5", "129", "0", "neg", "float", "bool")}
       | {f"test_top_logprobs_past_the_vocabulary_refused[{i}]" for i in ("vocab+1", "1e6", "neg")}
       | {"test_validation_error_body_has_no_source_paths"})
GUARDS = ({f"test_good_n_passes[{n}]" for n in (1, 2, 128)}
          | {f"test_top_logprobs_within_the_vocabulary_pass[{k}]" for k in (0, 5, 1000)})


def test_red_on_pristine_green_when_patched(sglang_release):
    assert_red_green(sglang_release, CHECK, RED, GUARDS)
