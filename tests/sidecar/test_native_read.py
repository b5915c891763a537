"""The native host-node read (``ple/native_read.c``) on CPU: the same rows as the mapped reader,
no GIL while it runs, a process exit with a message on every failure, and a build that refuses
what it cannot compile or load."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import BF16_LAYER, FP8_LAYER
from test_build_and_read import _ids

from sglang_ssd_stream.sidecar import MappedReader, SidecarReader, native, open_reader
from sglang_ssd_stream.staging import native_read
from sglang_ssd_stream.staging.native_read import NativeBuildError, NativeRead

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _own_library_cache(tmp_path_factory, monkeypatch):
    """Every test session compiles the library itself, into a private cache."""
    monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(tmp_path_factory.getbasetemp() / "kit-home"))


@pytest.mark.parametrize("layer", [FP8_LAYER, BF16_LAYER])
@pytest.mark.parametrize("workers,inline,slow,threaded", [
    (1, 2048, 1e-6, "none"),  # one worker: one inline copy
    (8, 2048, float("inf"), "none"),  # every chunk warm: inline in chunks
    (8, 2048, 0.0, "after-probe"),  # every chunk "faulting": the 64-row probe inline, the rest on threads
    (8, 0, 1e-6, "all"),  # inline off: all on threads
])
@pytest.mark.parametrize("rank", ["whole", "tp-middle"])
@pytest.mark.parametrize("io", ["mmap", "pread"])
def test_native_rows_equal_the_python_readers(big, layer, workers, inline, slow, threaded, rank, io):
    _, result, ref = big
    t = result.manifest.table(layer)
    lo, hi = (0, t.rows) if rank == "whole" else (t.rows // 3, 2 * t.rows // 3)
    ids = _ids(t.rows, t.row_bytes, 5000, seed=layer + workers)  # duplicates, first/last, page-straddling rows
    ids[:4] = [lo, hi - 1, (lo - 1) % t.rows, hi % t.rows]  # this rank's edges and the rows just outside
    expected = np.full((ids.size, t.row_bytes), 0xAB, np.uint8)
    out = np.full((ids.size, t.row_bytes), 0xCD, np.uint8)
    with open_reader(t, io, vocab_start=lo, vocab_end=hi, max_rows=ids.size, workers=workers) as r:
        r.read_rows(ids, expected)
        node = NativeRead(r, ids, out, what="test read", slow_row_s=slow, inline_rows=inline)
        node.run()
        assert np.array_equal(out, expected)
        out[:] = 0xCD
        node.run()  # a graph replays: the same node again
        stats = node.stats
    assert np.array_equal(out, expected)
    inside = (ids >= lo) & (ids < hi)
    assert np.array_equal(out[inside], ref[layer][ids[inside]]) and not out[~inside].any()
    assert inside.any() and (~inside).any() == (rank != "whole")
    n = ids.size
    assert stats == {"calls": 2, "threaded_rows": 2 * {"none": 0, "after-probe": n - 64, "all": n}[threaded]}


def test_the_native_read_needs_no_gil(table, ref):
    """The driver runs a host node on its own thread. While the engine's thread runs Python and never
    lets go of the GIL, the native read finishes; a Python host node (the same work through a ctypes
    callback) cannot even start until the GIL is released."""
    import gc
    import threading

    ids = np.arange(table.rows - 1, -1, -7, dtype=np.int64)
    out = np.zeros((ids.size, table.row_bytes), np.uint8)
    with MappedReader(table, max_rows=ids.size, workers=2) as r:
        node = NativeRead(r, ids, out, what="test read")
        py_out = np.zeros_like(out)
        callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _: r.read_rows(ids, py_out))
        results = {}
        interval = sys.getswitchinterval()
        sys.setswitchinterval(30.0)  # this thread keeps the GIL for the whole busy loop
        # nor may a collection in the loop let go of it: a finalizer of an earlier test's garbage (an unclosed
        # socket's close, say) releases the GIL. Once, in a cold run, the Python callback finished inside the loop.
        gc.collect()
        gc.disable()
        try:
            for name, fn, arg in (("native", node.function, node.argument),
                                  ("python", ctypes.cast(callback, ctypes.c_void_p).value, None)):
                done = ctypes.c_int32(0)
                handle = node.lib.ssd_test_start(fn, arg, ctypes.addressof(done))
                assert handle
                end = time.perf_counter() + (5.0 if name == "native" else 0.5)
                while time.perf_counter() < end and not done.value:  # pure Python: the GIL is never released
                    pass
                results[name] = bool(done.value)
                assert node.lib.ssd_test_join(handle) == 0  # ctypes releases the GIL here: the callback runs
                assert done.value == 1
        finally:
            gc.enable()
            sys.setswitchinterval(interval)
        assert threading.active_count() >= 1
    assert results == {"native": True, "python": False}
    assert np.array_equal(out, ref[ids]) and np.array_equal(py_out, ref[ids])


_FAILING = textwrap.dedent("""
    import sys
    import numpy as np
    import os
    from sglang_ssd_stream.sidecar import load_manifest, open_reader
    from sglang_ssd_stream.staging.native_read import NativeRead
    t = load_manifest(sys.argv[1]).tables[0]
    io, case = sys.argv[2], sys.argv[3]
    ids = np.array([0, 5, t.rows - 1] + ([t.rows] if case == "out-of-table" else []), dtype=np.int64)
    out = np.zeros((ids.size, t.row_bytes), np.uint8)
    threaded = case.endswith("-threaded")
    r = open_reader(t, io, max_rows=8, workers=4 if threaded else 1)
    node = NativeRead(r, ids, out, what="PLE layer 2 sidecar read", inline_rows=0 if threaded else None)
    node.run()
    print("FIRST", out[:3].any())
    if case in ("truncated", "shrinks-after-the-size-check"):
        with open(t.file, "r+b") as f:
            f.truncate(4096)
    if case == "shrinks-after-the-size-check":
        node._arrays["file_bytes"][0] = 0  # the size checks pass, as if the file shrank right after them
        st = os.stat(t.file)
        node._arrays["base_size"][0], node._arrays["base_mtime_ns"][0] = st.st_size, st.st_mtime_ns
    if case == "rewritten":  # `cp other over it`: same inode, same size, other bytes
        import time
        time.sleep(0.05)  # past the filesystem clock tick of the build's own last write
        data = bytes(b ^ 0x5A for b in t.file.read_bytes())
        with open(t.file, "r+b") as f:
            f.write(data)
    if case.startswith("io-error"):
        node._arrays["file_fd"][0] = os.open(t.file, os.O_WRONLY)  # every pread on it fails (EBADF)
    if case == "closed":
        node.close()
    node.run()
    print("CONTINUED")
