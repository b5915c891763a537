"""The SGLang adapter: everything that imports sglang, or reads its server arguments.

- :mod:`.plugin`: the ``sglang.srt.plugins`` entry point (guard, knobs, hooks; fatal on failure);
- :mod:`.hooks`: the four HookRegistry hooks serving the PLE table from the sidecar (through the row cache);
- :mod:`.prefetch`: the scheduler's two hooks feeding the prompt-ahead prefetch of PLE rows;
- :mod:`.config`: which sidecar, and the ``SGLANG_SSD_STREAM_*`` PLE knobs (readers, row cache, prefetch);
- :mod:`.knobs`: runtime knobs with no source edit (the QSA prefill logits budget);
- :mod:`.doctor`: ``sglang-ssd-stream doctor`` and ``serve``'s preflight for SGLang.

Importing this package imports nothing (the entry point must stay stdlib-only at import time).
"""
