"""Whether an engine's own safetensors weight iterator hands a PLE shard tensor out as a view of the file's
mapping (nothing read but what is touched) or as a copy in the process's anonymous memory (the whole shard read).
Used by both engines' checks: what docs/sidecar.md says about serving the checkpoint itself rests on it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PLE_NAME = "model.language_model.layers.0.ple.ple_embedding.ngram_embedding.shard_0.weight"
SHARD_MIB = 64  # far above readahead and the allocator's noise, small for CI


def write_ple_shard(path: Path) -> int:
    """A safetensors file holding one fp8 PLE shard tensor of :data:`SHARD_MIB` MiB; its bytes."""
    import torch
    from safetensors.torch import save_file

    t = torch.randint(0, 127, (SHARD_MIB * 1024, 1024), dtype=torch.uint8).view(torch.float8_e4m3fn)
    save_file({PLE_NAME: t}, str(path))
    return t.numel()


def _anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))


def _mapping_of(ptr: int) -> str | None:
    """The file mapped at address ``ptr`` in this process (None: anonymous memory)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return fields[5] if len(fields) > 5 and fields[5].startswith("/") else None
    return None


@dataclass(frozen=True)
class Residency:
    mapped_file: str | None  # the file the tensor's bytes are a mapping of
    anon_growth: int  # anonymous memory the iterator added while the tensor was alive (bytes)
    nbytes: int


def residency(weights, path: Path) -> Residency:
    """Iterate ``weights`` (an engine iterator over ``path``, not yet started) and measure the PLE tensor."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # nothing of the shard in the page cache before
    finally:
        os.close(fd)
    before = _anon()
    for name, tensor in weights:
        if name == PLE_NAME:
            got = Residency(_mapping_of(tensor.data_ptr()), _anon() - before, tensor.numel() * tensor.element_size())
            del tensor
            return got
    raise AssertionError(f"{PLE_NAME} not in the iterator's output")
