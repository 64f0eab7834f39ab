"""Who the peers are and whether they are alive: SWIM (mtcfs.peer.swim) over
authenticated datagrams (mtcfs.peer.gossip).

Addresses come from --peers and --peers-file (re-read when it changes); they are
the SWIM member ids. Each host probes one member per period (and its replica
partners more often), asks others to probe a member that did not answer,
suspects it, and declares it dead if it does not refute in time; the news
travels piggybacked on the probes. So the cost per host does not grow with the
number of hosts. A host's node id, failure domain and data port travel in its
datagrams and in the member updates about it.

A peer is `alive` once heard of (directly, or from a member update at the
incarnation it started with) and while SWIM holds it alive or suspect; `known_dead`
once SWIM declared it dead; neither while it has not been heard of yet (commits
wait for such a peer until it is found dead).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc
import trio

from mtcfs.peer import placement, security, swim
from mtcfs.peer.addresses import AddressError, read_peers_file
from mtcfs.peer.gossip import Codec, Endpoint
from mtcfs.peer.v1 import peer_pb2 as pb
from mtcfs.peer.v1 import peer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# A host down this long is gone for good: longer than a frozen daemon, a cut link or a
# daemon restarting over its RAM dir stays away (withdrawal, commit-marker uploads).
GONE_AFTER = 15.0
FILE_CHECK = 0.25  # how often the peers file's mtime is looked at
# This host's own pings to a peer unanswered in a row before it counts as unreachable
# from here (reads skip it as a holder), whatever the others say: a one-way partition.
MISSED_DIRECT = 3
RECHECK = 1.0  # an unreachable peer is pinged again this often (up to RECHECK_MAX a round)
RECHECK_MAX = 8
STRANGERS = 64  # channels kept to hosts not among the peers (stub_for)
# A loop that has not come round for this long gets no quick acks (QuickAcks): a daemon
# wedged that long is as good as dead to its peers; one merely busy comes round sooner.
WEDGED = 20.0

# The daemon's SWIM timing: a host loaded by other work (FUSE, replication, tests on two
# cores) may answer a probe late; a suspicion is refuted, a death is not. Probes are
# most of an idle daemon's CPU (each datagram ~0.2 ms of Python at both ends): a member
# each second and a replica partner in the same tick; a probe unanswered for 0.5 s
# makes a suspect (as with a 0.5 s period), and the suspicion timeout,
# 2 x max(1, log10 N) x period, is what it was with 4 x 0.5 s.
DAEMON_SWIM = swim.SwimConfig(period=1.0, partner_period=1.0, ack_timeout=0.3,
                              probe_timeout=0.5, suspicion_mult=2.0)


class _Channel:
    """A peer's gRPC channel and stub, opened on first use (a host of a large job
    talks to few of the others)."""

    def __init__(self, addr: str, tls: tuple[bytes, bytes, bytes | None] | None) -> None:
        self.addr = addr
        self.tls = tls
        self._opened: list[tuple[grpc.Channel, pb_grpc.PeerStub]] = []  # none, or the one
        self._lock = threading.Lock()  # opened from the trio thread or a worker thread

    def open(self) -> pb_grpc.PeerStub:
        with self._lock:
            if not self._opened:
                channel = security.open_channel(self.addr, self.tls)
                self._opened.append((channel, pb_grpc.PeerStub(channel)))
            return self._opened[0][1]

    def close(self) -> None:
        with self._lock:
            for channel, _ in self._opened:
                channel.close()
            self._opened.clear()


class _Strangers:
    """Channels to addresses not among the peers (a host of the job, holding the token,
    that sent us something to answer), kept for the next time: at most STRANGERS."""

    def __init__(self, tls: tuple[bytes, bytes, bytes | None] | None) -> None:
        self.tls = tls
        self._conns: dict[str, _Channel] = {}

    def stub(self, addr: str) -> pb_grpc.PeerStub:
        conn = self._conns.get(addr)
        if conn is None:
            if len(self._conns) >= STRANGERS:
                self.close()
            conn = self._conns[addr] = _Channel(addr, self.tls)
        return conn.open()

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()


@dataclass(eq=False)
class Peer:
    addr: str
    conn: _Channel
    node_id: str = ""
    domain: str = ""
    alive: bool = False
    dead: bool = False  # SWIM declared it dead
    heard: bool = False  # heard of at an incarnation it announced
    ready: bool = False  # caught up when last heard of: its snapshot is whole
    last_ok: float = 0.0
    heard_at: float = 0.0  # time.monotonic() of its last message to us (0: none yet)
    ram_free: int = 0
    data_port: int = 0  # its bulk data channel (mtcfs.peer.bulk); 0: gRPC only
    busy: int = 0  # transfers in flight to or from it
    removed: bool = False
    missed: int = 0  # this host's direct pings to it unanswered in a row
    unreachable: bool = False  # MISSED_DIRECT of them: reads do not ask it

    @property
    def stub(self) -> pb_grpc.PeerStub:
        return self.conn.open()

    @property
    def known_dead(self) -> bool:
        """Declared dead: commits stop waiting for it."""
        return self.dead

    def describe(self) -> dict[str, object]:
        return {
            "address": self.addr,
            "node_id": self.node_id or None,
            "alive": self.alive,
            "failure_domain": self.domain or None,
            "last_seen_seconds": round(time.time() - self.last_ok, 1) if self.last_ok else None,
            "ram_free": self.ram_free,
            "transfers": self.busy,
            "data_port": self.data_port or None,
            "unreachable_from_here": self.unreachable,
        }


def named(p: Peer, node_id: str, domain: str, data_port: int) -> bool:
    """Take what `p` says it is. True when that is a new node id or failure domain at
    its address (a replacement host): a new membership version, so that the placement
    ring and Membership.by_node are made again."""
    new = (p.node_id, p.domain) != (node_id, domain)
    p.node_id, p.domain, p.data_port = node_id, domain, data_port
    return new


class LiveByNode:
    """The live peers by node id, as of a membership version: Membership.by_node is
    asked for each holder of each file an index batch changes, so not a walk of every
    peer."""

    def __init__(self, peers: dict[str, Peer]) -> None:
        self.peers = peers  # (Membership's own table)
        self.as_of = -1  # the membership version the table was made at
        self.live: dict[str, Peer] = {}

    def get(self, node_id: str, version: int) -> Peer | None:
        p = self.live.get(node_id) if version == self.as_of else None
        if p is not None and p.alive and p.node_id == node_id:
            return p
        if p is None and version == self.as_of:
            return None
        # Made again for this version (or after a peer changed without one).
        self.as_of, self.live = version, {}
        for q in self.peers.values():
            if q.alive and q.node_id and q.node_id not in self.live:
                self.live[q.node_id] = q
        return self.live.get(node_id)


class MembershipEvents(Protocol):
    """What membership tells (mtcfs.core.events.Listener has these)."""

    def peer_alive(self, peer: Peer) -> None: ...

    def peer_dead(self, peer: Peer) -> None: ...

    def peer_ready(self, peer: Peer) -> None: ...

    def peer_restarted(self, peer: Peer) -> None: ...

    def peers_changed(self) -> None: ...


class FreeRam(Protocol):
    """This host's RAM tier, as membership tells the others of it."""

    @property
    def free(self) -> int: ...


