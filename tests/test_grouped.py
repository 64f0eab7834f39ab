"""mtcfs.peer.grouped, the core alone: hosts in one process, messages handed over at
once (some dropped on purpose), time given by the test."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mtcfs.peer import fanout, grouped, security, wire
from mtcfs.peer.grouped import Carried, Carry, GroupedFanout, group_size
from mtcfs.peer.v1 import peer_pb2 as pb

from support import simnet


class Hosts:
    def __init__(self, n: int, group: int) -> None:
        self.ids = [f"h{i}" for i in range(n)]
        self.live = {i: [x for x in self.ids if x != i] for i in self.ids}
        self.got: dict[str, list[tuple[str, int]]] = {i: [] for i in self.ids}
        self.hosts = {i: GroupedFanout(i, self._live_of(i), self._deliver_to(i), group=group)
                      for i in self.ids}
        self.drop: Callable[[str, str, object], bool] = lambda src, dst, msg: False
        self.down: set[str] = set()

    def _live_of(self, i: str) -> Callable[[], list[str]]:
        return lambda: self.live[i]

    def _deliver_to(self, i: str) -> Callable[[object, object], None]:
        return lambda parts, bundle: self.got[i].extend((p.origin, p.seq) for p in parts)

    def run(self, out: list, src: str, now: float) -> None:
        todo = [(src, dst, m) for dst, m in out]
        while todo:
            s, d, m = todo.pop(0)
            if d in self.down or self.drop(s, d, m):
                continue
            todo += [(d, d2, m2) for d2, m2 in self.hosts[d].on_message(s, m, now)]

    def publish(self, i: str, now: float) -> int:
        seq, out = self.hosts[i].publish(pb.ChangeBatch(from_node=i), 10, now)
        self.run(out, i, now)
        return seq

    def tick(self, now: float) -> None:
        for i, h in self.hosts.items():
            if i not in self.down:
                self.run(h.tick(now), i, now)

    def kill(self, node: str, now: float) -> None:
        self.down.add(node)
        for i in self.ids:
            if node in self.live[i]:
                self.live[i] = [x for x in self.live[i] if x != node]
                if i not in self.down:
                    self.run(self.hosts[i].dead(node, now), i, now)


def test_groups_are_about_the_square_root_of_the_hosts_from_64_on() -> None:
    assert group_size(63) == 1 and group_size(64) == 16 and group_size(10_000) == 100
    assert group_size(255) == 16 and group_size(300) == 17
    assert group_size(5, 3) == 3 and group_size(10_000, 1) == 1


def test_a_batch_a_commit_waits_for_lingers_less_at_its_leader() -> None:
    """A leader gathers its group's batches for LINGER; once a batch that a commit or
    an fsync waits for (ChangeBatch.waited) is among them, URGENT_LINGER."""
    assert grouped.URGENT_LINGER < grouped.LINGER
    net = Hosts(9, 3)
    plain = net.publish("h1", 0.0)  # h0 leads h0-h2
    net.tick(grouped.URGENT_LINGER)
    assert not net.hosts["h1"].complete(plain)  # still gathered at h0
    seq, out = net.hosts["h2"].publish(pb.ChangeBatch(from_node="h2", waited=True), 10,
                                       grouped.URGENT_LINGER, urgent=True)
    net.run(out, "h2", grouped.URGENT_LINGER)
    net.tick(2 * grouped.URGENT_LINGER)  # well before LINGER
    assert net.hosts["h2"].complete(seq) and net.hosts["h1"].complete(plain)
    assert net.hosts["h0"].counters.bundles == 1  # one tree for both
    for i in net.ids:
        assert {("h1", plain), ("h2", seq)} <= set(net.got[i]) or i in ("h1", "h2")
    # Its wire form says so too: a hand-over decoded at the leader is urgent.
    carry = Carry(grouped.Part("h2", 1, pb.ChangeBatch(from_node="h2", waited=True), 10, True))
    _, back = wire.tree_from_pb(wire.tree_to_pb("h2", carry))
    assert isinstance(back, Carry) and back.part.urgent


def test_a_step_of_nine_hosts_in_groups_of_three_makes_three_trees() -> None:
    net = Hosts(9, 3)
    seqs = {i: net.publish(i, 0.0) for i in net.ids}
    assert not any(net.hosts[i].complete(s) for i, s in seqs.items())
    net.tick(grouped.LINGER)  # the leaders' gathered batches leave
    assert all(net.hosts[i].complete(s) for i, s in seqs.items())
    for i in net.ids:  # every host has every other host's batch, once
        assert sorted(net.got[i]) == sorted((o, seqs[o]) for o in net.ids if o != i), i
    bundles = {i: h.counters.bundles for i, h in net.hosts.items()}
    assert bundles == {i: int(i in ("h0", "h3", "h6")) for i in net.ids}, bundles
    assert sum(h.tree.counters.forwards_sent for h in net.hosts.values()) == 3 * 8
    assert all(h.in_flight() == 0 and h.counters.own_trees == 0 for h in net.hosts.values())


def test_a_leader_gathers_while_batches_keep_coming_for_at_most_linger_most() -> None:
    """A leader's bundle leaves LINGER after the last batch it was handed, at most
    LINGER_MOST after the first: a save whose batches come over a second (each
    host's files, then its copies' announcements) makes a few trees, not one per
    batch. After a pause of LINGER the next batch starts a tree of its own."""
    assert grouped.LINGER < grouped.LINGER_MOST
    net = Hosts(9, 3)  # h0 leads h0-h2
    gap = grouped.LINGER * 0.8
    seqs, t = [], 0.0
    while t <= grouped.LINGER_MOST - gap:
        for i in ("h1", "h2", "h0"):  # (the leader's own batch waits with the others)
            seqs.append((i, net.publish(i, t)))
        net.tick(t)
        assert not any(net.hosts[i].complete(s) for i, s in seqs), t
        t += gap
    net.tick(grouped.LINGER_MOST)
    assert all(net.hosts[i].complete(s) for i, s in seqs)
    assert net.hosts["h0"].counters.bundles == 1
    assert sorted(net.got["h7"]) == sorted(seqs)
    # A pause: the next batch goes down a tree of its own, LINGER after it came.
    t = grouped.LINGER_MOST + 2 * grouped.LINGER
    late = net.publish("h1", t)
    net.tick(t + grouped.LINGER * 0.9)
    assert not net.hosts["h1"].complete(late)
    net.tick(t + grouped.LINGER)
    assert net.hosts["h1"].complete(late) and net.hosts["h0"].counters.bundles == 2


def test_without_groups_a_batch_leaves_at_once_down_its_writers_tree() -> None:
    net = Hosts(5, 1)
    seq = net.publish("h2", 0.0)
    assert net.hosts["h2"].complete(seq) and net.hosts["h2"].counters.handed == 0
    assert all(net.got[i] == [("h2", seq)] for i in net.ids if i != "h2")


def test_a_lost_carried_is_told_again_when_the_writer_hands_it_over_again() -> None:
    net = Hosts(6, 3)
    lost = []

    def drop(src: str, dst: str, msg: object) -> bool:
        if isinstance(msg, Carried) and not lost:
            lost.append(msg)
            return True
        return False

    net.drop = drop
    seq = net.publish("h1", 0.0)
    # The leader's bundle leaves (and its tree completes) before the writer asks again.
    net.run(net.hosts["h0"].tick(grouped.LINGER), "h0", grouped.LINGER)
    assert lost and not net.hosts["h1"].complete(seq)
    net.tick(grouped.LINGER + fanout.RETRY)
    assert net.hosts["h1"].complete(seq)
    assert net.hosts["h1"].counters.handed_again == 1 and net.hosts["h1"].counters.own_trees == 0
    assert net.got["h4"] == [("h1", seq)]  # applied once


def test_a_hand_over_sent_again_while_its_leader_gathers_is_held_not_sent_twice() -> None:
    net = Hosts(6, 3)
    leader = net.hosts["h0"]
    seq, out = net.hosts["h2"].publish(pb.ChangeBatch(from_node="h2"), 10, 0.0)
    net.run(out, "h2", 0.0)
    leader.flush_at = None  # (keep it gathering: as a leader whose flush is late)
    answer = leader.on_message("h2", Carry(out[0][1].part), 0.3)
    assert answer == [("h2", Carried((seq,), held=True))]
    net.hosts["h2"].on_message("h0", answer[0][1], 0.3)
    # Held: the writer asks again, backing off, but never sends it down its own tree
    # while its leader answers (unless it dies).
    for t in range(1, 41):
        net.run(net.hosts["h2"].tick(t / 4), "h2", t / 4)
    assert net.hosts["h2"].counters.own_trees == 0
    assert 3 <= net.hosts["h2"].counters.handed_again <= 6
    net.run(leader.flush(10.0), "h0", 10.0)
    assert net.hosts["h2"].complete(seq) and net.got["h5"] == [("h2", seq)]


def test_a_dead_leaders_members_send_their_batches_down_their_own_trees() -> None:
    net = Hosts(6, 3)
    net.down.add("h3")  # killed before it answers anything
    seq = net.publish("h4", 0.0)
    net.tick(grouped.LINGER)
    assert not net.hosts["h4"].complete(seq)
    net.kill("h3", 1.0)  # declared dead: the hand-over goes down h4's own tree
    assert net.hosts["h4"].complete(seq) and net.hosts["h4"].counters.own_trees == 1
    assert all(net.got[i] == [("h4", seq)] for i in net.ids if i not in ("h3", "h4"))
    assert net.hosts["h4"].leader() == "h4"  # the first live host of its group now


def test_a_writer_falls_back_to_its_own_tree_when_its_leader_never_answers() -> None:
    net = Hosts(6, 3)
    net.drop = lambda src, dst, msg: isinstance(msg, Carry)
    seq = net.publish("h5", 0.0)
    t = 0.0
    while not net.hosts["h5"].complete(seq) and t < 5:
        t += 0.05
        net.tick(t)
    assert net.hosts["h5"].complete(seq) and net.hosts["h5"].counters.own_trees == 1
    assert t < (1 + 2 + 4) * fanout.RETRY + 0.1, t


@pytest.mark.parametrize("how", ["restarted", "failed"])
def test_a_restarted_leader_or_a_failed_hand_over_goes_down_the_writers_tree(how) -> None:
    net = Hosts(6, 3)
    w = net.hosts["h1"]
    seq, out = w.publish(pb.ChangeBatch(from_node="h1"), 10, 0.0)
    (dst, msg), = out
    w.delivered(dst, msg)
    assert w.waiting_on(seq) == {"h0"}
    net.run(w.restarted("h0", 0.1) if how == "restarted" else w.failed("h0", msg, 0.1),
            "h1", 0.1)
    assert w.complete(seq) and w.counters.own_trees == 1


def test_a_hand_over_of_another_hosts_batch_is_ignored() -> None:
    net = Hosts(6, 3)
    part = grouped.Part("h2", 1, pb.ChangeBatch(from_node="h2"), 10)
    assert net.hosts["h0"].on_message("h1", Carry(part), 0.0) == []
    assert net.got["h0"] == [] and net.hosts["h0"].flush_at is None


def test_a_bundles_tree_message_is_checked_before_it_is_applied() -> None:
    e = simnet.entry("g", "root", "g", 5, "h1")
    good = pb.TreeMessage(from_node="a:1", origin="a:1", seq=3, end="b:1", batch=pb.ChangeBatch(
        from_node="h1", entries=[e, e], parts=[
            pb.Part(origin="a:1", seq=1, entries=1, from_node="h1"),
            pb.Part(origin="c:1", seq=7, entries=1, from_node="h2")]))
    security.check_tree(good)
    bad = []
    m = pb.TreeMessage()
    m.CopyFrom(good)
    m.batch.parts[1].entries = 2  # the parts do not add up to the entries
    bad.append(m)
    m = pb.TreeMessage()
    m.CopyFrom(good)
    m.batch.parts[0].seq = 0
    bad.append(m)
    m = pb.TreeMessage()
    m.CopyFrom(good)
    m.batch.parts[0].from_node = "../x"
    bad.append(m)
    m = pb.TreeMessage()
    m.CopyFrom(good)
    m.carry = True  # a hand-over is one writer's
    bad.append(m)
    bad.append(pb.TreeMessage(from_node="a:1", origin="a:1", seq=1, carried=[0]))
    bad.append(pb.TreeMessage(from_node="a:1", origin="a:1", seq=1, carried=[1], ack=True,
                              start="x"))
    for m in bad:
        with pytest.raises(security.BadRequest):
            security.check_tree(m)
    security.check_tree(pb.TreeMessage(from_node="a:1", origin="a:1", seq=1, carried=[1, 2]))


def _others(ids: list[str], me: str) -> Callable[[], list[str]]:
    return lambda: [x for x in ids if x != me]


def test_the_lead_turns_among_a_groups_hosts_and_every_host_agrees_on_it() -> None:
    """wall_turn: each period another host of each group leads, the same one on every
    host of the group (drawn from the period's number: every host of a group of
    four leads within 40 periods, and a period k later is not always the same
    host); 0: the first host, always."""
    now = [0.0]
    ids = [f"h{i:02}" for i in range(12)]  # (sorted as strings: the live list's order)
    hosts = {i: GroupedFanout(i, _others(ids, i),
                              lambda parts, bundle: None, group=4,
                              turn=grouped.wall_turn(10.0, lambda: now[0]))
             for i in ids}
    groups = [ids[k:k + 4] for k in range(0, 12, 4)]
    led: dict[int, set[str]] = {g: set() for g in range(3)}
    every_fourth: set[str] = set()
    for period in range(40):
        now[0] = period * 10.0 + 3.0
        for g, members in enumerate(groups):
            seen = {hosts[m].leader() for m in members}
            assert len(seen) == 1, (period, seen)
            assert seen <= set(members)
            led[g] |= seen
        if period % 4 == 0:
            every_fourth.add(hosts["h00"].leader())
    assert all(led[g] == set(groups[g]) for g in led), led
    assert len(every_fourth) > 1
    fixed = GroupedFanout("h02", _others(ids, "h02"), lambda p, b: None,
                          group=4, turn=grouped.wall_turn(0.0))
    assert fixed.leader() == "h00"


def test_a_group_cut_short_at_the_end_of_the_list_draws_among_its_own_hosts() -> None:
    ids = [f"h{i}" for i in range(10)]  # groups of 4: h0-h3, h4-h7, and h8-h9
    for turn in range(8):
        leaders = {GroupedFanout(i, _others(ids, i),
                                 lambda p, b: None, group=4,
                                 turn=lambda t=turn: t).leader() for i in ("h8", "h9")}
        assert leaders == {("h8", "h9")[turn % 2]}
