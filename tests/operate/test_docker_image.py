"""Issue 28 item 3: the A100 compose file runs this kit's own runtime, and the repository builds it.

Before: `service --compose` required `--image` ("an engine image with this kit installed") and nothing in the
repository built one, so the container would run an image's own vLLM, not the hash-locked, patched, verified
runtime. There is no Docker daemon here: the Dockerfile's steps are read, not run (not yet built here).
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

from sglang_ssd_stream import __version__
from sglang_ssd_stream.operate import add_operate_commands
from sglang_ssd_stream.operate.service import DEFAULT_IMAGE, IMAGE_BUILD, IMAGE_DOCKERFILE

from .conftest import SIDES, write_model

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / IMAGE_DOCKERFILE


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", "\n".join(ln for ln in DOCKERFILE.read_text().splitlines()
                                             if not ln.lstrip().startswith("#")))
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in text.splitlines() if ln.strip()]


def test_the_image_is_built_by_install_sh_from_the_locks_and_verified():
    steps = _instructions()
    runs = [args for op, args in steps if op == "RUN"]
    install = [r for r in runs if "install.sh" in r]
    assert len(install) == 1
    commands = [shlex.split(c) for c in install[0].split("&&")]
    assert commands[0][:4] == ["sh", "install.sh", "--engine", "vllm"] and "--unlocked" not in commands[0]
    assert commands[1][:4] == ["sh", "install.sh", "--engine", "vllm"] and commands[1][-1] == "--check"
    assert commands[0][4:] == commands[1][4:-1]  # --check judges the runtime the install built
    copied = " ".join(args for op, args in steps if op == "COPY")
    for part in ("install.sh", "pyproject.toml", "README.md", "sglang_ssd_stream", "vllm_ple_offload", "patches",
                 "hashes"):  # everything install.sh fingerprints and pip installs
        assert part in copied, part
    prefix = commands[0][commands[0].index("--prefix") + 1]
    from sglang_ssd_stream.patching.engines import ENGINES

    env = dict(a.split("=", 1) for op, args in steps if op == "ENV" for a in args.split())
    assert env["PATH"].startswith(f"{prefix}/vllm-{ENGINES['vllm'].pinned}/venv/bin:")
    assert ("ENTRYPOINT", '["vllm", "serve"]') in steps  # compose's command is the serve arguments


def test_the_base_image_has_a_python_the_locks_cover():
    """Ubuntu 24.04 ships CPython 3.12: install.sh needs a lock for it on both architectures."""
    assert "ubuntu24.04" in DOCKERFILE.read_text()
    for arch in ("x86_64", "aarch64"):
        from sglang_ssd_stream.patching.engines import ENGINES

        assert (REPO / "hashes" / "locks" / f"vllm-{ENGINES['vllm'].pinned}-py312-{arch}.txt").is_file()


def test_compose_uses_that_image_by_default_and_says_how_to_build_it(tmp_path, capsys):
    assert DEFAULT_IMAGE == f"qwen38-vllm-ple:{__version__}"
    assert f"-t {DEFAULT_IMAGE}" in IMAGE_BUILD and IMAGE_DOCKERFILE in IMAGE_BUILD
    assert f"-t {DEFAULT_IMAGE}" in DOCKERFILE.read_text()  # the Dockerfile's own build line names the same tag
    p = argparse.ArgumentParser()
    add_operate_commands(p.add_subparsers(dest="command", required=True), SIDES["vllm"])
    model = write_model(tmp_path / "m")
    out = tmp_path / "compose.yaml"
    args = p.parse_args(["service", "--profile", "a100x4", "--model", str(model), "--cache-dir", str(tmp_path),
                         "-o", str(out)])
    assert args.func(args) == 0
    text = out.read_text()
    assert f'    image: "{DEFAULT_IMAGE}"\n' in text
    assert text.startswith(f"# {DEFAULT_IMAGE}: this kit's vLLM runtime; build it in the kit's repository first: "
                           f"{IMAGE_BUILD}\n")
