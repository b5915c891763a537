"""``SGLANG_QSA_PREFILL_LOGITS_BUDGET_MB``, applied by the plugin inside each SGLang process (no source edit).

It caps the fp32 ``[query_rows, compressed_keys]`` workspace of QSA prefill top-k selection. sglang 0.5.23
hard-codes 128 MiB in ``qsa_indexer._QSA_PREFILL_LOGITS_BUDGET_BYTES`` and reads it at call time in
``_qsa_prefill_row_chunk_size``; top-k is per row, so tiling rows does not change the selection. The Thor
profile sets 32 (its write-up: fewer transient allocations on a 128 GB unified-memory box). The knob is
declared with the others in :mod:`sglang_ssd_stream.knobs`.
"""

from __future__ import annotations

from . import settings

QSA_BUDGET_ENV = settings.QSA_BUDGET.name
QSA_BUDGET_TARGET = "sglang.srt.layers.attention.qsa.qsa_indexer._QSA_PREFILL_LOGITS_BUDGET_BYTES"


def apply_qsa_budget() -> int | None:
    """Set the budget when the variable is set; returns the bytes applied (None: upstream default kept)."""
    mb = settings.current().qsa_budget_mb
    if mb is None:
        return None
    import importlib

    module_name, _, attr = QSA_BUDGET_TARGET.rpartition(".")
    module = importlib.import_module(module_name)
    if not isinstance(getattr(module, attr, None), int):
        raise RuntimeError(f"{QSA_BUDGET_TARGET} is missing in this sglang; the budget knob cannot be applied")
    setattr(module, attr, mb << 20)
    return mb << 20
