"""Tree messages over the data channel: one framed stream per peer, gRPC behind it.

A save sends every host a few hundred small tree messages (mtcfs.peer.fanout's
forwards and acks). As gRPC calls each cost both sides far more than its bytes:
a future and its completion-queue thread (started afresh for a channel with no
call in flight), the server's polling and handler threads, a handler that waits
for the trio thread. On the data channel a message is one authenticated frame
(mtcfs.peer.bulk: Conn.send_tree) on a connection kept open to that peer,
written by a thread of the peer's own (a peer whose socket is full, or that
does not answer a connect, holds up no other) and handed to the receiver's trio
thread without a reply: acks travel as messages of their own, on the
receiver's stream to the sender.

A message handed to the kernel counts as delivered (as a returned gRPC call
did): the tree waits for its ack, and the receiver's death or restart resends
it (mtcfs.peer.fanout). Messages to a peer without a data channel go by gRPC
(TreeCalls). A stream that fails (a connect or a send) fails the messages it
held, as a failed call does (the broadcaster sends them again shortly), and the
peer's messages go by gRPC for DOWN seconds; a peer that refuses streams (an
older mtcfs) gets gRPC for REFUSED_DOWN.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from mtcfs.peer import wire
from mtcfs.peer.bulk import Conn, Remote
from mtcfs.peer.datachannel import DataChannel, data_address
from mtcfs.peer.dissemination import Outcome, TreeCalls
from mtcfs.peer.membership import Membership
from mtcfs.peer.v1 import peer_pb2 as pb

log = logging.getLogger(__name__)

IDLE = 120.0  # seconds a stream with nothing to send stays open (its thread ends)
DOWN = 10.0  # seconds a peer's messages go by gRPC after its stream failed
REFUSED_DOWN = 600.0  # ... after it refused a stream (another version of mtcfs)
DELIVERED = pb.TreeReply()  # what a sent message's outcome is told: handed over, no ack


@dataclass
class Counters:
    streamed: int = 0  # tree messages sent on streams
    streams_opened: int = 0
    stream_failures: int = 0  # connects and sends that failed (then gRPC for a while)


@dataclass(eq=False)
class _Link:
    """The stream to one peer's data channel and the thread that writes it."""

    to: tuple[str, int]  # the peer's data channel
    addr: str  # its gRPC address (what the fallback and the log name)
    queue: queue.SimpleQueue[tuple[object, Outcome]] = field(
        default_factory=queue.SimpleQueue)
    open: bool = True  # takes messages (False once its thread ends or is ending)


class TreeLinks:
    def __init__(self, members: Membership, channel: DataChannel, grpc: TreeCalls) -> None:
        """`channel`: the data channel (NoDataChannel: every message by gRPC);
        `grpc`: the gRPC transport, for peers without a stream."""
        self.members = members
        self.channel = channel
        self.grpc = grpc
        self.counters = Counters()
        self._links: dict[tuple[str, int], _Link] = {}
        self._down: dict[tuple[str, int], float] = {}  # data address -> gRPC until
        self._lock = threading.Lock()
        self._closed = False

    def forward(self, addr: str, msg: object, outcome: Outcome) -> None:
        """Send `msg` to `addr` (trio thread): on its stream if it has one, else by gRPC.
        `outcome` as TreeCalls.forward's (a streamed message: the empty reply once sent)."""
        p = self.members.peers.get(addr)
        if p is None or not self.channel.reaches(p):
            self._by_grpc(addr, msg, outcome)
            return
        to = data_address(p)
        with self._lock:
            if self._closed or time.monotonic() < self._down.get(to, 0.0):
                link = None
            else:
                link = self._links.get(to)
                if link is None or not link.open:
                    link = self._links[to] = _Link(to, addr)
                    threading.Thread(target=self._run, args=(link,), daemon=True,
                                     name="tree-link").start()
                link.queue.put((msg, outcome))
        if link is None:
            self._by_grpc(addr, msg, outcome)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links = list(self._links.values())
        for link in links:
            link.queue.put((None, _nothing))
        self.grpc.close()

    def _by_grpc(self, addr: str, msg: object, outcome: Outcome) -> None:
        self.grpc.forward(addr, msg, outcome)

    def _run(self, link: _Link) -> None:
        conn: Conn | None = None
        try:
            while True:
                try:
                    msg, outcome = link.queue.get(timeout=IDLE)
                except queue.Empty:
                    with self._lock:
                        if link.queue.empty():  # (else a message came meanwhile)
                            link.open = False
                            return
                    continue
                if msg is None:
                    return
                try:
                    if conn is None:
                        conn = self.channel.tree_stream(link.to)
                        self.counters.streams_opened += 1
                    conn.send_tree(wire.tree_to_pb(self.members.me, msg).SerializeToString())
                except (OSError, Remote) as e:
                    self._failed(link, e, (msg, outcome))
                    return
                self.counters.streamed += 1
                outcome(DELIVERED, False)
        finally:
            if conn is not None:
                conn.close()

    def _failed(self, link: _Link, e: Exception, first: tuple[object, Outcome]) -> None:
        """The stream failed: this message and those queued behind it failed (their
        resends go by gRPC, as the peer's next messages for a while)."""
        self.counters.stream_failures += 1
        refused = isinstance(e, Remote)
        log.log(logging.WARNING if refused else logging.DEBUG,
                "tree stream to %s: %s; its tree messages go by gRPC for %.0f s",
                link.addr, e, REFUSED_DOWN if refused else DOWN)
        with self._lock:
            link.open = False
            self._down[link.to] = time.monotonic() + (REFUSED_DOWN if refused else DOWN)
        left = [first]
        while not link.queue.empty():
            left.append(link.queue.get())
        for _, outcome in left:
            outcome(None, False)

    def status(self) -> dict[str, int]:
        with self._lock:
            open_now = sum(lk.open for lk in self._links.values())
        return {**vars(self.counters), **self.grpc.status(), "streams": open_now}


def _nothing(reply: pb.TreeReply | None, late: bool) -> None:
    pass
