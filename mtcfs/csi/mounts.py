"""Mount-table reading and bind mounts for the CSI node plugin.

Everything the plugin knows about published volumes comes from
/proc/self/mountinfo (the plugin keeps no state): a bind mount of a directory
of the mtcfs FUSE mount shows there with the FUSE superblock's device number,
fstype `fuse.mtcfs`, source `mtcfs:<node id>` and, as its `root`, the
directory inside the filesystem that was bound. `os.path.ismount` cannot tell
such a bind apart from a plain directory of the same filesystem.

mount(2)/umount2(2) are called through libc (ctypes): no fork+exec per
request, and errors come back as errno.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import threading
from typing import Any

# The mount table is read by mtcfs.mountinfo (the daemon's checks use it too).
from mtcfs.mountinfo import (  # noqa: F401  (re-exported for the plugin and its tests)
    MOUNTINFO,
    MTCFS_FSTYPE,
    MTCFS_SOURCE_PREFIX,
    MountEntry,
    entries_at,
    entry_at,
    mountinfo,
)

# <linux/mount.h>
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_RELATIME = 1 << 21
MNT_DETACH = 2

# Per-mount flags a read-only remount of a bind must carry over: the kernel
# replaces them all with what the remount passes.
_KEPT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
               "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long


class MountError(OSError):
    """mount(2)/umount2(2) failed; str() names the call and the path."""


def _check(ret: int, what: str, path: str) -> None:
    if ret != 0:
        code = ctypes.get_errno()
        raise MountError(code, f"{what} {path}: {os.strerror(code)}")


# The new mount API (Linux >= 5.12), the same numbers on every architecture.
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442
_OPEN_TREE_CLONE = 1
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOUNT_ATTR_RDONLY = 0x1


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _bind_readonly_detached(source: str, target: str) -> bool:
    """Clone `source` as a detached mount, make it read-only, then attach it at
    `target`: it is read-only from the moment it appears, so the copies that
    mount propagation hands to pods (a re-bind under a HostToContainer volume)
    are read-only too, which a remount afterwards would not give them.
    False when the kernel lacks the calls (the caller falls back)."""
    fd = _libc.syscall(_SYS_OPEN_TREE, ctypes.c_int(_AT_FDCWD), source.encode(),
                       ctypes.c_uint(_OPEN_TREE_CLONE | os.O_CLOEXEC))
    if fd < 0:
        code = ctypes.get_errno()
        if code == errno.ENOSYS:
            return False
        raise MountError(code, f"bind mount {source} on {target}: {os.strerror(code)}")
    try:
        attr = _MountAttr(attr_set=_MOUNT_ATTR_RDONLY)
        if _libc.syscall(_SYS_MOUNT_SETATTR, ctypes.c_int(fd), b"",
                         ctypes.c_uint(_AT_EMPTY_PATH), ctypes.byref(attr),
                         ctypes.c_size_t(ctypes.sizeof(attr))) < 0:
            code = ctypes.get_errno()
            if code == errno.ENOSYS:
                return False
            raise MountError(code, f"read-only bind of {source}: {os.strerror(code)}")
        _check(_libc.syscall(_SYS_MOVE_MOUNT, ctypes.c_int(fd), b"", ctypes.c_int(_AT_FDCWD),
                             target.encode(), ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH)),
               f"bind mount {source} on", target)
    finally:
        os.close(fd)
    return True


def bind(source: str, target: str, readonly: bool) -> None:
    """Bind-mount directory `source` onto `target` (on top of whatever is mounted
    there: see node.Publisher.rebind_stale). Read-only binds are made read-only
    before they are attached where the kernel can; else by a second remount call
    (a bind ignores MS_RDONLY on the first one)."""
    if readonly and _bind_readonly_detached(source, target):
        return
    _check(_libc.mount(source.encode(), target.encode(), None, MS_BIND, None),
           f"bind mount {source} on", target)
    if readonly:
        entry = entry_at(target)
        kept = 0
        if entry is not None:
            for opt in entry.options:
                kept |= _KEPT_FLAGS.get(opt, 0)
        ret = _libc.mount(None, target.encode(), None,
                          MS_BIND | MS_REMOUNT | MS_RDONLY | kept, None)
        if ret != 0:
            code = ctypes.get_errno()
            _libc.umount2(target.encode(), MNT_DETACH)  # no half-published rw mount left
            raise MountError(code, f"read-only remount of {target}: {os.strerror(code)}")


def unmount(target: str) -> bool:
    """Unmount the topmost mount at `target`; detach it lazily when it is busy
    (open files in a pod that is going away must not block the unpublish).
    Returns False when nothing was mounted there."""
    if _libc.umount2(target.encode(), 0) == 0:
        return True
    code = ctypes.get_errno()
    if code == errno.EINVAL:  # not a mount point
        return False
    if code == errno.EBUSY or code == errno.ENOTCONN:
        _check(_libc.umount2(target.encode(), MNT_DETACH), "lazy unmount of", target)
        return True
    raise MountError(code, f"unmount {target}: {os.strerror(code)}")


# -- calls that may hang on a FUSE mount ----------------------------------------------------

class _Pending:
    """Calls still running per key: a hung FUSE daemon leaves the thread blocked in
    the kernel, so at most one is outstanding per path instead of one per check."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.keys: set[str] = set()


_pending = _Pending()


class Timeout(Exception):
    pass


def call_with_timeout(key: str, timeout: float, fn: Any, *args: Any) -> Any:
    """fn(*args) in a daemon thread; Timeout when it takes longer than `timeout`
    or a previous call for `key` is still stuck. Exceptions of fn are re-raised."""
    with _pending.lock:
        if key in _pending.keys:
            raise Timeout(f"a previous call on {key} has not returned")
        _pending.keys.add(key)
    result: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            result["value"] = fn(*args)
        except BaseException as e:  # handed to the caller
            result["error"] = e
        finally:
            with _pending.lock:
                _pending.keys.discard(key)
            done.set()

    threading.Thread(target=run, name=f"fs-call {key}", daemon=True).start()
    if not done.wait(timeout):
        raise Timeout(f"no answer from {key} within {timeout:g} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


CONTROL_XATTR = "user.mtcfs.control"  # served on the root of a live mtcfs mount


def mount_root_live(path: str, timeout: float = 2.0) -> tuple[bool, str]:
    """(live, why not): the mtcfs daemon at `path` answers. Reading the virtual
    control xattr of the mount root goes all the way to the daemon; a dead mount
    fails with ENOTCONN and a stuck one does not answer (hence the timeout)."""
    entry = entry_at(path)
    if entry is None or not entry.is_mtcfs:
        return False, f"{path} is not an mtcfs mount"
    try:
        call_with_timeout(f"getxattr {path}", timeout, os.getxattr, path, CONTROL_XATTR)
    except Timeout as e:
        return False, f"the mtcfs daemon at {path} does not answer ({e})"
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            return False, f"the mtcfs daemon at {path} is gone (dead mount)"
        return False, f"{path}: {e.strerror}"
    return True, ""


def is_dead(path: str, timeout: float = 2.0) -> bool:
    """True when statfs at `path` fails with ENOTCONN: its FUSE connection is gone
    (statfs always reaches the daemon; stat may be answered from the attribute
    cache). A path that does not answer in time is not called dead (it may come back)."""
    try:
        call_with_timeout(f"statfs {path}", timeout, os.statvfs, path)
    except Timeout:
        return False
    except OSError as e:
        return e.errno == errno.ENOTCONN
    return False
