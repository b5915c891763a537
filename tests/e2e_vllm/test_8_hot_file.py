"""The hot file across stops of the real server (issue 38 item 1), with ``VLLM_PLE_HOT_INTERVAL_S=0``: written
only at a stop. One chain of three starts over a private copy of the sidecar and one data directory
(``conftest.py``, "the hot file across stops"):

(s) a stop (the suite's, SIGTERM to the whole process group) writes the file, and the next start loads it before
    its first request and answers as the reference;
(a) a forged file (rows changed, checksums recomputed, identities kept) is refused once, at load: a cold start;
(b) a table rewritten in place while served (its mtime put back) is never saved: the stop refuses; after the
    operator renames the right table over it, a restart refuses the file bound to the old table and starts cold.
"""

from __future__ import annotations

import re

from ..e2e.models import PLE_LAYER_IDS, SPLIT_NGRAM_PARTS
from .conftest import HOT_TABLE

LOADED = r"PLE hot file {path}: (\d+) rows into 2 layer\(s\)"
WRITTEN = r"PLE hot file {path}: (\d+) rows written$"
IGNORED = r"PLE hot file {path} ignored \((.*)\); the row cache starts cold$"
ANY_HOT = r"PLE hot file "
SPOT_CHECKED = len(PLE_LAYER_IDS) * SPLIT_NGRAM_PARTS  # checkpoint shards of the PLE tables, one row each
GRACE = r"vllm-ple-offload plugin: pid \d+: VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=30 "


def _worker(sc) -> int:
    (pid,) = sc.role_pids()["worker"]
    return pid


def _path(sc, setup) -> str:
    return re.escape(str(setup["path"]))


def _greedy(sc) -> dict:
    return {label: (run["token_ids"], run["logprobs"]) for label, run in sc.results["greedy"].items()}


def _identities(header) -> dict:
    return {t["layer"]: t["file"] for t in header["tables"]}


def test_a_forged_file_is_refused_once_and_the_start_is_cold(hot_setup, hot_forged, vllm_table):
    """(a) The forged file carries the real file's binding, so only the rows against the tables can refuse it."""
    sc, path = hot_forged, _path(hot_forged, hot_setup)
    genuine, forged = hot_setup["genuine"], hot_setup["forged"]
    assert _identities(forged) == _identities(genuine) and forged["manifest"] == genuine["manifest"]
    assert [t["row_range"] for t in forged["tables"]] == [t["row_range"] for t in genuine["tables"]]
    assert set(hot_setup["forged_rows"]) == {0, 1} and all(hot_setup["forged_rows"].values())
    warned = sc.grep(IGNORED.format(path=path))
    assert len(warned) == 1 and sc.grep(IGNORED.format(path=path), _worker(sc)) == warned, sc.log[-4000:]
    assert re.search(r"layer \d's row \d+ differs from its table", warned[0]), warned
    assert len(sc.grep(r"PLE hot file .* ignored")) == 1
    assert not sc.grep(r"PLE hot file .* rows into")  # cold: nothing placed
    assert _greedy(sc) == _greedy(vllm_table)


def test_a_stop_writes_the_hot_file(hot_setup, hot_forged):
    """(s) With writes only at shutdown, the suite's stop (SIGTERM to the process group) writes the file: the
    plugin gave vLLM's stop the time (the launcher says so), and the worker wrote at its exit."""
    sc, path = hot_forged, _path(hot_forged, hot_setup)
    assert sc.env["VLLM_PLE_HOT_INTERVAL_S"] == "0"
    assert len(sc.grep(GRACE, sc.leader)) == 1 and len(sc.grep(GRACE)) == 1, sc.log[:4000]
    assert sc.after_stop == {}  # the group ended on its own, within our stop's SIGTERM grace
    written = sc.grep(WRITTEN.format(path=path), _worker(sc))
    assert len(written) == 1 and int(re.search(r"(\d+) rows written", written[0])[1]) > 0, sc.log[-4000:]
    assert written[0] not in sc.results["log_before_requests"]  # at the stop, not before
    assert not sc.grep(r"PLE hot file .* not written")
    files = sc.results["after_stop"]
    assert list(files) == [hot_setup["path"].name], files  # the file, no temporary left
    assert files[hot_setup["path"].name] != hot_setup["forged_bytes"]
    # bound to the tables as the worker read them, as the forged one was (nothing changed them meanwhile)
    assert _identities(sc.results["header"]) == _identities(hot_setup["genuine"])


