"""Catching up with hosts that are back after a partition or a flap, once per side.

A host that saw another dead assumes it missed that host's changes meanwhile
(nothing is queued for a dead host), and merges what changed there once it is
back (a delta snapshot: mtcfs.peer.join.SnapshotPuller). Done by every host on its own, a
flap of one host among N costs that host N-1 pulls to serve, and a healed
partition costs every host one pull per host of the other side. Here:

- **Hosts back are gathered**: a partition heals over a few gossip periods,
  so the pulls start once no host came back for GATHER_QUIET (at most
  GATHER_MAX after the first).
- **One snapshot covers a side**: a source lists the hosts whose changes it
  may lack (seen dead, not caught up with, never heard from: Coverage); every
  other host's changes reached it by the commit rule. Pulls go on to an
  uncovered host only, so one pull per side back usually covers all of it.
- **One host per side pulls**: the host that follows the lowest address back
  on the ring of this side's live hosts (the same host for every host of the
  side that sees the same hosts back). It republishes what it pulled down
  the dissemination tree, waits until every live host applied it (the
  commit rule), and then publishes a marker (CaughtUp: these hosts, from
  this time on). The next two hosts of the ring stand in for it, one after
  the other, if no marker came within STAND_IN_WAIT each (it died, or the
  hosts of the side saw different hosts back: one declared dead for a moment
  during the heal). The others wait for a marker up to HANDOFF_WAIT and
  otherwise pull themselves.

Until a host back is caught up with, it is not accounted for (commit markers
wait: PeerTier.hosts_accounted). Runs in the daemon's trio thread. Markers other
hosts published reach it through `Markers`, which the tree's inbox fills: built
before both, as CatchUps publishes its own through the tree.
"""

from __future__ import annotations

import bisect
import logging
import random
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

import trio

from mtcfs.peer import swim
from mtcfs.peer.membership import GONE_AFTER, Membership, Peer

log = logging.getLogger(__name__)

# A delta reaches back this far before our last message from the host back (clocks
# and the moment each host noticed the death differ).
DELTA_MARGIN = 30.0
# The designated puller reaches back further, for the other hosts of its side
# (they noticed the death up to this much earlier).
HANDOFF_SLACK = 30.0
GATHER_QUIET = 0.5  # seconds without another host back before the pulls start
GATHER_MAX = 2.0  # ... at most after the first
# How long a host waits for its side's designated puller's marker before it pulls
# itself: the puller's gather, its pull and the republication's commit fit in it.
HANDOFF_WAIT = 20.0
# The STAND_INS - 1 hosts after the designated one on the ring take its place, the
# k-th after k * STAND_IN_WAIT without a marker (then republishing as it would).
STAND_INS = 3
STAND_IN_WAIT = 5.0
MAX_TRIES = 3  # failed pulls from a host back before it is given up on (logged)
MARKER_TTL = 30.0  # a marker that came before we saw its hosts back still counts this long
# A host back that restarted while we saw it dead cannot tell us what its earlier life
# wrote (its RAM may have gone with it). The hosts that saw that life withdraw a step
# that lost a file once its holder has been gone GONE_AFTER; commit markers here wait
# that long and a margin, so that a marker never goes up beside files nobody has.
RESTART_HOLD = GONE_AFTER + 10.0


@dataclass
class Pulled:
    """A pull's outcome: `ok` False if it failed (what arrived is applied);
    `uncovered` the hosts whose changes the source may lack (None: it did not say,
    it covers only itself)."""

    ok: bool
    uncovered: frozenset[str] | None = None


class Puller(Protocol):
    async def pull(self, p: Peer, since: float, republish: bool) -> Pulled:
        """Merge what changed at `p` in the last `since` seconds (0: all of it),
        republishing it down the tree if asked."""
        ...


class Republisher(Protocol):
    async def settled(self, what: str) -> bool:
        """True once every live host applied what this host published (the commit
        rule)."""
        ...

    def announce_caught_up(self, hosts: list[str], since_unix: float) -> None:
        """Publish a CaughtUp marker."""
        ...


class Accounting(Protocol):
    def peers_changed(self) -> None:
        """Hosts back were caught up with: commit markers held for them may go."""
        ...


