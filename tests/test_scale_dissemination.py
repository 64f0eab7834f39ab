"""Index dissemination by trees (mtcfs.peer.fanout) on many hosts in virtual
time over the in-process network of support.simnet: a batch is complete only
once every live host applied it, a child that dies mid-way has its subtree
re-sent, every host converges to the same index under loss and reordering,
and a host away for long catches up with one snapshot, nothing queued for it."""

from __future__ import annotations

import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtcfs.peer import fanout, grouped
from mtcfs.peer.v1 import peer_pb2 as pb

from support import simnet


def batch(writer: str, *entries: pb.Entry) -> pb.ChangeBatch:
    return pb.ChangeBatch(from_node=writer, entries=entries)


def test_ranges_cover_the_ring_once() -> None:
    ids = [f"n{i}" for i in range(10)]
    assert [x for x in ids if fanout.in_range(x, "n3", "n3")] == [x for x in ids if x != "n3"]
    assert [x for x in ids if fanout.in_range(x, "n7", "n2")] == ["n0", "n1", "n8", "n9"]


def test_a_batch_is_complete_once_every_live_host_has_it(tmp_path) -> None:
    net = simnet.cluster(200, seed=2, real_index=["h0000", "h0100"], root=str(tmp_path))
    net.loop.run_until(1.0)
    w = net.hosts["h0042"]
    b = batch("h0042", simnet.entry("d1", "root", "step_1", 5, "h0042", is_dir=True))
    b.waited = True  # a commit's: its group leader lingers URGENT_LINGER only
    seq = w.publish(b)
    t = net.loop.run_until_true(lambda: w.tree.complete(seq), 5.0, 0.001)
    assert t is not None and t - 1.0 < 0.1
    assert all(("h0042", seq) in h.batches for h in net.hosts.values())
    # The writer sent at most FANOUT copies; the tree is log_8(200) deep, not 200 wide.
    assert w.tree.tree.counters.forwards_sent <= fanout.FANOUT
    assert max(h.tree.tree.counters.forwards_sent for h in net.hosts.values()) <= fanout.FANOUT
    assert all(h.store.digest() == net.hosts["h0001"].store.digest()
               for h in net.hosts.values())


def test_a_child_dead_mid_way_has_its_subtree_resent() -> None:
    net = simnet.cluster(100, seed=4)
    net.loop.run_until(1.0)
    w = net.hosts["h0000"]
    # Kill the writer's first child before it can forward: its range is re-split once
    # membership declares it dead, and the batch still reaches everyone else.
    child = sorted(w.swim.live())[0]
    net.kill(child)
    seq = w.publish(batch("h0000", simnet.entry("x", "root", "x", 1, "h0000")))
    t = net.loop.run_until_true(lambda: w.tree.complete(seq), 15.0)
    assert t is not None
    assert w.tree.tree.counters.regrafts == 1
    assert all(("h0000", seq) in h.batches for h in net.hosts.values() if h.up)


writes = st.lists(
    st.tuples(st.integers(0, 11), st.integers(0, 7), st.floats(0.0, 3.0)),
    min_size=1, max_size=40)


@settings(max_examples=25, deadline=None)
@given(writes=writes, loss=st.sampled_from([0.0, 0.05, 0.2]),
       latency=st.sampled_from([(0.0002, 0.002), (0.001, 0.3)]), seed=st.integers(0, 99))
def test_every_host_converges_to_the_same_index(writes, loss, latency, seed) -> None:
    """Concurrent writes of the same few entries from many hosts, at random times,
    over a network that drops and reorders (latency up to 300 ms against a 0.25 s
    retry): every host ends with the same stamps, the newest of each entry; the
    real index on one host agrees with the compact ones."""
    with tempfile.TemporaryDirectory(prefix="mtcfs-sim-") as root:
        _converge(simnet.cluster(12, seed=seed, loss=loss, real_index=["h0003"], root=root),
                  writes, latency)