class _UnknownRam:
    """No RAM tier to look at (tools and simulations): told as none free."""

    free = 0


class _Unbound:
    """The datagram socket before open(): nothing sent, nothing received."""

    bound = False
    sent = received = bytes_sent = bytes_received = send_errors = 0

    def send(self, addr: str, data: bytes) -> None:
        pass

    def forget(self, addr: str) -> None:
        pass

    def start(self, token: trio.lowlevel.TrioToken) -> None:
        pass

    async def receive(self) -> list[pb.GossipMessage]:
        await trio.sleep_forever()
        return []

    def drain(self) -> list[pb.GossipMessage]:
        return []

    def close(self) -> None:
        pass


class _Unheard:
    def peer_alive(self, peer: Peer) -> None:
        pass

    def peer_dead(self, peer: Peer) -> None:
        pass

    def peer_ready(self, peer: Peer) -> None:
        pass

    def peer_restarted(self, peer: Peer) -> None:
        pass

    def peers_changed(self) -> None:
        pass


@dataclass
class Self:
    """What this host says of itself in every datagram (the peer tier fills in its
    data port, free RAM and readiness once it knows them)."""

    node_id: str
    domain: str = ""
    data_port: int = 0
    ram_free: int = 0
    ready: bool = False
    replicas: int = 0  # K: its replica partners are probed more often


