"""Issue 43 item 2: no kit command answers a bad path or input with a traceback.

Every verb of both CLIs, enumerated from their argparse parsers (a new verb is covered without touching this
file), runs as a subprocess with each of its path arguments made bad in one of the ways an operator meets:
a path whose parent is a regular file, a name over the OS limit, ``SGLANG_SSD_STREAM_HOME`` over the OS limit
and, for an output, an existing folder where a file is written or a place the kernel refuses to create. It
must end with one of the kit's exit codes (``sglang_ssd_stream.errors``) and no "Traceback" on stderr.

Nothing here can change an engine: patch verbs always get ``--site-packages`` (a bad path), serve always
``--dry-run``, and the network is closed (offline hub, a refusing proxy, a closed port for servers).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_ssd_stream import errors
from sglang_ssd_stream.cli import build_parser as sglang_parser
from vllm_ple_offload.cli import build_parser as vllm_parser

REPO = Path(__file__).resolve().parents[2]
CLIS = {"sglang_ssd_stream": sglang_parser, "vllm_ple_offload.cli": vllm_parser}
# the kit's exit codes, from the one place that defines them, plus the shell's for SIGINT/SIGTERM
EXIT_CODES = {v for k, v in vars(errors).items() if k.startswith("EXIT_")} | {130, 143}
OUTPUTS = {"-o", "--out", "--output"}
CLOSED_URL = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused at once
# the options that make a verb safe to run here whatever else it gets (see the module's docstring)
SAFETY = {("patch",): ["--site-packages", "{bad}"], ("serve",): ["--dry-run"],
          ("watch",): ["--samples", "1", "--interval", "1"]}


def leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(verb path, its parser) for every runnable command under ``parser``."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, sub in subs[0].choices.items():
        yield from leaves(sub, (*path, name))


VERBS = [(cli, path, parser) for cli, build in CLIS.items() for path, parser in leaves(build())]
KINDS = ("parent_is_a_file", "name_too_long", "home_too_long", "output_is_a_folder", "output_unwritable")


def argv_for(path: tuple[str, ...], parser: argparse.ArgumentParser, bad: str) -> list[str] | None:
    """The verb's command line with every path it takes set to ``bad`` (None: the verb takes no path)."""
    argv, takes_path = list(path), False
    for prefix, extra in SAFETY.items():
        if path[:len(prefix)] == prefix:
            argv += [bad if a == "{bad}" else a for a in extra]
            takes_path |= "{bad}" in extra
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.nargs == argparse.REMAINDER:
            continue
        flag = action.option_strings[0] if action.option_strings else None
        if flag and flag in argv:
            continue
        if action.choices:  # a profile, a backend: the first one the parser offers
            if action.required:
                argv += [flag, next(iter(action.choices))]
            continue
        if action.dest == "url":
            argv += [flag, CLOSED_URL]
        elif action.dest == "user":
            argv += [flag, "root"]
        elif not flag or action.required or set(action.option_strings) & OUTPUTS or action.dest in (
                "model", "data_dir", "cache_dir", "sidecar", "site_packages"):
            if action.nargs == 0:
                continue
            argv += ([flag] if flag else []) + [bad]
            takes_path = True
    return argv if takes_path else None


def takes_output(parser: argparse.ArgumentParser) -> bool:
    return any(set(a.option_strings) & OUTPUTS for a in parser._actions)


def test_every_verb_of_both_clis_is_enumerated():
    names = {(cli, " ".join(path)) for cli, path, _ in VERBS}
    for verb in ("patch apply", "sidecar profile", "serve", "plan", "service", "doctor"):
        assert ("sglang_ssd_stream", verb) in names and ("vllm_ple_offload.cli", verb) in names, names
    assert ("sglang_ssd_stream", "sidecar verify") in names and ("sglang_ssd_stream", "model fetch") in names


def _applies(path, parser, kind: str) -> bool:
    """A verb meets a kind of bad path only where it takes one (the output kinds: where it writes a file)."""
    if kind in ("output_is_a_folder", "output_unwritable") and not takes_output(parser):
        return False
    return argv_for(path, parser, "x") is not None


CASES = [(cli, path, parser, kind) for kind in KINDS for cli, path, parser in VERBS if _applies(path, parser, kind)]


@pytest.mark.parametrize("cli, path, parser, kind", CASES,
                         ids=[f"{c.split('.')[0]}:{'-'.join(p)}-{k}" for c, p, _, k in CASES])