def _converge(net: simnet.Net, writes: list[tuple[int, int, float]],
              latency: tuple[float, float]) -> None:
    net.latency = latency
    ids = list(net.hosts)
    for i, (host, guid, at) in enumerate(writes):
        e = simnet.entry(f"g{guid}", "root", f"g{guid}", i + 1, ids[host], size=i)
        net.loop.at(at, net.hosts[ids[host]].publish, batch(ids[host], e))
    net.loop.run_until(4.0)
    net.loss = 0.0  # the last retries get through (the loss is a fault, not the network)
    t = net.loop.run_until_true(lambda: all(h.tree.in_flight() == 0
                                            for h in net.hosts.values()), 60.0, 0.1)
    assert t is not None
    newest: dict[str, tuple[int, str]] = {}
    for i, (host, guid, _) in enumerate(writes):
        newest[f"g{guid}"] = max(newest.get(f"g{guid}", (0, "")), (i + 1, ids[host]))
    for h in net.hosts.values():
        assert h.store.digest() == newest, h.node
    real = net.hosts["h0003"].store
    assert isinstance(real, simnet.IndexStore)
    real.close()


def test_a_host_away_for_long_catches_up_with_one_snapshot() -> None:
    net = simnet.cluster(50, seed=6)
    net.loop.run_until(1.0)
    away = "h0020"
    net.partition([away])
    # A long absence: 120 batches from every seventh host while it is cut off.
    for k in range(120):
        for h in list(net.hosts.values())[::7]:
            if h.node != away:
                e = simnet.entry(f"{h.node}-{k}", "root", f"{h.node}-{k}", k + 1, h.node)
                net.loop.at(net.loop.now + 2.0 + k * 0.05, h.publish, batch(h.node, e))
    net.loop.run_until(net.loop.now + 2.0 + 120 * 0.05 + 1.0)
    # Nobody holds anything for it: no queue, no batch in flight.
    assert all(h.tree.in_flight() == 0 for h in net.hosts.values() if h.node != away)
    assert all(len(h.tree.tree._seen) <= fanout.REMEMBER for h in net.hosts.values())
    assert all(net.hosts[h].swim.state_of(away) == 2 for h in net.hosts if h != away)
    # Away longer than the routers' repair window: nothing is resent to it, it
    # reconciles with one host's snapshot.
    net.loop.run_until(net.loop.now + fanout.REPAIR_WINDOW)
    net.heal()
    back = net.hosts[away]
    t = net.loop.run_until_true(
        lambda: back.store.digest() == net.hosts["h0000"].store.digest(), 30.0, 0.1)
    assert t is not None
    assert back.revivals >= 1
    assert back.snapshot_entries <= 2 * len(net.hosts["h0000"].store.digest())
    assert sum(h.tree.tree.counters.repairs for h in net.hosts.values()) == 0


@given(ids=st.sets(st.integers(0, 50), min_size=1, max_size=30), start=st.integers(0, 50),
       end=st.integers(0, 50))
def test_a_range_holds_the_live_hosts_between_its_ends_in_ring_order(ids, start, end) -> None:
    names = sorted(f"n{i:02d}" for i in ids)
    f = fanout.Fanout("me", lambda: names, lambda *a: None)
    s, e = f"n{start:02d}", f"n{end:02d}"
    span = f._others(s, e)
    got = [span[k] for k in range(len(span))]
    want = [x for x in names if fanout.in_range(x, s, e)]
    assert sorted(got) == want
    # In ring order from start: the ones after start first.
    assert got == [x for x in want if x > s] + [x for x in want if x < s]