def _datagram(me: str, local: Self, msg: swim.Message) -> pb.GossipMessage:
    """A SWIM message as a datagram, with what this host says of itself."""
    return pb.GossipMessage(
        from_node=me, kind=msg.kind, seq=msg.seq, incarnation=msg.incarnation,
        target=msg.target, node_id=local.node_id, failure_domain=local.domain,
        data_port=local.data_port, ram_free=local.ram_free, ready=local.ready)


class QuickAcks:
    """Answers pings and refutes suspicions in the thread that reads the datagrams
    (gossip.Endpoint), before the event loop sees them. When every host of a job saves
    at once on few cores, an event loop can be busy for seconds, longer than SWIM's
    suspicion timeout: answered from the loop, busy hosts were suspected, then found
    dead, and the re-splits and catch-ups that followed kept everyone busy. A quick
    ack carries no news; the loop's own ack to the same ping follows only when it has
    some (`covers`). A suspicion of this host heard here takes a higher incarnation at
    once (Swim.refute), which the quick answer carries. A loop that has not come round
    for WEDGED seconds (`came_round`) gets neither."""

    def __init__(self, me: str, local: Self, codec: Codec, swim_: swim.Swim) -> None:
        self.me = me
        self.local = local
        self.codec = codec
        self.swim = swim_
        self._loop_seen = time.monotonic()
        self._acked: set[tuple[str, int]] = set()  # (sender, seq) of pings answered
        self.sent = 0
        self.refuted = 0
        self.wedged = False  # the loop did not come round for WEDGED (logged once)

    def came_round(self) -> None:
        if self.wedged:
            self.wedged = False
            log.warning("the event loop came round again: pings answered at once again")
        self._loop_seen = time.monotonic()

    def answer(self, m: pb.GossipMessage, send: Callable[[str, bytes], None]) -> None:
        if m.node_id == self.local.node_id:
            return  # (a host with our own node id is not answered: Membership.receive)
        if time.monotonic() - self._loop_seen > WEDGED:
            if not self.wedged:
                self.wedged = True
                log.warning("the event loop has not come round for %.0f s: pings are left "
                            "to it (this host may be found dead)", WEDGED)
            return
        refuted = False
        for u in m.updates:
            if u.node == self.me and self.swim.refute(swim.Update(u.node, u.state,
                                                                  u.incarnation)):
                refuted = True
                self.refuted += 1
        if m.kind == swim.PING:
            out = swim.Message(swim.ACK, m.seq, self.swim.incarnation, self.me)
        elif refuted:  # (the refutation is the message's incarnation)
            out = swim.Message(swim.GOSSIP, incarnation=self.swim.incarnation)
        else:
            return
        send(m.from_node, self.codec.seal(_datagram(self.me, self.local, out), m.from_node))
        if out.kind == swim.ACK:
            if len(self._acked) > 4096:  # (pings the loop never answered: a stranger's)
                self._acked.clear()
            self._acked.add((m.from_node, m.seq))
            self.sent += 1

    def counts(self) -> dict[str, int]:
        return {"quick_acks": self.sent, "quick_refutations": self.refuted}

    def covers(self, dst: str, msg: swim.Message) -> bool:
        """Whether the loop's `msg` to `dst` is an ack sent already, with no news."""
        if msg.kind != swim.ACK or (dst, msg.seq) not in self._acked:
            return False
        self._acked.discard((dst, msg.seq))
        return not msg.updates


