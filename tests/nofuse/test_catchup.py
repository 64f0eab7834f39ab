"""Catching up with hosts back after a partition (mtcfs.peer.catchup), in virtual
time: which host of a side pulls, how one pull covers a whole side, how the others
are told, and what they do when nobody tells them.

The membership here is a stand-in: a dict of peers in the states under test (SWIM
itself runs in test_scale_membership, and the whole exchange between real daemons
in test_peers_netns's partition test); pulls, the commit wait and the marker are
recorded instead of sent."""

from __future__ import annotations

import time

import pytest
import trio
import trio.testing

from mtcfs.peer import catchup, swim
from mtcfs.peer.catchup import CatchUps, Markers, Pulled
from mtcfs.peer.membership import Peer

pytestmark = [pytest.mark.nofuse]


class View:
    """The part of Membership that CatchUps reads: peers by address, the live ones."""

    def __init__(self, *addrs: str) -> None:
        self.peers = {a: Peer(a, None, node_id=a, alive=True, ready=True,  # type: ignore[arg-type]
                              heard_at=time.monotonic()) for a in addrs}

    def live(self) -> list[Peer]:
        return [p for p in self.peers.values() if p.alive and not p.dead]


class Side:
    """One host's CatchUps, with its pulls, commit waits and markers recorded."""

    def __init__(self, me: str, view: View,
                 uncovered: dict[str, frozenset[str] | None] | None = None,
                 failing: set[str] | None = None) -> None:
        self.view = view
        self.pulls: list[tuple[str, float, bool]] = []
        self.markers: list[tuple[list[str], float]] = []
        self.settles: list[str] = []
        self.accounted = 0
        self.uncovered = uncovered or {}
        self.failing = failing or set()
        # It pulls, settles, announces and is told of accounted hosts through this Side.
        self.c = CatchUps(me, view, self, self, self, Markers())  # type: ignore[arg-type]

    async def pull(self, p: Peer, since: float, republish: bool) -> Pulled:
        self.pulls.append((p.addr, since, republish))
        await trio.sleep(0.5)
        if p.addr in self.failing:
            return Pulled(False)
        return Pulled(True, self.uncovered.get(p.addr))

    async def settled(self, what: str) -> bool:
        self.settles.append(what)
        await trio.sleep(0.2)
        return True

    def announce_caught_up(self, hosts: list[str], since_unix: float) -> None:
        self.markers.append((hosts, since_unix))

    def peers_changed(self) -> None:
        self.accounted += 1

    def cut(self, *addrs: str) -> None:
        for a in addrs:
            p = self.view.peers[a]
            p.alive, p.dead = False, True
            self.c.dead(p, 5)

    def heal(self, *addrs: str, incarnation: int = 6) -> None:
        for a in addrs:
            p = self.view.peers[a]
            p.alive, p.dead = True, False
            self.c.back(p, incarnation)


def partition(me: str, **kw: object) -> Side:
    """Hosts a0..a3 on one side (`me` among them), b0..b1 on the other."""
    side = Side(me, View(*[a for a in ("a0", "a1", "a2", "a3", "b0", "b1") if a != me]),
                **kw)
    side.cut("b0", "b1")
    return side


async def run(side: Side, until: float, then=None) -> None:
    async with trio.open_nursery() as n:
        side.c.start(n)
        await then() if then is not None else None
        await trio.sleep(until)
        n.cancel_scope.cancel()


# What b0 and b1 lack after the partition: side a's changes (so each covers the other).
SIDE_B_LACKS_SIDE_A: dict[str, frozenset[str] | None] = {
    b: frozenset({"a0", "a1", "a2", "a3"}) for b in ("b0", "b1")}


def first_pull_after_heal(side: Side, until: float, clock: trio.testing.MockClock) -> float:
    """Heal b0 and b1; the seconds until `side` made its first pull."""
    waited: list[float] = []

    async def heal() -> None:
        t0 = trio.current_time()
        side.heal("b0", "b1")
        while not side.pulls:
            await trio.sleep(0.1)
        waited.append(trio.current_time() - t0)

    trio.run(run, side, until, heal, clock=clock)
    return waited[0]


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


