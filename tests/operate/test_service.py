"""systemd unit (write-up 000 §5) and compose file (write-up 002), exact where it matters."""

from __future__ import annotations

import argparse
import re

import pytest

from sglang_ssd_stream.operate import add_operate_commands
from sglang_ssd_stream.operate.errors import ServeRefused
from sglang_ssd_stream.operate.profiles import PROFILES
from sglang_ssd_stream.operate.service import render_compose, systemd_quote

from .conftest import SIDES


def _run(engine, argv, capsys):
    p = argparse.ArgumentParser()
    add_operate_commands(p.add_subparsers(dest="command", required=True), SIDES[engine])
    args = p.parse_args(argv)
    assert args.func(args) == 0
    return capsys.readouterr().out


def test_systemd_unit_matches_writeup(capsys):
    out = _run("sglang", ["service", "--profile", "thor", "--model", "/home/nvidia/models/Q", "--user", "nvidia",
                          "--home", "/home/nvidia", "--cli", "/home/nvidia/.local/bin/sglang-ssd-stream",
                          "--served-name", "Qwen/Qwen3.6-27B-NVFP4"], capsys)
    assert out == (
        "[Unit]\nDescription=Qwen3.8 Flash-Next on SGLang (thor profile)\nWants=network-online.target\n"
        "After=network-online.target\n\n[Service]\nType=simple\nUser=nvidia\nGroup=nvidia\n"
        "WorkingDirectory=/home/nvidia\nEnvironment=HOME=/home/nvidia\n"
        "ExecStart=/home/nvidia/.local/bin/sglang-ssd-stream serve --profile thor --model /home/nvidia/models/Q "
        "--host 127.0.0.1 --mtp on --served-name Qwen/Qwen3.6-27B-NVFP4\n"
        "Restart=always\nRestartSec=10\nTimeoutStopSec=90\nKillMode=mixed\nLimitMEMLOCK=infinity\n"
        "StandardOutput=journal\nStandardError=journal\nSyslogIdentifier=qwen38-ssd-stream\n\n"
        "[Install]\nWantedBy=multi-user.target\n")


def test_systemd_open_bind_needs_key_file(tmp_path, capsys):
    base = ["service", "--profile", "thor", "--model", "/m", "--user", "u", "--home", "/h", "--cli", "/c",
            "--host", "0.0.0.0"]
    p = argparse.ArgumentParser()
    add_operate_commands(p.add_subparsers(dest="command", required=True), SIDES["sglang"])
    args = p.parse_args(base)
    with pytest.raises(ServeRefused, match="refusing to bind 0.0.0.0 without an API key"):
        args.func(args)
    out = _run("sglang", base + ["--api-key-file", "/etc/qwen/key"], capsys)
    assert "--host 0.0.0.0 --mtp on --api-key-file /etc/qwen/key\n" in out


def test_systemd_quoting():
    assert systemd_quote("/plain/path") == "/plain/path"
    assert systemd_quote("/a b/c") == '"/a b/c"'
    assert systemd_quote("50%") == "50%%"
    assert systemd_quote("$HOME") == '"$$HOME"'
    assert systemd_quote('say "hi"') == '"say \\"hi\\""'
    with pytest.raises(ServeRefused, match="newline"):
        systemd_quote("a\nExecStartPre=/bin/evil")


def test_systemd_writes_file_atomically(tmp_path, capsys):
    out = tmp_path / "unit.service"
    _run("sglang", ["service", "--profile", "thor", "--model", "/m", "--user", "u", "--home", "/h", "--cli", "/c",
                    "-o", str(out)], capsys)
    assert out.read_text().startswith("[Unit]\n") and "LimitMEMLOCK=infinity\n" in out.read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["unit.service"]


