"""Issue 28 item 2: every unit name `service` writes comes from one place (`-o` or `--name`), and the watch unit
names the server unit that was really written. systemd-analyze does not catch a wrong `Wants=` (it is soft) and
may be absent, so the unit files are parsed here."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from sglang_ssd_stream.cli import main
from sglang_ssd_stream.errors import EXIT_OK, EXIT_REFUSED

REPO = Path(__file__).resolve().parents[2]
BASE = ["service", "--profile", "thor", "--model", "/m", "--user", "u", "--home", "/h", "--cli", "/c"]


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (a key may repeat), as systemd reads a unit file."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in text.splitlines():
        if not line.strip() or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip()[1:-1], {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key, []).append(value)
    return sections


def assert_watch_names_server(server_unit: str, server_text: str, watch_unit: str, watch_text: str) -> None:
    """``server_unit``/``watch_unit``: the names systemd gives the two files (``qwen38.service``)."""
    server, watch = parse_unit(server_text), parse_unit(watch_text)
    assert server["Service"]["SyslogIdentifier"] == [server_unit.removesuffix(".service")]
    assert watch["Unit"]["Wants"] == [server_unit] and watch["Unit"]["After"] == [server_unit]
    argv = shlex.split(watch["Service"]["ExecStart"][0])
    assert argv[argv.index("--unit") + 1] == server_unit.removesuffix(".service")
    assert watch["Service"]["SyslogIdentifier"] == [watch_unit.removesuffix(".service")]


def run(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("server_args", "watch_args", "server_unit"), [
    (["-o", "qwen38.service"], ["-o", "qwen38-watch.service"], "qwen38.service"),  # the README's
    (["--name", "llm", "-o", "llm.service"], ["--name", "llm", "-o", "llm-watch.service"], "llm.service"),
    (["-o", "llm.service"], ["--name", "llm", "-o", "llm-watch.service"], "llm.service"),
])
def test_both_units_written_reference_each_other(tmp_path, capsys, server_args, watch_args, server_unit):
    def in_tmp(args):
        return [str(tmp_path / a) if a.endswith(".service") else a for a in args]

    assert run(BASE + in_tmp(server_args), capsys)[0] == EXIT_OK
    assert run(BASE + ["--watch-unit"] + in_tmp(watch_args), capsys)[0] == EXIT_OK
    watch_unit = server_unit.replace(".service", "-watch.service")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([server_unit, watch_unit])
    assert_watch_names_server(server_unit, (tmp_path / server_unit).read_text(), watch_unit,
                              (tmp_path / watch_unit).read_text())


@pytest.mark.parametrize("name", [None, "llm"])
def test_units_on_stdout_share_the_name(capsys, name):
    named = ["--name", name] if name else []
    server = run(BASE + named, capsys)[1]
    watch = run(BASE + named + ["--watch-unit"], capsys)[1]
    unit = name or "qwen38-ssd-stream"
    assert_watch_names_server(f"{unit}.service", server, f"{unit}-watch.service", watch)


@pytest.mark.parametrize(("args", "message"), [
    (["--name", "llm", "-o", "qwen38.service"],
     "--name llm but -o qwen38.service: systemd names the unit after its file, so the two disagree; drop --name, "
     "or write -o llm.service"),
    (["--watch-unit", "--name", "llm", "-o", "qwen38-watch.service"],
     "--name llm but -o qwen38-watch.service: systemd names the unit after its file, so the two disagree; drop "
     "--name, or write -o llm-watch.service"),
    (["--watch-unit", "-o", "watch.service"],
     "-o watch.service does not name the server unit: a watch unit's file is <server unit>-watch.service "
     "(qwen38-watch.service beside qwen38.service); write -o qwen38-ssd-stream-watch.service"),
])
def test_names_that_disagree_are_refused_and_nothing_is_written(tmp_path, capsys, args, message):
    args = [str(tmp_path / a) if a.endswith(".service") else a for a in args]
    code, out, err = run(BASE + args, capsys)
    assert code == EXIT_REFUSED and message in err and out == ""
    assert not any(tmp_path.iterdir())


def test_the_readme_example_gives_units_that_reference_each_other(tmp_path, capsys):
    """Run the README's own `service` lines (systemd unit, then its watch unit) and check what they wrote."""
    lines = [ln.split("  #")[0] for ln in (REPO / "README.md").read_text().splitlines()
             if ln.startswith("sglang-ssd-stream service ")]
    assert len(lines) == 2, lines
    server_line, watch_line = sorted(lines, key=lambda ln: "--watch-unit" in ln)
    written = []
    for line in (server_line, watch_line):
        argv = shlex.split(line.replace("$MODEL", "/m").replace("$USER", "u"))[1:] + ["--home", "/h", "--cli", "/c"]
        i = argv.index("-o") + 1
        written.append(argv[i])
        argv[i] = str(tmp_path / argv[i])
        assert run(argv, capsys)[0] == EXIT_OK
    server_unit, watch_unit = written
    assert_watch_names_server(server_unit, (tmp_path / server_unit).read_text(), watch_unit,
                              (tmp_path / watch_unit).read_text())
