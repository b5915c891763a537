"""The closed set of errors the PLE sidecar raises.

Each one subclasses an error of :mod:`sglang_ssd_stream.errors` (so the CLI maps it to an exit
code) and therefore a builtin (``ValueError`` or ``OSError``), keeps its data as attributes, and
pickles (an error raised in an engine worker crosses to its parent process).
"""

from __future__ import annotations

from typing import Any

from ..errors import BadKitData, EnvironmentProblem


class _WithData:
    """Mixin: ``Error(message, **data)`` keeps ``data`` as attributes and survives pickling."""

    def __init__(self, message: str, **data: Any):
        super().__init__(message)  # type: ignore[call-arg]
        self.__dict__.update(data)

    def __reduce__(self):
        state = {k: v for k, v in self.__dict__.items() if k != "message"}
        return self.__class__, (self.message,), state  # type: ignore[attr-defined]


class SidecarManifestError(_WithData, BadKitData):
    """``ssd-stream.json`` is malformed: missing, extra, mistyped or oversized field, unknown format."""


class SidecarPathEscape(_WithData, BadKitData):
    """A table path leaves the artifact directory (absolute, ``..``, or a symlink pointing outside)."""


class SidecarSizeMismatch(_WithData, BadKitData):
    """A table's size disagrees with ``rows × columns × itemsize`` or with its file on disk."""


class SidecarTruncated(SidecarSizeMismatch):
    """A table file is shorter than the manifest declares."""


class SidecarChecksumMismatch(_WithData, BadKitData):
    """A table file's SHA-256 is not the one the manifest declares."""


class SidecarShapeMismatch(_WithData, BadKitData):
    """A table's dtype, width or row count does not match what the model expects."""


class SidecarRowOutOfRange(_WithData, BadKitData):
    """A requested row id lies outside the table (a caller bug, not an I/O failure)."""


class SidecarCheckpointError(_WithData, BadKitData):
    """The checkpoint given to the builder has no usable, complete set of PLE shards."""


class SidecarIOError(_WithData, EnvironmentProblem):
    """Reading a table failed (I/O error, short read, file vanished); the reader is now closed for use."""


class SidecarChanged(SidecarIOError):
    """A table was written while it is served (in place: its size or mtime changed since it was
    opened). Its rows are never served again; rows read across the write are not returned."""


class SidecarReaderUnusable(SidecarIOError):
    """The reader refuses work: it was closed, or an earlier read failed (fail-closed)."""


class SidecarWarning(UserWarning):
    """A sidecar works but will be slow or fragile (e.g. it lives on a network filesystem)."""


__all__ = [
    "SidecarManifestError",
    "SidecarPathEscape",
    "SidecarSizeMismatch",
    "SidecarTruncated",
    "SidecarChecksumMismatch",
    "SidecarShapeMismatch",
    "SidecarRowOutOfRange",
    "SidecarCheckpointError",
    "SidecarIOError",
    "SidecarChanged",
    "SidecarReaderUnusable",
    "SidecarWarning",
]