def test_compose_matches_writeup(capsys):
    out = _run("vllm", ["service", "--profile", "a100x4", "--model", "/srv/Qwen3.8-Flash-Next-AWQ-W4A16",
                        "--image", "lazymio/vllm-backport:latest-sm80", "--cache-dir", "/srv/cache",
                        "--served-name", "qwen3.8-flash-next", "--served-name", "qwen3.8-27b-int8-w8a16"], capsys)
    assert "privileged" not in out
    for line in ('    image: "lazymio/vllm-backport:latest-sm80"', '      - "127.0.0.1:30001:30001"',
                 '      - "/srv/Qwen3.8-Flash-Next-AWQ-W4A16:/model:ro"', '      VLLM_PLE_CPU_OFFLOAD: "1"',
                 '      OMP_NUM_THREADS: "1"', '      VLLM_WORKER_MULTIPROC_METHOD: "spawn"',
                 "    cap_add:\n      - SYS_PTRACE", "    ipc: host", '    shm_size: "32g"',
                 "      memlock: -1", "      stack: 67108864", '              device_ids: ["0", "1", "2", "3"]'):
        assert line in out, line
    command = out.split("    command:\n")[1].splitlines()
    assert command == [f"      - {x}" for x in (
        '"/model"', '"--tensor-parallel-size"', '"4"', '"--enable-expert-parallel"', '"--max-model-len"', '"262144"',
        '"--max-num-seqs"', '"8"', '"--max-num-batched-tokens"', '"16384"', '"--gpu-memory-utilization"', '"0.88"',
        '"--disable-custom-all-reduce"', '"--speculative-config"',
        '"{\\"method\\":\\"mtp\\",\\"num_speculative_tokens\\":3}"', '"--compilation-config"',
        '"{\\"mode\\":0,\\"cudagraph_mode\\":\\"FULL_DECODE_ONLY\\"}"', '"--enable-auto-tool-choice"',
        '"--tool-call-parser"', '"qwen3_xml"', '"--reasoning-parser"', '"qwen3"', '"--enable-prompt-tokens-details"',
        '"--enable-prefix-caching"', '"--host"', '"0.0.0.0"', '"--port"', '"30001"', '"--served-model-name"',
        '"qwen3.8-flash-next"', '"qwen3.8-27b-int8-w8a16"')]


def _compose(**kw):
    args = dict(service="s", image="i", model_dir="/m", cache_dir="/c", port=None, publish="127.0.0.1",
                require_api_key=False, allow_unauthenticated=False, served_names=(), gpus=("0", "1", "2", "3"))
    args.update(kw)
    return render_compose(PROFILES["vllm", "a100x4"], SIDES["vllm"], **args)


def test_compose_public_port_needs_key_which_stays_out_of_the_file():
    with pytest.raises(ServeRefused, match="refusing to bind 0.0.0.0"):
        _compose(publish="0.0.0.0")
    out = _compose(publish="0.0.0.0", require_api_key=True)
    assert '      VLLM_API_KEY: "${VLLM_API_KEY:?set VLLM_API_KEY on the host}"' in out
    assert "--api-key" not in out


def test_compose_gpu_count_must_match_tp():
    with pytest.raises(ServeRefused, match=r"runs tensor parallel 4; got 2 GPU ids \['0', '1'\]"):
        _compose(gpus=("0", "1"))


def test_compose_chat_template_mounted():
    out = _compose(chat_template="/srv/t.jinja")
    assert '      - "/srv/t.jinja:/opt/chat-template.jinja:ro"' in out
    assert out.rstrip().endswith('- "--chat-template"\n      - "/opt/chat-template.jinja"')


def test_compose_refuses_sglang_profile():
    with pytest.raises(ServeRefused,
                       match="compose files are for the engines served from a container; SGLang profile thor"):
        render_compose(PROFILES["sglang", "thor"], SIDES["sglang"], service="s", image="i", model_dir="/m",
                       cache_dir="/c", port=None, publish="127.0.0.1", require_api_key=False,
                       allow_unauthenticated=False, served_names=(), gpus=("0",))


