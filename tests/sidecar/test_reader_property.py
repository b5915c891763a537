"""Property test of the page planner: any ids, row widths, buffer and coalescing sizes."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_ssd_stream.sidecar import PAGE_SIZE, SidecarReader
from sglang_ssd_stream.sidecar.format import SidecarTable

ROW_BYTES = [1, 2, 160, 320, 4096, 5000, 12288]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_planner_matches_direct_indexing(tmp_path_factory, data):
    row_bytes = data.draw(st.sampled_from(ROW_BYTES))
    rows = data.draw(st.integers(1, 3000))
    row_start = data.draw(st.integers(0, 50))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    table_bytes = rng.integers(0, 256, size=(rows, row_bytes), dtype=np.uint8)
    path = tmp_path_factory.mktemp("prop") / "t.bin"
    path.write_bytes(table_bytes.tobytes())
    t = SidecarTable(0, "t.bin", path, "0" * 64, "float8_e4m3fn", rows, row_bytes, row_start, rows * row_bytes)

    lo = data.draw(st.integers(row_start, row_start + rows - 1))
    hi = data.draw(st.integers(lo + 1, row_start + rows))
    total = row_start + rows
    ids = np.array(data.draw(st.lists(st.integers(0, total - 1), max_size=400)), dtype=np.int64)
    spill_pages = (row_bytes + PAGE_SIZE - 2) // PAGE_SIZE
    buffer = data.draw(st.one_of(st.none(),
                                 st.integers(spill_pages + 1, spill_pages + 12).map(lambda p: p * PAGE_SIZE)))
    reader = SidecarReader(
        t, vocab_start=lo, vocab_end=hi, max_rows=data.draw(st.integers(1, 500)),
        workers=data.draw(st.integers(1, 3)), max_read_bytes=PAGE_SIZE * data.draw(st.integers(1, 8)),
        buffer_bytes=buffer,
    )
    out = np.full((ids.size, row_bytes), 0xEE, np.uint8)
    with reader:
        reader.read_rows(ids, out)
    inside = (ids >= lo) & (ids < hi)
    assert np.array_equal(out[inside], table_bytes[ids[inside] - row_start])
    assert not out[~inside].any()
    path.unlink()
