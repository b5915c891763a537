"""Engine-neutral patch core: manifests, strict diff application, file states, transactions.

Imports neither sglang nor vllm; both engine sides (``sglang-ssd-stream patch`` and
``vllm-ple-offload patch``) drive the same code with a different ``Engine``.
"""

from .engines import ENGINES, Engine
from .manifest import Manifest, known_manifests, load_manifest
from .state import FileState, survey

__all__ = ["ENGINES", "Engine", "Manifest", "load_manifest", "known_manifests", "FileState", "survey"]
