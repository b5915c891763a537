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


def verify_rows_source(tokens: torch.Tensor, history: torch.Tensor, keep=None):
    """``tokens`` ``[requests, width]`` (a negative id ends a row early: a draft not proposed) and ``history``
    ``[requests, ngram_size - 1]``; ``keep``: the rows to hand over (default all), chosen on the host after the
    copy (an index tensor built for the device would make the engine's thread wait). Returns ``(source,
    on_device)``: ``source()`` gives ``[(history, tokens)]`` per kept row, ``on_device`` whether it waits for the
    device."""
    if tokens.dim() != 2 or history.dim() != 2 or tokens.shape[0] != history.shape[0]:
        raise ValueError(f"verify rows {tuple(tokens.shape)} and histories {tuple(history.shape)} do not pair up")
    device = None
    if tokens.is_cuda:
        device = tokens.device
        host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host_history = torch.empty(history.shape, dtype=history.dtype, pin_memory=True)
        host_tokens.copy_(tokens, non_blocking=True)
        host_history.copy_(history, non_blocking=True)
        ready = torch.cuda.Event(blocking=True)  # the waiting thread sleeps instead of spinning a core
        ready.record()
    else:
        host_tokens, host_history, ready = tokens.clone(), history.clone(), None
    rows_kept = None if keep is None else list(keep)

    def source():
        if ready is not None:
            # the prefetch thread's current device must be the event's: a CUDA call on a thread that never chose
            # one would create a context on GPU 0 (half a GiB on it for every other rank)
            torch.cuda.set_device(device)
            ready.synchronize()  # the prefetch thread waits for the device, never the engine
        hist, toks = host_history.numpy().astype(np.int64), host_tokens.numpy().astype(np.int64)
        rows = []
        for i in range(toks.shape[0]) if rows_kept is None else rows_kept:
            t = toks[i]
            cut = np.flatnonzero(t < 0)
            rows.append((hist[i], t[:cut[0]] if cut.size else t))
        return rows

    return source, ready is not None