class Markers:
    """CaughtUp markers delivered by the tree, until CatchUps reads them."""

    def __init__(self) -> None:
        self._waiting: list[tuple[str, list[str], float]] = []
        self._ready = trio.Event()

    def put(self, src: str, hosts: Collection[str], since_unix: float) -> None:
        self._waiting.append((src, list(hosts), since_unix))
        self._ready.set()

    async def take(self) -> list[tuple[str, list[str], float]]:
        await self._ready.wait()
        self._ready = trio.Event()
        out, self._waiting = self._waiting, []
        return out


@dataclass
class Stats:
    seen_back: int = 0  # hosts seen back after this host saw them dead
    pulls: int = 0  # catch-up pulls made here
    pulls_failed: int = 0
    covered_by_pulls: int = 0  # hosts back covered by a pull from another host back
    covered_by_markers: int = 0  # hosts back another host of our side pulled for us
    covered_by_earlier: int = 0  # hosts back merged here before we saw them back
    markers_sent: int = 0
    markers_received: int = 0
    handoff_timeouts: int = 0  # waited HANDOFF_WAIT for a marker, then pulled
    stand_ins: int = 0  # stood in for the designated host (no marker in time)
    restarted_away: int = 0  # hosts back that had restarted meanwhile (markers held)


class CatchUps:
    def __init__(self, me: str, members: Membership, puller: Puller,
                 republisher: Republisher, accounting: Accounting, markers: Markers,
                 wall: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`puller`: snapshots from hosts back; `republisher`: the tree this host
        republishes what it pulled down (and its marker); `accounting`: told when
        hosts back were caught up with; `markers`: other hosts' markers."""
        self.me = me
        self.members = members
        self.puller = puller
        self.republisher = republisher
        self.accounting = accounting
        self.markers = markers
        self._wall = wall
        self._clock = clock
        self.stats = Stats()
        # Hosts found dead, to catch up with once back: address -> (time.monotonic()
        # of its last message to us (0: none), its SWIM incarnation then).
        self.owed: dict[str, tuple[float, int]] = {}
        # Hosts back whose changes we still need: address -> wall-clock time from
        # which (0: everything).
        self.pending: dict[str, float] = {}
        self._tries: dict[str, int] = {}  # failed pulls from a host back, in a row
        self._first: set[str] = set()  # first heard of once we were live: pulled whole
        # Hosts back that had restarted while away: address -> self._clock() when seen
        # back (commit markers wait RESTART_HOLD from then).
        self.restarted: dict[str, float] = {}
        # Hosts whose changes from since_unix on were merged here lately (a marker, or
        # a pull that covered them while we still saw them dead): host -> (since_unix,
        # time.monotonic() then). Counts for MARKER_TTL when they are back.
        self._covered: dict[str, tuple[float, float]] = {}
        self._changed = trio.Event()
        self._running = False
        self._nursery: list[trio.Nursery] = []  # where its tasks run, once started

    def start(self, nursery: trio.Nursery) -> None:
        self._nursery.append(nursery)
        nursery.start_soon(self._read_markers)

    async def _read_markers(self) -> None:
        while True:
            for src, hosts, since_unix in await self.markers.take():
                self.marker(src, hosts, since_unix)

    # -- what membership and the tree tell us ---------------------------------------------

    def dead(self, p: Peer, incarnation: int) -> None:
        """`p` was declared dead: what it changes until it is back is missed here."""
        if p.addr in self.pending:  # back and gone again before we caught up
            self.pending.pop(p.addr)
            self._poke()
        self._covered.pop(p.addr, None)  # about its previous absence
        self.owed.setdefault(p.addr, (p.heard_at, incarnation))

    def back(self, p: Peer, incarnation: int) -> None:
        """`p` is alive and caught up (trio thread): back after we saw it dead, or
        first seen since we started (it was away then: everything it has)."""
        owed = self.owed.pop(p.addr, None)
        if not self._nursery:  # (not started: what it misses is in the start's pull)
            return
        if owed is None:
            # Heard of only once this host was live (it went live without it): its
            # whole snapshot, from it, at once (no side to share it with: the others
            # knew it before).
            self._first.add(p.addr)
            self._nursery[0].start_soon(self._first_contact, p)
            return
        last_heard, then = owed
        self.stats.seen_back += 1
        if incarnation - then >= swim.RESTART_JUMP:
            self.restarted[p.addr] = self._clock()
            self.stats.restarted_away += 1
            log.info("peer %s (%s) restarted while it was away: nothing to pull from it; "
                     "what its earlier life wrote reaches here from the hosts that saw it, "
                     "and commit markers wait %.0f s for their withdrawals", p.addr,
                     p.node_id, RESTART_HOLD)
            return
        need = 0.0
        if last_heard:
            need = self._wall() - (time.monotonic() - last_heard) - DELTA_MARGIN
        covered = self._covered.get(p.addr)
        if (covered is not None and time.monotonic() - covered[1] <= MARKER_TTL
                and covered[0] <= need):
            self.stats.covered_by_earlier += 1
            log.info("peer %s (%s) back: its changes were merged here already (a pull "
                     "from another host, or one host of this side for all)", p.addr,
                     p.node_id)
            return
        self.pending[p.addr] = need
        self._poke()
        if not self._running:
            self._running = True
            self._nursery[0].start_soon(self._rounds)

    def marker(self, src: str, hosts: Collection[str], since_unix: float) -> None:
        """`src` pulled `hosts`' changes from `since_unix` on and every live host
        applied them."""
        self.stats.markers_received += 1
        self._merged(hosts, since_unix)
        for h in hosts:
            need = self.pending.get(h)
            if need is not None and since_unix <= need:
                del self.pending[h]
                self.stats.covered_by_markers += 1
        log.info("%s caught up with %d hosts back for its side", src, len(hosts))
        self._poke()
        self.accounting.peers_changed()

    def _merged(self, hosts: Collection[str], since_unix: float) -> None:
        now = time.monotonic()
        for h in hosts:
            self._covered[h] = (since_unix, now)
        for h in [h for h, (_, t) in self._covered.items() if now - t > MARKER_TTL]:
            del self._covered[h]

    def uncovered(self) -> list[str]:
        """The hosts whose changes we may lack: a snapshot from here covers the rest."""
        return sorted(a for a, p in self.members.peers.items()
                      if not p.removed and (p.dead or not p.alive or a in self.owed
                                            or a in self.pending or a in self._first))

    def accounted(self) -> bool:
        now = self._clock()
        for h in [h for h, t in self.restarted.items() if now - t >= RESTART_HOLD]:
            del self.restarted[h]
        # A host seen dead is alive again by gossip before its first message says it is
        # back (and its catch-up starts): what it wrote meanwhile is not here yet.
        back_unseen = any(p is not None and p.alive for p in map(self.members.peers.get,
                                                                 self.owed))
        return (not self.pending and not self._first and not self.restarted
                and not back_unseen)

    def status(self) -> dict[str, object]:
        return {**vars(self.stats), "owed": len(self.owed),
                "pending": len(self.pending) + len(self._first),
                "restarted_hold": len(self.restarted)}

    # -- the rounds ------------------------------------------------------------------------

    def _poke(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _wait_change(self, timeout: float) -> bool:
        with trio.move_on_after(timeout):
            await self._changed.wait()
            return True
        return False

    async def _counted_pull(self, p: Peer, since: float, republish: bool) -> Pulled:
        pulled = await self.puller.pull(p, since, republish)
        self.stats.pulls += 1
        self.stats.pulls_failed += not pulled.ok
        return pulled

    async def _first_contact(self, p: Peer) -> None:
        try:
            await self._counted_pull(p, 0.0, False)
        finally:
            self._first.discard(p.addr)
            self.accounting.peers_changed()

    async def _rounds(self) -> None:
        try:
            while self.pending:
                first = trio.current_time()
                while (await self._wait_change(GATHER_QUIET)
                       and trio.current_time() - first < GATHER_MAX):
                    pass
                group = dict(self.pending)
                if not group:
                    continue
                rank = self._rank(group)
                if rank == 0:
                    await self._pull_group(group, republish=True)
                    continue
                # The next hosts of the ring stand in for the designated one, one after
                # the other (it may have died, or the hosts of the side may see
                # different hosts back: a host declared dead for a moment during the
                # heal); the rest pull for themselves at the end of the wait.
                stand_in = rank < STAND_INS
                wait = rank * STAND_IN_WAIT if stand_in else HANDOFF_WAIT
                deadline = trio.current_time() + wait
                while (any(h in self.pending for h in group)
                       and trio.current_time() < deadline):
                    await self._wait_change(deadline - trio.current_time())
                left = {h: need for h, need in group.items() if h in self.pending}
                if not left:
                    continue
                if stand_in:
                    self.stats.stand_ins += 1
                    log.info("no host of this side republished the changes of %d hosts "
                             "back within %.0f s: standing in (%d after the designated "
                             "host)", len(left), wait, rank)
                else:
                    self.stats.handoff_timeouts += 1
                    log.warning("no host of this side republished the changes of %d hosts "
                                "back within %.0f s: pulling them here", len(left), wait)
                await self._pull_group(left, republish=stand_in)
        finally:
            self._running = False

    def side(self) -> list[str]:
        """This side's hosts, as this host sees them: alive, caught up, not back from
        away (sorted: the ring)."""
        return sorted({self.me, *(p.addr for p in self.members.live()
                                  if p.ready and p.addr not in self.pending
                                  and p.addr not in self.owed)})

    def _rank(self, group: Collection[str]) -> int:
        """Where this host comes on the ring of its side after the lowest address
        back: 0, the designated host."""
        ring = self.side()
        first = bisect.bisect_right(ring, min(group))
        return (ring.index(self.me) - first) % len(ring)

    def _covered_meanwhile(self, group: Collection[str], uncovered: Collection[str],
                           since_unix: float) -> list[str]:
        """A pull's source covers hosts back since the group was made, and hosts we
        still see dead: their changes are here now."""
        early = [h for h in self.owed if h not in uncovered]
        self._merged(early, since_unix)
        for h, need in list(self.pending.items()):
            if h not in group and h not in uncovered and since_unix <= need:
                del self.pending[h]
                self.stats.covered_by_pulls += 1
                early.append(h)
        return early

    async def _pull_group(self, group: dict[str, float], republish: bool) -> None:
        """Pull from hosts of `group` until all of it is covered, or pulls failed."""
        start = min(group.values())
        alone = len(self.side()) == 1  # (nobody on this side to republish to)
        republish = republish and not alone
        now = self._wall()
        since = 0.0
        if start > 0:
            since = now - start + (HANDOFF_SLACK if republish else 0.0)
        since_unix = now - since if since else 0.0  # (0: whole snapshots)
        left = set(group)  # not covered yet
        tried: set[str] = set()
        covered: list[str] = []
        ahead: list[str] = []  # covered too, though not back yet in our view
        while True:
            candidates = [h for h in left - tried
                          if (p := self.members.peers.get(h)) is not None
                          and p.alive and not p.dead]
            if not candidates:
                break
            src = random.choice(candidates)
            tried.add(src)
            pulled = await self._counted_pull(self.members.peers[src], since, republish)
            if not pulled.ok:
                continue
            done = {src} if pulled.uncovered is None else {
                h for h in left if h == src or h not in pulled.uncovered}
            self.stats.covered_by_pulls += len(done) - 1
            covered += sorted(done)
            left -= done
            if pulled.uncovered is not None:
                ahead += self._covered_meanwhile(group, pulled.uncovered, since_unix)
        for h in group:
            if self.pending.get(h) == group[h]:  # (not gone and back again meanwhile)
                del self.pending[h]
        for h in left:  # pulls failed: alive still, tried again in the next round
            p = self.members.peers.get(h)
            if p is None or not p.alive or p.dead:
                continue  # gone again (owed again: see dead)
            tries = self._tries[h] = self._tries.get(h, 0) + 1
            if tries < MAX_TRIES:
                self.pending[h] = group[h]
            else:
                log.error("gave up catching up with %s after %d failed pulls", h, tries)
                self._tries.pop(h, None)
        for h in covered:
            self._tries.pop(h, None)
        self._poke()
        self.accounting.peers_changed()
        if not (republish and covered):
            return
        if await self.republisher.settled(
                f"republishing the changes of {len(covered)} hosts back"):
            self.republisher.announce_caught_up(sorted({*covered, *ahead}), since_unix)
            self.stats.markers_sent += 1
