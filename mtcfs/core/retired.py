"""Steps retention no longer keeps in RAM (--keep-steps): retention is their one
owner; the peer tier asks, so as not to push replicas of files every host drops."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mtcfs.core.namespace import ROOT

if TYPE_CHECKING:
    from mtcfs.core.namespace import Inode, Namespace


class RetiredSteps:
    def __init__(self, ns: Namespace) -> None:
        self.ns = ns
        self.dirs: set[int] = set()  # inos of the step directories retired

    def replace(self, dirs: set[int]) -> None:
        """Retention's latest answer: these step directories are retired now."""
        self.dirs = dirs

    def contains(self, node: Inode) -> bool:
        """`node` lies in a retired step."""
        if not self.dirs or not node.linked:
            return False
        while node.ino != ROOT:
            if node.parent in self.dirs:
                return True
            node = self.ns.inodes[node.parent]
        return False