def test_a_host_left_out_while_thought_dead_gets_the_batch_when_back() -> None:
    """A false death (a flap): the writer routes without the host, then sees it alive
    again and resends it what it routed meanwhile; the host's ack completes nothing."""
    live = {"w": ["a"], "a": ["w", "y"], "y": ["a", "w"]}
    got: dict[str, list[int]] = {n: [] for n in live}
    hosts = {n: fanout.Fanout(n, lambda n=n: live[n], lambda o, s, p, n=n: got[n].append(s))
             for n in live}

    def run(out: list, src: str) -> None:
        todo = [(src, dst, m) for dst, m in out]
        while todo:
            s, d, m = todo.pop(0)
            todo += [(d, d2, m2) for d2, m2 in hosts[d].on_message(s, m, 1.0)]

    w = hosts["w"]
    w.dead("y", 0.5)
    seq, out = w.publish(pb.ChangeBatch(), 10, 1.0)
    run(out, "w")
    assert w.complete(seq) and got["a"] == [1] and got["y"] == []
    live["w"] = ["a", "y"]
    run(w.alive("y", 2.0), "w")
    assert got["y"] == [1] and w.in_flight() == 0 and w.counters.repairs == 1
    assert w.alive("y", 3.0) == []  # once


def test_the_cores_messages_survive_their_protobuf_encoding() -> None:
    from mtcfs.peer import swim, wire

    m = swim.Message(swim.PING_REQ, 7, 3, "h2", (swim.Update("h9", swim.DEAD, 4),))
    raw = wire.gossip_to_pb("h1", m).SerializeToString()
    assert wire.gossip_from_pb(pb.GossipMessage.FromString(raw)) == ("h1", m)
    b = batch("h1", simnet.entry("g", "root", "g", 5, "h1"))
    c = batch("h3", simnet.entry("k", "root", "k", 6, "h3"),
              simnet.entry("l", "root", "l", 7, "h3"))
    for parts in ((grouped.Part("h1", 9, b, b.ByteSize()),),
                  (grouped.Part("h1", 9, b, b.ByteSize()), grouped.Part("h3", 4, c, c.ByteSize()))):
        f = fanout.Forward("h1", 3, "h5", grouped.Bundle(parts), 0)
        raw = wire.tree_to_pb("h2", f).SerializeToString()
        assert wire.tree_size("h2", f) == len(raw)
        src, got = wire.tree_from_pb(pb.TreeMessage.FromString(raw))
        assert src == "h2" and isinstance(got, fanout.Forward)
        assert (got.origin, got.seq, got.end) == ("h1", 3, "h5")
        assert [(p.origin, p.seq, list(p.payload.entries)) for p in got.payload.parts] == [
            (p.origin, p.seq, list(p.payload.entries)) for p in parts]
    for m in (fanout.Ack("h1", 3, "h2", "h5"), grouped.Carried((4, 5), held=True),
              grouped.Carry(grouped.Part("h1", 9, b, b.ByteSize()))):
        raw = wire.tree_to_pb("h2", m).SerializeToString()
        assert wire.tree_size("h2", m) == len(raw)
        assert wire.tree_from_pb(pb.TreeMessage.FromString(raw)) == ("h2", m)


