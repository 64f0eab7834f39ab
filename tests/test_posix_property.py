"""Model-based test: mtcfs must behave like tmpfs.

A hypothesis state machine applies the same random sequence of POSIX calls to
an mtcfs mount and to a tmpfs mounted `nodev,nosuid` like mtcfs mounts are,
and compares every result (return value or errno) and, after every step, the
whole tree: names, types, modes, owners, nlink, which names share an inode
(hard links), device numbers, file sizes and contents (of files beyond 1 MiB:
every range that holds data on tmpfs, and both ends), and user.* extended
attributes.

Calls are made by root and by a second user (uid/gid 65534, no other groups,
through a helper process that keeps running): permission errors, sticky
directories, hard-link protection and the clearing of set-id bits on write,
truncate, fallocate and chown are the kernel's and mtcfs's together, and must come
out as on tmpfs. fallocate(2) runs in every mode tmpfs has (0, KEEP_SIZE,
PUNCH_HOLE|KEEP_SIZE) and in some it refuses (EOPNOTSUPP on both).

Not compared, by design: timestamps, directory st_size (mtcfs reports 0), the
virtual `user.mtcfs.*` attributes, which only mtcfs has, and st_blocks. Files larger
than 1 TiB (MAX_SHARED_SIZE) are made and kept as on tmpfs: mtcfs keeps them on
their writer's host only, which this single mount does not see.

Known mtcfs bugs (KNOWN_BUGS) are not triggered by default, so that the run
checks everything else; MTCFS_POSIX_KNOWN_BUGS=1 triggers them too.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import select
import shutil
import stat
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from mtcfs.core.versions import MAX_SHARED_SIZE

from support.mounts import BOTH_DATA_PATHS


@pytest.fixture(params=BOTH_DATA_PATHS)
def data_path(request: pytest.FixtureRequest) -> str:
    """Every test here runs with passthrough and with every byte through the daemon."""
    return request.param

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
AT_FDCWD = -100

_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = _libc.renameat2
_renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                       ctypes.c_uint]
_renameat2.restype = ctypes.c_int


FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10
_libc.fallocate64.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def fallocate(fd: int, mode: int, off: int, length: int) -> None:
    if _libc.fallocate64(fd, mode, off, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def renameat2(src: str, dst: str, flags: int) -> None:
    if _renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), src, None, dst)


# The second user: no supplementary groups, so "in the file's group" means gid 65534.
USER = 65534
SETID = stat.S_ISUID | stat.S_ISGID

# mtcfs bugs the comparison found (see the xfail tests in test_posix_semantics.py).
# While listed, the model does not make the calls that trigger them (counted as
# "(known bug, not run)"); remove an entry once the bug is fixed.
KNOWN_BUGS = {
    "user-truncate-past-shared": "passthrough: after a truncate past 1 TiB by the second "
                                 "user of a set-id file, a later tree showed the bits "
                                 "cleared on mtcfs and kept on tmpfs (seen once, "
                                 "2026-12-05; not reduced yet)",
    "chown-nothing-by-other": "passthrough: chown(f, -1, -1) by a user who does not own a "
                              "set-id regular file succeeds (tmpfs: EPERM); without the "
                              "writeback cache the kernel sends it as the same setattr of "
                              "nothing as its own clearing of the bits on a write",
    "writeback-kills-setid": "fuse: the kernel writes cached pages back through any writable "
                             "handle of the file; mtcfs clears set-id bits when that handle's "
                             "opener is unprivileged, though root wrote the data",
}


# A small pool of names, so that operations collide: files a/b/c, dirs d1/d2,
# nested up to two levels. Any op may hit any name (a file where a directory
# is expected, and so on); the bias only makes the useful cases frequent.
PARENTS = ("", "", "d1", "d2", "d1/d2", "d2/d1")
FILE_NAMES = ("a", "b", "c")
DIR_NAMES = ("d1", "d2")


# Directories (None) come before what they contain; ("chr", dev), ("blk", dev),
# ("fifo", 0) and ("sock", 0) are made by mknod, ("link", path) is a hard link.
INITIAL_TREE: tuple[tuple[str, bytes | tuple[str, Any] | None], ...] = (
    ("d1", None),
    ("d2", None),
    ("d1/d2", None),
    ("d2/d1", None),
    ("d1/d2/d1", None),
    ("a", b"alpha" * 1000),
    ("b", b""),
    ("d1/a", b"d1/a"),
    ("d1/c", bytes(range(256)) * 40),
    ("d2/b", b"d2/b"),
    ("d1/d2/a", b"x" * 5000),
    ("d1/d2/b", b"bravo"),
    ("d2/d1/c", b"charlie"),
    ("d1/d2/d1/a", b"deep"),
    ("d2/a", ("chr", os.makedev(1, 3))),
    ("d1/b", ("fifo", 0)),
    ("d2/d1/b", ("blk", os.makedev(8, 1))),
    ("d1/d2/c", ("sock", 0)),
    ("c", ("link", "a")),
    ("d2/c", ("link", "d1/c")),
)
# Owners and modes the initial entries may be given ((uid, gid, mode); None: as
# created by root), so that the second user meets its own files, world-writable
# and sticky directories and set-id files from the first step.
INITIAL_DIR_PERMS = (None, None, (0, 0, 0o1777), (USER, USER, 0o755), (0, 0, 0o777),
                     (USER, USER, 0o1777), (0, USER, 0o2775), (0, 0, 0o700))
INITIAL_FILE_PERMS = (None, None, (USER, USER, 0o644), (0, 0, 0o666), (0, 0, 0o4666),
                      (USER, USER, 0o6755), (0, 0, 0o2666), (0, USER, 0o2664))


def _join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


file_paths = st.builds(_join, st.sampled_from(PARENTS), st.sampled_from(FILE_NAMES))
dir_paths = st.builds(_join, st.sampled_from(PARENTS), st.sampled_from(DIR_NAMES))
any_paths = st.one_of(file_paths, dir_paths)
offsets = st.one_of(
    st.sampled_from((0, 1, 4095, 4096, 4097, 65536, 131072 - 1, 200_000)),
    st.integers(0, 300_000),
)
# Sizes and offsets near and past the largest file mtcfs shares (sparse on both sides).
# Files near 1 TiB are few: mtcfs checksums a file at every close, ~50 ms for one that
# large.
big_sizes = st.sampled_from(((1 << 32) + 1, MAX_SHARED_SIZE - 4096, MAX_SHARED_SIZE,
                             MAX_SHARED_SIZE + 1, MAX_SHARED_SIZE + 4096, 1 << 41,
                             999_999_999_999_999, MAX_SHARED_SIZE + 1, 1 << 41, (1 << 63) - 1))
big_offsets = st.sampled_from(((1 << 32) - 3, (1 << 33) + 4095, (1 << 32) - 3,
                               MAX_SHARED_SIZE - 70_000, MAX_SHARED_SIZE - 5, MAX_SHARED_SIZE,
                               MAX_SHARED_SIZE + 4096))
any_offsets = st.one_of(offsets, offsets, offsets, big_offsets)
payloads = st.one_of(
    st.binary(max_size=64),
    st.binary(min_size=1, max_size=8192),
    st.tuples(st.binary(min_size=1, max_size=16), st.integers(1, 20_000)).map(
        lambda t: (t[0] * (t[1] // len(t[0]) + 1))[: t[1]]
    ),
)
file_modes = st.sampled_from((0o644, 0o600, 0o755, 0o000, 0o4755, 0o2644, 0o1777, 0o666,
                              0o4666, 0o2666, 0o6777, 0o2745))
dir_modes = st.sampled_from((0o755, 0o700, 0o777, 0o1777, 0o2755, 0o000))
# chmod of directories: world-writable (sticky or not) often, for the second user.
chmod_dir_modes = st.sampled_from((0o755, 0o700, 0o777, 0o1777, 0o1777, 0o2775, 0o3777,
                                   0o1733, 0o000))
owners = st.sampled_from((-1, 0, USER))
user_owners = st.sampled_from((-1, USER, USER, 0))
# The modes tmpfs has, often; PUNCH_HOLE without KEEP_SIZE and ZERO_RANGE it refuses.
falloc_modes = st.sampled_from((0, 0, FALLOC_FL_KEEP_SIZE, FALLOC_FL_KEEP_SIZE,
                                FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE))
# The second user's: not ZERO_RANGE, which on a set-id file is the one documented
# difference (FUSE clears the bits before the daemon refuses the mode; tmpfs refuses first).
user_falloc_modes = st.sampled_from((0, FALLOC_FL_KEEP_SIZE,
                                     FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                     FALLOC_FL_PUNCH_HOLE))
falloc_lengths = st.one_of(st.sampled_from((0, 1, 4096, 8191, 65536)),
                           st.integers(1, 300_000))
xattr_names = st.sampled_from(("user.x", "user.y", "user.long.attribute.name"))
xattr_values = st.binary(max_size=64)
xattr_flags = st.sampled_from((0, 0, os.XATTR_CREATE, os.XATTR_REPLACE))
rename_flags = st.sampled_from((0, 0, RENAME_NOREPLACE, RENAME_EXCHANGE))
open_flags = st.sampled_from((os.O_RDWR, os.O_RDWR | os.O_APPEND, os.O_RDONLY,
                              os.O_WRONLY | os.O_TRUNC, os.O_RDWR | os.O_CREAT))
node_types = st.sampled_from((stat.S_IFCHR, stat.S_IFBLK, stat.S_IFIFO, stat.S_IFSOCK,
                              stat.S_IFREG, 0))
node_modes = st.sampled_from((0o644, 0o600, 0o666, 0o4755, 0o2755, 0o1777))
devices = st.sampled_from((os.makedev(1, 3), os.makedev(8, 1), os.makedev(0, 0),
                           os.makedev(4095, (1 << 20) - 1), os.makedev(1, 3), os.makedev(8, 1),
                           os.makedev(4096, 0)))
user_open_flags = st.sampled_from((os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                   os.O_WRONLY | os.O_CREAT | os.O_TRUNC, os.O_RDONLY,
                                   os.O_WRONLY, os.O_RDWR | os.O_CREAT, os.O_RDWR | os.O_TRUNC,
                                   os.O_WRONLY | os.O_APPEND))
user_fd_flags = st.sampled_from((os.O_WRONLY, os.O_RDWR, os.O_RDWR | os.O_CREAT, os.O_RDONLY,
                                 os.O_WRONLY | os.O_APPEND, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                 os.O_RDWR | os.O_TRUNC))
user_create_modes = st.sampled_from((0o644, 0o666, 0o600, 0o4755, 0o2755, 0o2644))
user_chmod_modes = st.sampled_from((0o644, 0o666, 0o4755, 0o2755, 0o6777, 0o2775, 0o1777,
                                    0o777))

Outcome = tuple[str, Any]

# What the run exercised: (operation, outcome) -> count. Printed at the end
# (pytest -s) and checked against EXPECTED_COVERAGE.
COVERAGE: Counter[tuple[str, str]] = Counter()


def attempt(fn: Callable[[], Any]) -> Outcome:
    try:
        return ("ok", fn())
    except OSError as e:
        return ("error", errno.errorcode.get(e.errno, e.errno) if e.errno else repr(e))


WHOLE = 1 << 20  # files up to this size are compared whole
EDGE = 1 << 16  # of larger files: their first and last EDGE bytes, and every data range


def data_ranges(path: str, size: int) -> list[tuple[int, int]] | None:
    """What to compare of a regular file: all of it (None), or, beyond WHOLE bytes,
    both ends and the ranges that hold data on this (tmpfs) side (SEEK_DATA/HOLE)."""
    if size <= WHOLE:
        return None
    out = [(0, EDGE)]
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        pos = 0
        while pos < size and len(out) < 64:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:
                    break
                raise
            end = os.lseek(fd, start, os.SEEK_HOLE)
            out.append((start, min(end, start + WHOLE)))
            pos = end
    finally:
        os.close(fd)
    out.append((size - EDGE, size))
    return out


def read_ranges(path: str, ranges: list[tuple[int, int]] | None) -> bytes | tuple:
    """The file's content (ranges None: all of it, but never more than 2 * WHOLE bytes),
    or (offset, bytes) of each range."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if ranges is None:
            chunks, pos = [], 0
            while pos <= 2 * WHOLE:  # to the end, whatever the size said
                b = os.pread(fd, WHOLE, pos)
                if not b:
                    break
                chunks.append(b)
                pos += len(b)
            return b"".join(chunks)
        return tuple((start, os.pread(fd, end - start, start)) for start, end in ranges)
    finally:
        os.close(fd)


