"""Extended attributes: the user's (user.*, trusted.*, security.*), recorded in the
metadata store, and mtcfs's own under user.mtcfs.* (virtual, read-only, not
listed): user.mtcfs.control on the root (the control socket), user.mtcfs.state
(mtcfs.fs.state_view)."""

from __future__ import annotations

import errno

from mtcfs.core.namespace import ROOT, Inode, Namespace
from mtcfs.fs.errors import FsError

XATTR_NAME_MAX = 255
XATTR_SIZE_MAX = 65536
CONTROL_XATTR = b"user.mtcfs.control"
RESERVED_XATTR_PREFIX = b"user.mtcfs."


class Xattrs:
    def __init__(self, ns: Namespace, control_socket: str) -> None:
        self.ns = ns
        self.control_socket = control_socket
        # True once any file carries security.capability: until then the
        # kernel's per-write capability probe is answered without a lookup.
        self.has_caps = any(b"security.capability" in n.xattrs for n in ns.inodes.values())

    def getxattr(self, node: Inode, name: bytes) -> bytes:
        """(user.mtcfs.state is FileStateView's.)"""
        if name == CONTROL_XATTR and node.ino == ROOT:
            return self.control_socket.encode()
        try:
            return node.xattrs[name]
        except KeyError:
            raise FsError(errno.ENODATA) from None

    def setxattr(self, node: Inode, name: bytes, value: bytes) -> None:
        if name.startswith(RESERVED_XATTR_PREFIX):
            raise FsError(errno.EPERM)
        if not name.startswith((b"user.", b"trusted.", b"security.")):
            raise FsError(errno.EOPNOTSUPP)
        if len(name) > XATTR_NAME_MAX:
            raise FsError(errno.ERANGE)
        if len(value) > XATTR_SIZE_MAX:
            raise FsError(errno.E2BIG)
        if name == b"security.capability":
            self.has_caps = True
        self.ns.set_xattr(node, name, value)

    def listxattr(self, node: Inode) -> list[bytes]:
        # user.mtcfs.* are virtual and not listed, so `cp -a` and rsync -X
        # do not try to copy them.
        return list(node.xattrs)

    def removexattr(self, node: Inode, name: bytes) -> None:
        if name.startswith(RESERVED_XATTR_PREFIX):
            raise FsError(errno.EPERM)
        if name not in node.xattrs:
            raise FsError(errno.ENODATA)
        self.ns.remove_xattr(node, name)