def test_the_host_after_the_lowest_back_pulls_one_snapshot_for_its_side(clock) -> None:
    # a0 follows b0 on the ring a0 < a1 < a2 < a3 (wrapping): it pulls. b0's snapshot
    # covers b1 (b0 lacks only our side's changes), so one pull covers both.
    side = partition("a0", uncovered=SIDE_B_LACKS_SIDE_A)

    async def heal() -> None:
        side.heal("b0", "b1")
        assert not side.c.accounted()

    trio.run(run, side, 10.0, heal, clock=clock)
    assert len(side.pulls) == 1 and side.pulls[0][0] in ("b0", "b1"), side.pulls
    since, republish = side.pulls[0][1:]
    assert republish
    # Back to 30 s before the cut, and HANDOFF_SLACK further for the others of its side.
    assert catchup.DELTA_MARGIN + catchup.HANDOFF_SLACK <= since < \
        catchup.DELTA_MARGIN + catchup.HANDOFF_SLACK + 5
    assert len(side.settles) == 1
    [(hosts, since_unix)] = side.markers
    assert hosts == ["b0", "b1"] and abs(time.time() - since - since_unix) < 5
    assert side.c.accounted() and side.c.stats.covered_by_pulls == 1


def test_the_others_of_the_side_take_the_marker_and_pull_nothing(clock) -> None:
    side = partition("a1")

    async def heal() -> None:
        side.heal("b0", "b1")
        await trio.sleep(3.0)
        assert not side.c.accounted()  # (commit markers wait)
        side.c.marker("a0", ["b0", "b1"], time.time() - 3600)

    trio.run(run, side, 1.0, heal, clock=clock)
    assert side.pulls == [] and side.markers == []
    assert side.c.accounted() and side.c.stats.covered_by_markers == 2
    assert side.accounted >= 1


def test_a_marker_that_reaches_back_too_little_does_not_count(clock) -> None:
    side = partition("a3")

    async def heal() -> None:
        side.heal("b0", "b1")
        side.c.marker("a0", ["b0", "b1"], time.time())  # from now on: not from the cut

    trio.run(run, side, catchup.HANDOFF_WAIT + 10, heal, clock=clock)
    assert side.c.stats.covered_by_markers == 0 and side.c.stats.handoff_timeouts == 1
    assert [h for h, _, _ in side.pulls] in (["b0", "b1"], ["b1", "b0"])  # no coverage said


def test_the_next_host_stands_in_for_the_designated_one(clock) -> None:
    # a1 comes after a0 (the designated host): without a marker within STAND_IN_WAIT
    # it pulls and republishes as a0 would have.
    side = partition("a1", uncovered=SIDE_B_LACKS_SIDE_A)
    waited = first_pull_after_heal(side, 10.0, clock)
    assert catchup.STAND_IN_WAIT <= waited <= catchup.STAND_IN_WAIT + catchup.GATHER_MAX + 1
    assert len(side.pulls) == 1 and side.pulls[0][2] is True
    assert side.c.stats.stand_ins == 1 and side.c.stats.handoff_timeouts == 0
    assert [h for h, _ in side.markers] == [["b0", "b1"]] and side.c.accounted()


def test_without_a_marker_a_host_pulls_itself_after_the_wait(clock) -> None:
    # a3 is the third after the designated host: it does not stand in.
    side = partition("a3", uncovered=SIDE_B_LACKS_SIDE_A)
    waited = first_pull_after_heal(side, catchup.HANDOFF_WAIT + 10, clock)
    # The gather, then HANDOFF_WAIT for the designated host (a0), then one pull (the
    # snapshot covers the other host back), not republished.
    assert catchup.HANDOFF_WAIT <= waited <= catchup.HANDOFF_WAIT + catchup.GATHER_MAX + 1
    assert len(side.pulls) == 1 and side.pulls[0][2] is False
    assert side.c.stats.handoff_timeouts == 1 and side.markers == []
    assert side.c.accounted()


