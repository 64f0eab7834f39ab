"""How a dropped copy travels: real indexes (each with its SQLite store, its Copies
and its outbox) and the real RemoteChanges that answers a host told it holds what
it does not; batches are handed from outbox to outbox, no network.

A chaos smoke's hosts evicted a commit marker by retention within 30 ms of each
other and never became quiet again: each told the others it had dropped the file
along with its own list of holders, older than theirs; told it held the file, each
answered with its list, which named another host that had dropped it; and so on,
an announcement a second for ever."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from mtcfs.core.copies import Copies
from mtcfs.core.events import Listener
from mtcfs.core.namespace import Inode
from mtcfs.peer.index import ReplicatedIndex, first_hand
from mtcfs.peer.outbox import Outbox
from mtcfs.peer.remote import RemoteChanges
from mtcfs.peer.v1 import peer_pb2 as pb

from support import simnet

pytestmark = pytest.mark.nofuse


class CopiesToIndex(Listener):
    """Where a copy's coming or going goes, as PeerTier.copies_changed routes it."""

    def __init__(self, index: ReplicatedIndex) -> None:
        self.index = index

    def copies_changed(self, node: Inode, dropped: str = "") -> None:
        if node.generation:
            self.index.sources_changed(node, dropped=dropped)
        else:
            self.index.holders_changed(node, dropped=dropped)


class Host:
    def __init__(self, node_id: str, root: Path) -> None:
        self.node_id = node_id
        self.store = simnet.IndexStore(node_id, str(root / node_id))
        self.outbox = Outbox()
        index = self.store.index
        index.outbox = self.outbox
        index.copies = Copies(node_id, ns=index.ns, is_live=lambda h: True,
                              events=CopiesToIndex(index))
        self.remote = RemoteChanges(index, Listener(), node_id)
        self.sent = 0

    def file(self, guid: str) -> Inode:
        ino = self.store.index.ns.by_guid[guid]
        return self.store.index.ns.inodes[ino]

    def close(self) -> None:
        self.store.close()


def cluster(tmp_path: Path, n: int, persisted: bool) -> list[Host]:
    """`n` hosts, each holding a copy of one sealed file (a step's marker)."""
    hosts = [Host(f"h{k}", tmp_path) for k in range(n)]
    d = simnet.entry("d1", "root", "step_1", 1, "h0", is_dir=True)
    f = simnet.entry("f1", "d1", ".metadata", 2, "h0", size=10)
    f.holders[:] = [h.node_id for h in hosts]
    if persisted:
        f.persisted_version, f.generation = 1, 17
    for h in hosts:
        h.store.index.apply([d, f])
        node = h.file("f1")
        node.has_data = True
        node.holders = [x.node_id for x in hosts]
        h.outbox.take(1 << 20)
    return hosts


def rounds(hosts: list[Host], rng: random.Random | None, most: int) -> int:
    """Hand every host's waiting entries to the others, a round at a time (in a shuffled
    order and split into single entries when `rng` is given), until no host has any;
    returns the rounds it took (`most` + 1: never quiet)."""
    for k in range(most):
        out: list[tuple[Host, list[pb.Entry]]] = []
        for h in hosts:
            batch = h.outbox.take(1 << 20)
            h.sent += len(batch)
            for other in hosts:
                if other is not h and batch:
                    if rng is not None and rng.random() < 0.5:
                        out += [(other, [e]) for e in batch]
                    else:
                        out.append((other, batch))
        if not out:
            return k
        if rng is not None:
            rng.shuffle(out)
        for dst, batch in out:
            dst.remote.apply(list(batch))
    return most + 1


@pytest.mark.parametrize("persisted", [False, True], ids=["in-ram", "persisted"])
def test_hosts_that_all_drop_a_file_at_once_fall_quiet(tmp_path: Path, persisted: bool) -> None:
    hosts = cluster(tmp_path, 3, persisted)
    for h in hosts:
        h.store.index.copies.evicted(h.file("f1"))
    # (Before: the three kept answering each other for the whole 50 rounds.)
    assert rounds(hosts, None, 50) == 1
    for h in hosts:
        node = h.file("f1")
        assert node.holders == [] and node.sources == [] and not node.has_data
        # One announcement each: its own drop (behind the step directory, persisted).
        assert h.sent == (2 if persisted else 1)
    for h in hosts:
        h.close()