def test_a_coalesced_batch_persists_what_it_applied(tmp_path) -> None:
    """ReplicatedIndex.apply writes each inode and name once per batch, at its end
    (MetaStore.transaction(coalesce=True)): the metadata store reopened holds the
    same tree as the index in memory — creations, renames, replacements and removals
    in one batch, and a snapshot applied to a fresh index in pieces."""
    src = simnet.IndexStore("h0", str(tmp_path / "src"))
    src.index.apply([
        simnet.entry("d1", "root", "step_1.tmp", 1, "h0", is_dir=True),
        *[simnet.entry(f"f{i}", "d1", f"shard-{i}", 2, "h0", size=i) for i in range(50)],
        simnet.entry("d1", "root", "step_1", 3, "h0", is_dir=True),  # the commit rename
        simnet.entry("f3", "d1", "moved", 4, "h1", size=3),  # a rename within
        simnet.entry("g3", "d1", "shard-4", 5, "h1", size=44),  # replaces f4's name
        pb.Entry(id="f7", lamport=6, writer="h1", removed=True),
        simnet.entry("d2", "root", "empty", 7, "h0", is_dir=True),
        pb.Entry(id="d2", lamport=8, writer="h0", removed=True),
    ])
    snap = src.snapshot()
    dst = simnet.IndexStore("h9", str(tmp_path / "dst"))
    for i in range(0, len(snap), 7):
        dst.index.apply(snap[i:i + 7])
    assert dst.digest() == src.digest()

    def tree(store: simnet.IndexStore) -> dict[str, tuple[str, int]]:
        ns = store.index.ns
        return {ns.path_of(n): (n.guid, n.size) for n in ns.inodes.values()
                if n.linked and n.guid != "root"}

    for name, store in (("src", src), ("dst", dst)):
        want = tree(store)
        assert "step_1/moved" in want and "step_1/shard-3" not in want
        assert want["step_1/shard-4"] == ("g3", 44) and "step_1/shard-7" not in want
        assert "empty" not in want and "step_1.tmp" not in want
        store.close()
        again = simnet.IndexStore(name, str(tmp_path / name))
        assert tree(again) == want, name
        again.close()


def test_a_child_that_has_the_batch_is_not_sent_it_again_for_being_slow() -> None:
    """Over a reliable transport a returned call means the child has the batch: it is
    waited for (or found dead), and sent it again only after DELIVERED_RETRY (it may
    have restarted and lost it); a child whose call did not return is retried soon."""
    live = ["b", "c"]
    a = fanout.Fanout("a", lambda: live, lambda *x: None, fanout=2, retry=0.25)
    seq, out = a.publish("batch", 5, 0.0)
    assert sorted(dst for dst, _ in out) == ["b", "c"]
    a.delivered("a", seq, "b")
    resent = [dst for dst, _ in a.tick(1.0)]
    assert resent == ["c"]
    assert [dst for dst, _ in a.tick(fanout.DELIVERED_RETRY - 1)] == ["c"]
    assert "b" in [dst for dst, _ in a.tick(fanout.DELIVERED_RETRY + 0.1)]
    assert not a.complete(seq)


def test_a_child_that_restarted_after_taking_the_batch_gets_it_again_at_once() -> None:
    """A restarted child lost the batches its previous life took (and its subtree's
    acks with them): it gets them again when membership sees the new life, not after
    DELIVERED_RETRY, so a commit waiting for it is not held for 30 s."""
    live = ["b", "c"]
    a = fanout.Fanout("a", lambda: live, lambda *x: None, fanout=2, retry=0.25)
    seq, _ = a.publish("batch", 5, 0.0)
    for child in ("b", "c"):
        a.delivered("a", seq, child)
    out = a.restarted("b", 1.0)
    assert [(dst, msg.seq, msg.payload) for dst, msg in out] == [("b", seq, "batch")]
    assert a.restarted("c", 1.0)  # delivered: resent
    assert a.restarted("b", 1.1) == []  # not delivered since: its resend is pending
    assert a.restarted("x", 1.0) == []  # not a child of any batch
    # The new life applies and acks it: the batch completes.
    for child in ("b", "c"):
        a.on_message(child, fanout.Ack("a", seq, child, "c" if child == "b" else "a"), 1.2)
    assert a.complete(seq)


