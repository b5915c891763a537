"""A verify step's tokens off the device for the prefetch thread, without the engine waiting (issue 27 item 3).

Both engines' MTP hooks call :func:`verify_rows_source` right after the draft tokens exist, with per request the
verify row (the last committed token, then the drafts) and its n-gram history, as device tensors the engine
computed. On a GPU the two are copied to pinned host memory with non-blocking copies on the current stream and
an event is recorded after them: the engine's thread enqueues and goes on. The returned source, called on the
prefetch thread (:meth:`~sglang_ssd_stream.sidecar.prefetch.PromptPrefetcher.drafted`), waits for that event,
then hands the rows over. Pinned tensors come from torch's caching host allocator, which keeps a block until the
copies recorded on it are done, so reusing memory never races a copy. On a CPU the copies are plain ones.
"""

from __future__ import annotations

import numpy as np
import torch


def verify_rows_source(tokens: torch.Tensor, history: torch.Tensor):
    """``tokens`` ``[requests, width]`` (a negative id ends a row early: a draft not proposed) and ``history``
    ``[requests, ngram_size - 1]``; returns ``(source, on_device)``: ``source()`` gives ``[(history, tokens)]``
    per request, ``on_device`` whether it waits for the device."""
    if tokens.dim() != 2 or history.dim() != 2 or tokens.shape[0] != history.shape[0]:
        raise ValueError(f"verify rows {tuple(tokens.shape)} and histories {tuple(history.shape)} do not pair up")
    if tokens.is_cuda:
        host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host_history = torch.empty(history.shape, dtype=history.dtype, pin_memory=True)
        host_tokens.copy_(tokens, non_blocking=True)
        host_history.copy_(history, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
    else:
        host_tokens, host_history, ready = tokens.clone(), history.clone(), None

    def source():
        if ready is not None:
            ready.synchronize()  # the prefetch thread waits for the device, never the engine
        rows = []
        for h, t in zip(host_history.numpy().astype(np.int64), host_tokens.numpy().astype(np.int64), strict=True):
            cut = np.flatnonzero(t < 0)
            rows.append((h, t[:cut[0]] if cut.size else t))
        return rows

    return source, ready is not None
