"""Engine-neutral PLE sidecar: format, verification, builder and bounded-memory reader.

Imports neither sglang nor vllm nor torch; both engine plugins build on it.

- :mod:`.format`: ``load_manifest``, ``SidecarTable``, ``check_model_shape``, ``find_weight_scales``
- :mod:`.verify`: ``verify_sidecar`` (SHA-256, cached by inode/size/mtime)
- :mod:`.build`: ``build_sidecar`` from an HF checkpoint's PLE shards (a copy)
- :mod:`.in_place`: ``build_in_place``: a manifest naming the shards' own regions (no copy)
- :mod:`.reader`: ``SidecarReader`` (page planner, threaded ``preadv``, fail-closed)
- :mod:`.mapped`: ``MappedReader`` (read-only mapping, threaded ``numpy.take``: fast when warm)
- :func:`open_reader`: either of the two by name (``io="mmap"`` or ``"pread"``)
- :mod:`.cli`: ``add_sidecar_commands`` (``sidecar build|verify``)
"""

from .errors import (
    SidecarChanged,
    SidecarCheckpointError,
    SidecarChecksumMismatch,
    SidecarIOError,
    SidecarManifestError,
    SidecarPathEscape,
    SidecarReaderUnusable,
    SidecarRowOutOfRange,
    SidecarShapeMismatch,
    SidecarSizeMismatch,
    SidecarTruncated,
    SidecarWarning,
)
from .format import (
    MANIFEST_NAME,
    ROWS_PER_TOKEN,
    SCALE_FILE_NAME,
    SidecarManifest,
    SidecarTable,
    TableRegion,
    WeightScale,
    check_model_shape,
    filesystem_type,
    find_weight_scales,
    load_manifest,
    warn_if_network_fs,
)
from .mapped import MappedReader
from .reader import PAGE_SIZE, SidecarReader, rows_for_tokens
from .verify import VerifyReport, verify_sidecar

IO_MODES = ("mmap", "pread")


def open_reader(table: SidecarTable, io: str, *, max_rows: int, workers: int, vocab_start: int | None = None,
                vocab_end: int | None = None, total_rows: int | None = None,
                rows_per_task: int | None = None) -> MappedReader | SidecarReader:
    """A row reader of ``table`` for this rank: ``io="mmap"`` (:class:`MappedReader`) or
    ``"pread"`` (:class:`SidecarReader`); both have the same ``read_rows(ids, out)`` contract."""
    common = dict(vocab_start=vocab_start, vocab_end=vocab_end, total_rows=total_rows, max_rows=max_rows,
                  workers=workers)
    if io == "mmap":
        return MappedReader(table, rows_per_task=rows_per_task, **common)
    if io == "pread":
        return SidecarReader(table, **common)
    raise ValueError(f"PLE sidecar I/O {io!r}: expected one of {IO_MODES}")

__all__ = [
    "MANIFEST_NAME", "ROWS_PER_TOKEN", "SCALE_FILE_NAME", "PAGE_SIZE",
    "SidecarManifest", "SidecarTable", "TableRegion", "WeightScale", "VerifyReport", "SidecarReader",
    "MappedReader", "IO_MODES", "open_reader",
    "load_manifest", "check_model_shape", "find_weight_scales", "filesystem_type", "warn_if_network_fs",
    "verify_sidecar", "rows_for_tokens",
    "SidecarChanged", "SidecarChecksumMismatch", "SidecarCheckpointError", "SidecarIOError", "SidecarManifestError",
    "SidecarPathEscape", "SidecarReaderUnusable", "SidecarRowOutOfRange", "SidecarShapeMismatch",
    "SidecarSizeMismatch", "SidecarTruncated", "SidecarWarning",
]
