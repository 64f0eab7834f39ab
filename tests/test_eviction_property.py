"""Property: eviction never drops the only copy of anything.

A cluster of hosts is simulated around the real eviction rules
(`mtcfs.core.copies.Copies`, the rules `SpaceManager` applies to every
victim) and real `Inode` records: each host has its own, possibly stale, view
of each file (holders, persisted, writer), updated only by messages that
arrive late and in any order between hosts, as the replicated index's
broadcasts do. Hypothesis runs random sequences of writes, replications,
read-throughs (cache copies), uploads, evictions, message deliveries and host
deaths. After every step except a death, no file that had a copy (on a live
host or in the bucket) may have lost its last one; after a writer evicts its
own copy of a file not yet persisted, K live hosts still hold it. A
`pressure_everywhere` step makes every host evict at once on stale views
(the race that would lose a file if replica holders trusted each other:
allowing that makes this test fail within a few hundred examples).

The daemons' end-to-end behaviour is covered by test_lifecycle.py; this test
searches the interleavings a handful of real daemons would rarely hit.
"""

from __future__ import annotations

import copy
import stat
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mtcfs.core.copies import OWN, Copies
from mtcfs.core.namespace import CLOSED, Inode

HOSTS = ("h0", "h1", "h2")
FILES = ("f0", "f1")


@dataclass
class Msg:
    """One broadcast entry: the sender's view of the file, plus who dropped a copy."""

    file: str
    version: int
    author: str
    holders: list[str]
    persisted_version: int
    dropped: list[str] = field(default_factory=list)


def new_view(name: str) -> Inode:
    return Inode(ino=1 + FILES.index(name), mode=stat.S_IFREG | 0o644, uid=0, gid=0, parent=1,
                 name=name.encode(), state=CLOSED, version=0, has_data=False, size=1)


