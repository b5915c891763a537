"""Runtime knobs the plugin applies inside each SGLang process (no source edit needed).

``SGLANG_QSA_PREFILL_LOGITS_BUDGET_MB``: cap on the fp32 ``[query_rows, compressed_keys]``
workspace of QSA prefill top-k selection. sglang 0.5.23 hard-codes 128 MiB in
``qsa_indexer._QSA_PREFILL_LOGITS_BUDGET_BYTES`` and reads it at call time in
``_qsa_prefill_row_chunk_size``; top-k is per row, so tiling rows does not change the selection.
The Thor profile sets 32 (its write-up: fewer transient allocations on a 128 GB unified-memory box).

The PLE sidecar's own knobs are read by :mod:`.config` and refused at plugin start when malformed
(``config.validate_env``): ``SGLANG_SSD_STREAM_SIDECAR``, ``_NO_VERIFY``, ``_IO``, ``_READ_WORKERS``,
``_PLE_MAX_TOKENS``, ``_PLE_GATHER``, ``_ROW_CACHE_MB`` (the row cache budget, MiB for all PLE layers of a
process; 0: off; profiles: thor 1024, discrete-gpu 4096) and ``_PREFETCH_CHUNKS`` (prefill chunks read ahead).
"""

from __future__ import annotations

import os

from ..env_numbers import knob_int

QSA_BUDGET_ENV = "SGLANG_QSA_PREFILL_LOGITS_BUDGET_MB"
QSA_BUDGET_TARGET = "sglang.srt.layers.attention.qsa.qsa_indexer._QSA_PREFILL_LOGITS_BUDGET_BYTES"
QSA_BUDGET_MAX_MB = 1 << 16  # 64 GiB: anything larger is a typo, not a budget


def parse_qsa_budget_mb(raw: str) -> int:
    return knob_int(QSA_BUDGET_ENV, raw, 1, QSA_BUDGET_MAX_MB, unit=" MiB", what="an integer number of MiB (e.g. 32)")


def apply_qsa_budget() -> int | None:
    """Set the budget when the variable is set; returns the bytes applied (None: upstream default kept)."""
    raw = os.environ.get(QSA_BUDGET_ENV)
    if raw is None:
        return None
    budget = parse_qsa_budget_mb(raw) << 20
    import importlib

    module_name, _, attr = QSA_BUDGET_TARGET.rpartition(".")
    module = importlib.import_module(module_name)
    if not isinstance(getattr(module, attr, None), int):
        raise RuntimeError(f"{QSA_BUDGET_TARGET} is missing in this sglang; the budget knob cannot be applied")
    setattr(module, attr, budget)
    return budget


def apply_all() -> None:
    apply_qsa_budget()