""")


@pytest.mark.parametrize("io,case,message", [
    (io, "truncated", "SidecarTruncated: the PLE table is truncated: it has 4096 bytes, expected 800480")
    for io in ("mmap", "pread")] + [
    (io, "out-of-table", "SidecarRowOutOfRange: row id 5003 at position 3 is outside the table [0, 5003)")
    for io in ("mmap", "pread")] + [
    (io, "closed", "the sidecar reader was closed while a graph that reads it can still replay")
    for io in ("mmap", "pread")] + [
    (io, "rewritten", "SidecarChanged: the PLE table was written while it is served")
    for io in ("mmap", "pread")] + [
    ("pread", "io-error", "SidecarIOError: reading row 0 (byte 0) of the PLE table failed: Bad file descriptor"),
    ("pread", "io-error-threaded", "SidecarIOError: reading row"),  # from copy threads: still one message
    ("pread", "shrinks-after-the-size-check",
     "SidecarTruncated: short read of row 5002 at byte 800320: the PLE table ends there"),
])
def test_a_failing_native_read_ends_the_process_with_a_message(small, tmp_path, io, case, message):
    _, art = small
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    proc = subprocess.run([sys.executable, "-c", _FAILING, str(art), io, case], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == native_read.EXIT_CODE, proc.stderr
    assert "CONTINUED" not in proc.stdout
    assert ("FIRST True" in proc.stdout) == (case != "out-of-table")  # an id outside the table: nothing read at all
    assert f"sglang-ssd-stream: PLE layer 2 sidecar read failed inside a CUDA stream/graph: {message}" in proc.stderr
    assert "stopping this process: the step's rows were not read." in proc.stderr
    assert proc.stderr.count("failed inside a CUDA stream/graph") == 1  # one message, even from several threads
    if case.startswith("io-error"):
        assert "Bad file descriptor" in proc.stderr


@pytest.mark.parametrize("io", ["mmap", "pread"])
def test_a_node_outlives_its_reader_with_its_own_descriptor_and_mapping(table, ref, tmp_path, io):
    """A graph may replay after the reader was closed or dropped: the node still reads this table,
    never a file that reused the reader's descriptor number."""
    ids = np.array([0, 7, table.rows - 1, 7], dtype=np.int64)
    out = np.zeros((ids.size, table.row_bytes), np.uint8)
    r = open_reader(table, io, max_rows=8, workers=1)
    node = NativeRead(r, ids, out, what="test read")
    number = r.fileno()
    r.close()
    del r
    other = tmp_path / "other.bin"
    other.write_bytes(b"\x77" * (table.bytes * 2))
    fd = os.open(other, os.O_RDONLY)
    try:
        assert fd == number  # the lowest free number: the reader's, now this other file's
        node.run()
    finally:
        os.close(fd)
    assert np.array_equal(out, ref[ids])


