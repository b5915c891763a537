"""Issue 28 item 7: each message says what is true and what to do next; usage errors exit 64 on both CLIs."""

from __future__ import annotations

import importlib.util
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sglang_ssd_stream.cli import main as sglang_main
from sglang_ssd_stream.errors import EXIT_ENVIRONMENT, EXIT_OK, EXIT_USAGE
from sglang_ssd_stream.patching.guard import Verdict
from sglang_ssd_stream.sglang import doctor
from sglang_ssd_stream.sglang.doctor import ERROR, GIB, WARNING, Device, Facts, Request, run_checks
from vllm_ple_offload.cli import main as vllm_main

from .conftest import write_model

H200 = Device("NVIDIA H200", (9, 0), 140 * GIB, integrated=False, pageable_memory_access=False)
THOR = Device("NVIDIA Thor", (11, 0), 122 * GIB, integrated=True, pageable_memory_access=True)


def exit_of(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse
        return exc.code


def facts(**changes) -> Facts:
    base = dict(device=H200, source=Verdict("sglang", "patched", "0.5.23", "x", files=7), c_compiler="/usr/bin/cc",
                cxx_compiler="/usr/bin/c++", swap_bytes=0, swappiness=60, journald_persistent=False,
                request=Request(), tegra=None)
    return Facts(**{**base, **changes})


def by_check(findings, check):
    return [f for f in findings if f.check == check]


@pytest.fixture
def no_machine(monkeypatch):
    """The doctor's facts of a CPU box without touching torch or the engine: the request is what diagnose built."""
    monkeypatch.setattr(doctor, "gather_facts", lambda *, request, **_: facts(device=None, request=request))


# --------------------------------------------------------------------------- doctor --profile


@pytest.mark.parametrize(("device", "why"), [(None, "no CUDA device here"),
                                             (H200, "NVIDIA H200 has its own memory, not unified memory")])
def test_thor_profile_off_a_jetson_names_the_checks_it_skipped(device, why):
    (found,) = by_check(run_checks(facts(device=device, request=Request(jetson_profile="thor"))), "jetson_host")
    assert found.level == WARNING
    assert found.message == ("profile thor is written for Jetson AGX Thor and this machine is not one, so its host "
                             f"checks were skipped: swap, swappiness and persistent journal ({why}); L4T release "
                             "(no /etc/nv_tegra_release: not a Jetson)")
    assert found.fix == ("run `sglang-ssd-stream doctor --profile thor` on the Thor that will serve; for a discrete "
                         "GPU use --profile discrete-gpu")
    assert not by_check(run_checks(facts(device=device, request=Request(jetson_profile="thor"))), "swap")


def test_no_skip_finding_where_the_thor_checks_ran_or_do_not_apply():
    from sglang_ssd_stream.checks import host

    on_thor = facts(device=THOR, request=Request(jetson_profile="thor"),
                    tegra=host.TegraRelease(38, 4, 0, "# R38 (release), REVISION: 4.0"))
    assert not by_check(run_checks(on_thor), "jetson_host") and by_check(run_checks(on_thor), "swap")
    assert not by_check(run_checks(facts(request=Request())), "jetson_host")  # discrete-gpu, or no profile


def test_doctor_marks_the_thor_profile(no_machine):
    _, findings = doctor.diagnose(profile="thor")
    assert [f.level for f in by_check(findings, "jetson_host")] == [WARNING]
    _, findings = doctor.diagnose(profile="discrete-gpu")
    assert not by_check(findings, "jetson_host")


def test_a_vllm_profile_on_the_sglang_doctor_is_a_usage_error_naming_the_right_cli(capsys):
    assert exit_of(sglang_main, ["doctor", "--profile", "a100x4"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert ("argument --profile: 'a100x4' is a vllm-ple-offload profile: check it with `vllm-ple-offload serve "
            "--profile a100x4 --model DIR --dry-run` in the vLLM runtime (./install.sh --engine vllm); "
            "sglang-ssd-stream's profiles: thor, discrete-gpu") in err
    assert exit_of(sglang_main, ["doctor", "--profile", "nope"]) == EXIT_USAGE
    assert "unknown profile 'nope'; sglang-ssd-stream's profiles: thor, discrete-gpu" in capsys.readouterr().err


# --------------------------------------------------------------------------- usage errors: 64 on both CLIs


@pytest.mark.parametrize("main", [sglang_main, vllm_main], ids=["sglang-ssd-stream", "vllm-ple-offload"])
@pytest.mark.parametrize("argv", [
    [], ["--bogus"], ["serve"], ["serve", "--profile", "nope", "--model", "m"], ["plan", "--profile", "thor"],
    ["patch", "status", "--python"], ["patch", "apply", "--python", "x", "--site-packages", "y"],
    ["service", "--profile", "thor"], ["validate", "--url", "u"], ["watch", "--bogus"],
    ["validate", "--url", "http://127.0.0.1:1/v1", "--model", "m", "--suite", "bogus"],
])
def test_usage_errors_exit_64(main, argv, capsys):
    assert exit_of(main, argv) == EXIT_USAGE


def test_usage_errors_of_each_doctor_exit_64(capsys):
    assert exit_of(sglang_main, ["doctor", "--profile", "a100x4"]) == EXIT_USAGE
    assert exit_of(vllm_main, ["doctor", "--table-gib", "x"]) == EXIT_USAGE


# --------------------------------------------------------------------------- validate


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_validate_with_the_server_down_says_so(capsys):
    url = f"http://127.0.0.1:{_free_port()}/v1"
    assert sglang_main(["validate", "--url", url, "--model", "m"]) == EXIT_ENVIRONMENT
    err = capsys.readouterr().err
    assert f"the server at {url} is not answering (ConnectError" in err
    assert "start it (`sglang-ssd-stream serve`) or fix --url, then run validate again" in err
    assert "--context-length" not in err


@pytest.mark.parametrize(("status", "fix"), [
    (401, "pass its key with --api-key-file"),
    (404, "check --url: the OpenAI base URL of the server, e.g. http://127.0.0.1:8000/v1"),
    (500, "so the served context is unknown; pass --context-length"),
])
def test_validate_against_a_server_that_answers_without_its_models(capsys, status, fix):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(status)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
        assert sglang_main(["validate", "--url", url, "--model", "m"]) == EXIT_ENVIRONMENT
    finally:
        srv.shutdown()
        srv.server_close()
    assert f"{url}/models answered HTTP {status}; {fix}" in capsys.readouterr().err


# --------------------------------------------------------------------------- serve --dry-run


@pytest.mark.real_doctor
def test_dry_run_for_a_missing_model_does_not_ask_for_a_smaller_pool(tmp_path, capsys, no_machine):
    missing = tmp_path / "nonexistent"
    assert sglang_main(["serve", "--profile", "thor", "--model", str(missing), "--dry-run"]) == EXIT_OK
    out = capsys.readouterr().out
    assert f"# [error] memory: cannot size weights and pool: {missing}/config.json: no such file\n" in out
    assert f"#     fix: {doctor.MODEL_FIX}\n" in out
    assert "lower --max-total-tokens" not in out


def test_the_pool_refusal_still_names_the_pool():
    (found,) = by_check(run_checks(facts(request=Request(memory_plan_error="a 9-token pool needs more"))), "memory")
    assert found.level == ERROR and found.fix.startswith("lower --max-total-tokens")


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_dry_run_reports_an_open_bind_without_a_key_and_exits_0(tmp_path, capsys, engine):
    """README: `--dry-run` "exits 0 on any machine"; the open bind is a finding of the report, a refusal of serve."""
    import argparse

    from sglang_ssd_stream.operate import add_operate_commands
    from sglang_ssd_stream.operate.errors import ServeRefused

    from .conftest import SIDES

    model = write_model(tmp_path / "m")
    p = argparse.ArgumentParser()
    add_operate_commands(p.add_subparsers(dest="command", required=True), SIDES[engine])
    argv = ["serve", "--profile", "thor", "--model", str(model), "--host", "0.0.0.0"]
    args = p.parse_args(argv + ["--dry-run"])
    assert args.func(args, exec_fn=lambda *a: pytest.fail("exec in dry run")) == EXIT_OK
    out = capsys.readouterr().out
    assert ("# [error] exposure: --host 0.0.0.0 is not loopback and the launch has no API key: anyone who can reach "
            "it could use the model, so serve refuses it\n#     fix: pass --api-key-file FILE, bind --host 127.0.0.1, "
            "or --allow-unauthenticated if an authenticating proxy guards it\n") in out
    assert "# a real serve would refuse here: 1 error(s) above" in out and "--host 0.0.0.0" in out
    args = p.parse_args(argv)
    with pytest.raises(ServeRefused, match="refusing to bind 0.0.0.0 without an API key"):
        args.func(args, exec_fn=lambda *a: pytest.fail("exec of an open bind"))
    args = p.parse_args(argv + ["--api-key", "k", "--dry-run"])
    assert args.func(args) == EXIT_OK and "exposure" not in capsys.readouterr().out


def test_dry_run_help_says_when_it_exits_0(capsys):
    assert exit_of(sglang_main, ["serve", "--help"]) == EXIT_OK
    text = " ".join(capsys.readouterr().out.split())
    assert "an open bind without an API key included (shell comments), and exit 0" in text


# --------------------------------------------------------------------------- plan


def test_plan_without_device_memory_says_why_there_is_no_fit(model_dir, capsys):
    assert sglang_main(["plan", "--profile", "thor", "--model", str(model_dir)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "host memory beside the device fit below" in out
    assert out.rstrip().endswith("memory: no device fit without --device-memory-gib (GiB per device; `plan --help` "
                                 "says where to read it, 122.86 on Thor)")
    assert sglang_main(["plan", "--profile", "thor", "--model", str(model_dir), "--device-memory-gib", "122.86"]) == 0
    out = capsys.readouterr().out
    assert "no device fit" not in out and "memory: " in out and "headroom" in out


# --------------------------------------------------------------------------- update-model, model fetch


@pytest.fixture
def hub_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)


def test_update_model_without_the_hub_leaves_nothing_it_created(tmp_path, capsys, hub_offline):
    data = tmp_path / "data"
    assert sglang_main(["update-model", "--data-dir", str(data), "-q"]) == EXIT_ENVIRONMENT
    err = capsys.readouterr().err
    assert "(HF_HUB_OFFLINE=1 is set: huggingface_hub does not ask it)" in err and "Unset HF_HUB_OFFLINE" in err
    assert not data.exists()
    data.mkdir()  # a data dir that was there stays, empty as it was
    assert sglang_main(["update-model", "--data-dir", str(data), "-q"]) == EXIT_ENVIRONMENT
    assert list(data.iterdir()) == []


def test_update_model_help_describes_it(capsys):
    assert exit_of(sglang_main, ["update-model", "--help"]) == EXIT_OK
    text = " ".join(capsys.readouterr().out.split())
    assert "Download the prepared snapshot" in text and "leaves state.json as it was" in text


@pytest.mark.parametrize("pinned", [False, True])
def test_model_fetch_names_hf_hub_offline(tmp_path, capsys, hub_offline, pinned):
    data = tmp_path / "data"
    revisions = ["--prepared-revision", "1" * 40, "--dense-revision", "2" * 40] if pinned else []
    code = sglang_main(["model", "fetch", "--out", str(tmp_path / "view"), "--data-dir", str(data), "-q", *revisions])
    assert code == EXIT_ENVIRONMENT
    err = capsys.readouterr().err
    assert "HF_HUB_OFFLINE=1 is set, so the model hub is not asked for" in err
    assert "Unset HF_HUB_OFFLINE and retry" in err and "Retry, or set HF_ENDPOINT" not in err
    assert not data.exists() and not (tmp_path / "view").exists()


# --------------------------------------------------------------------------- vllm-ple-offload in the SGLang runtime


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="needs a runtime without vLLM")
@pytest.mark.parametrize("json_out", [False, True])
def test_vllm_patch_status_without_vllm_names_the_install(capsys, json_out):
    assert vllm_main(["patch", "status"] + (["--json"] if json_out else [])) == EXIT_ENVIRONMENT
    out, err = capsys.readouterr()
    text = json.loads(out)["message"] if json_out else err
    assert "vLLM is not installed in this runtime" in text and "./install.sh --engine vllm" in text
    assert "install vllm there first" not in out + err


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="needs a runtime without vLLM")
def test_patch_with_a_python_lacking_the_engine_names_the_install(capsys):
    """--python pointing at an interpreter without the engine: say it is not that runtime and how to build it."""
    import sys

    rc = vllm_main(["patch", "status", "--python", sys.executable])
    err = capsys.readouterr().err
    assert rc == EXIT_ENVIRONMENT
    assert "cannot import vllm: it is not the vllm runtime" in err and "./install.sh --engine vllm" in err, err


def test_every_docs_reference_in_a_message_names_a_page_and_section_that_exist():
    """Issue 43 item 6: the vLLM doctor's settings fix pointed at "README: vLLM", a section the README lacks.
    A message points at docs/<page>.md#<anchor>; the page must exist and hold a heading with that anchor."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]

    def anchor(heading: str) -> str:  # GitHub's: lower case, punctuation dropped, spaces to hyphens
        return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")

    refs, stale = [], []
    for src in [*(repo / "sglang_ssd_stream").rglob("*.py"), *(repo / "vllm_ple_offload").rglob("*.py")]:
        text = src.read_text()
        stale += [f"{src.name}: {m}" for m in re.findall(r"\(README: [^)]*\)", text)]
        refs += [(src.name, page, frag) for page, frag in re.findall(r"docs/([\w.-]+\.md)#([\w-]+)", text)]
    assert not stale, stale
    assert any(page == "configuration.md" for _, page, _ in refs)  # the vLLM doctor's settings fix
    for name, page, frag in refs:
        doc = repo / "docs" / page
        assert doc.is_file(), (name, page)
        headings = {anchor(line.lstrip("#")) for line in doc.read_text().splitlines() if line.startswith("#")}
        assert frag in headings, (name, page, frag, sorted(headings))


def _cli(tmp_path, *argv):
    import os
    import subprocess
    import sys
    from pathlib import Path

    return subprocess.run([sys.executable, "-m", "sglang_ssd_stream", *argv], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2],
                          env={**os.environ, "HOME": str(tmp_path)})


@pytest.mark.parametrize("verb", [["plan", "--profile", "discrete-gpu"], ["doctor"]])
def test_a_missing_model_folder_is_named_not_taken_for_a_hub_repo_id(tmp_path, verb):
    """Issue 43 item 6: transformers took the missing path for a hub repo id and advised on its name."""
    missing = tmp_path / "no-such-model"
    r = _cli(tmp_path, *verb, "--model", str(missing))
    assert r.returncode in (2, 3) and "Traceback" not in r.stderr, r.stderr
    said = r.stdout + r.stderr
    assert f"{missing}: no such directory" in said and "Repo id" not in said, said


def test_plan_takes_the_model_config_json_as_its_help_says_and_refuses_another_file(tmp_path):
    """Issue 43 items 2 and 6: ``--model <dir>/config.json`` (the help's "or its config.json") plans as the
    folder does; another file is refused, naming what --model takes."""
    model = write_model(tmp_path / "model")
    by_dir = _cli(tmp_path, "plan", "--profile", "discrete-gpu", "--model", str(model), "--json")
    by_file = _cli(tmp_path, "plan", "--profile", "discrete-gpu", "--model", str(model / "config.json"), "--json")
    assert by_dir.returncode == by_file.returncode == EXIT_OK, (by_dir.stderr, by_file.stderr)
    assert json.loads(by_file.stdout) == json.loads(by_dir.stdout)
    other = _cli(tmp_path, "plan", "--profile", "discrete-gpu", "--model", str(model / "ssd-stream.json"))
    assert other.returncode == 3 and "Traceback" not in other.stderr, other.stderr
    assert "is a file: pass the model's folder or its config.json" in other.stderr