def test_a_bad_path_is_refused_without_a_traceback(tmp_path, cli, path, parser, kind):
    home = tmp_path / "home"
    home.mkdir()
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder\n")
    too_long = str(tmp_path / ("n" * (os.pathconf("/", "PC_NAME_MAX") + 1)))
    env = {**os.environ, "HOME": str(home), "HF_HUB_OFFLINE": "1", "https_proxy": CLOSED_URL,
           "http_proxy": CLOSED_URL, "HTTPS_PROXY": CLOSED_URL, "HTTP_PROXY": CLOSED_URL, "no_proxy": ""}
    env.pop("SGLANG_SSD_STREAM_HOME", None)
    if kind == "parent_is_a_file":
        bad = str(a_file / "x")
    elif kind == "name_too_long":
        bad = too_long
    elif kind == "home_too_long":
        bad = str(a_file / "x")
        env["SGLANG_SSD_STREAM_HOME"] = too_long
    else:
        bad = str(tmp_path) if kind == "output_is_a_folder" else "/proc/sglang-ssd-stream-test/out"
    argv = argv_for(path, parser, bad)
    r = subprocess.run([sys.executable, "-m", cli, *argv], capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=300, stdin=subprocess.DEVNULL)
    shown = f"{cli} {' '.join(argv)}\nexit {r.returncode}\n{r.stderr[-3000:]}"
    assert "Traceback (most recent call last)" not in r.stderr, shown
    assert r.returncode in EXIT_CODES, shown
    if kind == "home_too_long" and "SGLANG_SSD_STREAM_HOME" in r.stderr:
        assert "OS limit" in r.stderr, shown  # named with the reason, not a bare ENAMETOOLONG


def _run(tmp_path, *argv, env_extra=None):
    env = {**os.environ, "HOME": str(tmp_path), **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "sglang_ssd_stream", *argv], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("where", ["parent_is_a_file", "a_folder", "proc"])
def test_service_output_that_cannot_be_written_is_named_with_exit_4(tmp_path, where):
    """The docs' ``-o /etc/systemd/system/…`` as a non-root user: simulated as root by places root cannot write."""
    from .conftest import write_model

    model = write_model(tmp_path / "model")
    (tmp_path / "a-file").write_text("x")
    out = {"parent_is_a_file": str(tmp_path / "a-file" / "qwen38.service"), "a_folder": str(tmp_path),
           "proc": "/proc/sglang-ssd-stream-test/qwen38.service"}[where]
    r = _run(tmp_path, "service", "--profile", "discrete-gpu", "--model", str(model), "--user", "root", "-o", out)
    assert r.returncode == errors.EXIT_ENVIRONMENT and "Traceback" not in r.stderr, r.stderr
    assert f"cannot write {out}: " in r.stderr and "nothing was written" in r.stderr, r.stderr


@pytest.mark.parametrize("argv", [["doctor"], ["sidecar", "verify", "{model}"],
                                  ["serve", "--profile", "discrete-gpu", "--model", "{model}", "--dry-run"]])
def test_a_kit_home_over_the_os_limit_is_refused_naming_the_knob(tmp_path, argv):
    from .conftest import write_model

    model = str(write_model(tmp_path / "model"))
    home = str(tmp_path / ("h" * (os.pathconf("/", "PC_NAME_MAX") + 1)))
    r = _run(tmp_path, *[model if a == "{model}" else a for a in argv], env_extra={"SGLANG_SSD_STREAM_HOME": home})
    assert "Traceback" not in r.stderr, r.stderr
    if argv[0] == "serve":  # a dry run reports what a real serve refuses on, and exits 0
        assert r.returncode == errors.EXIT_OK and "# [error] kit_home: SGLANG_SSD_STREAM_HOME: " in r.stdout, r.stdout
        real = _run(tmp_path, *[model if a == "{model}" else a for a in argv if a != "--dry-run"],
                    env_extra={"SGLANG_SSD_STREAM_HOME": home})
        assert real.returncode == errors.EXIT_REFUSED and "kit_home" in real.stderr, real.stderr
        return
    assert r.returncode == errors.EXIT_ENVIRONMENT, r.stderr
    assert "SGLANG_SSD_STREAM_HOME=" in r.stderr and "over the OS limit" in r.stderr, r.stderr
