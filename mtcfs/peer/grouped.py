"""Batches carried by a group leader: one tree per group of hosts, not one per host.

mtcfs.peer.fanout sends each batch down a tree of its own. When every host of
a job publishes at once (a checkpoint step: each host's files, then the
commit), N hosts make N trees of N hosts: 2 x N^2 messages per save, and
every host forwards and acks N batches. At 10,000 hosts that is 20,000 tree
messages per host per save.

Here the hosts form groups of `group` consecutive hosts of the sorted list of
live hosts (about the square root of N from RELAY_FROM hosts on, MIN_GROUP at
least; below that a group of one, which is the plain tree). A host hands its
batch to its group's first live host (`Carry`), which applies it and, once no
other came for LINGER (at most LINGER_MOST after the first), sends every batch
it holds down one tree as a `Bundle`; once that tree completed it tells each
writer (`Carried`). So a save costs N / group trees, and a host
forwards and acks about sqrt(N) of them. The writer's commit rule is
unchanged: a batch is complete once every host live in the trees' views
applied it (the leader is the tree's writer, as any router is its range's).

Which host of a group leads turns with the wall clock (`wall_turn`: every
--peer-group-turn seconds another, picked the same way on every host from the
period's number, which hosts share through NTP): a leader forwards and acks
about three times a member's messages per save (it carries its members'
batches and is an inner host of the other groups' trees), so a fixed first
host would carry that for the whole job. A host whose clock is off by a
moment at a turn only makes one more tree.

The leader is only a hint: any host carries what it is handed, so hosts whose
views differ for a moment (a death not seen everywhere yet) only make more
trees, never lose a batch. A batch whose leader is declared dead or
restarted, whose hand-over failed, or that was not carried within its
retries, goes down a tree of its writer's own. A batch may then be applied
twice on some hosts: applying an index batch is idempotent (last writer wins
on each entry), and batches of one writer were never ordered (several are in
flight at once, resends and regrafts reorder them).

A sans-IO core like the tree's: the daemon (mtcfs.peer.dissemination) and
the simulation (tests/support/simnet.py) drive it with messages and the time.
"""

from __future__ import annotations

import bisect
import math
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mtcfs.peer import fanout
from mtcfs.peer.fanout import DELIVERED_RETRY, Ack, Fanout, Forward

RELAY_FROM = 64  # hosts: from this many on, groups of about sqrt(N) (below: no groups)
# ... and of at least this many: a member's share of a save is about two tree
# messages per group, a leader's about two per member besides, and the lead turns
# (wall_turn). 64 daemons saving every 10 s spent 117 CPU-ms a save each in groups of
# 16 against about 170 in groups of 8 (4 trees a save instead of 8 on every host).
MIN_GROUP = 16
# Seconds a leader gathers its group's batches before its tree leaves: LINGER
# after the last that came, at most LINGER_MOST after the first. A save's batches
# leave their hosts over a second or more on a busy job (each host's files, then
# its copies' announcements: mtcfs.peer.outbox), and a bundle of them is one tree
# for every host instead of one each: at 64 hosts saving every 10 s (groups of 8),
# 200 ms and 1 s had every host apply 75-110 bundles a save, these about 40. With a
# batch a commit or an fsync waits for among them (Part.urgent), URGENT_LINGER after
# the first: the fsyncs of a job's hosts come at once and still share a tree.
LINGER = 0.5
LINGER_MOST = 2.0
URGENT_LINGER = 0.01
TRIES = 3  # hand-overs to a leader before the writer sends it down its own tree
MAX_PARTS = 1024  # batches one bundle carries at most (security bounds the entries)
MAX_BYTES = 4 << 20  # ... and bytes
REMEMBER = 4096  # batches carried lately: a late duplicate is told "carried" again


@dataclass(frozen=True, slots=True)
class Part:
    """One host's batch: its writer's address and number, and the batch."""

    origin: str
    seq: int
    payload: object
    size: int
    urgent: bool = False  # a commit waits for it: its leader does not linger


@dataclass(eq=False, slots=True)
class Bundle:
    """What a tree carries: the batches of one or more writers. `encoded`: its wire
    form once made or received (mtcfs.peer.wire), so that forwarding it to each
    child does not encode it again."""

    parts: tuple[Part, ...]
    encoded: object = None
    encoded_size: int = -1  # bytes of `encoded` (protobuf sizes a message anew each time)
    origins: frozenset[str] = field(init=False)  # the writers (one check per host)

    def __post_init__(self) -> None:
        self.origins = frozenset(p.origin for p in self.parts)


