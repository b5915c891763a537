"""Engine-neutral PLE sidecar: format, verification, builder and bounded-memory reader.

Imports neither sglang nor vllm nor torch; both engine plugins build on it.

- :mod:`.format`: ``load_manifest``, ``SidecarTable``, ``check_model_shape``, ``find_weight_scales``
- :mod:`.verify`: ``verify_sidecar`` (SHA-256, cached by inode/size/mtime)
- :mod:`.build`: ``build_sidecar`` from an HF checkpoint's PLE shards
- :mod:`.reader`: ``SidecarReader`` (page planner, threaded ``preadv``, fail-closed)
- :mod:`.cli`: ``add_sidecar_commands`` (``sidecar build|verify``)
"""

from .errors import (
    SidecarChecksumMismatch,
    SidecarCheckpointError,
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
    WeightScale,
    check_model_shape,
    filesystem_type,
    find_weight_scales,
    load_manifest,
    warn_if_network_fs,
)
from .reader import PAGE_SIZE, SidecarReader, rows_for_tokens
from .verify import VerifyReport, verify_sidecar

__all__ = [
    "MANIFEST_NAME", "ROWS_PER_TOKEN", "SCALE_FILE_NAME", "PAGE_SIZE",
    "SidecarManifest", "SidecarTable", "WeightScale", "VerifyReport", "SidecarReader",
    "load_manifest", "check_model_shape", "find_weight_scales", "filesystem_type", "warn_if_network_fs",
    "verify_sidecar", "rows_for_tokens",
    "SidecarChecksumMismatch", "SidecarCheckpointError", "SidecarIOError", "SidecarManifestError",
    "SidecarPathEscape", "SidecarReaderUnusable", "SidecarRowOutOfRange", "SidecarShapeMismatch",
    "SidecarSizeMismatch", "SidecarTruncated", "SidecarWarning",
]