def test_drops_heard_in_any_order_leave_no_host_named_a_holder(tmp_path: Path) -> None:
    """Five hosts evict one after another, each before it heard of the others' drops;
    the batches arrive shuffled, some entry by entry. Nothing waits afterwards, and no
    host still names a holder (a reader would ask it, to be refused)."""
    for seed in range(20):
        hosts = cluster(tmp_path / str(seed), 5, persisted=False)
        rng = random.Random(seed)
        for h in rng.sample(hosts, len(hosts)):
            h.store.index.copies.evicted(h.file("f1"))
            if rng.random() < 0.5:
                rounds(hosts, rng, 1)  # some hear of it before the next evicts
        assert rounds(hosts, rng, 50) <= 2, seed
        assert [h.file("f1").holders for h in hosts] == [[]] * 5, seed
        for h in hosts:
            h.close()


def test_a_host_named_a_holder_of_what_it_lacks_says_only_that(tmp_path: Path) -> None:
    """A replacement host (the node id of one that held the file) hears it holds a
    copy: it answers that it has none, naming no one else, and the others stop
    listing it."""
    hosts = cluster(tmp_path, 3, persisted=False)
    new = Host("h2", tmp_path / "replacement")
    new.remote.apply(hosts[0].store.snapshot())  # lists h2 as a holder
    assert "h2" not in new.file("f1").holders and not new.file("f1").has_data
    answer = new.outbox.take(1 << 20)
    assert [(e.id, list(e.holders), list(e.sources), list(e.dropped)) for e in answer] == [
        ("f1", [], [], ["h2"])]
    for h in hosts[:2]:
        h.remote.apply(answer)
        assert h.file("f1").holders == ["h0", "h1"]
        assert h.outbox.count() == 0  # nothing to answer in turn
    for h in (*hosts, new):
        h.close()


@pytest.mark.parametrize("persisted", [False, True], ids=["in-ram", "persisted"])
def test_an_announcement_waiting_when_its_host_drops_the_copy_does_not_name_it(
        tmp_path: Path, persisted: bool) -> None:
    """An upload lands (announced: it waits up to 1 s), then retention evicts the file
    within 0.1 s. The drop of a file in the bucket is a change, and changes leave
    before announcements: the announcement, still naming its host a holder, would
    undo the drop everywhere and for good (a chaos run's replacement host asked h1
    for a marker h1 had evicted 17 s before)."""
    hosts = cluster(tmp_path, 3, persisted)
    h0 = hosts[0]
    node = h0.file("f1")
    h0.store.index.holders_changed(node)  # (the upload's, or a replica's, announcement)
    h0.store.index.copies.evicted(node)
    rounds(hosts, None, 5)
    assert [h.file("f1").holders for h in hosts] == [["h1", "h2"]] * 3
    for h in hosts:
        h.close()


def test_an_announcement_waiting_when_another_host_drops_does_not_name_it(
        tmp_path: Path) -> None:
    """h1's announcement (a replica it pushed landed) waits; h2's drop reaches h1 and
    h0 first. When h1's announcement leaves, it must not give h2 back to h0."""
    hosts = cluster(tmp_path, 3, persisted=False)
    h0, h1, h2 = hosts
    h1.store.index.holders_changed(h1.file("f1"))  # waits (ANNOUNCE)
    h2.store.index.copies.evicted(h2.file("f1"))
    drop = h2.outbox.take(1 << 20)
    for h in (h0, h1):
        h.remote.apply(list(drop))
    assert h0.file("f1").holders == ["h0", "h1"]
    h0.remote.apply(h1.outbox.take(1 << 20))
    assert h0.file("f1").holders == ["h0", "h1"]
    for h in hosts:
        h.close()


@pytest.mark.parametrize("persisted", [False, True], ids=["in-ram", "persisted"])
def test_a_snapshot_says_whether_its_source_holds_a_copy(tmp_path: Path,
                                                         persisted: bool) -> None:
    """h1 missed h2's drop (it was starting); it then pulls h2's snapshot, whose entry
    does not name h2 (mtcfs.peer.join applies each entry as first_hand). For a
    persisted file h1 stops naming h2; an unpersisted one keeps the name until h2's
    word comes (else a copy h2 got after its snapshot was made could look lost)."""
    hosts = cluster(tmp_path, 3, persisted)
    h0, h1, h2 = hosts
    h2.store.index.copies.evicted(h2.file("f1"))
    h2.outbox.take(1 << 20)  # (lost on its way to h1)
    h1.remote.apply([first_hand(e, "h2") for e in h2.store.snapshot()])
    assert h1.file("f1").holders == (["h0", "h1"] if persisted else ["h0", "h1", "h2"])
    assert h1.outbox.count() == 0  # nothing to answer
    # A snapshot of a source that holds the file changes nothing.
    h1.remote.apply([first_hand(e, "h0") for e in h0.store.snapshot()])
    assert "h0" in h1.file("f1").holders
    for h in hosts:
        h.close()
