"""Which opens bypass the daemon (FUSE passthrough), and their backing files.

An open answered with a backing file id makes the kernel send that open file's
reads, writes and mmaps straight to the backing file: here the file's data in
the RAM tier. The kernel's rules (fs/fuse/iomode.c) decide the bookkeeping:

- all concurrent opens of an inode are of one kind: while it is open with
  passthrough every further open must be too, with the same backing file, and
  while it is open through the daemon (the page cache) no open may be
  passthrough; a mix fails the open with EIO. So the first open of an inode
  decides, and the kind sticks until its last handle is released;
- one backing id per inode, shared by its handles, released at the last one.

Whether a first open may pass through is the filesystem's call (the data must
be wholly in the local RAM tier, a writer needs room, ...): see
Filesystem._passthrough_allowed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class Stats:
    opens: int = 0  # handles opened with passthrough
    daemon_opens: int = 0  # handles served by the daemon while passthrough is on
    registered: int = 0  # backing files registered
    failures: int = 0  # registrations the kernel refused (served by the daemon instead)


class Passthrough:
    def __init__(self, register: Callable[[int], int],
                 unregister: Callable[[int], None]) -> None:
        self._register = register  # fd -> backing id (pyfuse3.backing_open)
        self._unregister = unregister  # backing id -> None (pyfuse3.backing_close)
        self.enabled = False  # the kernel agreed at INIT: enable()
        self._backing: dict[int, list[int]] = {}  # ino -> [backing id, handles]
        self._daemon: dict[int, int] = {}  # ino -> handles served by the daemon
        self.stats = Stats()

    @classmethod
    def unused(cls) -> Passthrough:
        """For a mount that never asks the kernel for passthrough: every handle is
        served by the daemon."""
        return cls(lambda fd: 0, lambda backing: None)

    def enable(self) -> None:
        """The kernel agreed to passthrough at INIT and a backing file registered: new
        handles may bypass the daemon from now on."""
        self.enabled = True

    def open(self, ino: int, fd: int, allowed: bool) -> int:
        """A new handle of `ino` (its data file open as `fd`): its backing id, or 0
        when the daemon serves it."""
        if not self.enabled:
            return 0
        entry = self._backing.get(ino)
        if entry is not None:  # the kernel requires the same kind, the same file
            entry[1] += 1
            self.stats.opens += 1
            return entry[0]
        if allowed and not self._daemon.get(ino):
            try:
                backing = self._register(fd)
            except OSError as e:
                self.stats.failures += 1
                log.warning("passthrough refused for inode %d (%s): served by the daemon",
                            ino, e.strerror or e)
            else:
                self._backing[ino] = [backing, 1]
                self.stats.registered += 1
                self.stats.opens += 1
                return backing
        self._daemon[ino] = self._daemon.get(ino, 0) + 1
        self.stats.daemon_opens += 1
        return 0

    def release(self, ino: int, backing: int) -> None:
        """A handle of `ino` opened with `backing` (0: by the daemon) was released."""
        if not self.enabled:
            return
        if backing:
            entry = self._backing.get(ino)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] <= 0:
                del self._backing[ino]
                try:
                    self._unregister(entry[0])
                except OSError as e:
                    log.warning("releasing backing file %d: %s", entry[0], e.strerror or e)
            return
        n = self._daemon.get(ino, 0) - 1
        if n > 0:
            self._daemon[ino] = n
        else:
            self._daemon.pop(ino, None)

    def is_open(self, ino: int) -> bool:
        """`ino` has handles open with passthrough."""
        return ino in self._backing

    def status(self) -> dict[str, object]:
        return {
            "enabled": self.enabled,
            "backing_files": len(self._backing),
            "passthrough_opens": self.stats.opens,
            "daemon_opens": self.stats.daemon_opens,
            "refused": self.stats.failures,
        }


CAP_SYS_ADMIN = 21


def unavailable() -> str | None:
    """Why FUSE passthrough cannot work for this daemon here (None: it can, as far
    as can be told before mounting; the kernel has the last word at INIT)."""
    try:
        import pyfuse3
    except ImportError:
        return "pyfuse3 is not installed"
    if not hasattr(pyfuse3, "backing_open"):
        return ("pyfuse3 lacks the passthrough patch (make bootstrap builds it; see "
                "scripts/build_pyfuse3.sh)")
    release = os.uname().release
    try:
        major, minor = (int(x) for x in release.split(".")[:2])
    except ValueError:
        major = minor = 0
    if (major, minor) < (6, 9):
        return f"Linux {release} has no FUSE passthrough (needs 6.9 or newer)"
    if not _has_cap(CAP_SYS_ADMIN):
        return "FUSE passthrough needs CAP_SYS_ADMIN (run the daemon privileged)"
    if not _initial_user_namespace():
        # The kernel checks CAP_SYS_ADMIN in the initial user namespace.
        return ("FUSE passthrough needs CAP_SYS_ADMIN in the initial user namespace (this "
                "daemon runs in a user namespace of its own)")
    return None


def _initial_user_namespace() -> bool:
    """The initial user namespace maps every uid onto itself."""
    try:
        with open("/proc/self/uid_map") as f:
            return f.read().split() == ["0", "0", "4294967295"]
    except OSError:
        return True


def _has_cap(bit: int) -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> bit & 1)
    except OSError:
        pass
    return os.geteuid() == 0