def test_a_host_alone_on_its_side_pulls_one_snapshot_and_republishes_nothing(clock) -> None:
    # b0 was cut off from everyone: it is the designated host of its side of one.
    side = Side("b0", View("a0", "a1", "a2", "b1"),
                uncovered={a: frozenset({"b0"}) for a in ("a0", "a1", "a2", "b1")})
    side.cut("a0", "a1", "a2", "b1")

    async def heal() -> None:
        side.heal("a0", "a1")
        await trio.sleep(1.0)  # the others are seen back later than the pull started
        side.heal("a2", "b1")

    trio.run(run, side, 10.0, heal, clock=clock)
    assert len(side.pulls) == 1 and side.pulls[0][2] is False, side.pulls
    assert side.settles == [] and side.markers == []
    assert side.c.accounted()
    st = side.c.stats
    assert st.covered_by_pulls + st.covered_by_earlier == 3, st


def test_a_failed_pull_is_tried_again_then_given_up(clock) -> None:
    side = Side("b0", View("a0"), failing={"a0"})
    side.cut("a0")

    async def heal() -> None:
        side.heal("a0")

    trio.run(run, side, 30.0, heal, clock=clock)
    assert [h for h, _, _ in side.pulls] == ["a0"] * catchup.MAX_TRIES
    assert side.c.stats.pulls_failed == catchup.MAX_TRIES and side.c.accounted()


def test_a_host_first_seen_after_we_started_is_pulled_whole(clock) -> None:
    # b0 was away when this host started (it went live without it): everything b0
    # has is pulled, not a delta.
    side = Side("b1", View("b0"))
    side.view.peers["b0"].alive = False

    async def heal() -> None:
        side.heal("b0")

    trio.run(run, side, 10.0, heal, clock=clock)
    assert side.pulls == [("b0", 0.0, False)] and side.c.accounted()


def test_a_host_that_restarted_meanwhile_is_not_pulled_from(clock) -> None:
    side = Side("b0", View("a0"))
    side.cut("a0")

    async def heal() -> None:
        side.heal("a0", incarnation=5 + swim.RESTART_JUMP)

    trio.run(run, side, 10.0, heal, clock=clock)
    assert side.pulls == [] and not side.c.owed


def test_what_a_snapshot_source_may_lack(clock) -> None:
    side = partition("a0")

    async def heal() -> None:
        assert side.c.uncovered() == ["b0", "b1"]  # dead
        side.heal("b0")
        assert side.c.uncovered() == ["b0", "b1"]  # back, not caught up with yet
        side.c.marker("a1", ["b0"], 0.0)
        assert side.c.uncovered() == ["b1"]

    trio.run(run, side, 0.1, heal, clock=clock)


def test_commit_markers_wait_after_a_host_restarted_while_away(clock) -> None:
    """Its earlier life may have written files nobody here saw and nobody holds now (a
    replaced host): the hosts that saw that life withdraw such a step after
    GONE_AFTER, so markers here wait RESTART_HOLD (a chaos run saw a marker in the
    bucket for 20 s beside files no host had)."""
    now = [100.0]
    side = Side("b0", View("a0"))
    side.c = CatchUps("b0", side.view, side, side, side, Markers(),  # type: ignore[arg-type]
                      clock=lambda: now[0])
    side.cut("a0")

    async def heal() -> None:
        side.heal("a0", incarnation=5 + swim.RESTART_JUMP)

    trio.run(run, side, 10.0, heal, clock=clock)
    assert side.pulls == [] and not side.c.owed
    assert not side.c.accounted() and side.c.status()["restarted_hold"] == 1
    now[0] += catchup.RESTART_HOLD - 1
    assert not side.c.accounted()
    now[0] += 1
    assert side.c.accounted() and side.c.status()["restarted_away"] == 1


def test_a_host_alive_again_by_gossip_is_not_accounted_for_before_it_is_back(clock) -> None:
    """Seen alive (gossip) before its first message says it is back: its catch-up has
    not started, so what it wrote meanwhile is not here (a chaos run's marker went
    to the bucket then, without the cut-off host's shards)."""
    side = Side("b0", View("a0"))
    side.cut("a0")
    p = side.view.peers["a0"]
    p.alive, p.dead = True, False  # membership's view; CatchUps.back not called yet
    assert not side.c.accounted()

    async def back() -> None:
        side.heal("a0")  # its first message: pulled, then accounted for

    trio.run(run, side, 10.0, back, clock=clock)
    assert side.pulls and side.c.accounted()