class Cluster(RuleBasedStateMachine):
    K = 1
    DURABLE = False  # a bucket is configured (own data then waits for its upload)

    def __init__(self) -> None:
        super().__init__()
        self.live = set(HOSTS)
        # The truth: which version of each file each host holds, and the bucket's.
        self.data: dict[str, dict[str, int]] = {h: {} for h in HOSTS}
        self.version = dict.fromkeys(FILES, 0)
        self.bucket = dict.fromkeys(FILES, 0)
        # Each host's view (its replicated index entry for each file).
        self.views = {h: {f: new_view(f) for f in FILES} for h in HOSTS}
        self.inbox: dict[str, list[Msg]] = {h: [] for h in HOSTS}
        self.available = set()

    # -- helpers -------------------------------------------------------------------------

    def copies(self, host: str) -> Copies:
        return Copies(host, self.K, lambda n: n in self.live, durable=self.DURABLE)

    def current_holders(self, f: str) -> set[str]:
        return {h for h in self.live if self.data[h].get(f) == self.version[f]}

    def is_available(self, f: str) -> bool:
        return self.version[f] > 0 and (bool(self.current_holders(f))
                                        or self.bucket[f] == self.version[f])

    def broadcast(self, src: str, f: str, dropped: tuple[str, ...] = ()) -> None:
        v = self.views[src][f]
        msg = Msg(f, v.version, v.author, list(v.holders), v.persisted_version, list(dropped))
        for h in HOSTS:
            if h != src and h in self.live:
                self.inbox[h].append(copy.deepcopy(msg))

    def apply(self, host: str, m: Msg) -> None:
        """The index's merge (Copies.take_version / Copies.merge, as
        mtcfs.peer.index calls them): a newer version replaces; the same version
        merges holders as a set (minus dropped ones) and takes the persisted state."""
        v = self.views[host][m.file]
        if m.version > v.version:
            assert self.data[host].get(m.file) != m.version  # a replica brings its entry
            v.version, v.author = m.version, m.author
            self.copies(host).take_version(v, m.holders, m.persisted_version, 0, fresh=True)
        elif m.version == v.version:
            self.copies(host).merge(v, m.holders, m.dropped, m.persisted_version, 0)

    # -- operations ----------------------------------------------------------------------

    @rule(host=st.sampled_from(HOSTS), f=st.sampled_from(FILES))
    def write(self, host: str, f: str) -> None:
        if host not in self.live:
            return
        self.version[f] += 1
        self.data[host][f] = self.version[f]
        v = self.views[host][f]
        v.version = self.version[f]
        self.copies(host).sealed_here(v)
        self.broadcast(host, f)

    @rule(f=st.sampled_from(FILES), to=st.sampled_from(HOSTS))
    def replicate(self, f: str, to: str) -> None:
        target = to
        writers = [h for h in self.live if self.views[h][f].author == h
                   and self.data[h].get(f) == self.version[f]]
        if not writers or target not in self.live or target in writers:
            return
        writer = writers[0]
        if self.data[target].get(f) == self.version[f]:
            return
        self.data[target][f] = self.version[f]
        tv = self.views[target][f]
        wv = self.views[writer][f]
        # The replica carries the writer's entry; the receiver stores and verifies it,
        # the writer counts it.
        tv.version, tv.author = wv.version, writer
        self.copies(target).take_version(tv, wv.holders, wv.persisted_version, 0,
                                         fresh=True)
        self.copies(target).received(tv)
        self.copies(writer).replica_made(wv, target)
        self.broadcast(writer, f)

    @rule(host=st.sampled_from(HOSTS), f=st.sampled_from(FILES))
    def read_through(self, host: str, f: str) -> None:
        """A reader fetches a copy from a holder its view names (mtcfs.peer.reader asks
        no one else) that has it, or from the bucket; the copy is cached, not
        announced. (Before: from any copy anywhere, which a reader whose view named
        only a host that had dropped it could not do; Hypothesis found a loss that
        rested on that.)"""
        v = self.views[host][f]
        if host not in self.live or v.version != self.version[f] or v.has_data:
            return
        if not (self.bucket[f] == v.version
                or any(h in self.live and self.data[h].get(f) == v.version
                       for h in v.holders if h != host)):
            return
        self.data[host][f] = v.version
        self.copies(host).fetched(v)

    @rule(f=st.sampled_from(FILES))
    def upload(self, f: str) -> None:
        writers = [h for h in self.live if self.views[h][f].author == h
                   and self.data[h].get(f) == self.version[f]]
        if not writers:
            return
        w = writers[0]
        self.bucket[f] = self.version[f]
        self.copies(w).persisted(self.views[w][f], 1, self.version[f])
        self.broadcast(w, f)

    @rule(host=st.sampled_from(HOSTS), f=st.sampled_from(FILES))
    def evict(self, host: str, f: str) -> None:
        self._evict(host, f)

    def _evict(self, host: str, f: str) -> None:
        v = self.views[host][f]
        if host not in self.live or self.data[host].get(f) != v.version:
            return
        if not self.copies(host).droppable(v):
            return
        had = self.is_available(f)
        kind = self.copies(host).kind(v)
        del self.data[host][f]
        announced = host in v.holders
        self.copies(host).evicted(v)
        if announced:
            self.broadcast(host, f, dropped=(host,))
        assert not had or self.is_available(f), f"evicting {f} on {host} lost its last copy"
        if kind == OWN and v.version == self.version[f] and self.bucket[f] != self.version[f]:
            # The writer lets its copy go only while K peers hold one.
            assert len(self.current_holders(f)) >= self.K, (
                f"{f} left with {len(self.current_holders(f))} live copies < K={self.K}")

    @rule(f=st.sampled_from(FILES), order=st.permutations(HOSTS))
    def pressure_everywhere(self, f: str, order: list[str]) -> None:
        """Every host runs short of RAM at once: each evicts on its own view, before
        any hears of the others' evictions."""
        for host in order:
            self._evict(host, f)

    @rule(host=st.sampled_from(HOSTS), n=st.integers(1, 4))
    def deliver(self, host: str, n: int) -> None:
        for _ in range(min(n, len(self.inbox[host]))):
            self.apply(host, self.inbox[host].pop(0))

    @rule(host=st.sampled_from(HOSTS), i=st.integers(0, 50))
    def deliver_out_of_order(self, host: str, i: int) -> None:
        if self.inbox[host]:
            self.apply(host, self.inbox[host].pop(i % len(self.inbox[host])))

    @precondition(lambda self: len(self.live) > 1)
    @rule(host=st.sampled_from(HOSTS))
    def kill(self, host: str) -> None:
        if host in self.live:
            self.live.discard(host)
            self.data[host].clear()
            self.inbox[host].clear()
            self.available = {f for f in FILES if self.is_available(f)}

    # -- the property ----------------------------------------------------------------------

    @invariant()
    def nothing_lost_but_by_a_death(self) -> None:
        now = {f for f in FILES if self.is_available(f)}
        lost = self.available - now
        assert not lost, f"lost {sorted(lost)} without a host dying"
        self.available = now


class ClusterK2(Cluster):
    K = 2


class ClusterDurable(Cluster):
    DURABLE = True

    @invariant()
    def own_data_kept_until_persisted(self) -> None:
        """With a bucket, the writer's copy stays until the upload (which reads it)."""
        for f in FILES:
            writers = [h for h in HOSTS if self.views[h][f].author == h
                       and self.views[h][f].version == self.version[f]]
            for w in writers:
                if w in self.live and self.bucket[f] != self.version[f]:
                    assert self.data[w].get(f) == self.version[f], f"{w} dropped unpersisted {f}"


_settings = settings(max_examples=300, stateful_step_count=60, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestOnlyCopyNeverEvicted = Cluster.TestCase
TestOnlyCopyNeverEvicted.settings = _settings
TestOnlyCopyNeverEvictedK2 = ClusterK2.TestCase
TestOnlyCopyNeverEvictedK2.settings = _settings
TestOwnDataWaitsForUpload = ClusterDurable.TestCase
TestOwnDataWaitsForUpload.settings = _settings
