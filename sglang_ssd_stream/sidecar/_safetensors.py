"""Minimal reader/writer of the safetensors container, numpy-free and torch-free.

The builder copies PLE shards byte for byte, and numpy has no float8/bfloat16, so instead of
materialising tensors we read the header (8-byte little-endian length + JSON) and the byte range
of each tensor. Layout per https://github.com/huggingface/safetensors (``data_offsets`` are
relative to the end of the header).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import SidecarCheckpointError

# The reference implementation refuses headers above 100 MB; so do we.
MAX_HEADER_BYTES = 100_000_000

# safetensors dtype tag -> (our dtype name, itemsize)
DTYPES = {
    "F8_E4M3": ("float8_e4m3fn", 1),
    "BF16": ("bfloat16", 2),
    "F16": ("float16", 2),
    "F32": ("float32", 4),
    "F64": ("float64", 8),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}
TAG_OF = {name: tag for tag, (name, _) in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live inside a safetensors file."""

    file: Path
    name: str
    dtype: str  # our name, e.g. "float8_e4m3fn"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Parse and check a safetensors header; returns ``{tensor name: TensorInfo}``.

    Raises:
        SidecarCheckpointError: the file is not a well-formed safetensors file.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) != 8:
                raise SidecarCheckpointError(f"{path}: not a safetensors file (header length missing; {size} bytes)",
                                             path=str(path))
            (hlen,) = struct.unpack("<Q", raw)
            if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
                raise SidecarCheckpointError(
                    f"{path}: safetensors header length {hlen} is invalid for a {size}-byte file", path=str(path)
                )
            header_bytes = f.read(hlen)
    except OSError as exc:
        raise SidecarCheckpointError(f"{path}: cannot read ({exc.strerror or exc})", path=str(path)) from exc
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SidecarCheckpointError(f"{path}: safetensors header is not JSON ({exc})", path=str(path)) from exc
    if not isinstance(header, dict):
        raise SidecarCheckpointError(f"{path}: safetensors header is not an object", path=str(path))
    base = 8 + hlen
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            tag = meta["dtype"]
            shape = tuple(int(d) for d in meta["shape"])
            begin, end = (int(x) for x in meta["data_offsets"])
        except (TypeError, KeyError, ValueError) as exc:
            raise SidecarCheckpointError(f"{path}: tensor {name!r} has a malformed header entry",
                                         path=str(path)) from exc
        if tag not in DTYPES:
            raise SidecarCheckpointError(f"{path}: tensor {name!r} has unknown dtype {tag!r}", path=str(path))
        dtype, itemsize = DTYPES[tag]
        count = 1
        for d in shape:
            if d < 0:
                raise SidecarCheckpointError(f"{path}: tensor {name!r} has negative shape {shape}", path=str(path))
            count *= d
        if not (0 <= begin <= end and base + end <= size) or end - begin != count * itemsize:
            raise SidecarCheckpointError(
                f"{path}: tensor {name!r} byte range [{begin}, {end}) does not fit shape {list(shape)} {tag} "
                f"in a {size}-byte file",
                path=str(path),
            )
        out[name] = TensorInfo(path, name, dtype, shape, base + begin, end - begin)
    return out


def cross_check(path: str | os.PathLike, tensors: dict[str, TensorInfo]) -> None:
    """Confirm our header reading against the ``safetensors`` library (when installed).

    The library is the reference implementation; if it disagrees about names, dtypes or shapes,
    the file is refused rather than copied.
    """
    try:
        from safetensors import safe_open
    except ImportError:  # pragma: no cover - safetensors is a declared dependency
        return
    try:
        with safe_open(str(path), framework="numpy") as f:
            theirs = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    except Exception as exc:  # the library raises SafetensorError and friends
        raise SidecarCheckpointError(f"{path}: safetensors refuses the file ({exc})", path=str(path)) from exc
    ours = {k: (TAG_OF[i.dtype], i.shape) for k, i in tensors.items()}
    if theirs != ours:
        diff = sorted(set(theirs.items()) ^ set(ours.items()))[:3]
        raise SidecarCheckpointError(f"{path}: header disagrees with the safetensors library: {diff}", path=str(path))


def read_tensor_bytes(info: TensorInfo) -> bytes:
    """Read one (small) tensor's raw bytes."""
    with open(info.file, "rb") as f:
        data = os.pread(f.fileno(), info.nbytes, info.offset)
    if len(data) != info.nbytes:
        raise SidecarCheckpointError(
            f"{info.file}: tensor {info.name!r} is truncated ({len(data)} of {info.nbytes} bytes)", path=str(info.file)
        )
    return data


def write_small(path: str | os.PathLike, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    """Write ``{name: (dtype name, shape, raw bytes)}`` as a safetensors file (atomically)."""
    path = Path(path)
    header: dict[str, object] = {}
    pos = 0
    blobs = []
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": TAG_OF[dtype], "shape": list(shape), "data_offsets": [pos, pos + len(data)]}
        pos += len(data)
        blobs.append(data)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # the format pads the header with spaces to 8-byte alignment
    from ..atomic_file import replacing

    with replacing(path) as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for b in blobs:
            f.write(b)