Ranges = dict[str, list[tuple[int, int]] | None]


def snapshot(root: str, ranges: Ranges | None = None) -> tuple[dict[str, tuple], Ranges]:
    """Everything POSIX-visible that must match between the two trees. `ranges`: the
    ranges of large files to compare (the reference's; None: take them from this
    tree). Returns the snapshot and the ranges used."""
    out: dict[str, tuple] = {}
    used: Ranges = {}
    by_ino: dict[int, list[str]] = {}

    def xattrs(p: str) -> dict[str, bytes]:
        names = os.listxattr(p, follow_symlinks=False)
        return {n: os.getxattr(p, n, follow_symlinks=False) for n in sorted(names)
                if n.startswith("user.") and not n.startswith("user.mtcfs.")}

    def walk(rel: str) -> None:
        full = os.path.join(root, rel)
        for name in sorted(os.listdir(full)):
            r = _join(rel, name)
            p = os.path.join(root, r)
            s = os.lstat(p)
            mode = oct(stat.S_IMODE(s.st_mode))
            common = (mode, f"nlink={s.st_nlink}", f"owner={s.st_uid}:{s.st_gid}")
            if stat.S_ISDIR(s.st_mode):
                out[r] = ("dir", *common, xattrs(p))
                walk(r)
                continue
            by_ino.setdefault(s.st_ino, []).append(r)
            if stat.S_ISREG(s.st_mode):
                if ranges is None:
                    want = data_ranges(p, s.st_size)
                elif r in ranges:
                    want = ranges[r]
                else:  # (not a file on the other side)
                    want = None if s.st_size <= WHOLE else [(0, EDGE), (s.st_size - EDGE,
                                                                        s.st_size)]
                used[r] = want
                out[r] = ("file", *common, f"size={s.st_size}", xattrs(p),
                          read_ranges(p, want))
            elif stat.S_ISLNK(s.st_mode):
                out[r] = ("symlink", f"owner={s.st_uid}:{s.st_gid}", f"size={s.st_size}",
                          os.readlink(p))
            else:
                kind = {stat.S_IFCHR: "chr", stat.S_IFBLK: "blk", stat.S_IFIFO: "fifo",
                        stat.S_IFSOCK: "sock"}.get(stat.S_IFMT(s.st_mode),
                                                   oct(stat.S_IFMT(s.st_mode)))
                rdev = f"rdev={os.major(s.st_rdev)}:{os.minor(s.st_rdev)}"
                out[r] = (kind, *common, rdev, f"size={s.st_size}")  # (no user.* xattrs)

    root_st = os.stat(root)
    out["."] = ("root", oct(stat.S_IMODE(root_st.st_mode)), f"nlink={root_st.st_nlink}",
                f"owner={root_st.st_uid}:{root_st.st_gid}")
    walk("")
    # Inode numbers differ between the two trees: compare which names share one.
    for names in by_ino.values():
        for r in names:
            out[r] = (*out[r], f"same inode as {sorted(set(names) - {r})}")
    return out, used


def describe_diff(got: dict[str, tuple], want: dict[str, tuple]) -> str:
    lines = []
    for path in sorted(set(got) | set(want)):
        g, w = got.get(path), want.get(path)
        if g == w:
            continue
        if g is None or w is None:
            lines.append(f"  {path}: mtcfs={_short(g)} tmpfs={_short(w)}")
            continue
        for i, (a, b) in enumerate(zip(g, w, strict=False)):
            if a == b:
                continue
            if isinstance(a, bytes) and isinstance(b, bytes):
                lines.append(f"  {path}: content differs: {_bytes_diff(a, b)}")
            elif isinstance(a, tuple) and isinstance(b, tuple):
                for (sa, a1), (sb, b1) in zip(a, b, strict=False):
                    if (sa, a1) != (sb, b1):
                        lines.append(f"  {path}: content from offset {sa} differs: "
                                     f"{_bytes_diff(a1, b1)}")
                if len(a) != len(b):
                    lines.append(f"  {path}: {len(a)} ranges vs {len(b)}")
            else:
                lines.append(f"  {path}: field {i}: mtcfs={a!r} tmpfs={b!r}")
        if len(g) != len(w):
            lines.append(f"  {path}: mtcfs={_short(g)} tmpfs={_short(w)}")
    return "\n".join(lines)