def test_native_read_refuses_other_readers_o_direct_and_bad_buffers(table):
    ids = np.zeros(4, np.int64)
    with pytest.raises(TypeError, match="reads a MappedReader or a SidecarReader, not dict"):
        NativeRead({}, ids, np.zeros((4, table.row_bytes), np.uint8), what="x")
    with SidecarReader(table, max_rows=4) as r:
        r.direct = True  # as if opened with O_DIRECT (which this filesystem may not support)
        with pytest.raises(ValueError, match="O_DIRECT refuses"):
            NativeRead(r, ids, np.zeros((4, table.row_bytes), np.uint8), what="x")
    with MappedReader(table, max_rows=4, workers=1) as r:
        with pytest.raises(ValueError, match="ids must be a contiguous 1-D int64"):
            NativeRead(r, ids.astype(np.int32), np.zeros((4, table.row_bytes), np.uint8), what="x")
        with pytest.raises(ValueError, match=r"out must be contiguous uint8 \[4, 160\]"):
            NativeRead(r, ids, np.zeros((4, table.row_bytes + 1), np.uint8), what="x")


# ----------------------------------------------------------------------------- build


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No library loaded and an empty cache."""
    monkeypatch.setattr(native_read, "_lib", None)
    monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(tmp_path / "home"))
    return tmp_path


def test_build_once_then_reuse(fresh):
    path = native_read.build()
    assert path.is_file() and path.is_relative_to(fresh / "home" / "native")
    stamp = path.stat().st_mtime_ns
    assert native_read.build() == path and path.stat().st_mtime_ns == stamp
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".build-")] == []
    assert native_read.load().ssd_abi() == native_read.ABI


@pytest.mark.parametrize("cc,message", [
    ("false", "compiling the native host-node library failed (false -O2"),
    ("/nonexistent/cc", "cannot run the C compiler (/nonexistent/cc -O2"),
])
def test_a_machine_without_a_working_compiler_is_refused_with_the_way_out(fresh, monkeypatch, cc, message):
    monkeypatch.setenv("CC", cc)
    with pytest.raises(NativeBuildError) as err:
        native_read.load()
    assert message in str(err.value) and "--disable-cuda-graph" in str(err.value)
    assert not native_read.library_path().exists()
    assert [p for p in native_read.library_path().parent.iterdir() if p.name != ".lock"] == []  # no temp left


def test_no_compiler_on_path_is_refused_with_the_way_out(fresh, monkeypatch):
    """Without $CC the compiler comes from PATH (not from Python's build-time CC)."""
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(fresh / "empty"))
    with pytest.raises(NativeBuildError, match=r"(?s)no C compiler on PATH \(cc, gcc, clang\) and CC is not set.*"
                                               r"--disable-cuda-graph"):
        native_read.load()