def _parsed(engine, argv):
    p = argparse.ArgumentParser()
    add_operate_commands(p.add_subparsers(dest="command", required=True), SIDES[engine])
    return p.parse_args(argv)


NO_SUCH_USER = "ssd-stream-no-such-user"


def test_systemd_user_this_host_lacks_is_refused_without_home(capsys):
    """Issue 17 item 4: never `WorkingDirectory=~nvidia`; without --home the unit is refused."""
    import pwd

    with pytest.raises(KeyError):
        pwd.getpwnam(NO_SUCH_USER)
    args = _parsed("sglang", ["service", "--profile", "thor", "--model", "/m", "--user", NO_SUCH_USER, "--cli", "/c"])
    with pytest.raises(ServeRefused, match=f"user '{NO_SUCH_USER}' does not exist on this host.*--home"):
        args.func(args)
    assert capsys.readouterr().out == ""  # nothing written


def test_systemd_user_this_host_lacks_with_home_warns(capsys):
    args = _parsed("sglang", ["service", "--profile", "thor", "--model", "/m", "--user", NO_SUCH_USER,
                              "--home", "/home/x", "--cli", "/c"])
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    assert "~" not in out
    assert f"User={NO_SUCH_USER}\nGroup={NO_SUCH_USER}\nWorkingDirectory=/home/x\nEnvironment=HOME=/home/x\n" in out
    assert f"warning: user '{NO_SUCH_USER}' does not exist on this host" in err


def test_systemd_existing_user_home_and_group_from_the_account_database(capsys):
    import grp
    import os
    import pwd

    pw = pwd.getpwuid(os.getuid())
    out = _run("sglang", ["service", "--profile", "thor", "--model", "/m", "--user", pw.pw_name, "--cli", "/c"], capsys)
    group = grp.getgrgid(pw.pw_gid).gr_name
    assert f"User={pw.pw_name}\nGroup={group}\nWorkingDirectory={pw.pw_dir}\nEnvironment=HOME={pw.pw_dir}\n" in out


def test_the_watch_unit_names_the_server_unit_the_user_wrote(tmp_path, capsys):
    """Issue 28 item 2: following the README (`-o qwen38.service`, then `--watch-unit -o qwen38-watch.service`)
    gave a watcher tied to qwen38-ssd-stream.service, which did not exist."""
    base = ["service", "--profile", "thor", "--model", "/m", "--user", "u", "--home", "/h", "--cli", "/c"]
    _run("sglang", base + ["-o", str(tmp_path / "qwen38.service")], capsys)
    server = (tmp_path / "qwen38.service").read_text()
    assert "SyslogIdentifier=qwen38\n" in server
    _run("sglang", base + ["--watch-unit", "-o", str(tmp_path / "qwen38-watch.service")], capsys)
    watch = (tmp_path / "qwen38-watch.service").read_text()
    assert "Wants=qwen38.service" in watch and "After=qwen38.service" in watch
    assert re.search(r"--unit qwen38(\s|$)", watch), watch
    assert "qwen38-ssd-stream" not in watch
    explicit = _run("sglang", base + ["--watch-unit", "--name", "llm"], capsys)  # --name still decides
    assert "Wants=llm.service" in explicit and "--unit llm" in explicit


def test_a_watch_unit_file_not_named_name_watch_is_refused(tmp_path, capsys):
    """`-o watch.service` does not say which server unit it watches: refused (a guess tied the watcher to a unit
    that may not exist), naming the file to write; nothing is written."""
    base = ["service", "--profile", "thor", "--model", "/m", "--user", "u", "--home", "/h", "--cli", "/c"]
    args = _parsed("sglang", base + ["--watch-unit", "-o", str(tmp_path / "watch.service")])
    with pytest.raises(ServeRefused, match="write -o qwen38-ssd-stream-watch.service"):
        args.func(args)
    assert not any(tmp_path.iterdir())
