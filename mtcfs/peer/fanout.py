"""Index changes to every live host through a tree: each host sends to a few.

A sans-IO state machine like mtcfs.peer.swim: the driver hands it what
arrives and the time, and sends what it returns. It moves opaque change
batches (`payload`, with a size for accounting) and hands each one to
`deliver` once per host; what a batch holds is the index's business.

The tree of a batch is rooted at its writer. The live hosts, by node id,
form a ring; a host is given a RANGE of it, from itself up to (not
including) `end` (the writer's range is the whole ring). It applies the
batch, splits the live hosts of the rest of its range into `fanout`
contiguous runs and forwards the batch to the first host of each run with
that run as its range, so the tree has depth log_fanout(N) and every host
sends at most `fanout` copies of each batch, whatever N. Ranges are
disjoint by construction, so hosts whose views of the membership differ
still never cover a host twice: a host in a range that its root thinks is
dead is left out (membership gossip converges in seconds; see
docs/peers.md).

Acks go back up: a host acks its parent once it has applied the batch and
every child it forwarded to has acked, so the writer's batch is complete
when every live host has applied it: that is the commit rule
(`complete`, used by `wait_applied`). A child that does not ack within
`retry` gets the batch again (lost messages); a child found dead (`dead`,
from membership) has its range re-split by the parent among the range's
live hosts, so its subtree is not lost.

A host that some router left out because it thought it dead (a false
death, a flap, views not yet converged) gets what that router routed
without it once the router sees it alive again (`alive`): each router
keeps a bounded log of what it routed (ROUTED batches, REPAIR_WINDOW
seconds). So a commit's "every live host" is every host live in the
routers' views; a host those views missed receives the batch moments
later (the window is the membership's convergence time).

Memory is bounded: a host keeps state only for batches in flight, a bounded
memory of recent batch ids (duplicates are re-acked, not re-applied) and
the bounded routing log. Nothing is queued for a host that is away: one
away longer than the window learns it was declared dead and reconciles with
one live host's snapshot (mtcfs.peer.swim's `declared_dead`).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

FANOUT = 8
RETRY = 0.25  # seconds before a child that has not acked gets the batch again
REMEMBER = 4096  # recent batch ids kept: a late duplicate is acked, not re-applied
ROUTED = 4096  # recent batches this host routed: resent to a host back from the dead
REPAIR_WINDOW = 30.0  # dead longer (here): it was told, and pulls a snapshot instead
# A child the transport says has the batch is sent it again only after this long (it
# may have restarted and lost it); until then its ack is awaited, or its death.
DELIVERED_RETRY = 30.0


@dataclass(frozen=True, slots=True)
class Forward:
    origin: str
    seq: int
    end: str  # the receiver's range: from itself up to `end` ("" or origin: the ring)
    payload: object
    size: int  # bytes of the payload on the wire (accounting only)


@dataclass(frozen=True, slots=True)
class Ack:
    origin: str
    seq: int
    start: str  # the range acked: [start, end)
    end: str


Message = Forward | Ack
Out = list[tuple[str, Message]]


@dataclass(slots=True)
class _Child:
    end: str
    sent: float
    tries: int = 0
    delivered: bool = False  # the transport says it has the batch: its ack is to come


@dataclass(slots=True)
class _Subtree:
    """A batch in flight through this host: the range it covers, children not acked."""

    parent: str  # "" at the writer
    end: str
    payload: object
    size: int
    children: dict[str, _Child] = field(default_factory=dict)
    repair: bool = False  # a resend to a host this one thought dead: no commit waits


@dataclass
class Counters:
    forwards_sent: int = 0
    acks_sent: int = 0
    retries: int = 0
    regrafts: int = 0  # a dead child's range re-split
    duplicates: int = 0
    repairs: int = 0  # batches resent to a host back from the dead
    applied: int = 0


def in_range(node: str, start: str, end: str) -> bool:
    """node in the ring interval (start, end); end == start: the whole ring but start."""
    if node == start:
        return False
    if start < end:
        return start < node < end
    return node > start or node < end


class _Span:
    """`count` hosts of a sorted list from index `first` on, wrapping around."""

    __slots__ = ("ids", "first", "count")

    def __init__(self, ids: Sequence[str], first: int, count: int) -> None:
        self.ids, self.first, self.count = ids, first, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, k: int) -> str:
        return self.ids[(self.first + k) % len(self.ids)]


class Fanout:
    def __init__(self, me: str, live: Callable[[], Sequence[str]],
                 deliver: Callable[[str, int, object], None], fanout: int = FANOUT,
                 retry: float = RETRY, first_seq: int = 0, max_backoff: int = 4) -> None:
        """`live`: the other hosts membership counts as live (alive or suspect), sorted
        by node id (Swim.live);
        `deliver(origin, seq, payload)`: apply a batch here (once per batch);
        `first_seq`: this host's batches are numbered from first_seq + 1 (a restarted
        host with the same id must not reuse the numbers of its previous life: the
        others would take its new batches for duplicates)."""
        self.me = me
        self.live = live
        self.deliver = deliver
        self.fanout = fanout
        self.retry = retry
        self.max_backoff = max_backoff  # resends wait up to retry * 2**max_backoff
        self.counters = Counters()
        self._seq = self._first = first_seq
        # (origin, seq) -> end -> subtree: one range of a batch, or more after a regraft
        self._flight: dict[tuple[str, int], dict[str, _Subtree]] = {}
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._done: OrderedDict[tuple[str, int, str], None] = OrderedDict()
        # What this host routed (time, origin, seq, its range's end, payload, size), and
        # since when it has held each host dead: a host it left out of a tree while it
        # thought it dead gets those batches when it is back (a false death, a flap).
        self._routed: deque[tuple[float, str, int, str, object, int]] = deque(maxlen=ROUTED)
        self._dead_since: dict[str, float] = {}
        self.completed = first_seq  # this host's batches applied everywhere, in order
        self._complete: set[int] = set()  # completed out of order, above `completed`

    # -- the writer --------------------------------------------------------------------

    def publish(self, payload: object, size: int, now: float) -> tuple[int, Out]:
        """Send a batch of this host's changes to every live host. Returns its seq:
        `complete(seq)` once every live host has applied it."""
        self._seq += 1
        key = (self.me, self._seq, self.me)
        t = _Subtree("", self.me, payload, size)
        self._flight.setdefault(key[:2], {})[self.me] = t
        self._remember_seen((self.me, self._seq))
        out = self._split(key, t, self._others(self.me, self.me), now)
        return self._seq, out + self._finish_if_done(key, t)

    def complete(self, seq: int) -> bool:
        return seq <= self.completed or seq in self._complete

    def published(self) -> int:
        return self._seq

    # -- messages ----------------------------------------------------------------------

    def on_message(self, src: str, msg: Message, now: float) -> Out:
        if isinstance(msg, Ack):
            return self._on_ack(src, msg, now)
        key = (msg.origin, msg.seq, msg.end)
        if key in self._done:
            self.counters.duplicates += 1
            return [self._ack(src, msg.origin, msg.seq, msg.end)]
        ranges = self._flight.setdefault(key[:2], {})
        if msg.end in ranges:
            self.counters.duplicates += 1  # being forwarded: the ack follows
            ranges[msg.end].parent = src
            return []
        if (msg.origin, msg.seq) not in self._seen:
            self._remember_seen((msg.origin, msg.seq))
            self.counters.applied += 1
            self.deliver(msg.origin, msg.seq, msg.payload)
        t = _Subtree(src, msg.end, msg.payload, msg.size)
        ranges[msg.end] = t
        out = self._split(key, t, self._others(self.me, msg.end), now)
        return out + self._finish_if_done(key, t)

    def _on_ack(self, src: str, ack: Ack, now: float) -> Out:
        for end, t in self._flight.get((ack.origin, ack.seq), {}).items():
            c = t.children.get(ack.start)
            if c is not None and c.end == ack.end:
                del t.children[ack.start]
                return self._finish_if_done((ack.origin, ack.seq, end), t)
        return []

    def _finish_if_done(self, key: tuple[str, int, str], t: _Subtree) -> Out:
        if t.children:
            return []
        origin, seq, end = key
        ranges = self._flight[(origin, seq)]
        del ranges[end]
        if not ranges:
            del self._flight[(origin, seq)]
        if not t.parent:
            if not t.repair:
                self._completed(seq)
            return []
        self._remember(self._done, key)
        return [self._ack(t.parent, origin, seq, end)]

    def _completed(self, seq: int) -> None:
        self._complete.add(seq)
        while self.completed + 1 in self._complete:
            self.completed += 1
            self._complete.discard(self.completed)

    def _ack(self, dst: str, origin: str, seq: int, end: str) -> tuple[str, Message]:
        self.counters.acks_sent += 1
        return dst, Ack(origin, seq, self.me, end)

    # -- the tree ----------------------------------------------------------------------

    def _others(self, start: str, end: str) -> _Span:
        """The live hosts of the range (start, end), in ring order from start: found
        by bisection in membership's sorted list, so a batch costs O(fanout log N)."""
        ids = self.live()
        i0 = bisect.bisect_right(ids, start)
        if start < end:
            count = bisect.bisect_left(ids, end) - i0
        else:  # the range wraps around (or is the whole ring: start == end)
            count = len(ids) - i0 + bisect.bisect_left(ids, end)
        return _Span(ids, i0, count)

    def _split(self, key: tuple[str, int, str], t: _Subtree, hosts: _Span,
               now: float) -> Out:
        """Forward to the first host of each of up to `fanout` runs of `hosts`, each
        with its run as its range (its end: the next run's first host, or ours)."""
        out: Out = []
        if not hosts:
            return out
        if not t.repair:
            self._routed.append((now, key[0], key[1], t.end, t.payload, t.size))
        n = len(hosts)
        runs = min(self.fanout, n)
        starts = [n * i // runs for i in range(runs)]
        for i, s in enumerate(starts):
            child = hosts[s]
            end = hosts[starts[i + 1]] if i + 1 < runs else t.end
            t.children[child] = _Child(end, now)
            out.append(self._forward(child, key, t, end))
        return out

    def _forward(self, dst: str, key: tuple[str, int, str], t: _Subtree,
                 end: str) -> tuple[str, Message]:
        self.counters.forwards_sent += 1
        return dst, Forward(key[0], key[1], end, t.payload, t.size)

    # -- time and membership -----------------------------------------------------------

    def delivered(self, origin: str, seq: int, child: str) -> None:
        """The transport handed the batch to `child` (a reliable transport's call
        returned): do not resend it for being slow, only after DELIVERED_RETRY."""
        for t in self._flight.get((origin, seq), {}).values():
            c = t.children.get(child)
            if c is not None:
                c.delivered = True

    def tick(self, now: float) -> Out:
        """Resend to children that have not acked (their subtree dedups), backing off:
        a child whose subtree waits for a host not yet found dead is not flooded."""
        out: Out = []
        for key, t in self._subtrees():
            for child, c in t.children.items():
                wait = self.retry * (1 << min(c.tries, self.max_backoff))
                if c.delivered:
                    wait = max(wait, DELIVERED_RETRY)
                if now >= c.sent + wait:
                    c.sent, c.tries, c.delivered = now, c.tries + 1, False
                    self.counters.retries += 1
                    out.append(self._forward(child, key, t, c.end))
        return out

    def _subtrees(self) -> list[tuple[tuple[str, int, str], _Subtree]]:
        return [((origin, seq, end), t) for (origin, seq), ranges in self._flight.items()
                for end, t in ranges.items()]

    def alive(self, node: str, now: float) -> Out:
        """Membership sees `node` alive again: resend it what this host routed without
        it while it was dead here (each as a range of that host alone)."""
        since = self._dead_since.pop(node, None)
        if since is None or now - since > REPAIR_WINDOW:
            return []
        out: Out = []
        alone = node + "\0"  # the range [node, node\0) holds node only
        for t, origin, seq, end, payload, size in self._routed:
            if t < since or not in_range(node, self.me, end):
                continue
            ranges = self._flight.setdefault((origin, seq), {})
            rkey = "repair:" + node
            if rkey in ranges:
                continue
            sub = ranges[rkey] = _Subtree("", rkey, payload, size, repair=True)
            sub.children[node] = _Child(alone, now)
            self.counters.repairs += 1
            out.append(self._forward(node, (origin, seq, rkey), sub, alone))
        return out

    def restarted(self, node: str, now: float) -> Out:
        """`node` restarted (a new life, seen before any death): what it was handed in
        its previous life is lost there, so it gets those batches again at once rather
        than after DELIVERED_RETRY (a commit waits for its ack meanwhile)."""
        out: Out = []
        for key, t in self._subtrees():
            c = t.children.get(node)
            if c is not None and c.delivered:
                c.sent, c.tries, c.delivered = now, c.tries + 1, False
                self.counters.retries += 1
                out.append(self._forward(node, key, t, c.end))
        return out

    def dead(self, node: str, now: float) -> Out:
        """Membership declared `node` dead: its ranges go to its range's live hosts."""
        self._dead_since[node] = now
        out: Out = []
        for key, t in self._subtrees():
            c = t.children.pop(node, None)
            if c is None:
                continue
            self.counters.regrafts += 1
            out += self._split(key, t, self._others(node, c.end), now)
            out += self._finish_if_done(key, t)
        return out

    def in_flight(self) -> int:
        return sum(len(r) for r in self._flight.values())

    def busy(self) -> bool:
        """A batch is in flight here (in_flight() > 0, without counting)."""
        return any(self._flight.values())  # (stops at the first: no count)

    def own_in_flight(self) -> list[object]:
        """The payloads of this host's batches not complete yet."""
        return [t.payload for (origin, _), ranges in self._flight.items()
                if origin == self.me for t in ranges.values() if not t.repair]

    def waiting_on(self, upto: int) -> set[str]:
        """The children that have not acked one of this host's batches up to `upto`
        (each answers for its range: a host below it may be the one missing)."""
        return {child for (origin, seq), ranges in self._flight.items()
                if origin == self.me and seq <= upto
                for t in ranges.values() if not t.repair for child in t.children}

    def _remember_seen(self, batch: tuple[str, int]) -> None:
        self._remember(self._seen, batch)

    @staticmethod
    def _remember(d: OrderedDict, key: object) -> None:
        d[key] = None
        if len(d) > REMEMBER:
            d.popitem(last=False)

    def status(self) -> dict[str, object]:
        return {"in_flight": self.in_flight(), "published": self._seq - self._first,
                "completed": self.completed - self._first, **vars(self.counters)}
