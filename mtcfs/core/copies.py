"""Where a file's copies are: the one owner of that knowledge.

Every change to where a file's copies are goes through `Copies`: this host's
data (`has_data`, and whether it is a read-through `cached` copy), the hosts
holding the current version (`holders`), the durable tier's object
(`generation`, `persisted_version`). It records each change (the metadata
store) and announces it (`events.copies_changed`, which the peer tier turns into
an index broadcast). Every count of copies is one of its methods.

The eviction rules (the only copy is never evicted):

- a *cache* copy (read through from a peer or the bucket; never announced as a
  holder, only as a restore *source* of a persisted file, which counts for
  nothing here) may go when the file is persisted or a live peer holds it;
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

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from mtcfs.core.events import Listener
from mtcfs.core.namespace import CLOSED, Inode

if TYPE_CHECKING:
    from mtcfs.core.namespace import Namespace

OWN, REPLICA, CACHE = "own", "replica", "cache"


def _never(node_id: str) -> bool:
    return False


class Copies:
    def __init__(self, node_id: str, replicas: int = 0,
                 is_live: Callable[[str], bool] = _never, durable: bool = False,
                 ns: Namespace | None = None, events: Listener | None = None) -> None:
        self.node_id = node_id
        self.replicas = replicas  # K
        self.is_live = is_live
        self.durable = durable  # a durable tier is configured: own data waits to be persisted
        # Records changes (without a namespace the caller keeps records, as tests do).
        self._record: Callable[[Inode], None] = _recorder(ns)
        self._ns = ns
        self._events = events or Listener()

    # -- counting ----------------------------------------------------------------------------

    def kind(self, node: Inode) -> str:
        if node.cached:
            return CACHE
        if not node.author or node.author == self.node_id:
            return OWN
        return REPLICA

    def elsewhere(self, node: Inode) -> int:
        """Live peers holding a verified copy of this version."""
        return sum(1 for _ in self._live_holders(node))

    def _live_holders(self, node: Inode) -> Iterator[str]:
        return (h for h in node.holders if h != self.node_id and self.is_live(h))

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
                   if h != node.author and (h == self.node_id or self.is_live(h)))

    def replicated(self, node: Inode) -> bool:
        """K verified peer copies of this version exist (--fsync replicas)."""
        return self.replicas >= 1 and self.replicas_of(node) >= self.replicas

    def lost(self, node: Inode) -> bool:
        """A sealed version with no copy left anywhere this host can reach."""
        if node.state != CLOSED or node.persisted or not node.version:
            return False
        if node.has_data and not node.dirty:
            return False
        return next(self._live_holders(node), None) is None  # (stops at the first)

    def seen_holders(self, node: Inode) -> list[str]:
        """The holders as `user.mtcfs.state` shows them: with this host if it has a copy."""
        holders = list(node.holders)
        if node.has_data and self.node_id not in holders:
            holders.append(self.node_id)  # a cached copy, not announced
        return holders

    # -- this host's copy ----------------------------------------------------------------------

    def sealed_here(self, node: Inode) -> None:
        """A new version was written and sealed here: its one copy is this host's."""
        node.holders = [self.node_id]
        node.author = self.node_id
        node.cached = False
        node.has_data = True

    def received(self, node: Inode) -> None:
        """A replica from a peer is in this RAM tier, verified."""
        node.has_data = True
        node.cached = False  # a replica now: announced by its sender
        self._hold(node)
        self._record(node)

    def fetched(self, node: Inode) -> None:
        """A copy read through (from a peer or the bucket) is in this RAM tier, verified."""
        node.has_data = True
        node.cached = True  # evictable while another copy exists
        self._hold(node)
        self._record(node)
        self._events.fetched(node)

    def restored(self, node: Inode) -> None:
        """A replacement host's background restore brought back a copy the job listed
        this host as holding (its own data, or a replica it held): a held copy again,
        not a cache copy, and announced, so the job counts it as before the loss (and
        a later replacement under this node id restores it again)."""
        node.has_data = True
        node.cached = False
        self._hold(node)
        self._record(node)
        self._events.copies_changed(node)

    def restoring(self, node: Inode) -> None:
        """This host reads the persisted version through and serves its verified chunks
        to peers meanwhile (and the whole copy after): announced as a source."""
        if self.node_id not in node.sources:
            node.sources.append(self.node_id)
        self._events.copies_changed(node)

    def not_restoring(self, node: Inode) -> None:
        """The read-through failed (or its data went): no longer a source."""
        if self.node_id in node.sources:
            node.sources.remove(self.node_id)
            self._events.copies_changed(node, self.node_id)

    def emptied(self, node: Inode) -> None:
        """A fresh RAM file for data about to be written (truncated to 0)."""
        node.has_data = True

    def evicted(self, node: Inode) -> None:
        """This host's copy was dropped (evicted, or lost): other hosts hear of it."""
        announced = self.node_id in node.holders or self.node_id in node.sources
        node.has_data = False
        node.cached = False
        if self.node_id in node.holders:
            node.holders.remove(self.node_id)
        if self.node_id in node.sources:
            node.sources.remove(self.node_id)
        self._record(node)
        if announced:
            self._events.copies_changed(node, self.node_id)

    def lost_at_start(self, node: Inode) -> None:
        """At start-up the data of a sealed file is gone from the RAM dir."""
        if self.node_id in node.holders:
            node.holders.remove(self.node_id)
        node.has_data = False

    def elsewhere_only(self, node: Inode) -> None:
        """A version whose data is not here (another host's, or the bucket's)."""
        node.has_data = False
        node.cached = False

    def replicas_from(self, writer: str) -> list[Inode]:
        """The verified replicas of `writer`'s files held here (a scan: for its death)."""
        nodes = self._ns.inodes.values() if self._ns is not None else ()
        return [n for n in nodes if n.author == writer and self.node_id in n.holders
                and self.resident(n) and self.kind(n) == REPLICA]

    # -- peers' copies ----------------------------------------------------------------------

    def replica_made(self, node: Inode, holder: str) -> None:
        """A peer verified and stored a replica of this host's file."""
        if holder not in node.holders:
            node.holders.append(holder)
        self._record(node)
        self._events.copies_changed(node)

    def merge(self, node: Inode, holders: Sequence[str], dropped: Sequence[str],
              persisted_version: int, generation: int,
              sources: Sequence[str] = ()) -> tuple[bool, bool]:
        """Another host's view of the same version: holders and sources merge as sets
        (those it says dropped their copy leave), and its persisted state is taken if
        newer. Only this host knows whether it holds a copy. Returns (changed,
        disowned): disowned when the view lists this host as a holder without a copy
        here."""
        new = [h for h in holders if h not in node.holders and h != self.node_id]
        gone = [h for h in dropped if h in node.holders and h not in holders
                and h != self.node_id]
        disowned = (self.node_id in holders and not node.has_data
                    and self.node_id not in dropped)
        persisted = node.persisted_version < persisted_version == node.version
        # Sources are soft state (not recorded): a stale one costs a refused request.
        node.sources.extend(s for s in sources if s not in node.sources and s != self.node_id)
        node.sources[:] = [s for s in node.sources if s not in dropped or s in sources
                           or s == self.node_id]
        if not new and not persisted and not gone:
            return False, disowned
        node.holders.extend(new)
        node.holders[:] = [h for h in node.holders if h not in gone]
        if persisted:
            node.persisted_version, node.generation = persisted_version, generation
        self._record(node)
        return True, disowned

    def lacks(self, node: Inode, holder: str, version: int) -> None:
        """`holder` answered that it has no complete copy of `version`: a persisted
        file's view here stops naming it (its drop never reached this host, or came
        back in a stale list). Recorded, not announced: its own word is what others
        take. An unpersisted file keeps the name: the answer may be of a moment (a
        replica still arriving), and a view short of a copy could make it look lost."""
        if node.version == version and node.persisted and holder in node.holders:
            node.holders.remove(holder)
            self._record(node)

    def take_version(self, node: Inode, holders: Sequence[str], persisted_version: int,
                     generation: int, fresh: bool, sources: Sequence[str] = ()) -> bool:
        """Another host's version (fresh: new content; its data is not here). Returns
        whether the view lists this host as a holder of data it does not have."""
        node.persisted_version, node.generation = persisted_version, generation
        if fresh:
            me = self.node_id
            node.holders = list(holders)
            disowned = me in node.holders
            if disowned:
                node.holders = [h for h in node.holders if h != me]
            node.sources = [s for s in sources if s != me] if sources else []
            node.has_data = False
            return disowned
        node.sources.extend(s for s in sources if s not in node.sources and s != self.node_id)
        node.holders.extend(h for h in holders if h not in node.holders and h != self.node_id)
        return False

    # -- the durable tier ----------------------------------------------------------------------

    def persisted(self, node: Inode, generation: int, version: int) -> None:
        """The durable tier holds `version` under the file's name as `generation` (an
        upload or a server-side copy landed): recorded, then announced (the peer tier
        tells the others, the lifecycle counts it)."""
        node.generation = generation
        if node.version == version:
            node.persisted_version = version
        self._record(node)
        self._events.persisted(node)

    def object_adopted(self, node: Inode, generation: int) -> None:
        """A hard-linked file lost its own name: the object of the further name it is
        now known by holds its version. Recorded only: the name change itself is what
        other hosts hear of."""
        node.generation = generation
        node.persisted_version = node.version
        self._record(node)

    def unpersisted(self, node: Inode) -> None:
        """Its object no longer holds the file under its name (renamed, or gone)."""
        node.generation = 0
        node.persisted_version = 0
        self._record(node)

    def name_gone(self, node: Inode) -> None:
        """The file's last name was removed: its object goes (nothing is recorded:
        the inode goes too)."""
        node.generation = 0

    def in_bucket(self, node: Inode, generation: int) -> None:
        """The bucket's object is this file's current version (a file made from the
        listing: nothing waited for it)."""
        node.generation = generation
        node.persisted_version = node.version

    def found_in_bucket(self, node: Inode, generation: int) -> None:
        """A listing found this sealed file's bytes under its name: another host's
        upload whose word has not come yet, or ours that landed just before a crash.
        Announced like an upload: what waits for the file to be persisted (a step to
        reinstate, a writer waiting for room, an fsync with --fsync gcs) must hear of
        it, since the uploader's word, coming later, then changes nothing here."""
        self.in_bucket(node, generation)
        self._record(node)
        self._events.persisted(node)

    # -- helpers -------------------------------------------------------------------------------

    def _hold(self, node: Inode) -> None:
        if self.node_id not in node.holders:
            node.holders.append(self.node_id)


def _recorder(ns: Namespace | None) -> Callable[[Inode], None]:
    """How Copies records a change: written through to the metadata store, or not at
    all (no namespace)."""
    if ns is None:
        return lambda node: None

    def record(node: Inode) -> None:
        with ns.store.transaction():
            ns.persist(node)

    return record
