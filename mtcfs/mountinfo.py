"""/proc/self/mountinfo (proc(5)), read by the daemon's mountpoint checks and
by the CSI node plugin.

A bind mount of a directory of an mtcfs mount shows there with the FUSE
superblock's device number, fstype `fuse.mtcfs`, source `mtcfs:<node id>` and,
as its `root`, the directory inside the filesystem that was bound.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

MOUNTINFO = "/proc/self/mountinfo"

MTCFS_FSTYPE = "fuse.mtcfs"  # subtype=mtcfs (mtcfs/fs/fuse_ops.py mount_options)
MTCFS_SOURCE_PREFIX = "mtcfs:"  # fsname=mtcfs:<node id>

_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/self/mountinfo (proc(5))."""

    mount_id: int
    parent_id: int
    dev: str  # "major:minor" of the superblock: the same for a mount and its binds
    root: str  # the directory of the filesystem that is mounted here
    mount_point: str
    options: frozenset[str]  # per-mount options: rw|ro, nosuid, ...
    fstype: str
    source: str

    @property
    def readonly(self) -> bool:
        return "ro" in self.options

    @property
    def is_mtcfs(self) -> bool:
        return self.fstype == MTCFS_FSTYPE or (
            self.fstype.startswith("fuse") and self.source.startswith(MTCFS_SOURCE_PREFIX))


def _unescape(field: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def mountinfo() -> list[MountEntry]:
    """The mount table of this process's mount namespace, in mount order."""
    entries = []
    with open(MOUNTINFO) as f:
        for line in f:
            parts = line.split()
            sep = parts.index("-", 6)
            entries.append(MountEntry(
                mount_id=int(parts[0]), parent_id=int(parts[1]), dev=parts[2],
                root=_unescape(parts[3]), mount_point=_unescape(parts[4]),
                options=frozenset(parts[5].split(",")), fstype=parts[sep + 1],
                source=_unescape(parts[sep + 2]) if len(parts) > sep + 2 else ""))
    return entries


def entry_at(path: str, table: list[MountEntry] | None = None) -> MountEntry | None:
    """The topmost mount at `path` (the one a lookup sees), or None."""
    path = os.path.abspath(path)
    found = None
    for e in table if table is not None else mountinfo():
        if e.mount_point == path:
            found = e
    return found


def entries_at(path: str, table: list[MountEntry] | None = None) -> list[MountEntry]:
    """Every mount stacked at `path`, bottom first."""
    path = os.path.abspath(path)
    return [e for e in (table if table is not None else mountinfo()) if e.mount_point == path]