def test_a_restart_loads_it_before_the_first_request(hot_setup, hot_forged, hot_restart, vllm_table):
    """(s) The next start over the same data directory places the file's rows before its first request."""
    sc, path = hot_restart, _path(hot_restart, hot_setup)
    (written,) = hot_forged.grep(WRITTEN.format(path=path))
    rows = int(re.search(r"(\d+) rows written", written)[1])
    before = sc.results["log_before_requests"]
    loaded = [line for line in before.splitlines() if re.search(LOADED.format(path=path), line)]
    # rows the cache already holds are skipped (the line counts those placed): the weight loader's spot-check
    # (StreamedPLEEmbedding.weight_loader: the first row of each checkpoint shard, compared with the sidecar) read
    # one row per shard through the row cache before the load, and the stop wrote those rows too
    assert len(loaded) == 1 and int(re.search(r"(\d+) rows into", loaded[0])[1]) == rows - SPOT_CHECKED > 0, \
        (rows, loaded, before[-4000:])
    assert sc.grep(LOADED.format(path=path), _worker(sc)) == loaded
    assert not sc.grep(r"PLE hot file .* ignored")
    assert _greedy(sc) == _greedy(vllm_table)


def test_a_table_written_in_place_while_served_is_not_saved(hot_setup, hot_forged, hot_restart):
    """(b) Rewritten in its own inode with its mtime put back: only its ctime tells, and the stop refuses."""
    sc = hot_restart
    rw = sc.results["rewrite"]
    b, a = rw["before"], rw["after"]
    assert (a.st_ino, a.st_size, a.st_mtime_ns) == (b.st_ino, b.st_size, b.st_mtime_ns)
    assert a.st_ctime_ns != b.st_ctime_ns
    refused = sc.grep(rf"PLE hot file {_path(sc, hot_setup)} not written \(TableChanged: PLE table \S*"
                      rf"{re.escape(HOT_TABLE)} \(layer 1\) changed while it is served \(ctime_ns ", _worker(sc))
    assert len(refused) == 1, sc.log[-4000:]
    assert len(sc.grep(r"PLE hot file .* not written")) == 1 and not sc.grep(r"PLE hot file .* rows written")
    # no file carries rows of the rewritten table: the data directory is what start 1's stop left, byte for byte
    assert sc.results["after_stop"] == hot_forged.results["after_stop"]
    assert sc.after_stop == {}


def test_a_restart_after_the_table_is_restored_refuses_the_old_file(hot_setup, hot_forged, hot_restored,
                                                                     vllm_table):
    """(b) The operator renamed the right table over the rewritten one (a new inode): the restart verifies the
    tables again (the server would refuse to start on a wrong SHA-256), refuses the file bound to the old table
    once, starts cold and answers as the reference."""
    sc, path = hot_restored, _path(hot_restored, hot_setup)
    assert sc.results["restored"].st_ino != sc.results["rewritten"].st_ino
    assert sc.results["before_start"] == hot_forged.results["after_stop"]  # start 1's file, bound to the old table
    warned = sc.grep(IGNORED.format(path=path), _worker(sc))
    assert len(warned) == 1 and len(sc.grep(r"PLE hot file .* ignored")) == 1, sc.log[-4000:]
    assert re.search(rf"layer 1's table \S*{re.escape(HOT_TABLE)} is not the file its rows were read from "
                     rf"\(inode \d+ -> {sc.results['restored'].st_ino}", warned[0]), warned
    assert not sc.grep(r"PLE hot file .* rows into")
    assert _greedy(sc) == _greedy(vllm_table)