@dataclass(frozen=True, slots=True)
class Carry:
    """Writer to its leader: send this batch down your next tree."""

    part: Part


@dataclass(frozen=True, slots=True)
class Carried:
    """Leader to writer: these batches of yours reached every host of the tree (held:
    they are on their way; a hand-over sent again while they were)."""

    seqs: tuple[int, ...]
    held: bool = False


Message = Forward | Ack | Carry | Carried
Out = list[tuple[str, object]]


@dataclass(slots=True)
class _Handed:
    """A batch of this host's handed to a leader and not carried yet."""

    part: Part
    leader: str
    sent: float
    tries: int = 1
    delivered: bool = False  # the transport says the leader has it
    held: bool = False  # the leader answered the last hand-over: it is on its way


@dataclass
class Counters:
    handed: int = 0  # batches of this host's handed to a leader
    handed_again: int = 0
    carried_for_others: int = 0  # batches of other hosts' this host sent down its trees
    bundles: int = 0  # trees this host started
    own_trees: int = 0  # batches that went down a tree of their writer's own (fallback)


def no_turn() -> int:
    """The group's first live host leads, always."""
    return 0


def wall_turn(period: float, clock: Callable[[], float] = time.time) -> Callable[[], int]:
    """Whose turn it is to lead, the same on every host whose clock agrees: a number
    drawn from the `period`'s index (so that saves every k periods do not meet the
    same leader each time); period 0: no_turn."""
    if period <= 0:
        return no_turn

    def turn() -> int:
        return zlib.crc32(int(clock() // period).to_bytes(8, "little", signed=True))
    return turn


def group_size(hosts: int, group: int = 0) -> int:
    """Hosts per group: `group` if set (1: no groups), else sqrt(N) from RELAY_FROM
    (MIN_GROUP at least)."""
    if group > 0:
        return group
    return max(MIN_GROUP, math.isqrt(hosts)) if hosts >= RELAY_FROM else 1


class GroupedFanout:
    def __init__(self, me: str, live: Callable[[], Sequence[str]],
                 deliver: Callable[[Sequence[Part], Bundle | None], None], *,
                 group: int = 0, fanout: int = fanout.FANOUT, retry: float = fanout.RETRY,
                 first_seq: int = 0, max_backoff: int = 4,
                 turn: Callable[[], int] = no_turn) -> None:
        """As fanout.Fanout; `turn`: which host of a group leads (wall_turn);
        `deliver(parts, bundle)`: apply other hosts' batches here,
        those of a tree's bundle (`bundle.parts` itself unless this host's own is
        left out), or one handed over (bundle None); each once, unless it came
        down two trees. `group`: hosts per group (0: group_size's choice)."""
        self.me = me
        self.live = live
        self.deliver = deliver
        self.group = group
        self.turn = turn
        self.retry = retry  # a hand-over not answered is sent again after this (backing off)
        self.tree = Fanout(me, live, self._deliver_bundle, fanout=fanout, retry=retry,
                           first_seq=first_seq, max_backoff=max_backoff)
        self.counters = Counters()
        self._seq = self._first = first_seq
        self.completed = first_seq  # this host's batches applied everywhere, in order
        self._complete: set[int] = set()
        self._handed: dict[int, _Handed] = {}  # by seq
        self._gathered: list[Part] = []  # to go down this host's next tree
        self._gathered_keys: set[tuple[str, int]] = set()
        self._gathered_bytes = 0
        self.flush_at: float | None = None  # when the gathered batches must leave
        self._latest = 0.0  # ... at the latest (LINGER_MOST after the first)
        self._bundles: dict[int, tuple[Part, ...]] = {}  # tree seq -> parts in flight
        self._in_bundles: set[tuple[str, int]] = set()  # their parts' (origin, seq)
        self._carried: OrderedDict[tuple[str, int], None] = OrderedDict()

    # -- groups ------------------------------------------------------------------------

    def leader(self) -> str:
        """The host of this host's group (`group` consecutive hosts of the sorted list
        of live hosts) whose turn it is."""
        ids = self.live()
        n = len(ids) + 1
        g = group_size(n, self.group)
        if g <= 1:
            return self.me
        at = bisect.bisect_left(ids, self.me)  # this host's place among all
        first = at - at % g
        lead = first + self.turn() % min(g, n - first)
        if lead == at:
            return self.me
        return ids[lead] if lead < at else ids[lead - 1]

    # -- the writer --------------------------------------------------------------------

    def publish(self, payload: object, size: int, now: float,
                own_tree: bool = False, urgent: bool = False) -> tuple[int, Out]:
        """Send a batch of this host's to every live host, through its group's leader
        unless `own_tree` (`urgent`: a commit waits for it). Returns its seq:
        `complete(seq)` once every live host has applied it."""
        self._seq += 1
        part = Part(self.me, self._seq, payload, size, urgent)
        leader = self.me if own_tree else self.leader()
        if leader != self.me:
            self._handed[self._seq] = _Handed(part, leader, now)
            self.counters.handed += 1
            return self._seq, [(leader, Carry(part))]
        if own_tree:
            return self._seq, self._send_down((part,), now)
        # A leader's own batch is gathered with its group's (a step: all write at
        # once); without groups it leaves at once.
        self._gather(part, now)
        if group_size(len(self.live()) + 1, self.group) <= 1:
            return self._seq, self.flush(now)
        return self._seq, []

    def complete(self, seq: int) -> bool:
        return seq <= self.completed or seq in self._complete

    def published(self) -> int:
        return self._seq

    def _completed(self, seq: int) -> None:
        self._handed.pop(seq, None)
        if seq <= self.completed:
            return
        self._complete.add(seq)
        while self.completed + 1 in self._complete:
            self.completed += 1
            self._complete.discard(self.completed)

    # -- the leader --------------------------------------------------------------------

    def _gather(self, part: Part, now: float) -> None:
        # (None exactly while nothing is gathered: flush() clears both.)
        if self.flush_at is None:
            self._latest = now + LINGER_MOST
            self.flush_at = now + LINGER
        if part.urgent:
            self._latest = min(self._latest, now + URGENT_LINGER)
        self.flush_at = min(self._latest, max(self.flush_at, now + LINGER))
        self._gathered.append(part)
        self._gathered_keys.add((part.origin, part.seq))
        self._gathered_bytes += part.size

    def flush(self, now: float) -> Out:
        """Send what this host gathered down a tree of its own (one or more)."""
        out: Out = []
        parts, self._gathered = self._gathered, []
        self._gathered_keys.clear()
        self._gathered_bytes = 0
        self.flush_at = None
        while parts:
            n, size = 0, 0
            while n < len(parts) and n < MAX_PARTS and (n == 0 or size + parts[n].size
                                                          <= MAX_BYTES):
                size += parts[n].size
                n += 1
            out += self._send_down(tuple(parts[:n]), now)
            parts = parts[n:]
        return out

    def _send_down(self, parts: tuple[Part, ...], now: float) -> Out:
        self.counters.bundles += 1
        self.counters.carried_for_others += sum(p.origin != self.me for p in parts)
        seq, out = self.tree.publish(Bundle(parts), sum(p.size for p in parts), now)
        self._bundles[seq] = parts
        self._in_bundles.update((p.origin, p.seq) for p in parts)
        return out + self._finished()

    def _finished(self) -> Out:
        """Bundles whose trees completed: their writers are told."""
        done = [s for s in self._bundles if self.tree.complete(s)]
        if not done:
            return []
        told: dict[str, list[int]] = {}
        for s in done:
            for p in self._bundles.pop(s):
                self._in_bundles.discard((p.origin, p.seq))
                if p.origin == self.me:
                    self._completed(p.seq)
                else:
                    self._remember((p.origin, p.seq))
                    told.setdefault(p.origin, []).append(p.seq)
        return [(origin, Carried(tuple(seqs))) for origin, seqs in told.items()]

    def _remember(self, key: tuple[str, int]) -> None:
        self._carried[key] = None
        if len(self._carried) > REMEMBER:
            self._carried.popitem(last=False)

    def _carrying(self, key: tuple[str, int]) -> bool:
        return key in self._gathered_keys or key in self._in_bundles

    # -- messages ----------------------------------------------------------------------

    def on_message(self, src: str, msg: object, now: float) -> Out:
        if isinstance(msg, Carry):
            if msg.part.origin != src:
                return []  # a host hands over its own batches only
            return self._on_carry(msg.part, now)
        if isinstance(msg, Carried):
            for s in msg.seqs:
                h = self._handed.get(s)
                if h is None or (msg.held and h.leader != src):
                    continue
                if msg.held:
                    h.held = True  # asked again later, never sent down our own tree
                else:
                    self._completed(s)
            return []
        assert isinstance(msg, Forward | Ack)
        return self.tree.on_message(src, msg, now) + self._finished()

    def _on_carry(self, part: Part, now: float) -> Out:
        key = (part.origin, part.seq)
        if key in self._carried:
            return [(part.origin, Carried((part.seq,)))]  # its "carried" was lost
        if part.origin == self.me:
            return []
        if self._carrying(key):  # a duplicate: its "carried" follows the tree
            return [(part.origin, Carried((part.seq,), held=True))]
        self.deliver((part,), None)
        self._gather(part, now)
        if len(self._gathered) >= MAX_PARTS or self._gathered_bytes >= MAX_BYTES:
            return self.flush(now)
        return []

    def _deliver_bundle(self, origin: str, seq: int, payload: object) -> None:
        if not isinstance(payload, Bundle):  # (a tree of a peer that does not bundle)
            payload = Bundle((Part(origin, seq, payload, 0),))
        parts = payload.parts
        if self.me in payload.origins:  # (this host's own: applied when it published)
            parts = tuple(p for p in parts if p.origin != self.me)
        if parts:
            self.deliver(parts, payload)

    # -- the transport's word ----------------------------------------------------------

    def delivered(self, dst: str, msg: object) -> None:
        """The transport handed `msg` to `dst` (a reliable call returned)."""
        if isinstance(msg, Carry):
            h = self._handed.get(msg.part.seq)
            if h is not None and h.leader == dst:
                h.delivered = True
        elif isinstance(msg, Forward):
            self.tree.delivered(msg.origin, msg.seq, dst)

    def failed(self, dst: str, msg: object, now: float) -> Out:
        """A call carrying `msg` to `dst` failed for good: a hand-over goes down a tree
        of its writer's own."""
        if isinstance(msg, Carry):
            h = self._handed.get(msg.part.seq)
            if h is not None and h.leader == dst:
                return self._own_tree(h, now)
        return []

    def _own_tree(self, h: _Handed, now: float) -> Out:
        del self._handed[h.part.seq]
        self.counters.own_trees += 1
        return self._send_down((h.part,), now)

    # -- time and membership -----------------------------------------------------------

    def tick(self, now: float) -> Out:
        out = self.tree.tick(now)
        if self.flush_at is not None and now >= self.flush_at:
            out += self.flush(now)
        for h in list(self._handed.values()):
            wait = self.retry * (1 << min(h.tries - 1, 4))
            if h.delivered:
                wait = max(wait, DELIVERED_RETRY)
            if now < h.sent + wait:
                continue
            if h.tries >= TRIES and not h.held:
                out += self._own_tree(h, now)
            else:
                h.sent, h.tries, h.delivered, h.held = now, h.tries + 1, False, False
                self.counters.handed_again += 1
                out.append((h.leader, Carry(h.part)))
        return out + self._finished()

    def alive(self, node: str, now: float) -> Out:
        return self.tree.alive(node, now)

    def dead(self, node: str, now: float) -> Out:
        """`node` declared dead: its ranges re-split, and what it was to carry for this
        host goes down this host's own tree."""
        out = self.tree.dead(node, now)
        for h in [h for h in self._handed.values() if h.leader == node]:
            out += self._own_tree(h, now)
        return out + self._finished()

    def restarted(self, node: str, now: float) -> Out:
        """`node` is a new process: what it was to carry for this host is lost there."""
        out = self.tree.restarted(node, now)
        for h in [h for h in self._handed.values() if h.leader == node]:
            out += self._own_tree(h, now)
        return out + self._finished()

    # -- what is on its way ------------------------------------------------------------

    def in_flight(self) -> int:
        return self.tree.in_flight() + len(self._handed) + len(self._gathered)

    def busy(self) -> bool:
        """Something in flight (in_flight() > 0, without counting)."""
        return self.tree.busy() or bool(self._handed) or bool(self._gathered)

    def own_in_flight(self) -> list[object]:
        """The payloads of this host's batches not complete yet."""
        return [*(h.part.payload for h in self._handed.values()),
                *(p.payload for p in self._gathered if p.origin == self.me),
                *(p.payload for parts in self._bundles.values() for p in parts
                  if p.origin == self.me)]

    def waiting_on(self, upto: int) -> set[str]:
        """The hosts a batch of this host's up to `upto` waits for: its leader, or the
        children of its tree that have not acked."""
        hosts = {h.leader for s, h in self._handed.items() if s <= upto}
        trees = [s for s, parts in self._bundles.items()
                 if any(p.origin == self.me and p.seq <= upto for p in parts)]
        if trees:
            hosts |= self.tree.waiting_on(max(trees))
        return hosts

    def status(self) -> dict[str, object]:
        ids = self.live()
        return {**self.tree.status(), "published": self._seq - self._first,
                "completed": self.completed - self._first,
                "group": group_size(len(ids) + 1, self.group), "leader": self.leader(),
                **vars(self.counters)}
