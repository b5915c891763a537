"""staging/verify_rows.py: a verify step's rows handed to the prefetch thread (on this CPU, the copy path)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_ssd_stream.staging.verify_rows import verify_rows_source


def test_rows_pair_with_their_history_and_a_negative_draft_ends_a_row():
    tokens = torch.tensor([[5, 6, 7, 8], [9, 10, -1, -1]])
    history = torch.tensor([[1, 2], [3, 4]])
    source, on_device = verify_rows_source(tokens, history)
    tokens[0, 0] = 99  # the engine reuses its buffers: the source holds a copy
    assert not on_device
    rows = source()
    assert [(h.tolist(), t.tolist()) for h, t in rows] == [([1, 2], [5, 6, 7, 8]), ([3, 4], [9, 10])]
    assert all(h.dtype == np.int64 and t.dtype == np.int64 for h, t in rows)


def test_rows_and_histories_that_do_not_pair_up_are_refused():
    with pytest.raises(ValueError, match="do not pair up"):
        verify_rows_source(torch.zeros(2, 4, dtype=torch.int64), torch.zeros(3, 2, dtype=torch.int64))
