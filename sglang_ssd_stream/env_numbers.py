"""The one rule for numeric knobs of both engines (SGLANG_SSD_STREAM_*, SGLANG_QSA_*, VLLM_PLE_*).

ASCII digits only: ``int()`` alone also takes ``'+8'``, ``'1_6'``, ``' 8 '``, ``'8\\n'`` and ``'٨'``, so a typo
or an odd export would act as a number. Each knob's parser bounds the value and names itself in its message.
"""

from __future__ import annotations


def ascii_int(raw: str, *, signed: bool = False) -> int:
    """``raw`` as an integer written in ASCII digits (with ``signed``, after an optional ``-``, so that a
    negative value is reported by the knob's range check); ValueError otherwise. ``-0`` is refused like
    ``+8``: a sign that changes nothing is an odd export, and it would pass a ``0..`` range as 0."""
    negative = signed and raw.startswith("-")
    digits = raw[1:] if negative else raw
    if not (digits.isascii() and digits.isdigit()) or (negative and int(digits, 10) == 0):
        raise ValueError(f"{raw!r} is not a whole number in ASCII digits")
    return int(raw, 10)


def knob_int(name: str, raw: str, lo: int, hi: int, *, what: str | None = None, unit: str = "") -> int:
    """Knob ``name``'s value ``raw``: ASCII digits, within ``lo..hi``; ValueError naming the knob otherwise.

    ``what`` says what a value is (``"an integer number of MiB (e.g. 1024; 0 turns the row cache off)"``),
    ``unit`` follows the range in the out-of-range message."""
    try:
        value = ascii_int(raw, signed=True)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {what or f'an integer {lo}..{hi}'} (ASCII digits only)") from None
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value} is out of range {lo}..{hi}{unit}")
    return value
