"""scripts/suites.py (what scripts/test.sh runs): the suites it cuts in two still run every test of the one
selection they came from, a usage error is exit 64, and a cut-short JUnit report does not stop the runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import suites  # noqa: E402  (a script, not a package)


def _collected(*args: str) -> set[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                       cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {line for line in r.stdout.splitlines() if "::" in line}


def test_the_sglang_parts_run_exactly_the_one_selection_they_were_cut_from():
    parts = [s for s in suites.SUITES.values() if s.group == "sglang"]
    assert len(parts) == 3
    whole = _collected("tests", "-m", suites.SGLANG_ONLY)
    got = [_collected(*s.args) for s in parts]
    assert all(got), [s.name for s, g in zip(parts, got, strict=True) if not g]
    assert sum(len(g) for g in got) == len(set().union(*got)), "a test runs in two parts"
    assert set().union(*got) == whole, sorted(whole ^ set().union(*got))[:5]  # none left out, none added
    assert len(whole) > 1000


def test_every_suite_test_sh_names_is_a_group_and_a_bad_name_is_a_usage_error():
    assert set(suites.GROUPS) == {"sglang", "vllm", "e2e", "e2e-vllm"}
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "suites.py"), "sglnag"], capture_output=True,
                       text=True, env={**os.environ, "SSD_STREAM_CACHE": "/nonexistent"}, timeout=60)
    assert r.returncode == 64 and "unknown suite: sglnag" in r.stderr, (r.returncode, r.stderr)


def test_a_junit_report_cut_short_leaves_the_counts_empty(tmp_path):
    cut = tmp_path / "cut.xml"
    cut.write_text('<testsuites><testsuite><testcase classname="tests.a" name="t"')
    assert suites.junit_results(cut) == ({"passed": 0, "failed": 0, "error": 0, "skipped": 0}, [])
    whole = tmp_path / "whole.xml"
    whole.write_text('<testsuites><testsuite><testcase classname="tests.a" name="t1" time="1.5"/>'
                     '<testcase classname="tests.a" name="t2" time="2"><failure/></testcase>'
                     '<testcase classname="tests.b" name="t3" time="0"><skipped/></testcase></testsuite></testsuites>')
    counts, cases = suites.junit_results(whole)
    assert counts == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert cases == [(1.5, "tests/a::t1"), (2.0, "tests/a::t2"), (0.0, "tests/b::t3")]


def test_nothing_selected_passes_only_under_the_users_filter():
    suite = suites.SUITES["sglang-ops"]
    for rc, args, ok in ((0, [], True), (suites.NO_TESTS, ["-k", "name"], True), (suites.NO_TESTS, [], False),
                         (1, ["-k", "name"], False)):
        suite.rc = rc
        assert suites.passed(suite, args) is ok, (rc, args)
    suite.rc = None


def test_a_path_the_user_names_runs_in_the_suite_that_holds_it_and_only_there():
    """pytest given a suite's folder and a file in it runs the whole folder: a named path replaces the suite's
    own paths, in the one suite whose selection holds it (its ``--ignore``s count); a filter alone changes no
    suite's paths."""
    def where(*args):
        return {name: suites.narrowed(s, list(args)) for name, s in suites.SUITES.items()
                if suites.narrowed(s, list(args)) is not None}

    assert where("tests/e2e/test_5_mtp.py", "-k", "mtp") == {"e2e": ["tests/e2e/test_5_mtp.py", "-m", "e2e", "-k",
                                                                      "mtp"]}
    got = where("tests/sidecar/test_hot_file.py::test_x")
    assert list(got) == ["sglang-core"] and got["sglang-core"][0] == "tests/sidecar/test_hot_file.py::test_x"
    assert list(where("tests/operate/test_serve.py")) == ["sglang-ops"]
    assert list(where("tests/sglang")) == ["sglang-engine"]
    assert list(where("tests/e2e_vllm/test_8_hot_file.py" if (REPO / "tests/e2e_vllm/test_8_hot_file.py").exists()
                      else "tests/e2e_vllm")) == ["e2e-vllm"]
    assert set(where("-k", "tests")) == set(suites.SUITES)  # a -k value that is a folder's name is not a path
    assert where("-k", "x")["vllm"] == [*suites.SUITES["vllm"].args, "-k", "x"]


def test_a_path_no_chosen_suite_holds_is_a_usage_error():
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "suites.py"), "vllm", "--", "tests/e2e"],
                       capture_output=True, text=True, env={**os.environ, "SSD_STREAM_CACHE": "/nonexistent"},
                       timeout=60)
    assert r.returncode == 64 and "no suite of vllm holds tests/e2e" in r.stderr, (r.returncode, r.stderr)
