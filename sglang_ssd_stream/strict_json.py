"""Strict JSON for the kit's own documents (patch manifests, journals, locks, sidecar manifests).

UTF-8, no duplicate keys (the second would silently win), no NaN/Infinity; nesting deep enough to
exhaust the parser's recursion is a :class:`NestedTooDeeply` error, not a ``RecursionError`` crash.
Standard library only: the engine-neutral floors (``patching/``, ``sidecar/``) both use it.
"""

from __future__ import annotations

import json


class NestedTooDeeply(ValueError):
    """The document nests deeper than the parser's recursion limit."""


def _no_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constant(name):
    raise ValueError(f"{name} is not JSON")


def loads(raw: bytes):
    """The document in ``raw``; ``ValueError`` (``UnicodeDecodeError`` and :class:`NestedTooDeeply` among
    them) when it is not strict JSON."""
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except RecursionError:
        raise NestedTooDeeply("nested too deeply") from None
