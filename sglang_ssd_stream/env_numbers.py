"""The one rule for numeric knobs of both engines (SGLANG_SSD_STREAM_*, SGLANG_QSA_*, VLLM_PLE_*).

ASCII digits only: ``int()`` alone also takes ``'+8'``, ``'1_6'``, ``' 8 '``, ``'8\\n'`` and ``'٨'``, so a typo
or an odd export would act as a number. Each knob's parser bounds the value and names itself in its message.
"""

from __future__ import annotations


def ascii_int(raw: str, *, signed: bool = False) -> int:
    """``raw`` as an integer written in ASCII digits (with ``signed``, after an optional ``-``, so that a
    negative value is reported by the knob's range check); ValueError otherwise."""
    digits = raw[1:] if signed and raw.startswith("-") else raw
    if not (digits.isascii() and digits.isdigit()):
        raise ValueError(f"{raw!r} is not a whole number in ASCII digits")
    return int(raw, 10)