class Membership:
    def __init__(self, me: str, node_id: str, static: list[str], peers_file: str | None,
                 secret: bytes | None, tls: tuple[bytes, bytes, bytes | None] | None,
                 events: MembershipEvents | None = None, *, domain: str = "",
                 replicas: int = 0, config: swim.SwimConfig = DAEMON_SWIM,
                 rng: random.Random | None = None, ram: FreeRam | None = None) -> None:
        self.me = me
        self.node_id = node_id
        self.static = static
        self.peers_file = peers_file
        self.metadata = security.call_metadata(secret)
        self.secret = secret
        self.tls = tls
        self.events = events or _Unheard()
        self.local = Self(node_id, domain, replicas=replicas)
        # This host's free RAM: looked at on each timer of the run loop, told in every
        # datagram.
        self.ram: FreeRam = ram or _UnknownRam()
        self.peers: dict[str, Peer] = {}
        self._file_mtime = 0.0
        self._started = time.time()
        self._rng = rng or random.Random()
        # The incarnation starts at the start time (ms): a restarted host's overrides
        # what the others hold of its previous life, dead or alive.
        self.swim = swim.Swim(me, [], self, self._rng, config, partners=self._partners,
                              now=time.monotonic(), incarnation=time.time_ns() // 10**6)
        self.codec = Codec(me, secret)
        self.quick = QuickAcks(me, self.local, self.codec, self.swim)
        self.endpoint: Endpoint[pb.GossipMessage] | _Unbound = _Unbound()  # bound by open()
        # The placement ring as of a membership version (-1: not made yet).
        self._ring: tuple[int, list[str], dict[str, str]] = (-1, [], {})
        self._ring_version = 0
        self._live_by_node = LiveByNode(self.peers)
        self._changed = trio.Event()
        self._hellos: dict[int, str] = {}  # seq of a hello -> the peer it went to
        self.answered: set[str] = set()  # peers that answered a hello: they know us
        self._pings: dict[int, tuple[str, float]] = {}  # our pings: seq -> (peer, sent)
        self._recheck_at = 0.0
        self._next_file = 0.0  # when the peers file is looked at next
        self._cut = False  # some peer was unreachable from here at the last look
        # The run loop's sleep until its next timer, moved by what is sent and received
        # meanwhile (see _rearm); None while it runs.
        self._sleep: list[trio.CancelScope] = []  # the run loop's sleep, while it sleeps
        self._strangers = _Strangers(tls)
        self.sync_addresses()

    # -- addresses -------------------------------------------------------------------

    def addresses(self) -> list[str]:
        out = list(self.static)
        if self.peers_file:
            try:
                out += read_peers_file(self.peers_file)
            except AddressError as e:
                log.error("%s", e)
                out += [p.addr for p in self.peers.values() if p.addr not in out]
        return [a for a in dict.fromkeys(out) if a != self.me]

    def sync_addresses(self) -> None:
        want = self.addresses()
        for addr in want:
            if addr not in self.peers:
                self.peers[addr] = Peer(addr, _Channel(addr, self.tls))
                self.swim.add(addr)
                self._ring_version += 1
                log.info("peer %s added", addr)
                if self.endpoint.bound:
                    self.hello(addr)
        for addr in list(self.peers):
            if addr not in want:
                p = self.peers.pop(addr)
                p.removed = True
                p.conn.close()
                self.swim.remove(addr)
                self.codec.forget(addr)
                self.endpoint.forget(addr)
                log.info("peer %s removed", addr)
                self._ring_version += 1
                self.events.peers_changed()

    @property
    def version(self) -> int:
        """Bumped whenever a peer is added, removed, or changes between alive and dead."""
        return self._ring_version

    def incarnation_of(self, addr: str) -> int:
        """Its SWIM incarnation: its start time in ms, plus one per suspicion it refuted
        (so a jump of a second or more means it restarted)."""
        return self.swim.incarnation_of(addr)

    def live(self) -> list[Peer]:
        return [p for p in self.peers.values() if p.alive]

    def is_live(self, node_id: str) -> bool:
        return self.by_node(node_id) is not None

    def job_size(self) -> int:
        """The hosts of the job as configured (peers live or not, and this one)."""
        return len(self.peers) + 1

    def live_nodes(self) -> list[str]:
        return [p.node_id for p in self.peers.values() if p.alive and p.node_id]

    def down_for(self, node_id: str) -> float:
        """Seconds since `node_id` was last seen alive by this daemon (0 while it is).
        A node not seen since this daemon started counts from the start, and not at
        all while a configured peer has not been heard of yet (it may be that node)."""
        seen = [p for p in self.peers.values() if p.node_id == node_id]
        if any(p.alive for p in seen):
            return 0.0
        if not seen and self.unresolved():
            return 0.0
        return min(self._unseen_for(p) for p in seen) if seen else self._unseen_for(None)

    def _unseen_for(self, p: Peer | None) -> float:
        """Seconds since this daemon last saw `p` alive (or started, if it never did)."""
        return max(0.0, time.time() - max(self._started, p.last_ok if p else 0.0))

    def all_accounted(self) -> bool:
        """Every configured host is alive, or has been down for GONE_AFTER (this daemon's
        view): the files of a host cut off for a moment are not forgotten meanwhile."""
        return all(p.alive or (p.known_dead and self._unseen_for(p) >= GONE_AFTER)
                   for p in self.peers.values())

    def by_node(self, node_id: str) -> Peer | None:
        return self._live_by_node.get(node_id, self._ring_version)

    def unresolved(self) -> list[Peer]:
        """Configured peers neither alive nor known dead (e.g. not heard of yet)."""
        return [p for p in self.peers.values() if not p.alive and not p.known_dead]

    # -- SWIM's listener ---------------------------------------------------------------

    def member_alive(self, node: str) -> None:
        self._refresh(node)

    def member_dead(self, node: str) -> None:
        self._refresh(node)

    def member_restarted(self, node: str) -> None:
        p = self.peers.get(node)
        if p is not None and p.alive:
            log.info("peer %s (%s) restarted", p.addr, p.node_id)
            self.events.peer_restarted(p)

    def declared_dead(self) -> None:
        log.warning("the other hosts declared this host dead (cut off, or too slow): "
                    "refuted, incarnation %d", self.swim.incarnation)

    def _refresh(self, addr: str) -> None:
        """Bring a peer's liveness in line with SWIM's view; tell what changed."""
        p = self.peers.get(addr)
        if p is None:
            return
        state = self.swim.state_of(addr)
        dead = state == swim.DEAD
        alive = p.heard and not dead and bool(p.node_id)
        was_alive, was_dead = p.alive, p.dead
        if alive:
            p.last_ok = time.time()
        if alive == was_alive and dead == was_dead:
            return
        p.alive, p.dead = alive, dead
        if dead:
            p.ready = False  # back, it is ready once it says so itself
        self._ring_version += 1
        if alive and not was_alive:
            log.info("peer %s (%s) is alive", p.addr, p.node_id)
            self.events.peer_alive(p)
        elif was_alive and not alive:
            log.warning("peer %s (%s) is dead", p.addr, p.node_id or "?")
            self.events.peer_dead(p)
        elif dead:
            log.info("peer %s has not been heard of: treated as dead until it is", p.addr)
        self.events.peers_changed()
        self._changed.set()
        self._changed = trio.Event()

    def _partners(self) -> list[str]:
        """This host's replica partners (its K successors and predecessors on the
        placement ring of the hosts alive), as addresses: probed most often."""
        k = self.local.replicas
        if k < 1:
            return []
        if self._ring[0] != self._ring_version:
            live = {p.node_id: p for p in self.peers.values() if p.alive}
            order = placement.ring([(self.node_id, self.local.domain),
                                    *((n, p.domain) for n, p in live.items())])
            addrs = {n: p.addr for n, p in live.items()}
            self._ring = (self._ring_version, order, addrs)
        _, order, addrs = self._ring
        near = placement.partners(order, self.node_id, k, lambda n: n in addrs)
        return [addrs[n] for n in near]

    # -- datagrams ---------------------------------------------------------------------

    def open(self) -> None:
        """Bind the datagram socket (before the peer tier waits for its peers)."""
        if not self.endpoint.bound:
            try:
                self.endpoint = Endpoint(self.me, self._take)
            except OSError as e:
                raise OSError(e.errno, f"membership datagrams: cannot bind UDP {self.me}: "
                                       f"{e.strerror}") from None

    def _send(self, out: swim.Out) -> None:
        if not self.endpoint.bound:
            return
        for dst, msg in out:
            if msg.kind == swim.PING and dst in self.peers:
                self._pings[msg.seq] = (dst, time.monotonic())
            if self.quick.covers(dst, msg):
                continue
            m = _datagram(self.me, self.local, msg)
            for u in msg.updates:
                up = m.updates.add(node=u.node, state=u.state, incarnation=u.incarnation)
                p = self.peers.get(u.node)
                if p is not None:
                    up.node_id, up.failure_domain, up.data_port = p.node_id, p.domain, p.data_port
                elif u.node == self.me:
                    up.node_id, up.failure_domain = self.local.node_id, self.local.domain
                    up.data_port = self.local.data_port
            data = self.codec.seal(m, dst)
            if len(data) > 60_000 and len(m.updates) > 1:
                # A member list too long for one datagram (thousands of hosts): in halves.
                half = len(msg.updates) // 2
                for part in (msg.updates[:half], msg.updates[half:]):
                    self._send([(dst, swim.Message(msg.kind, msg.seq, msg.incarnation,
                                                   msg.target, part))])
                continue
            self.endpoint.send(dst, data)
        self._rearm()

    def _rearm(self) -> None:
        """Move the run loop's wake-up to the next timer now due: sooner for a probe
        sent or a suspicion heard, later for a probe answered (no wake-up for nothing)."""
        for sleep in self._sleep:
            sleep.deadline = self._trio_time(self._due())

    @staticmethod
    def _trio_time(t: float) -> float:
        """A time.monotonic() time on trio's clock."""
        return trio.current_time() + max(0.0, t - time.monotonic())

    def _due(self) -> float:
        """When the run loop next has something to do (SWIM's timers and ours); the
        loop sleeps until then (SWIM judges its lateness by it)."""
        due = self.swim.next_due(plan=True)
        if self.peers_file:
            due = min(due, self._next_file)
        if self._pings:
            due = min(due, min(sent for _, sent in self._pings.values())
                      + self.swim.config.period)
        if self._cut:
            due = min(due, self._recheck_at)
        return due

    def _take(self, data: bytes) -> pb.GossipMessage | None:
        """In the datagram thread: open a datagram; a ping is answered at once."""
        m = self.codec.open(data)
        if m is not None:
            self.quick.answer(m, self.endpoint.send)
        return m

    def receive(self, data: bytes, now: float) -> None:
        m = self._take(data)
        if m is not None:
            self.on_datagram(m, now)

    def on_datagram(self, m: pb.GossipMessage, now: float) -> None:
        src = m.from_node
        p = self.peers.get(src)
        if p is None or p.removed:
            # Not a host of ours (we were not given its address), but one of the job (it
            # has the token): answer its pings, so that it counts us alive; nothing more.
            if m.kind == swim.PING:
                self._send([(src, swim.Message(swim.ACK, seq=m.seq,
                                               incarnation=self.swim.incarnation,
                                               target=self.me))])
            return
        if m.node_id == self.node_id:
            log.error("peer %s speaks with our own node id %s: ignoring it", src, self.node_id)
            return
        try:
            security.check_node_id(m.node_id, "node id")
        except security.BadRequest:
            return
        if named(p, m.node_id, m.failure_domain, m.data_port):
            self._ring_version += 1
        was_ready = p.ready
        p.ram_free, p.ready = m.ram_free, m.ready
        p.heard_at = time.monotonic()
        if p.ready and not was_ready and p.alive:
            # Back alive by gossip before it spoke to us, or done joining: now it says
            # it is caught up.
            self.events.peer_ready(p)
        if m.kind == swim.ACK:
            if self._hellos.get(m.seq) == src:
                del self._hellos[m.seq]
                self.answered.add(src)
            ping = self._pings.get(m.seq)
            if ping is not None and ping[0] == src:
                del self._pings[m.seq]
                p.missed = 0
                if p.unreachable:
                    p.unreachable = False
                    log.info("peer %s (%s) answers this host again", src, p.node_id)
        updates = []
        metas = []
        for u in m.updates:
            if u.node != self.me and u.node not in self.peers:
                continue
            updates.append(swim.Update(u.node, u.state, u.incarnation))
            metas.append(u)
        msg = swim.Message(m.kind, m.seq, m.incarnation, m.target, tuple(updates))
        self._send(self.swim.on_message(src, msg, now))
        # Heard of directly, at the incarnation it sent.
        if self.swim.members.get(src) is not None and \
                self.swim.members[src].incarnation == m.incarnation:
            p.heard = True
        self._refresh(src)
        for u in metas:
            q = self.peers.get(u.node)
            if q is None or q is p:
                continue
            held = self.swim.members.get(u.node)
            if held is None or held.incarnation != u.incarnation or u.state == swim.DEAD:
                self._refresh(u.node)
                continue
            if u.node_id and u.incarnation > 0:
                try:
                    security.check_node_id(u.node_id, "node id")
                except security.BadRequest:
                    continue
                if u.node_id == self.node_id:
                    continue
                if named(q, u.node_id, u.failure_domain, u.data_port):
                    self._ring_version += 1
                if not q.alive:
                    q.ready = False  # not known until it speaks to us
                q.heard = True
            self._refresh(u.node)

    # -- what the peer tier asks -------------------------------------------------------

    def hello_all(self, only_unheard: bool = True) -> None:
        """Ping the peers not heard of (or all): each answers with its incarnation and
        description. Once, at start or when a holder is not known yet: O(N) datagrams."""
        for p in list(self.peers.values()):
            if not only_unheard or not p.alive:
                self.hello(p.addr)

    def hello(self, addr: str) -> None:
        """A ping (no probe) whose answer says `addr` knows this host now."""
        out = self.swim.hello(addr)
        if len(self._hellos) > 4 * len(self.peers) + 64:
            self._hellos.clear()
        self._hellos[out[0][1].seq] = addr
        self._send(out)

    def join(self, seed: Peer) -> None:
        """Ask one live host for its member list (adopted as it is)."""
        self._send(self.swim.join(seed.addr))

    async def changed(self, timeout: float) -> None:
        """Wait until a peer's liveness changes, or `timeout`."""
        with trio.move_on_after(timeout):
            await self._changed.wait()

    async def check_all(self, wait: bool = False) -> None:
        """Ask every peer not alive to answer now; wait a moment for the answers."""
        self.hello_all()
        if self.unresolved() or wait:
            await self.changed(0.5)

    def mark_alive(self, addr: str, node_id: str) -> None:
        """A peer at `addr` is pulling our snapshot: it is up. Ask it to say so (its
        answer carries its incarnation)."""
        self.poke(addr)

    def failed(self, p: Peer, why: str, dead_now: bool = False) -> None:
        """A call to `p` failed: probe it now (SWIM decides whether it is dead)."""
        log.debug("peer %s: %s: probing it", p.addr, why)
        if p.addr in self.peers:
            self._send(self.swim.probe(p.addr, time.monotonic()))

    def gone(self, addresses: list[str], reason: str) -> int:
        """Word from outside (mtcfs controller: Kubernetes deleted or evicted these
        hosts' pods) that they are gone: each one known and not dead yet is probed at
        once, and declared dead without the suspicion period if it does not answer
        (mtcfs.peer.swim.Swim.gone). Returns how many are probed."""
        now = time.monotonic()
        probed = 0
        for addr in addresses:
            p = self.peers.get(addr)
            if p is None or p.dead or addr == self.me:
                continue
            log.info("peer %s (%s) is gone by word from outside (%s): probing it now",
                     addr, p.node_id or "?", reason or "no reason given")
            self._send(self.swim.gone(addr, now))
            probed += 1
        return probed

    def needs_poke(self, addr: str) -> bool:
        """Called from a gRPC thread: only a peer we think is down needs the trio thread."""
        p = self.peers.get(addr)
        return p is not None and not p.alive

    def poke(self, addr: str) -> None:
        """A peer at `addr` just called us: ping it if we think it is down."""
        p = self.peers.get(addr)
        if p is not None and not p.alive:
            self.hello(addr)

    async def run(self) -> None:
        self.open()
        self.endpoint.start(trio.lowlevel.current_trio_token())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._receive_loop)
            while True:
                now = time.monotonic()
                if now >= self._next_file:
                    self._next_file = now + FILE_CHECK
                    self._watch_file()
                self.local.ram_free = self.ram.free
                self.quick.came_round()
                # What came while this loop was away is read before SWIM's timers judge
                # (after a stall, acks and refutations wait in the socket).
                for m in self.endpoint.drain():
                    self.on_datagram(m, now)
                self._send(self.swim.tick(now))
                self._direct(now)
                # Asleep until the next timer (an idle host: a few wake-ups a second,
                # not one every TICK); messages move it (_rearm).
                with trio.CancelScope(deadline=self._trio_time(self._due())) as sleep:
                    self._sleep.append(sleep)
                    try:
                        await trio.sleep_forever()
                    finally:
                        self._sleep.clear()

    def _direct(self, now: float) -> None:
        """Count this host's pings that went unanswered; ping unreachable peers again."""
        late = now - self.swim.config.period
        for seq, (addr, sent) in list(self._pings.items()):
            if sent > late:
                continue
            del self._pings[seq]
            p = self.peers.get(addr)
            if p is None:
                continue
            p.missed += 1
            if p.missed >= MISSED_DIRECT and not p.unreachable and not p.dead:
                p.unreachable = self._cut = True
                log.warning("peer %s (%s) does not answer this host's pings: not asked for "
                            "data until it does", addr, p.node_id or "?")
        if self._cut and now >= self._recheck_at:
            self._recheck_at = now + RECHECK
            cut = [p for p in self.peers.values() if p.unreachable and not p.dead]
            self._cut = bool(cut)
            for p in self._rng.sample(cut, min(RECHECK_MAX, len(cut))):
                self._send(self.swim.hello(p.addr))

    async def _receive_loop(self) -> None:
        while True:
            got = await self.endpoint.receive()
            self.quick.came_round()
            for m in got:
                self.on_datagram(m, time.monotonic())

    def _watch_file(self) -> None:
        if not self.peers_file:
            return
        try:
            mtime = os.stat(self.peers_file).st_mtime
        except OSError:
            return
        if mtime != self._file_mtime:
            self._file_mtime = mtime
            self.sync_addresses()

    def status(self) -> dict[str, object]:
        out: dict[str, object] = {"swim": self.swim.status()}
        if self.endpoint.bound:
            e = self.endpoint
            out["datagrams"] = {"sent": e.sent, "received": e.received, "bytes_sent": e.bytes_sent,
                                "bytes_received": e.bytes_received, "send_errors": e.send_errors,
                                **self.quick.counts(), "dropped": vars(self.codec.dropped)}
        return out

    def stub_for(self, addr: str) -> pb_grpc.PeerStub:
        """A peer's gRPC stub, or a stranger's (_Strangers)."""
        p = self.peers.get(addr)
        return p.stub if p is not None else self._strangers.stub(addr)

    def close(self) -> None:
        for p in self.peers.values():
            p.conn.close()
        self._strangers.close()
        self.endpoint.close()

