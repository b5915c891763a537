"""``sidecar build|verify`` mounted on a parser the way the kit's CLI mounts them."""

from __future__ import annotations

import argparse
import json

import pytest
from conftest import make_checkpoint

from sglang_ssd_stream.errors import KitError
from sglang_ssd_stream.sidecar import SidecarChecksumMismatch, SidecarShapeMismatch
from sglang_ssd_stream.sidecar.cli import add_sidecar_commands


def run(argv):
    parser = argparse.ArgumentParser(prog="sglang-ssd-stream sidecar")
    sub = parser.add_subparsers(dest="command", required=True)
    parsers = add_sidecar_commands(sub)
    assert set(parsers) == {"build", "verify", "profile"}
    args = parser.parse_args(argv)
    return args.func(args)


def test_build_and_verify_json(tmp_path, capsys):
    ck = make_checkpoint(tmp_path / "ck", {5: ("float8_e4m3fn", 2000, 160)}, parts=4)
    out = tmp_path / "art"
    assert run(["build", str(ck.path), "-o", str(out), "--json", "-q", "--rows", "2000", "--columns", "160"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verified"] is True and doc["tables"][0]["rows"] == 2000 and doc["scale_file"].endswith(
        "model-plefp8-scale.safetensors")
    assert run(["verify", str(out), "--json", "-q"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["ok"] and rep["tables"][0]["status"] == "verified"  # verify re-hashes by default
    assert run(["verify", str(out / "ssd-stream.json"), "--json", "-q", "--use-cache"]) == 0
    assert json.loads(capsys.readouterr().out)["tables"][0]["status"] == "cached"


def test_build_text_output_and_no_verify(tmp_path, capsys):
    ck = make_checkpoint(tmp_path / "ck", {5: ("bfloat16", 100, 8)}, parts=4)
    assert run(["build", str(ck.path), "-o", str(tmp_path / "a"), "--no-verify", "-q"]) == 0
    text = capsys.readouterr().out
    assert "layer 5: ple/layer-5.bin  bfloat16 [100, 8]" in text and "skipped (--no-verify)" in text
    with pytest.raises(KitError, match="already exists; pass --force") as info:
        run(["build", str(ck.path), "-o", str(tmp_path / "a"), "-q"])
    assert info.value.exit_code == 2
    assert run(["build", str(ck.path), "-o", str(tmp_path / "a"), "-q", "--force"]) == 0


def test_verify_mismatch_prints_report_then_raises(small, capsys):
    _, art = small
    p = art / "ple" / "layer-2.bin"
    data = bytearray(p.read_bytes())
    data[0] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(SidecarChecksumMismatch) as info:
        run(["verify", str(art), "--json", "-q"])
    assert info.value.exit_code == 3
    rep = json.loads(capsys.readouterr().out)
    assert rep["ok"] is False and rep["tables"][0]["status"] == "mismatch"
    with pytest.raises(SidecarChecksumMismatch):
        run(["verify", str(art), "-q"])
    assert "FAILED" in capsys.readouterr().out


def test_verify_expected_model_shape(small):
    _, art = small
    with pytest.raises(SidecarShapeMismatch, match="is float8_e4m3fn, but the model expects bfloat16"):
        run(["verify", str(art), "-q", "--dtype", "bfloat16"])
    with pytest.raises(SidecarShapeMismatch, match="has 160 columns, but the model expects 320"):
        run(["verify", str(art), "-q", "--columns", "320"])
    assert run(["verify", str(art), "-q", "--dtype", "float8_e4m3fn", "--columns", "160", "--rows", "5003"]) == 0


@pytest.mark.parametrize("odd", ["loop", "fifo"])
def test_verify_of_an_odd_table_is_a_clear_refusal_through_the_real_cli(small, tmp_path, odd):
    """`sglang-ssd-stream sidecar verify` (the real entry point, a subprocess): a symlink loop or a FIFO where a
    table should be is a refusal naming the file, with a kit exit code and no traceback, and it never hangs."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    _, art = small
    table = art / "ple" / "layer-2.bin"
    table.unlink()
    if odd == "loop":
        (art / "ple" / "loop").symlink_to(table)
        table.symlink_to(art / "ple" / "loop")
    else:
        os.mkfifo(table)
    repo = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "sglang_ssd_stream", "sidecar", "verify", str(art)],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(repo), "HOME": str(tmp_path)})
    assert r.returncode in (2, 3), (r.returncode, r.stdout, r.stderr)
    assert "layer-2.bin" in r.stderr and "Traceback" not in r.stdout + r.stderr, r.stderr