def test_a_snapshot_made_in_pieces_while_the_index_changes_is_still_whole(tmp_path) -> None:
    """The source makes each piece when the stream takes it; changes between pieces
    (applied here too, as their broadcast reaches the requester) leave the requester
    with the source's index."""
    src = simnet.IndexStore("h0", str(tmp_path / "src"))
    src.index.apply([simnet.entry("d1", "root", "step_1", 1, "h0", is_dir=True),
                     *[simnet.entry(f"f{i}", "d1", f"shard-{i}", 2, "h0", size=i)
                       for i in range(40)]])
    dst = simnet.IndexStore("h9", str(tmp_path / "dst"))
    pieces = src.index.snapshot_pieces(10)
    dst.index.apply(next(pieces))
    # Between pieces: a rename out of what is still to come, a removal, a new directory
    # with a file; each change reaches the requester by broadcast as well.
    changes = [simnet.entry("f30", "root", "moved-up", 3, "h1", size=30),
               pb.Entry(id="f31", lamport=4, writer="h1", removed=True),
               simnet.entry("d2", "root", "step_2", 5, "h2", is_dir=True),
               simnet.entry("g1", "d2", "shard-0", 6, "h2", size=7)]
    src.index.apply(changes)
    dst.index.apply(changes)
    sizes = []
    for piece in pieces:
        sizes.append(len(piece))
        dst.index.apply(piece)
    assert max(sizes) <= 10
    assert dst.digest() == src.digest()
    src.close()
    dst.close()


def test_a_delta_snapshot_holds_what_changed_since_and_nothing_older(
        tmp_path, monkeypatch) -> None:
    from mtcfs.peer import snapshots as snapshots_mod

    clock = [1000.0]
    src = simnet.IndexStore("h0", str(tmp_path / "src"), now=lambda: clock[0])
    src.index.apply([simnet.entry("d1", "root", "step_1", 1, "h0", is_dir=True),
                     *[simnet.entry(f"f{i}", "d1", f"shard-{i}", 2, "h0", size=i)
                       for i in range(20)]])
    clock[0] += 100  # a host goes away, and then:
    src.index.apply([simnet.entry("d2", "root", "step_2", 3, "h1", is_dir=True),
                     simnet.entry("g1", "d2", "shard-0", 4, "h1", size=5),
                     simnet.entry("f3", "d2", "moved", 5, "h1", size=3),  # an old one moved
                     pb.Entry(id="f4", lamport=6, writer="h1", removed=True),
                     simnet.entry("f5", "d1", "shard-5", 2, "h0", size=5)])  # not newer
    clock[0] += 10
    delta = [e for piece in src.index.delta_pieces(30, 2) for e in piece]
    assert [(e.id, e.removed) for e in delta] == [
        ("d2", False), ("g1", False), ("f3", False), ("f4", True)]
    # A host that was away with the old state has the source's index after the delta.
    dst = simnet.IndexStore("h9", str(tmp_path / "dst"))
    dst.index.apply([simnet.entry("d1", "root", "step_1", 1, "h0", is_dir=True),
                     *[simnet.entry(f"f{i}", "d1", f"shard-{i}", 2, "h0", size=i)
                       for i in range(20)]])
    dst.index.apply(delta)
    assert dst.digest() == src.digest()
    # An index that started empty remembers every change it has; one that started
    # from its store (a restarted daemon) cannot tell what changed before it started.
    assert src.index.delta_pieces(10**6, 10) is not None
    src.close()
    src = simnet.IndexStore("h0", str(tmp_path / "src"), now=lambda: clock[0])
    clock[0] += 5
    assert src.index.delta_pieces(6, 10) is None
    assert [e for piece in src.index.delta_pieces(4, 10) for e in piece] == []
    src.index.apply([simnet.entry("g9", "d2", "shard-9", 9, "h1", size=9)])
    assert [e.id for piece in src.index.delta_pieces(4, 10) for e in piece] == ["g9"]
    # Forgetting the oldest moves the floor up.
    monkeypatch.setattr(snapshots_mod, "RECENT_MAX", 1)
    clock[0] += 1
    src.index.apply([simnet.entry("g2", "d2", "shard-1", 7, "h1", size=1)])
    assert list(src.index.recent.times) == ["g2"]  # g9, changed at 1115, forgotten
    assert src.index.delta_pieces(0.5, 10) is not None
    assert src.index.delta_pieces(2, 10) is None
    src.close()
    dst.close()


