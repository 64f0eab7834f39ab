"""Membership datagrams between daemons: SWIM's messages (mtcfs.peer.swim) over UDP.

Why UDP and not gRPC: a SWIM host sends a few small messages per second, and a
unary gRPC call from Python costs about a millisecond of CPU on each side, a
datagram a few microseconds (measured: docs/peers.md). SWIM tolerates loss by
design (indirect probes, suspicion, retransmitted gossip).

Each datagram is `MAGIC | GossipMessage | MAC`:

- The MAC is keyed BLAKE3 (32 bytes) over everything before it, under a key
  derived from the job's shared token (its own context: a key of the data
  channel or any other use does not open it). Without a token (--insecure) the
  key derives from the empty string: it only catches corruption.
- Inside the MAC: the receiver's address (`to`) and the send time in ns
  (`stamp`, strictly increasing per sender). A datagram meant for another
  host, older or newer than MAX_SKEW, older than REORDER behind the newest
  one seen from its sender, or seen already, is dropped: a recorded datagram
  replayed changes nothing.

The UDP socket is bound to the --listen address (UDP and TCP ports are distinct:
the gRPC server keeps the TCP port). A thread of its own reads it, so that a ping
is answered while the event loop is busy (mtcfs.peer.membership.QuickAcks).
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import trio
from blake3 import blake3
from google.protobuf.message import DecodeError

from mtcfs.peer.addresses import AddressError, parse_address
from mtcfs.peer.v1 import peer_pb2 as pb

log = logging.getLogger(__name__)

MAGIC = b"MTG1"
MAC_LEN = 32
MAX_DATAGRAM = 65507
MAX_SKEW = 30 * 10**9  # ns: hosts' clocks further apart than this cannot talk
REORDER = 2 * 10**9  # ns: a datagram this far behind its sender's newest is dropped
MAX_SENDERS = 4096  # replay windows kept before those past MAX_SKEW are forgotten

T = TypeVar("T")


def gossip_key(secret: bytes | None) -> bytes:
    return blake3(secret or b"", derive_key_context="mtcfs 2026 membership datagrams").digest()


@dataclass
class _Window:
    newest: int = 0
    seen: set[int] = field(default_factory=set)


@dataclass
class Dropped:
    """Datagrams refused, by reason (mtcfs status)."""

    malformed: int = 0
    bad_mac: int = 0
    misdirected: int = 0
    stale: int = 0
    replayed: int = 0


class Codec:
    """Seals and opens datagrams for the host at `me`."""

    def __init__(self, me: str, secret: bytes | None,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.me = me
        self._key = gossip_key(secret)
        self._clock = clock
        self._last = 0
        self._stamping = threading.Lock()  # seal() is called from two threads
        self._windows: dict[str, _Window] = {}
        self.dropped = Dropped()

    def _mac(self, body: bytes) -> bytes:
        return blake3(body, key=self._key).digest()

    def seal(self, m: pb.GossipMessage, to: str) -> bytes:
        with self._stamping:  # two equal stamps: the second is dropped as replayed
            self._last = max(self._last + 1, self._clock())
            m.to, m.stamp = to, self._last
        body = MAGIC + m.SerializeToString()
        return body + self._mac(body)

    def open(self, data: bytes) -> pb.GossipMessage | None:
        """The message, or None (counted) when it is not authentic, not for us, or
        replayed."""
        if len(data) < len(MAGIC) + MAC_LEN or not data.startswith(MAGIC):
            self.dropped.malformed += 1
            return None
        body, mac = data[:-MAC_LEN], data[-MAC_LEN:]
        if not hmac.compare_digest(self._mac(body), mac):
            self.dropped.bad_mac += 1
            return None
        try:
            m = pb.GossipMessage.FromString(body[len(MAGIC):])
        except DecodeError:
            self.dropped.malformed += 1
            return None
        if m.to != self.me:
            self.dropped.misdirected += 1
            return None
        try:  # the answer goes there: a sender that is no address is no peer
            parse_address(m.from_node, "sender")
        except AddressError:
            self.dropped.malformed += 1
            return None
        now = self._clock()
        if abs(m.stamp - now) > MAX_SKEW:
            self.dropped.stale += 1
            return None
        w = self._windows.get(m.from_node)
        if w is None:
            if len(self._windows) >= MAX_SENDERS:
                self._forget_stale(now)
            w = self._windows[m.from_node] = _Window()
        if m.stamp <= w.newest - REORDER or m.stamp in w.seen:
            self.dropped.replayed += 1
            return None
        w.seen.add(m.stamp)
        if m.stamp > w.newest:
            w.newest = m.stamp
            if len(w.seen) > 64:
                w.seen = {s for s in w.seen if s > w.newest - REORDER}
        return m

    def _forget_stale(self, now: int) -> None:
        """Drop the windows of senders silent for MAX_SKEW: any stamp such a window
        holds is refused as stale anyway (one window per address a token holder ever
        sent from would grow without bound)."""
        self._windows = {s: w for s, w in self._windows.items() if w.newest >= now - MAX_SKEW}

    def forget(self, sender: str) -> None:
        self._windows.pop(sender, None)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class Endpoint(Generic[T]):
    """A non-blocking UDP socket on this host's --listen address. Sends never wait
    (a full socket buffer drops the datagram: SWIM copes with loss).

    Datagrams are read by a thread of their own (start()) and passed to `take`
    there, as they arrive, whatever the event loop is doing: `take` opens them
    and may answer at once (membership's quick acks); what it returns waits in a
    queue for the loop (receive(), drain()). Before start() and in drain() the
    loop reads the socket itself; `take` runs under one lock, in one thread at a
    time."""

    bound = True  # (membership's stand-in before it binds says False)

    def __init__(self, listen: str, take: Callable[[bytes], T | None]) -> None:
        host, port = parse_address(listen, "--listen address")
        self.sock = socket.socket(_family(host), socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.sock.bind((host, port))
        self._take = take
        self._addrs: dict[str, tuple[str, int]] = {}
        self._taking = threading.Lock()
        self._taken: deque[T] = deque()
        self._token: trio.lowlevel.TrioToken | None = None
        self._arrived = trio.Event()
        self._wake_pending = False
        self._closed = False
        self.sent = 0
        self.received = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.send_errors = 0

    def _resolve(self, addr: str) -> tuple[str, int] | None:
        got = self._addrs.get(addr)
        if got is None:
            try:
                host, port = parse_address(addr, "peer address")
                infos = socket.getaddrinfo(host, port, self.sock.family, socket.SOCK_DGRAM)
            except (AddressError, OSError, UnicodeError) as e:  # (idna: a bad host name)
                log.warning("peer %s: %s", addr, e)
                return None
            got = self._addrs[addr] = infos[0][4][:2]
        return got

    def send(self, addr: str, data: bytes) -> None:
        to = self._resolve(addr)
        if to is None:
            return
        try:
            self.sock.sendto(data, to)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.ECONNREFUSED, errno.ENETUNREACH,
                               errno.EHOSTUNREACH, errno.EPERM, errno.EBADF):
                log.warning("datagram to %s: %s", addr, e)
            self.send_errors += 1
            return
        self.sent += 1
        self.bytes_sent += len(data)

    def start(self, token: trio.lowlevel.TrioToken) -> None:
        """Read in a thread of its own from now on, waking the loop of `token`."""
        if self._token is None:
            self._token = token
            threading.Thread(target=self._reader, name="datagrams", daemon=True).start()

    def _reader(self) -> None:
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        while not self._closed:
            poller.poll()  # (close() wakes it: shutdown)
            with self._taking:
                if self._closed:
                    return
                taken = self._read()
            if taken and not self._wake_pending:
                self._wake_pending = True
                try:
                    self._token.run_sync_soon(self._arrived.set)  # type: ignore[union-attr]
                except trio.RunFinishedError:
                    return

    def _read(self) -> int:
        """Take the datagrams waiting now (under _taking); how many were kept."""
        kept = 0
        while True:
            try:
                data = self.sock.recv(MAX_DATAGRAM + 1)
            except (BlockingIOError, InterruptedError):
                return kept
            except OSError as e:
                if e.errno == errno.EBADF:
                    return kept
                continue  # an ICMP error from an earlier send
            self.received += 1
            self.bytes_received += len(data)
            item = self._take(data)
            if item is not None:
                self._taken.append(item)
                kept += 1

    async def receive(self) -> list[T]:
        """What `take` kept (at least one item)."""
        while True:
            out = self.drain()
            if out:
                return out
            if self._token is None:
                await trio.lowlevel.wait_readable(self.sock)
                continue
            self._arrived = trio.Event()
            self._wake_pending = False  # from here on the reader wakes this event
            if not self._taken:
                await self._arrived.wait()

    def drain(self) -> list[T]:
        """What `take` kept, with what waits in the socket now (without waiting): after
        a stall the loop reads it even where the reader thread was starved too."""
        with self._taking:
            if not self._closed:
                self._read()
            out = list(self._taken)
            self._taken.clear()
        return out

    def forget(self, addr: str) -> None:
        self._addrs.pop(addr, None)

    def close(self) -> None:
        with self._taking:
            self._closed = True
            with contextlib.suppress(OSError):  # (unconnected: ENOTCONN, but it wakes poll)
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()
