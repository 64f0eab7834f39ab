"""Who the peers are and whether they are alive.

Addresses come from --peers and --peers-file (re-read when it changes). Each
peer is health-checked every second; three failed checks in a row (or a
failed call) mark it dead, so a dead peer is noticed within ~3 s and skipped.
A peer seen alive again is caught up: this node pulls its snapshot.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Protocol

import grpc
import trio

from mtcfs.peer import security
from mtcfs.peer.addresses import AddressError, read_peers_file
from mtcfs.peer.v1 import peer_pb2 as pb
from mtcfs.peer.v1 import peer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

HEALTH_INTERVAL = 1.0
RETRY_INTERVAL = 0.25  # peers not (yet) alive are checked this often: joins are seen fast
HEALTH_TIMEOUT = 1.0
DEAD_AFTER = 3  # failed checks in a row
# A host down this long is gone for good: longer than a frozen daemon, a cut link or a
# daemon restarting over its RAM dir stays away (withdrawal, commit-marker uploads).
GONE_AFTER = 15.0


@dataclass(eq=False)
class Peer:
    addr: str
    channel: grpc.Channel
    stub: pb_grpc.PeerStub
    node_id: str = ""
    domain: str = ""
    alive: bool = False
    failures: int = 0
    last_ok: float = 0.0
    ram_free: int = 0
    data_port: int = 0  # its bulk data channel (mtcfs.peer.bulk); 0: gRPC only
    busy: int = 0  # transfers in flight to or from it
    removed: bool = False
    checking: bool = False
    next_check: float = 0.0

    @property
    def known_dead(self) -> bool:
        """Not alive and failed enough checks in a row: commits stop waiting for it."""
        return not self.alive and self.failures >= DEAD_AFTER

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
        }


class MembershipEvents(Protocol):
    """What membership tells (mtcfs.events.Listener has these)."""

    def peer_alive(self, peer: Peer) -> None: ...

    def peer_dead(self, peer: Peer) -> None: ...

    def peers_changed(self) -> None: ...


class _Unheard:
    def peer_alive(self, peer: Peer) -> None:
        pass

    def peer_dead(self, peer: Peer) -> None:
        pass

    def peers_changed(self) -> None:
        pass


class Membership:
    def __init__(self, me: str, node_id: str, static: list[str], peers_file: str | None,
                 secret: bytes | None, tls: tuple[bytes, bytes, bytes | None] | None,
                 events: MembershipEvents | None = None) -> None:
        self.me = me
        self.node_id = node_id
        self.static = static
        self.peers_file = peers_file
        self.metadata = security.call_metadata(secret)
        self.tls = tls
        self.events = events or _Unheard()
        self.peers: dict[str, Peer] = {}
        self._file_mtime = 0.0
        self._limiter = trio.CapacityLimiter(64)
        self._nursery: trio.Nursery | None = None
        self._started = time.time()
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
                self.peers[addr] = self._connect(addr)
                log.info("peer %s added", addr)
        for addr in list(self.peers):
            if addr not in want:
                p = self.peers.pop(addr)
                p.removed = True
                p.channel.close()
                log.info("peer %s removed", addr)
                self.events.peers_changed()

    def _connect(self, addr: str) -> Peer:
        channel = security.open_channel(addr, self.tls)
        return Peer(addr, channel, pb_grpc.PeerStub(channel))

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
        all while a configured peer has not answered yet (it may be that node)."""
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
        for p in self.peers.values():
            if p.node_id == node_id and p.alive:
                return p
        return None

    # -- health ----------------------------------------------------------------------

    async def check(self, p: Peer, wait: bool = False) -> bool:
        """One health check (none if one is running). wait: also while the channel is
        in reconnect backoff (up to the timeout)."""
        if p.checking:
            return p.alive
        p.checking = True
        try:
            return await self._check(p, wait)
        finally:
            p.checking = False
            healthy = p.alive and not p.failures
            p.next_check = time.monotonic() + (HEALTH_INTERVAL if healthy else RETRY_INTERVAL)

    async def _check(self, p: Peer, wait: bool) -> bool:
        try:
            reply = await trio.to_thread.run_sync(
                lambda: p.stub.Health(pb.HealthRequest(from_node=self.node_id, listen=self.me),
                                      timeout=HEALTH_TIMEOUT,
                                      metadata=self.metadata, wait_for_ready=wait),
                limiter=self._limiter)
        except grpc.RpcError as e:
            self.failed(p, f"health check: {e.code().name}: {e.details()}")
            return False
        if p.removed:
            return False
        if reply.node_id == self.node_id:
            log.error("peer %s answers with our own node id %s: ignoring it", p.addr,
                      self.node_id)
            self.failed(p, "same node id", dead_now=True)
            return False
        p.node_id, p.domain, p.ram_free = reply.node_id, reply.failure_domain, reply.ram_free
        p.data_port = reply.data_port
        self._alive(p)
        return True

    def _alive(self, p: Peer) -> None:
        p.failures, p.last_ok = 0, time.time()
        if not p.alive:
            p.alive = True
            log.info("peer %s (%s) is alive", p.addr, p.node_id)
            self.events.peer_alive(p)
            self.events.peers_changed()

    def mark_alive(self, addr: str, node_id: str) -> None:
        """A peer at `addr` is pulling our snapshot: it is up, and from this moment
        every commit here waits for it (what it pulls misses nothing committed later)."""
        p = self.peers.get(addr)
        if p is None or p.removed or (p.node_id and p.node_id != node_id):
            return
        if node_id == self.node_id:
            return
        p.node_id = node_id
        self._alive(p)
        if not p.data_port and self._nursery is not None:
            # Alive without a health reply: its data channel's port is not known yet.
            p.next_check = 0.0
            self._nursery.start_soon(self.check, p)

    def failed(self, p: Peer, why: str, dead_now: bool = False) -> None:
        was_dead = p.known_dead
        p.failures = DEAD_AFTER if dead_now else p.failures + 1
        if p.alive and p.failures >= DEAD_AFTER:
            p.alive = False
            log.warning("peer %s (%s) is dead: %s", p.addr, p.node_id or "?", why)
            self.events.peer_dead(p)
            self.events.peers_changed()
        elif p.known_dead and not was_dead:
            log.info("peer %s has not answered %d checks: treated as dead until it does (%s)",
                     p.addr, DEAD_AFTER, why)
            self.events.peers_changed()

    def unresolved(self) -> list[Peer]:
        """Configured peers neither alive nor known dead (e.g. not yet reached)."""
        return [p for p in self.peers.values() if not p.alive and not p.known_dead]

    def needs_poke(self, addr: str) -> bool:
        """Called from a gRPC thread: only a peer we think is down needs the trio thread."""
        p = self.peers.get(addr)
        return p is not None and not p.alive

    def poke(self, addr: str) -> None:
        """A peer at `addr` just called us: check it now if we think it is down."""
        p = self.peers.get(addr)
        if p is not None and not p.alive:
            p.next_check = 0.0
            if self._nursery is not None:
                self._nursery.start_soon(self.check, p)

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await self._loop()

    async def _loop(self) -> None:
        assert self._nursery is not None
        while True:
            self._watch_file()
            now = time.monotonic()
            for p in list(self.peers.values()):
                if now >= p.next_check and not p.checking:
                    self._nursery.start_soon(self.check, p)
            await trio.sleep(RETRY_INTERVAL)

    async def check_all(self, wait: bool = False) -> None:
        async with trio.open_nursery() as nursery:
            for p in list(self.peers.values()):
                nursery.start_soon(self.check, p, wait)

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

    def close(self) -> None:
        for p in self.peers.values():
            p.channel.close()
