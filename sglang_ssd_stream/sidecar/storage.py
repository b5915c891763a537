"""What storage holds a sidecar file: its mount, filesystem and kind of disk.

One implementation for the sidecar's network-filesystem warning, sglang's doctor and vLLM's
preflight: the mount is the longest mount point above the file's real path in the mounts table
(a later entry of the same point stacks on top); the disk is its block device in sysfs (the
parent disk of a partition): NVMe by name, else SSD or HDD by ``queue/rotational``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

MOUNTS_PATH = "/proc/mounts"

# Filesystems where random 4 KiB reads go over a network (warned about, not refused).
NETWORK_FS_TYPES = frozenset(
    {
        "nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "9p", "afs", "coda", "ceph", "glusterfs",
        "lustre", "gpfs", "beegfs", "pvfs2", "orangefs", "davfs", "fuse.sshfs", "fuse.s3fs",
        "fuse.rclone", "fuse.gcsfuse", "fuse.glusterfs", "fuse.ceph", "fuse.juicefs", "fuse.goofys",
        "fuse.blobfuse", "fuse.blobfuse2", "fuse.mountpoint-s3", "fuse.davfs2", "fuse.cephfs",
    }
)
MEMORY_FS_TYPES = frozenset({"tmpfs", "ramfs"})


@dataclass(frozen=True)
class Disk:
    path: str
    fstype: str | None
    device: str | None  # block device name, e.g. nvme0n1
    kind: str  # "nvme" | "ssd" | "hdd" | "network" | "memory" | "unknown"


def _unescape_mount(field: str) -> str:
    # /proc/mounts writes space, tab, newline and backslash as \040, \011, \012, \134
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_of(path: str | os.PathLike, *, mounts_path: str | None = None) -> tuple[str, str, str] | None:
    """``(source, mount point, fstype)`` of the mount holding ``path`` (None without a mounts table)."""
    real = os.path.realpath(path)
    try:
        with open(mounts_path or MOUNTS_PATH, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        source, point, fstype = _unescape_mount(parts[0]), _unescape_mount(parts[1]), parts[2]
        if real == point or real.startswith(point.rstrip("/") + "/"):
            if best is None or len(point) >= len(best[1]):  # later entries of the same point stack on top
                best = (source, point, fstype)
    return best


def filesystem_type(path: str | os.PathLike, *, mounts_path: str | None = None) -> str | None:
    """The filesystem type holding ``path`` according to the mounts table (None if unknown)."""
    mount = mount_of(path, mounts_path=mounts_path)
    return None if mount is None else mount[2]


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def classify_disk(path: str | os.PathLike, *, mounts_path: str | None = None, sys_root: str = "/sys") -> Disk:
    """The storage behind ``path``: its filesystem, block device and kind."""
    mount = mount_of(path, mounts_path=mounts_path)
    if mount is None:
        return Disk(str(path), None, None, "unknown")
    source, _, fstype = mount
    if fstype in NETWORK_FS_TYPES:
        return Disk(str(path), fstype, None, "network")
    if fstype in MEMORY_FS_TYPES:
        return Disk(str(path), fstype, None, "memory")
    if not source.startswith("/dev/"):
        return Disk(str(path), fstype, None, "unknown")  # overlay, a bind of another mount, …
    name = os.path.basename(os.path.realpath(source)) if os.path.exists(source) else os.path.basename(source)
    block = Path(sys_root, "class", "block", name)
    disk = name
    if block.exists() and (block / "partition").exists():
        disk = block.resolve().parent.name  # a partition: its disk is the parent in sysfs
    if disk.startswith("nvme"):
        return Disk(str(path), fstype, disk, "nvme")
    rotational = _read_int(Path(sys_root, "block", disk, "queue", "rotational"))
    return Disk(str(path), fstype, disk, {0: "ssd", 1: "hdd"}.get(rotational, "unknown"))