def _bytes_diff(a: bytes, b: bytes) -> str:
    first = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
    return (f"len mtcfs={len(a)} tmpfs={len(b)}, first difference at {first}: "
            f"mtcfs={a[first:first + 16]!r} tmpfs={b[first:first + 16]!r}")


def _short(entry: tuple | None) -> str:
    if entry is None:
        return "<missing>"
    return repr(tuple(f"<{len(x)} bytes>" if isinstance(x, bytes)
                      else "<ranges>" if isinstance(x, tuple) else x for x in entry))


def clear_dir(root: str) -> None:
    for name in os.listdir(root):
        p = os.path.join(root, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.unlink(p)


def _stat(path: str, follow: bool = True) -> os.stat_result | None:
    try:
        return os.stat(path, follow_symlinks=follow)
    except OSError:
        return None


def _setid_file(s: os.stat_result | None) -> bool:
    return s is not None and stat.S_ISREG(s.st_mode) and bool(s.st_mode & SETID)


# -- the second user ------------------------------------------------------------------------

# Runs as uid/gid 65534 under the system python (the venv's may not be reachable by
# that uid). Inherits a directory fd of each tree (the paths above them need not be
# searchable); each request ([op, args] as a JSON line) is run on mtcfs, then on the
# reference, and answered with both outcomes.
_HELPER = r"""
import ctypes, errno, json, os, sys

roots = [int(sys.argv[1]), int(sys.argv[2])]
libc = ctypes.CDLL(None, use_errno=True)
libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                           ctypes.c_uint]
libc.fallocate64.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
fds = {}  # (handle, side) -> fd


def rename(side, src, dst, flags):
    if libc.renameat2(-100, os.fsencode(src), -100, os.fsencode(dst), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def open_close(side, path, flags, mode):
    os.close(os.open(path, flags | os.O_NONBLOCK, mode))


def write(side, path, off, data):
    # off < 0: appends (O_APPEND); returns the count and the position after.
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | (os.O_APPEND if off < 0 else 0))
    try:
        buf = bytes.fromhex(data)
        n = os.write(fd, buf) if off < 0 else os.pwrite(fd, buf, off)
        return [n, os.lseek(fd, 0, os.SEEK_CUR)] if off < 0 else n
    finally:
        os.close(fd)


def fopen(side, h, path, flags, mode):
    fds[h, side] = os.open(path, flags | os.O_NONBLOCK, mode)


def fwrite(side, h, data):
    n = os.write(fds[h, side], bytes.fromhex(data))
    return [n, os.lseek(fds[h, side], 0, os.SEEK_CUR)]


def ffallocate(side, h, mode, off, length):
    if libc.fallocate64(fds[h, side], mode, off, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def fclose(side, h):
    os.close(fds.pop((h, side)))


def fstat(side, h):
    s = os.fstat(fds[h, side])
    return [s.st_mode, s.st_gid, s.st_size, os.lseek(fds[h, side], 0, os.SEEK_CUR)
            if s.st_mode & 0o170000 == 0o100000 else 0, s.st_ino]


OPS = {
    "open": open_close, "write": write, "fopen": fopen, "fwrite": fwrite, "fclose": fclose,
    "fstat": fstat, "ffallocate": ffallocate,
    "ftruncate": lambda side, h, size: os.ftruncate(fds[h, side], size),
    "fsync": lambda side, h: os.fsync(fds[h, side]),
    "truncate": lambda side, path, size: os.truncate(path, size),
    "unlink": lambda side, path: os.unlink(path),
    "rmdir": lambda side, path: os.rmdir(path),
    "mkdir": lambda side, path, mode: os.mkdir(path, mode),
    "rename": rename,
    "link": lambda side, src, dst: os.link(src, dst),
    "symlink": lambda side, target, path: os.symlink(target, path),
    "mknod": lambda side, path, mode, dev: os.mknod(path, mode, dev),
    "chmod": lambda side, path, mode: os.chmod(path, mode),
    "chown": lambda side, path, uid, gid: os.chown(path, uid, gid),
}

for line in sys.stdin:
    op, args = json.loads(line)
    out = []
    for side in (0, 1):
        os.fchdir(roots[side])
        try:
            out.append(["ok", OPS[op](side, *args)])
        except OSError as e:
            out.append(["error", errno.errorcode.get(e.errno, str(e.errno))])
        except KeyError:  # a handle that is not open
            out.append(["error", "EBADF"])
    os.chdir("/")
    print(json.dumps(out), flush=True)
"""


class SecondUser:
    """The helper process, for the whole test (started once: a few ms per call)."""

    def __init__(self, mnt_root: str, ref_root: str) -> None:
        self.dir_fds = [os.open(p, os.O_RDONLY | os.O_DIRECTORY) for p in (mnt_root, ref_root)]
        python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
        self.proc = subprocess.Popen(
            [python, "-I", "-c", _HELPER, *map(str, self.dir_fds)],
            user=USER, group=USER, extra_groups=[], pass_fds=self.dir_fds, cwd="/",
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self.next_handle = 0

    def __call__(self, op: str, *args: Any) -> tuple[Outcome, Outcome]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([op, args]) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"the second user's helper did not answer {op}{args} "
                               f"(exit status {self.proc.poll()})")
        got, want = json.loads(line)

        def outcome(o: list) -> Outcome:
            value = o[1]
            return (o[0], tuple(value) if isinstance(value, list) else value)

        return outcome(got), outcome(want)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in self.dir_fds:
            os.close(fd)


class Pair:
    """The same open file on both sides (fds of this process, or handles of the
    second user's helper)."""

    def __init__(self, fd_m: int, fd_r: int, desc: str, flags: int = 0, path: str = "") -> None:
        self.fd_m, self.fd_r, self.desc, self.flags = fd_m, fd_r, desc, flags
        self.path = path  # (its name when it was opened)
        self.open = True

    def __repr__(self) -> str:
        return f"<fd {self.desc}>"


class PosixModel(RuleBasedStateMachine):
    fds = Bundle("fds")
    user_fds = Bundle("user_fds")

    def __init__(self, mnt_root: str, ref_root: str, user: SecondUser,
                 data_path: str) -> None:
        super().__init__()
        self.m = mnt_root
        self.r = ref_root
        self.user = user
        self.data_path = data_path
        self.known_bugs = set() if os.environ.get("MTCFS_POSIX_KNOWN_BUGS") else set(KNOWN_BUGS)
        self.pairs: list[Pair] = []
        self.user_pairs: list[Pair] = []
        self.failed = False
        clear_dir(self.m)
        clear_dir(self.r)

    # -- helpers -------------------------------------------------------------

    def both(self, desc: str, fn: Callable[[str], Any]) -> Outcome:
        """Run fn(root) on mtcfs and on tmpfs; both outcomes must be equal."""
        got = attempt(lambda: fn(self.m))
        want = attempt(lambda: fn(self.r))
        self.check(got == want, f"{desc}: mtcfs -> {got!r}, tmpfs -> {want!r}")
        self._count(desc, got)
        return got

    @staticmethod
    def _count(desc: str, outcome: Outcome) -> None:
        COVERAGE[(desc.split("(", 1)[0], outcome[1] if outcome[0] == "error" else "ok")] += 1

    def both_fd(self, desc: str, pair: Pair, fn: Callable[[int], Any]) -> Outcome:
        got = attempt(lambda: fn(pair.fd_m))
        want = attempt(lambda: fn(pair.fd_r))
        self.check(got == want, f"{desc} on {pair!r}: mtcfs -> {got!r}, tmpfs -> {want!r}")
        self._count("fd " + desc, got)
        return got

    def as_user(self, key: str, desc: str, op: str, *args: Any,
                watch: str | None = None) -> Outcome:
        """The second user's call on both sides. key: what COVERAGE counts it as; watch:
        a path whose set-id bits are watched (counted when the call clears them)."""
        before = _stat(os.path.join(self.r, watch)) if watch is not None else None
        got, want = self.user(op, *args)
        self.check(got == want, f"as uid {USER}: {desc}: mtcfs -> {got!r}, tmpfs -> {want!r}")
        self._count(key, got)
        if key.endswith("[sticky]"):
            self._count(key.removesuffix("[sticky]"), got)  # (counted as both)
        if before is not None:
            self._count_setid_cleared(key, before, _stat(os.path.join(self.r, watch)))
        return got

    @staticmethod
    def _count_setid_cleared(key: str, before: os.stat_result | None,
                             after: os.stat_result | None) -> None:
        if (before is not None and after is not None and before.st_ino == after.st_ino
                and before.st_mode & SETID & ~after.st_mode):
            COVERAGE[(key, "cleared set-id")] += 1

    def sticky_tag(self, *paths: str) -> str:
        """'[sticky]' when the directory holding one of the paths is sticky."""
        for p in paths:
            s = _stat(os.path.join(self.r, os.path.dirname(p)))
            if s is not None and s.st_mode & stat.S_ISVTX:
                return "[sticky]"
        return ""

    def avoid(self, bug: str, trigger: bool) -> bool:
        """Whether to skip a call that would trigger a known mtcfs bug."""
        if trigger and bug in self.known_bugs:
            COVERAGE[("(known bug, not run)", bug)] += 1
            return True
        return False

    def check(self, ok: bool, msg: str) -> None:
        if not ok:
            self.failed = True
            raise AssertionError(msg)

    # -- set-up ------------------------------------------------------------------

    @initialize(keep=st.lists(st.booleans(), min_size=len(INITIAL_TREE),
                              max_size=len(INITIAL_TREE)),
                perms=st.lists(st.integers(0, 7), min_size=len(INITIAL_TREE),
                               max_size=len(INITIAL_TREE)))
    def populate(self, keep: list[bool], perms: list[int]) -> None:
        """Start from a random part of a tree that uses most of the name pool,
        so that operations meet existing files and directories, with some owned
        by the second user, world-writable, sticky or set-id."""
        for root in (self.m, self.r):
            for (path, content), wanted, perm in zip(INITIAL_TREE, keep, perms, strict=True):
                p = os.path.join(root, path)
                if not wanted or not os.path.isdir(os.path.dirname(p)):
                    continue
                if content is None:
                    os.mkdir(p)
                    owner_mode = INITIAL_DIR_PERMS[perm]
                elif isinstance(content, bytes):
                    Path(p).write_bytes(content)
                    owner_mode = INITIAL_FILE_PERMS[perm]
                elif content[0] == "link":
                    if os.path.exists(os.path.join(root, content[1])):
                        os.link(os.path.join(root, content[1]), p)
                    continue
                else:
                    kind = {"chr": stat.S_IFCHR, "blk": stat.S_IFBLK, "fifo": stat.S_IFIFO,
                            "sock": stat.S_IFSOCK}[content[0]]
                    os.mknod(p, kind | 0o666, content[1])
                    owner_mode = INITIAL_FILE_PERMS[perm]
                if owner_mode is not None:
                    os.chown(p, owner_mode[0], owner_mode[1])
                    os.chmod(p, owner_mode[2])
                if perm % 3 == 1 and not stat.S_ISLNK(os.lstat(p).st_mode):
                    with contextlib.suppress(OSError):  # (not on special files)
                        os.setxattr(p, "user.x", path.encode())

    # -- choosing names ------------------------------------------------------------

    def existing(self, kind: str) -> list[str]:
        """Paths of the reference tree, of one kind ('file', 'dir', 'any', or
        'xattr': those that carry extended attributes)."""
        out = []
        for dirpath, dirnames, filenames in os.walk(self.r):
            rel = os.path.relpath(dirpath, self.r)
            rel = "" if rel == "." else rel
            if kind in ("dir", "any", "xattr"):
                out += [_join(rel, d) for d in dirnames]
            if kind in ("file", "any", "xattr"):
                out += [_join(rel, f) for f in filenames]
        if kind == "xattr":
            out = [p for p in out if not os.path.islink(os.path.join(self.r, p))
                   and os.listxattr(os.path.join(self.r, p))]
        return sorted(out)

    def pick(self, data: st.DataObject, kind: str, label: str = "path") -> str:
        """Mostly an existing path of that kind, else any name of the pool."""
        pool = {"file": file_paths, "dir": dir_paths, "any": any_paths, "xattr": any_paths}[kind]
        existing = self.existing(kind)
        if existing:
            pool = st.one_of(st.sampled_from(existing), st.sampled_from(existing), pool)
        elif kind == "xattr":
            return self.pick(data, "any", label)
        return data.draw(pool, label=label)

    def pick_name(self, data: st.DataObject, kind: str, label: str = "path") -> str:
        """A name of the pool, mostly in an existing directory (new, or taken: EEXIST)."""
        names = [_join(d, n) for d in ("", *self.existing("dir"))
                 for n in (FILE_NAMES if kind == "file" else DIR_NAMES)]
        free = [n for n in names if not os.path.lexists(os.path.join(self.r, n))]
        pool = file_paths if kind == "file" else dir_paths
        return data.draw(st.one_of(st.sampled_from(names), *[st.sampled_from(free)] * bool(free),
                                   pool), label=label)

    def _user_writable(self, rel: str, want_dir: bool) -> bool:
        """Whether the second user may write `rel` (a directory: make and remove names)."""
        st_ = _stat(os.path.join(self.r, rel))
        if st_ is None or stat.S_ISDIR(st_.st_mode) != want_dir:
            return False
        return bool(st_.st_mode & stat.S_IWOTH
                    or (st_.st_uid == USER and st_.st_mode & stat.S_IWUSR))

    def pick_for_user(self, data: st.DataObject, kind: str, label: str = "path",
                      prefer: str = "in writable dir") -> str:
        """Like pick, but biased to where the second user's calls do something: names in
        directories it may write (prefer "in writable dir"), files it may write
        ("writable"), what it owns ("owned"), or new names in directories it may write
        ("new")."""
        existing = self.existing(kind)
        if prefer == "new":  # (mostly names not taken)
            dirs = ["", *self.existing("dir")]
            cands = [_join(d, n) for d in dirs if self._user_writable(d, True)
                     for n in (DIR_NAMES if kind == "dir" else FILE_NAMES)]
            cands = [c for c in cands if not os.path.lexists(os.path.join(self.r, c))] * 3 + cands
        elif prefer == "writable":  # (set-id files first)
            cands = [p for p in existing if self._user_writable(p, False)]
            cands += [p for p in cands if _setid_file(_stat(os.path.join(self.r, p)))] * 2
        elif prefer == "owned":  # (set-id files first)
            cands = [p for p in existing
                     if (s := _stat(os.path.join(self.r, p), False)) and s.st_uid == USER]
            setid = [p for p in cands if _setid_file(_stat(os.path.join(self.r, p), False))]
            cands = setid * 2 + cands
        else:
            cands = [p for p in existing if self._user_writable(os.path.dirname(p), True)]
        if not cands:
            return self.pick(data, kind, label)
        return data.draw(st.one_of(st.sampled_from(cands), st.sampled_from(cands),
                                   st.sampled_from(cands), st.just(None)),
                         label=label) or self.pick(data, kind, label)

    # -- namespace ---------------------------------------------------------------
    # (Every open is O_NONBLOCK: a name may be a FIFO, which would block otherwise.)

    @rule(path=file_paths, mode=file_modes, exclusive=st.booleans())
    def create(self, path: str, mode: int, exclusive: bool) -> None:
        flags = os.O_CREAT | os.O_WRONLY | os.O_NONBLOCK | (os.O_EXCL if exclusive
                                                            else os.O_TRUNC)

        def op(root: str) -> None:
            os.close(os.open(os.path.join(root, path), flags, mode))

        self.both(f"open({path!r}, O_CREAT|{'O_EXCL' if exclusive else 'O_TRUNC'}, "
                  f"{mode:o})", op)

    @rule(path=dir_paths | file_paths, mode=dir_modes)
    def mkdir(self, path: str, mode: int) -> None:
        self.both(f"mkdir({path!r}, {mode:o})", lambda root: os.mkdir(os.path.join(root, path),
                                                                     mode))

    @rule(data=st.data(), kind=node_types, mode=node_modes, dev=devices)
    def mknod(self, data: st.DataObject, kind: int, mode: int, dev: int) -> None:
        # Device numbers: ordinary ones, 0:0, the largest the kernel encodes, and one
        # past it (EINVAL). Regular files too (kind S_IFREG, or 0).
        path = self.pick_name(data, data.draw(st.sampled_from(("file", "dir"))))
        self.both(f"mknod({path!r}, {kind | mode:o}, {os.major(dev)}:{os.minor(dev)})",
                  lambda root: os.mknod(os.path.join(root, path), kind | mode, dev))

    @rule(path=file_paths | dir_paths, dest=st.sampled_from(("a", "d1", "d1/a", "c/b", "d2/d1")))
    def symlink(self, path: str, dest: str) -> None:
        # Relative targets that stay inside the tree (the same on both sides);
        # they may dangle or loop.
        self.both(f"symlink({dest!r}, {path!r})",
                  lambda root: os.symlink(dest, os.path.join(root, path)))

    @rule(data=st.data(), follow=st.booleans())
    def link(self, data: st.DataObject, follow: bool) -> None:
        # A file (or a directory: EPERM, or a symlink: followed or not) to a new name or
        # an existing one (EEXIST).
        src = self.pick(data, data.draw(st.sampled_from(("file", "file", "any", "dir"))), "src")
        if data.draw(st.booleans(), label="existing dst"):
            dst = self.pick(data, data.draw(st.sampled_from(("file", "any"))), "dst")
        else:
            dst = self.pick_name(data, "file", "dst")
        self.both(f"link({src!r}, {dst!r}{'' if follow else ', nofollow'})",
                  lambda root: os.link(os.path.join(root, src), os.path.join(root, dst),
                                       follow_symlinks=follow))

    @rule(data=st.data())
    def rmdir(self, data: st.DataObject) -> None:
        path = self.pick(data, "any")
        self.both(f"rmdir({path!r})", lambda root: os.rmdir(os.path.join(root, path)))

    @rule(data=st.data())
    def unlink(self, data: st.DataObject) -> None:
        path = self.pick(data, "any")
        self.both(f"unlink({path!r})", lambda root: os.unlink(os.path.join(root, path)))

    @rule(data=st.data(), flags=rename_flags)
    def rename_file(self, data: st.DataObject, flags: int) -> None:
        self._rename(self.pick(data, "file", "src"), self.pick(data, "file", "dst"), flags)

    @rule(data=st.data(), flags=rename_flags)
    def rename_dir(self, data: st.DataObject, flags: int) -> None:
        # Covers moving a directory into its own subtree (EINVAL), over an
        # empty or non-empty directory, over a file, and a file over it.
        self._rename(self.pick(data, "dir", "src"), self.pick(data, "any", "dst"), flags)

    @rule(data=st.data(), flags=rename_flags)
    def rename_file_over_dir(self, data: st.DataObject, flags: int) -> None:
        self._rename(self.pick(data, "file", "src"), self.pick(data, "dir", "dst"), flags)

    def _rename(self, src: str, dst: str, flags: int) -> None:
        name = {0: "rename", RENAME_NOREPLACE: "renameat2[NOREPLACE]",
                RENAME_EXCHANGE: "renameat2[EXCHANGE]"}[flags]
        self.both(f"{name}({src!r}, {dst!r})",
                  lambda root: renameat2(os.path.join(root, src), os.path.join(root, dst),
                                         flags))

    @rule(data=st.data())
    def chmod(self, data: st.DataObject) -> None:
        path = self.pick(data, "any")
        s = _stat(os.path.join(self.r, path))
        mode = data.draw(chmod_dir_modes if s is not None and stat.S_ISDIR(s.st_mode)
                         else file_modes, label="mode")
        self.both(f"chmod({path!r}, {mode:o})", lambda root: os.chmod(os.path.join(root, path),
                                                                     mode))

    @rule(data=st.data(), uid=owners, gid=owners, follow=st.booleans())
    def chown(self, data: st.DataObject, uid: int, gid: int, follow: bool) -> None:
        path = self.pick(data, "any")
        before = _stat(os.path.join(self.r, path), follow)
        self.both(f"{'' if follow else 'l'}chown({path!r}, {uid}, {gid})",
                  lambda root: os.chown(os.path.join(root, path), uid, gid,
                                        follow_symlinks=follow))
        self._count_setid_cleared("chown", before, _stat(os.path.join(self.r, path), follow))

    @rule(data=st.data(), mode=file_modes)
    def give_to_user(self, data: st.DataObject, mode: int) -> None:
        """chown to the second user, then chmod (set-id modes too): files and directories
        the second user owns."""
        path = self.pick(data, "any")
        before = _stat(os.path.join(self.r, path))
        self.both(f"chown({path!r}, {USER}, {USER})",
                  lambda root: os.chown(os.path.join(root, path), USER, USER))
        self._count_setid_cleared("chown", before, _stat(os.path.join(self.r, path)))
        self.both(f"chmod({path!r}, {mode:o})",
                  lambda root: os.chmod(os.path.join(root, path), mode))

    @rule(data=st.data())
    def stat_path(self, data: st.DataObject) -> None:
        path = self.pick(data, "any")

        def op(root: str) -> tuple:
            s = os.lstat(os.path.join(root, path))
            size = s.st_size if stat.S_ISREG(s.st_mode) else None
            return (oct(s.st_mode), s.st_nlink, size, s.st_uid, s.st_gid, s.st_rdev)

        self.both(f"lstat({path!r})", op)

    # -- file data ---------------------------------------------------------------

    def _write(self, desc: str, ref: str | None, payload: bytes, start: int | None,
               fn: Callable[[str], Any]) -> None:
        """A write of `payload` at `start` (on the reference; None: not a regular file,
        or it will fail) by fn(root). ref: a path of the reference file."""
        if (start is not None and ref is not None and self.data_path == "fuse"
                and "writeback-kills-setid" in self.known_bugs
                and self.avoid("writeback-kills-setid",
                               self._user_writer_on(os.stat(ref).st_ino))):
            return
        self.both(desc, fn)

    def _regular_size(self, path: str) -> int | None:
        s = _stat(os.path.join(self.r, path))
        return s.st_size if s is not None and stat.S_ISREG(s.st_mode) else None

    @rule(data=st.data(), off=any_offsets, payload=payloads)
    def pwrite(self, data: st.DataObject, off: int, payload: bytes) -> None:
        # Sparse writes at large offsets too, up to and past MAX_SHARED_SIZE.
        path = self.pick(data, "file")

        def op(root: str) -> int:
            fd = os.open(os.path.join(root, path), os.O_WRONLY | os.O_NONBLOCK)
            try:
                return os.pwrite(fd, payload, off)
            finally:
                os.close(fd)

        self._write(f"pwrite({path!r}, <{len(payload)} bytes>, off={off})",
                    os.path.join(self.r, path), payload,
                    off if self._regular_size(path) is not None else None, op)

    @rule(data=st.data(), payload=payloads, create=st.booleans())
    def append(self, data: st.DataObject, payload: bytes, create: bool) -> None:
        path = self.pick(data, "file")
        flags = os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | (os.O_CREAT if create else 0)

        def op(root: str) -> tuple[int, int]:
            fd = os.open(os.path.join(root, path), flags, 0o644)
            try:
                n = os.write(fd, payload)
                return n, os.lseek(fd, 0, os.SEEK_CUR)
            finally:
                os.close(fd)

        self._write(f"open({path!r}, O_APPEND{'|O_CREAT' if create else ''}) + "
                    f"write(<{len(payload)} bytes>)", os.path.join(self.r, path), payload,
                    self._regular_size(path), op)

    @rule(data=st.data(), size=offsets)
    def truncate(self, data: st.DataObject, size: int) -> None:
        path = self.pick(data, "any")
        self.both(f"truncate({path!r}, {size})",
                  lambda root: os.truncate(os.path.join(root, path), size))

    @rule(data=st.data(), size=big_sizes)
    def truncate_big(self, data: st.DataObject, size: int) -> None:
        path = self.pick(data, "file")
        self.both(f"truncate({path!r}, {size})",
                  lambda root: os.truncate(os.path.join(root, path), size))

    @rule(data=st.data(), off=any_offsets, size=st.integers(0, 70_000))
    def pread(self, data: st.DataObject, off: int, size: int) -> None:
        path = self.pick(data, "any")

        def op(root: str) -> bytes:
            fd = os.open(os.path.join(root, path), os.O_RDONLY | os.O_NONBLOCK)
            try:
                return os.pread(fd, size, off)
            finally:
                os.close(fd)

        self.both(f"pread({path!r}, {size}, off={off})", op)

    # -- open files (kept open across other operations) ---------------------------

    @precondition(lambda self: sum(p.open for p in self.pairs) < 4)
    @rule(target=fds, data=st.data(), flags=open_flags)
    def open_fd(self, data: st.DataObject, flags: int):
        path = self.pick(data, "file")
        flags |= os.O_NONBLOCK
        fd_m = attempt(lambda: os.open(os.path.join(self.m, path), flags, 0o644))
        fd_r = attempt(lambda: os.open(os.path.join(self.r, path), flags, 0o644))
        for fd in (fd_m, fd_r):
            if fd[0] == "ok" and fd_m[0] != fd_r[0]:
                os.close(fd[1])
        self.check(fd_m[0] == fd_r[0] and (fd_m[0] == "ok" or fd_m == fd_r),
                   f"open({path!r}, {flags:#o}): mtcfs -> {fd_m!r}, tmpfs -> {fd_r!r}")
        self._count("open_fd", fd_m if fd_m[0] != "ok" else ("ok", None))
        if fd_m[0] != "ok":
            return multiple()
        pair = Pair(fd_m[1], fd_r[1], f"{path}:{flags:#o}", flags)
        self.pairs.append(pair)
        return pair

    def _fd_start(self, pair: Pair, off: int | None = None) -> int | None:
        """Where a write through the pair lands on the reference (None: not a file)."""
        if not pair.open:
            return None
        s = os.fstat(pair.fd_r)
        if not stat.S_ISREG(s.st_mode):
            return None
        if pair.flags & os.O_APPEND:
            return s.st_size
        return off if off is not None else os.lseek(pair.fd_r, 0, os.SEEK_CUR)

    def _fd_write(self, desc: str, pair: Pair, payload: bytes, start: int | None,
                  fn: Callable[[int], Any]) -> None:
        fds = {self.m: pair.fd_m, self.r: pair.fd_r}
        ref = f"/proc/self/fd/{pair.fd_r}" if pair.open else None
        self._write(f"fd {desc} on {pair!r}", ref, payload, start, lambda root: fn(fds[root]))

    @rule(pair=fds, off=any_offsets, payload=payloads)
    def fd_pwrite(self, pair: Pair, off: int, payload: bytes) -> None:
        self._fd_write(f"pwrite(<{len(payload)} bytes>, off={off})", pair, payload,
                       self._fd_start(pair, off), lambda fd: os.pwrite(fd, payload, off))

    @rule(pair=fds, payload=payloads)
    def fd_write(self, pair: Pair, payload: bytes) -> None:
        def op(fd: int) -> tuple[int, int]:
            n = os.write(fd, payload)
            return n, os.lseek(fd, 0, os.SEEK_CUR)

        self._fd_write(f"write(<{len(payload)} bytes>)", pair, payload, self._fd_start(pair),
                       op)

    @rule(pair=fds, off=any_offsets, size=st.integers(0, 70_000))
    def fd_pread(self, pair: Pair, off: int, size: int) -> None:
        self.both_fd(f"pread({size}, off={off})", pair, lambda fd: os.pread(fd, size, off))

    @rule(pair=fds, size=st.one_of(offsets, big_sizes))
    def fd_truncate(self, pair: Pair, size: int) -> None:
        fds = {self.m: pair.fd_m, self.r: pair.fd_r}
        self.both(f"fd ftruncate({size}) on {pair!r}", lambda root: os.ftruncate(fds[root], size))

    @rule(pair=fds, mode=falloc_modes, off=any_offsets, length=falloc_lengths)
    def fd_fallocate(self, pair: Pair, mode: int, off: int, length: int) -> None:
        fds = {self.m: pair.fd_m, self.r: pair.fd_r}
        self.both(f"fd fallocate(mode={mode:#x}, off={off}, len={length}) on {pair!r}",
                  lambda root: fallocate(fds[root], mode, off, length))

    @rule(pair=fds)
    def fd_fstat(self, pair: Pair) -> None:
        def op(fd: int) -> tuple:
            s = os.fstat(fd)  # (the path may name a directory: its size is not compared)
            return (oct(s.st_mode), s.st_nlink, s.st_size if stat.S_ISREG(s.st_mode) else None,
                    s.st_uid, s.st_gid)

        self.both_fd("fstat", pair, op)

    @rule(pair=fds)
    def fd_fsync(self, pair: Pair) -> None:
        self.both_fd("fsync", pair, os.fsync)

    @rule(pair=consumes(fds))
    def fd_close(self, pair: Pair) -> None:
        pair.open = False
        self.both_fd("close", pair, os.close)

    # -- extended attributes -------------------------------------------------------

    @rule(data=st.data(), name=xattr_names, value=xattr_values, flags=xattr_flags)
    def setxattr(self, data: st.DataObject, name: str, value: bytes, flags: int) -> None:
        path = self.pick(data, "xattr")
        try:  # often a name it has (XATTR_CREATE: EEXIST)
            have = sorted(os.listxattr(os.path.join(self.r, path)))
        except OSError:
            have = []
        if have and data.draw(st.booleans(), label="a name it has"):
            name = data.draw(st.sampled_from(have), label="name")
        self.both(f"setxattr({path!r}, {name!r}, {value!r}, flags={flags})",
                  lambda root: os.setxattr(os.path.join(root, path), name, value, flags))

    @rule(data=st.data(), name=xattr_names)
    def getxattr(self, data: st.DataObject, name: str) -> None:
        path = self.pick(data, "xattr")
        self.both(f"getxattr({path!r}, {name!r})",
                  lambda root: os.getxattr(os.path.join(root, path), name))

    @rule(data=st.data(), name=xattr_names)
    def removexattr(self, data: st.DataObject, name: str) -> None:
        path = self.pick(data, "xattr")
        self.both(f"removexattr({path!r}, {name!r})",
                  lambda root: os.removexattr(os.path.join(root, path), name))

    @rule(data=st.data())
    def listxattr(self, data: st.DataObject) -> None:
        path = self.pick(data, "any")

        def op(root: str) -> list[str]:
            return sorted(n for n in os.listxattr(os.path.join(root, path))
                          if not n.startswith("user.mtcfs."))

        self.both(f"listxattr({path!r})", op)

    # -- the second user (uid/gid 65534) --------------------------------------------

    @rule(data=st.data(), flags=user_open_flags, mode=user_create_modes)
    def user_open(self, data: st.DataObject, flags: int, mode: int) -> None:
        path = self.pick_for_user(data, "file", prefer=data.draw(
            st.sampled_from(("new", "in writable dir", "writable")), label="prefer"))
        self.as_user(f"user open{self.sticky_tag(path)}",
                     f"open({path!r}, {flags:#o}, {mode:o})", "open", path, flags, mode,
                     watch=path)

    @rule(data=st.data(), off=st.one_of(st.just(-1), offsets), payload=payloads)
    def user_write(self, data: st.DataObject, off: int, payload: bytes) -> None:
        # off -1: O_APPEND
        path = self.pick_for_user(data, "file", prefer="writable")
        self.as_user("user write", f"{'append' if off < 0 else 'pwrite'}({path!r}, "
                     f"<{len(payload)} bytes>, off={off})", "write", path, off, payload.hex(),
                     watch=path)

    @rule(data=st.data(), size=st.one_of(offsets, offsets, big_sizes))
    def user_truncate(self, data: st.DataObject, size: int) -> None:
        path = self.pick_for_user(data, "file", prefer="writable")
        if self.data_path == "passthrough" and self.avoid("user-truncate-past-shared",
                                                         size > MAX_SHARED_SIZE):
            return
        desc = f"truncate({path!r}, {size})"
        self.as_user("user truncate", desc, "truncate", path, size, watch=path)

    # Namespace calls as the second user: sticky directories (EPERM for others' names),
    # write and search permission (EACCES), protected hard links (EPERM).

    @rule(data=st.data(), op=st.sampled_from(("unlink", "unlink", "rmdir")))
    def user_remove(self, data: st.DataObject, op: str) -> None:
        path = self.pick_for_user(data, "dir" if op == "rmdir" else "file")
        self.as_user(f"user {op}{self.sticky_tag(path)}", f"{op}({path!r})", op, path)

    @rule(data=st.data(), flags=rename_flags)
    def user_rename(self, data: st.DataObject, flags: int) -> None:
        src = self.pick_for_user(data, "any", "src")
        dst = self.pick_for_user(data, "any", "dst", prefer=data.draw(
            st.sampled_from(("new", "in writable dir")), label="prefer"))
        name = {0: "rename", RENAME_NOREPLACE: "renameat2[NOREPLACE]",
                RENAME_EXCHANGE: "renameat2[EXCHANGE]"}[flags]
        self.as_user(f"user {name}{self.sticky_tag(src, dst)}", f"{name}({src!r}, {dst!r})",
                     "rename", src, dst, flags)

    @rule(data=st.data(), op=st.sampled_from(("mkdir", "link", "link", "symlink", "mkfifo",
                                              "mknod")), mode=dir_modes)
    def user_make(self, data: st.DataObject, op: str, mode: int) -> None:
        if op == "mkdir":
            path = self.pick_for_user(data, "dir", prefer="new")
            self.as_user(f"user mkdir{self.sticky_tag(path)}", f"mkdir({path!r}, {mode:o})",
                         "mkdir", path, mode)
        elif op == "link":
            src = self.pick_for_user(data, "file", "src", prefer=data.draw(
                st.sampled_from(("owned", "writable", "in writable dir")), label="prefer"))
            dst = self.pick_for_user(data, "file", "dst", prefer="new")
            self.as_user("user link", f"link({src!r}, {dst!r})", "link", src, dst)
        elif op == "symlink":
            path = self.pick_for_user(data, "file", prefer="new")
            self.as_user("user symlink", f"symlink('a', {path!r})", "symlink", "a", path)
        else:
            path = self.pick_for_user(data, "file", prefer="new")
            kind = stat.S_IFIFO if op == "mkfifo" else stat.S_IFCHR  # (EPERM: no CAP_MKNOD)
            self.as_user(f"user {op}", f"mknod({path!r}, {kind | 0o644:o})", "mknod", path,
                         kind | 0o644, os.makedev(1, 3))

    @rule(data=st.data(), op=st.sampled_from(("unlink", "rename", "rename", "rmdir")),
          flags=rename_flags)
    def user_in_sticky_dir(self, data: st.DataObject, op: str, flags: int) -> None:
        """Names in sticky directories, the second user's and others': only the owner of
        the name (or of the directory) may remove or rename it (EPERM)."""
        cands = [p for p in self.existing("any") if self.sticky_tag(p)]
        if not cands:
            return
        path = data.draw(st.sampled_from(cands), label="path")
        if op == "rename":
            dst = self.pick_for_user(data, "file", "dst", prefer="new")
            name = {0: "rename", RENAME_NOREPLACE: "renameat2[NOREPLACE]",
                    RENAME_EXCHANGE: "renameat2[EXCHANGE]"}[flags]
            self.as_user(f"user {name}{self.sticky_tag(path, dst)}",
                         f"{name}({path!r}, {dst!r})", "rename", path, dst, flags)
        else:
            self.as_user(f"user {op}[sticky]", f"{op}({path!r})", op, path)

    @rule(data=st.data(), mode=user_chmod_modes, uid=user_owners, gid=user_owners,
          which=st.sampled_from(("chmod", "chown")))
    def user_attr(self, data: st.DataObject, mode: int, uid: int, gid: int, which: str) -> None:
        """chmod/chown as the second user: its own files (the kernel drops set-group-ID
        for a group it is not in; chown clears set-id bits), others' (EPERM)."""
        path = self.pick_for_user(data, "any", prefer="owned")
        if which == "chmod":
            self.as_user("user chmod", f"chmod({path!r}, {mode:o})", "chmod", path, mode)
            return
        s = _stat(os.path.join(self.r, path), follow=True)
        if self.avoid("chown-nothing-by-other",
                      self.data_path == "passthrough" and uid == gid == -1 and s is not None
                      and stat.S_ISREG(s.st_mode) and s.st_uid != USER
                      and bool(s.st_mode & SETID)):
            return
        self.as_user("user chown", f"chown({path!r}, {uid}, {gid})", "chown", path, uid, gid,
                     watch=path)

    # The second user's open files, written after other calls changed the file (a
    # chmod u+s by root while it is open, for one).

    @precondition(lambda self: sum(p.open for p in self.user_pairs) < 2)
    @rule(target=user_fds, data=st.data(), flags=user_fd_flags, mode=user_create_modes)
    def user_open_fd(self, data: st.DataObject, flags: int, mode: int):
        path = self.pick_for_user(data, "file", prefer="writable")
        if (self.data_path == "fuse" and "writeback-kills-setid" in self.known_bugs
                and flags & os.O_ACCMODE != os.O_RDONLY):
            for pair in self.pairs:  # (root's cached writes go out through root's handles)
                if pair.open:
                    with contextlib.suppress(OSError):
                        os.fsync(pair.fd_m)
        h = self.user.next_handle
        self.user.next_handle += 1
        got = self.as_user("user open_fd", f"open({path!r}, {flags:#o}, {mode:o})", "fopen", h,
                           path, flags, mode)
        if got[0] != "ok":
            return multiple()
        pair = Pair(h, h, f"uid {USER}: {path}:{flags:#o}", flags, path)
        self.user_pairs.append(pair)
        return pair

    def _user_writer_on(self, ino: int) -> bool:
        """Whether the second user has this reference inode open for writing."""
        return any(pair.open and pair.flags & os.O_ACCMODE != os.O_RDONLY
                   and (s := self._user_fd_stat(pair)) is not None and s[4] == ino
                   for pair in self.user_pairs)

    def _user_fd_stat(self, pair: Pair) -> tuple[int, int, int, int, int] | None:
        """The reference file's mode, gid, size, the fd's offset and the file's inode
        (None: closed)."""
        got, want = self.user("fstat", pair.fd_r)
        return want[1] if want[0] == "ok" else None

    @rule(pair=user_fds, payload=payloads, size=offsets,
          op=st.sampled_from(("write", "write", "chmod u+s, write", "ftruncate")))
    def user_fd_io(self, pair: Pair, payload: bytes, size: int, op: str) -> None:
        """A write (or ftruncate) through an fd of the second user's; before the write,
        root may make the file (by the name it was opened by) set-user-ID."""
        if op == "ftruncate":
            self._user_fd_truncate(pair, size)
            return
        if op.startswith("chmod"):
            self._make_setuid(pair)
        s = self._user_fd_stat(pair)
        if s is not None and stat.S_ISREG(s[0]) and payload:
            mode, gid, size, pos, _ = s
            if mode & SETID:
                COVERAGE[("user fd write", "on a set-id file")] += 1
        before = s[0] if s is not None else 0
        got = self.as_user("user fd write", f"write(<{len(payload)} bytes>) on {pair!r}",
                           "fwrite", pair.fd_r, payload.hex())
        after = self._user_fd_stat(pair)
        if got[0] == "ok" and after is not None and before & SETID & ~after[0]:
            COVERAGE[("user fd write", "cleared set-id")] += 1
        if self.data_path == "fuse" and "writeback-kills-setid" in self.known_bugs:
            self.user("fsync", pair.fd_r)  # (its cached pages go out now, through its handle)

    def _make_setuid(self, pair: Pair) -> None:
        """Root makes the file (by the name it was opened by) set-user-ID."""
        s = _stat(os.path.join(self.r, pair.path))
        mode = stat.S_IMODE(s.st_mode) | stat.S_ISUID if s is not None else 0o4666
        self.both(f"chmod({pair.path!r}, {mode:o})",
                  lambda root: os.chmod(os.path.join(root, pair.path), mode))

    @rule(pair=user_fds, mode=user_falloc_modes, off=offsets, length=falloc_lengths,
          setuid=st.booleans())
    def user_fd_fallocate(self, pair: Pair, mode: int, off: int, length: int,
                          setuid: bool) -> None:
        """fallocate through an fd of the second user's, on a file root may first make
        set-user-ID (cleared as by a write)."""
        if setuid:
            self._make_setuid(pair)
        s = self._user_fd_stat(pair)
        got = self.as_user("user fd fallocate",
                           f"fallocate(mode={mode:#x}, off={off}, len={length}) on {pair!r}",
                           "ffallocate", pair.fd_r, mode, off, length)
        after = self._user_fd_stat(pair)
        if got[0] == "ok" and s is not None and after is not None and s[0] & SETID & ~after[0]:
            COVERAGE[("user fd fallocate", "cleared set-id")] += 1

    def _user_fd_truncate(self, pair: Pair, size: int) -> None:
        self.as_user("user fd ftruncate", f"ftruncate({size}) on {pair!r}", "ftruncate",
                     pair.fd_r, size)

    @rule(pair=consumes(user_fds))
    def user_fd_close(self, pair: Pair) -> None:
        pair.open = False
        self.as_user("user fd close", f"close() on {pair!r}", "fclose", pair.fd_r)

    # -- the whole tree ------------------------------------------------------------

    def compare_trees(self, when: str) -> None:
        want, ranges = snapshot(self.r)
        got, _ = snapshot(self.m, ranges)
        self.check(got == want, f"trees differ {when} (mtcfs vs tmpfs):\n"
                   + describe_diff(got, want))

    @invariant()
    def trees_match(self) -> None:
        self.compare_trees("")

    def teardown(self) -> None:
        for pair in self.pairs:
            if pair.open:
                pair.open = False
                for fd in (pair.fd_m, pair.fd_r):
                    os.close(fd)
        for pair in self.user_pairs:
            if pair.open:
                pair.open = False
                self.user("fclose", pair.fd_r)
        if not self.failed:
            # Closing may flush the last writes: compare once more.
            self.compare_trees("after closing all files")


# Outcomes the run must have produced, or the model is not testing what it
# claims to (checked when running with the default number of examples).
EXPECTED_COVERAGE = [
    ("rename", "ok"), ("rename", "EINVAL"), ("rename", "ENOTEMPTY"), ("rename", "EISDIR"),
    ("rename", "ENOTDIR"), ("renameat2[NOREPLACE]", "EEXIST"),
    ("renameat2[NOREPLACE]", "ok"), ("renameat2[EXCHANGE]", "ok"), ("rmdir", "ENOTEMPTY"),
    ("rmdir", "ok"), ("unlink", "ok"), ("unlink", "EISDIR"), ("mkdir", "EEXIST"),
    ("setxattr", "ok"), ("setxattr", "EEXIST"), ("setxattr", "ENODATA"), ("getxattr", "ok"),
    ("removexattr", "ok"), ("removexattr", "ENODATA"), ("truncate", "ok"), ("pwrite", "ok"),
    ("fd pread", "ok"), ("fd write", "ok"), ("fd ftruncate", "ok"), ("fd close", "ok"),
    # hard links, device nodes, FIFOs, sockets
    ("link", "ok"), ("link", "EEXIST"), ("link", "EPERM"), ("link", "ENOENT"),
    ("mknod", "ok"), ("mknod", "EEXIST"), ("mknod", "EINVAL"),
    ("open_fd", "EACCES"),  # (root) a device node: the mount is nodev
    # owners and set-id bits
    ("chown", "ok"), ("chown", "cleared set-id"), ("lchown", "ok"),
    ("user write", "cleared set-id"), ("user truncate", "cleared set-id"),
    ("user chown", "cleared set-id"), ("user chown", "EPERM"), ("user chmod", "EPERM"),
    ("user chmod", "ok"), ("user fd write", "cleared set-id"),
    # the second user: permissions and sticky directories
    ("user open", "EACCES"), ("user open", "ok"), ("user write", "EACCES"),
    ("user write", "ok"), ("user truncate", "ok"), ("user mkdir", "EACCES"),
    ("user mkdir", "ok"), ("user unlink", "ok"), ("user unlink[sticky]", "EPERM"),
    ("user unlink[sticky]", "ok"), ("user rename[sticky]", "EPERM"), ("user rename", "ok"),
    ("user link", "EPERM"), ("user link", "ok"),
    ("user mkfifo", "ok"), ("user fd write", "ok"), ("user fd ftruncate", "ok"),
    # fallocate: the modes tmpfs has, and those it refuses
    ("fd fallocate", "ok"), ("fd fallocate", "ENOTSUP"),
    ("user fd fallocate", "ok"), ("user fd fallocate", "cleared set-id"),
]
# Outcomes the same 300 sequences reach in some runs and not in others (they hinge on
# which names earlier steps left behind, and those on timing of the second user's
# calls): reported, not required; each has a directed test in test_posix_semantics.py.
RARE = {
    ("user mkdir", "EACCES"): "test_a_user_is_refused_where_tmpfs_refuses",
    ("user rename[sticky]", "EPERM"): "test_a_user_is_refused_where_tmpfs_refuses",
    ("user unlink[sticky]", "EPERM"): "test_a_user_is_refused_where_tmpfs_refuses",
    ("user unlink[sticky]", "ok"): "test_a_user_is_refused_where_tmpfs_refuses",
    ("open_fd", "EACCES"): "test_device_nodes_fifos_and_sockets_are_inert_nodes",
    ("user fd ftruncate", "ok"): "test_a_user_ftruncates_through_its_own_descriptor",
    ("user fd write", "cleared set-id"):
        "test_a_user_write_clears_set_id_bits_while_the_file_is_open",
    # (Each missed once in 600 runs, by CI or here.)
    ("user chown", "cleared set-id"): "test_set_group_id_is_cleared_for_users_outside_the_group",
    ("user link", "EPERM"): "test_a_user_is_refused_where_tmpfs_refuses",
    ("user mkdir", "ok"): "test_a_user_is_refused_where_tmpfs_refuses",
}


@pytest.mark.slow
def test_mtcfs_behaves_like_tmpfs(make_mount, ram_root: Path, data_path: str) -> None:
    # allow_other: for the second user. Huge pages: seals then read files through a
    # mapping, which the model's truncates and punched holes must never race.
    mnt = make_mount(extra=("-o", "allow_other", "--huge-pages", "always"))
    # The reference: a tmpfs of its own, nodev and nosuid as mtcfs mounts are (on
    # /dev/shm, opening a device node made by mknod would open the device).
    ref = ram_root / "ref"
    ref.mkdir()
    root_st = os.stat(mnt.path)
    subprocess.run(["mount", "-t", "tmpfs", "-o",
                    f"nodev,nosuid,size=1g,mode={stat.S_IMODE(root_st.st_mode):o},"
                    f"uid={root_st.st_uid},gid={root_st.st_gid}", "mtcfs-posix-ref", str(ref)],
                   check=True)
    user = SecondUser(str(mnt.path), str(ref))
    COVERAGE.clear()
    examples = int(os.environ.get("MTCFS_POSIX_EXAMPLES", "300"))
    # The same sequences on every run (CI must not depend on luck: a rare outcome
    # such as setxattr EEXIST went unproduced once in ~10 runs); MTCFS_POSIX_RANDOM=1
    # explores new ones.
    explore = bool(os.environ.get("MTCFS_POSIX_RANDOM"))

    def run(derandomize: bool, n: int) -> None:
        run_state_machine_as_test(
            lambda: PosixModel(str(mnt.path), str(ref), user, data_path),
            settings=settings(
                derandomize=derandomize,
                max_examples=n,
                stateful_step_count=int(os.environ.get("MTCFS_POSIX_STEPS", "50")),
                deadline=None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                       HealthCheck.data_too_large],
            ),
        )

    def uncovered() -> list[tuple[str, str]]:
        return [k for k in EXPECTED_COVERAGE if not COVERAGE[k] and k not in RARE]

    try:
        run(not explore, examples)
        # The same choices do not always make the same sequences: what the model draws
        # next depends on what the filesystems answered, and tmpfs's inode numbers and
        # times differ from run to run. An outcome not produced yet gets more runs
        # (every one compared with tmpfs all the same), up to two.
        for _ in range(2):
            if explore or examples < 300 or not uncovered():
                break
            print(f"not produced yet, {examples // 2} more runs: {uncovered()}")
            run(False, examples // 2)
    finally:
        user.close()
        subprocess.run(["umount", "-l", str(ref)], capture_output=True)
    print("\nposix model coverage:")
    for (op, outcome), n in sorted(COVERAGE.items()):
        print(f"  {op:32} {outcome:20} {n}")
    if examples >= 300 and not explore:
        missing = [k for k in EXPECTED_COVERAGE if not COVERAGE[k]]
        rare = [k for k in missing if k in RARE]
        if rare:
            print(f"rare outcomes not produced this time (tested directly: RARE): {rare}")
        missing = [k for k in missing if k not in RARE]
        assert not missing, f"the random runs never produced {missing}"
    # The daemon survived the whole run and saw no error it could not map.
    assert mnt.proc.poll() is None
    assert "internal error" not in mnt.log_path.read_text(errors="replace")
