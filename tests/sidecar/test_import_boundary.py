"""The sidecar package imports neither engine nor torch, and works that way end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import make_checkpoint

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import json, sys
    for name in ("sglang", "vllm", "torch", "triton"):
        sys.modules[name] = None  # any import of them raises ImportError
    import numpy as np
    import sglang_ssd_stream.sidecar as sc
    from sglang_ssd_stream.sidecar import build, cli, format, reader, verify, errors  # noqa: F401
    ck, out = sys.argv[1], sys.argv[2]
    res = build.build_sidecar(ck, out, progress=False)
    t = sc.load_manifest(out).table(6)
    ids = np.array([0, 999, 500, 0])
    buf = np.empty((4, t.row_bytes), np.uint8)
    with sc.SidecarReader(t, max_rows=4) as r:
        r.read_rows(ids, buf)
    engines = sorted(m for m in sys.modules if m.split(".")[0] in ("sglang", "vllm", "torch", "triton")
                     and sys.modules[m] is not None)
    print(json.dumps({"rows": buf.tolist(), "engines": engines, "verified": res.verify.ok}))
    """
)


def test_sidecar_runs_without_engines_or_torch(tmp_path):
    ck = make_checkpoint(tmp_path / "ck", {6: ("float8_e4m3fn", 1000, 160)}, parts=4)
    env = dict(os.environ, PYTHONPATH=str(REPO), HOME=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(ck.path), str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["engines"] == [] and doc["verified"] is True
    assert doc["rows"] == ck.tables[6][[0, 999, 500, 0]].tolist()


def test_blocked_import_really_fails():
    """Guard against a vacuous boundary test: the blocking idiom does make imports fail."""
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.modules['sglang'] = None; import sglang"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "halted; None in sys.modules" in proc.stderr


def test_no_engine_or_torch_imports_in_source():
    src = REPO / "sglang_ssd_stream" / "sidecar"
    for f in src.glob("*.py"):
        for line in f.read_text().splitlines():
            s = line.strip()
            for mod in ("sglang", "vllm", "torch"):
                assert not s.startswith((f"import {mod}", f"from {mod}")), (f, line)
