"""tests/triton_interpreter.py changes what the interpreter repeats, never what a kernel computes: sglang's own
per-token kernels and a kernel of nested @jit calls, reductions and a scan give bit-identical outputs under the
shipped interpreter and under it, leave triton.language as the shipped one leaves it, and a launch that raises
leaves no launch state behind. An interpreter source the module does not know is left as shipped."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.triton_interpreter import KNOWN, OFF_SWITCH

SCRIPT = Path(__file__).parent / "checks" / "interpreter_kernels.py"


def _run(sglang, tmp_path: Path, mode: str) -> dict:
    out = tmp_path / f"{mode}.npz"
    extra = {OFF_SWITCH: "upstream"} if mode == "upstream" else {}
    r = subprocess.run([sglang.python, str(SCRIPT), str(out)], capture_output=True, text=True, timeout=600,
                       env=sglang.env(extra))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def both(sglang, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("interp")
    return _run(sglang, tmp, "upstream"), _run(sglang, tmp, "fast")


def test_installed_only_where_asked(both):
    upstream, fast = both
    assert not upstream["installed"] and fast["installed"]


def test_every_kernel_output_is_bit_identical(both):
    upstream, fast = both
    outputs = [k for k in upstream if k not in ("installed", "lang_state_after", "raised", "launch_state_after_raise")]
    assert len(outputs) == 9 and set(outputs) == {k for k in fast if k in outputs}
    for k in outputs:
        assert upstream[k].dtype == fast[k].dtype and np.array_equal(upstream[k], fast[k], equal_nan=True), k
    assert np.isfinite(fast["nested_red"]).all() and np.abs(fast["gate_only_7"]).sum() > 0  # kernels did run


def test_triton_language_is_left_as_the_shipped_interpreter_leaves_it(both):
    upstream, fast = both
    assert list(upstream["lang_state_after"]) == list(fast["lang_state_after"])


def test_a_launch_that_raises_leaves_no_launch_state(both):
    upstream, fast = both
    assert str(upstream["raised"]) == str(fast["raised"]) != "no"
    assert str(fast["launch_state_after_raise"]) == "None"


def test_an_unknown_interpreter_source_is_left_as_shipped(sglang, tmp_path):
    fake = tmp_path / "interpreter.py"
    fake.write_text("# not triton's\n")
    code = (f"import types, tests.triton_interpreter as t; m = types.SimpleNamespace(__file__={str(fake)!r}); "
            "print(t.install(m))")
    r = subprocess.run([sglang.python, "-c", code], capture_output=True, text=True, timeout=120,
                       env=sglang.env({OFF_SWITCH: "upstream"}))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
    assert "not one this module knows; the interpreter runs unchanged" in r.stderr
    assert len(KNOWN) == 1