def test_the_collector_is_paused_while_snapshots_apply_and_back_after_the_last() -> None:
    import gc

    from mtcfs.peer.index import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # a second pull at the same time (a job starting together)
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()  # turned off by someone else: left off
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_step_on_100_hosts_goes_down_one_tree_per_group_and_survives_dead_leaders(
        ) -> None:
    """Every host publishes its step's batch at once: their groups' leaders (groups of
    10) carry them, so a host sends about 2 tree messages per group, not per host.
    Then again with two leaders killed as they gather their groups' batches: their
    members' batches go down trees of their own once the leaders are found dead,
    and every live host still has every live host's batch."""
    net = simnet.cluster(100, seed=5, loss=0.001, group=10)  # (auto: 16, MIN_GROUP)
    net.loop.run_until(2.0)
    hosts = list(net.hosts.values())
    assert {h.tree.status()["group"] for h in hosts} == {10}

    def step(k: int, kill: list[str]) -> dict[str, int]:
        live = [h for h in hosts if h.up]
        sent0 = sum(h.sent.messages for h in live)
        seqs = {h.node: h.publish(batch(h.node, simnet.entry(f"s{k}-{h.node}", "root",
                                                             f"{k}-{h.node}", k, h.node)))
                for h in live}
        net.loop.run_until(net.loop.now + 0.003)  # the hand-overs arrived, not the trees
        for node in kill:
            net.kill(node)
        alive = [h for h in live if h.up]
        t = net.loop.run_until_true(
            lambda: all(h.tree.complete(seqs[h.node]) for h in alive), 30.0)
        assert t is not None, [h.node for h in alive if not h.tree.complete(seqs[h.node])]
        for h in alive:
            assert all((w.node, seqs[w.node]) in h.batches for w in alive), h.node
        return {"messages": (sum(h.sent.messages for h in live) - sent0) // len(live),
                "own_trees": sum(h.tree.counters.own_trees for h in alive)}

    first = step(1, [])
    # 10 trees of 99 forwards and acks, shared by 100 hosts; the hand-overs and their
    # answers; membership's messages meanwhile. (One tree per host: about 200.)
    assert first["messages"] < 40, first
    leaders = sorted({h.tree.leader() for h in hosts} - {"h0000"})[:2]
    second = step(2, leaders)
    assert second["own_trees"] >= 2 * 9 - 2, second  # their members' (a few may have left)


@pytest.mark.parametrize("turn", [0.0, 10.0])
def test_with_the_lead_turning_no_host_carries_more_than_its_share(turn: float) -> None:
    """64 hosts in 8 groups save a step every 10 s, 16 times. A group's leader carries
    its members' batches and is an inner host of the other leaders' trees: about 60
    messages a save more than a member. With a fixed leader (--peer-group-turn 0)
    the same 8 hosts send that every save; turning every 10 s, each host leads
    about one save in eight, and no host sends much more than the median."""
    net = simnet.cluster(64, seed=5, group=8, group_turn=turn)  # (auto: 16, MIN_GROUP)
    net.loop.run_until(2.0)
    hosts = list(net.hosts.values())
    sent0 = {h.node: h.sent.messages for h in hosts}
    saves = 16
    for k in range(1, saves + 1):
        net.loop.run_until(k * 10.0 + 2.0)
        seqs = {h.node: h.publish(batch(h.node, simnet.entry(
            f"s{k}-{h.node}", "root", f"{k}-{h.node}", k, h.node))) for h in hosts}
        assert net.loop.run_until_true(
            lambda s=seqs: all(h.tree.complete(s[h.node]) for h in hosts), 30.0) is not None
    per_save = sorted((h.sent.messages - sent0[h.node]) / saves for h in hosts)
    median, most = per_save[len(per_save) // 2], per_save[-1]
    if turn:
        assert most < median + 15, (median, most)
    else:  # the contrast: the 8 fixed leaders
        assert per_save[-8] > median + 40, (median, per_save[-8:])
