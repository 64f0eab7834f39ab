"""Where a file's copies are, and whether this host's copy may be dropped.

The rules (DESIGN.md, "File lifecycle": the only copy is never evicted):

- a *cache* copy (read through from a peer or the bucket, never announced)
  may go when the file is persisted or a live peer holds it;
- this host's *own* data (it wrote this version) may go when the file is
  persisted; without a durable tier, when K live peers hold verified
  replicas. With one, the upload still needs it (each host uploads what it
  wrote, from its RAM): the writer waits for the upload instead;
- a *replica* (received for another host) may go only once the file is
  persisted. Replica holders never count on each other: two hosts evicting
  at once, each trusting the other's copy, could otherwise drop the last two.

Only copies on live peers count: a dead holder's copy may never come back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mtcfs.fs.namespace import CLOSED, Inode

OWN, REPLICA, CACHE = "own", "replica", "cache"


@dataclass
class Copies:
    """This host's view of the cluster, as far as eviction needs it."""

    node_id: str
    replicas: int = 0  # K
    is_live: Callable[[str], bool] = lambda node_id: False
    durable: bool = False  # a durable tier is configured: own data waits to be persisted

    def kind(self, node: Inode) -> str:
        if node.cached:
            return CACHE
        if not node.writer or node.writer == self.node_id:
            return OWN
        return REPLICA

    def elsewhere(self, node: Inode) -> int:
        """Live peers holding a verified copy of this version."""
        return sum(1 for h in node.holders if h != self.node_id and self.is_live(h))

    def resident(self, node: Inode) -> bool:
        """A complete, sealed copy of the file is in this host's RAM tier."""
        return (node.is_file and node.has_data and node.state == CLOSED and not node.dirty
                and node.size > 0)

    def droppable(self, node: Inode) -> bool:
        """This host's copy may be dropped without losing the file (see above)."""
        if not self.resident(node) or node.opens:
            return False
        if node.persisted:
            return True
        kind = self.kind(node)
        if kind == CACHE:
            return self.elsewhere(node) >= 1
        if kind == OWN:
            return (not self.durable and self.replicas >= 1
                    and self.elsewhere(node) >= self.replicas)
        return False

    def replicas_of(self, node: Inode) -> int:
        """Verified copies of this version other than its writer's, on live hosts
        (this one included)."""
        return sum(1 for h in node.holders
                   if h != node.writer and (h == self.node_id or self.is_live(h)))

    def replicated(self, node: Inode) -> bool:
        """K verified peer copies of this version exist (--fsync replicas)."""
        return self.replicas >= 1 and self.replicas_of(node) >= self.replicas