def test_without_cc_the_first_compiler_on_path_is_used(fresh, monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    (fresh / "bin").mkdir()
    for tool, name in (("cc", "gcc"), ("as", "as"), ("ld", "ld")):  # no `cc` on this PATH: the next name is taken
        real = subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        (fresh / "bin" / name).symlink_to(real)
    monkeypatch.setenv("PATH", str(fresh / "bin"))
    assert native_read.compiler() == ["gcc"]
    assert native_read.load().ssd_abi() == native_read.ABI


@pytest.mark.parametrize("change", ["smaller-field", "swapped-fields"])
def test_a_library_of_another_layout_is_refused(fresh, monkeypatch, change):
    """A library in the cache whose struct differs from ours would read garbage: refused at load,
    also when only two fields of one size traded places."""
    src = native_read.SOURCE.read_text()
    if change == "smaller-field":
        src = src.replace("char what[128];", "char what[64];")
    else:
        a, b = "    int32_t nsegs;\n", "    int32_t nfiles;\n"
        assert a in src and b in src
        src = src.replace(a, "@@A@@").replace(b, a).replace("@@A@@", b)
    other = fresh / "other.c"
    other.write_text(src)
    path = native_read.library_path()
    path.parent.mkdir(parents=True)
    subprocess.run([*native_read.compiler(), *native_read.CFLAGS, "-o", str(path), str(other)], check=True)
    with pytest.raises(NativeBuildError, match=r"struct size and field offsets .* delete it to rebuild"):
        native_read.load()


def test_a_cached_file_that_is_no_library_is_refused(fresh):
    path = native_read.library_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not an ELF file")
    with pytest.raises(NativeBuildError, match=r"cannot load the native host-node library .*libssd_native_read\.so"):
        native_read.load()


def test_an_interrupted_build_leaves_no_file(fresh, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(native.subprocess, "run", interrupted)  # the kit's one build rule (sidecar/native.py)
    monkeypatch.setattr(native, "_compiler_identity", lambda cc: "cc 1.0")
    with pytest.raises(KeyboardInterrupt):
        native_read.build()
    assert [p.name for p in native_read.library_path().parent.iterdir()] == [".lock"]


def test_concurrent_builds_make_one_library(fresh):
    """Two workers starting at once: one compiles, the other waits for the lock and loads that file."""
    slow_cc = fresh / "slow-cc"
    slow_cc.write_text("#!/bin/sh\nsleep 1\nexec cc \"$@\"\n")
    slow_cc.chmod(0o755)
    code = "from sglang_ssd_stream.staging import native_read as n; n.load(); print(n.library_path())"
    env = {**os.environ, "CC": str(slow_cc), "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    paths = {o.strip() for o, _ in outs}
    assert len(paths) == 1
    built = Path(paths.pop())
    assert sorted(p.name for p in built.parent.iterdir()) == [".lock", native_read.LIB_NAME]
    assert built.stat().st_mode & 0o777 == 0o755


def test_an_unwritable_cache_is_refused(fresh, monkeypatch):
    if os.geteuid() == 0:
        blocked = fresh / "file"
        blocked.write_text("")
        monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(blocked / "home"))  # below a file: fails even as root
    else:
        (fresh / "ro").mkdir(mode=0o500)
        monkeypatch.setenv("SGLANG_SSD_STREAM_HOME", str(fresh / "ro" / "home"))
    with pytest.raises(NativeBuildError, match="set SGLANG_SSD_STREAM_HOME to a writable directory"):
        native_read.build()
