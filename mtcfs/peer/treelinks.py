"""Tree messages over the data channel: one framed stream per peer, gRPC behind it.

A save sends every host a few hundred small tree messages (mtcfs.peer.fanout's
forwards and acks). As gRPC calls each cost both sides far more than its bytes:
a future and its completion-queue thread (started afresh for a channel with no
call in flight), the server's polling and handler threads, a handler that waits
for the trio thread. On the data channel a message is one authenticated frame
(mtcfs.peer.bulk: Conn.tree_frame) on a connection kept open to that peer.

The trio thread writes a frame itself when the stream takes it whole without
waiting (the common case: a message is small, the socket's buffer empty), so a
message costs no hand-over to another thread; the receiver's trio thread reads
it likewise (bulk.TrioReaders). The stream's own thread connects, writes what
a full socket left over and whatever queued behind it, and writes every frame
on TLS: a peer whose socket is full, or that does not answer a connect, holds
up neither the trio thread nor another peer's stream.

A message put on a stream counts as delivered (as a returned gRPC call did):
the tree waits for its ack, and the receiver's death or restart resends it
(mtcfs.peer.fanout). Messages to a peer without a data channel go by gRPC
(TreeCalls). A stream that fails (a connect or a send) fails the messages it
held, as a failed call does (the broadcaster sends them again shortly), and the
peer's messages go by gRPC for DOWN seconds; a peer that refuses streams (an
older mtcfs) gets gRPC for REFUSED_DOWN.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from mtcfs.peer import wire
from mtcfs.peer.bulk import STALL_TIMEOUT, Conn, Remote
from mtcfs.peer.datachannel import DataChannel, data_address
from mtcfs.peer.dissemination import Outcome, TreeCalls
from mtcfs.peer.membership import Membership
from mtcfs.peer.v1 import peer_pb2 as pb

log = logging.getLogger(__name__)

IDLE = 120.0  # seconds a stream with nothing to send stays open (its thread ends)
DOWN = 10.0  # seconds a peer's messages go by gRPC after its stream failed
REFUSED_DOWN = 600.0  # ... after it refused a stream (another version of mtcfs)
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets, unsent bytes dropped


@dataclass
class Counters:
    streamed: int = 0  # tree messages sent on streams
    written_at_once: int = 0  # ... of them written by the trio thread itself
    streams_opened: int = 0
    stream_failures: int = 0  # connects and sends that failed (then gRPC for a while)


Item = tuple[object, Outcome]  # a message, or a frame's bytes left to write; its outcome


@dataclass(eq=False)
class _Link:
    """The stream to one peer's data channel and the thread that connects and writes
    what the trio thread does not."""

    to: tuple[str, int]  # the peer's data channel
    addr: str  # its gRPC address (what the fallback and the log name)
    queue: queue.SimpleQueue[Item] = field(default_factory=queue.SimpleQueue)
    open: bool = True  # takes messages (False once its thread ends or is ending)
    conn: Conn | None = None  # once connected
    # The thread writes (connecting, finishing a frame, or TLS): the trio thread queues
    # behind it. False only on plain TCP with nothing queued.
    busy: bool = True
    used: float = 0.0  # last written by the trio thread (the thread's idle clock)
    gone: bool = False  # dropped: its host was declared dead or restarted


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
        self._to: dict[str, tuple[int, tuple[str, int]]] = {}  # addr -> (port, channel)
        self._lock = threading.Lock()
        self._closed = False

    def forward(self, addr: str, msg: object, outcome: Outcome) -> bool:
        """Send `msg` to `addr` (trio thread): on its stream if it has one (True: taken,
        the receiver has it as far as the tree is concerned; `outcome` is told only
        if the stream fails), else by gRPC (False: `outcome` as TreeCalls.forward's)."""
        to = self._stream_to(addr)
        now = time.monotonic()
        with self._lock:
            if to is None or self._closed or now < self._down.get(to, 0.0):
                link = None
            else:
                link = self._links.get(to)
                if link is None or not link.open:
                    link = self._links[to] = _Link(to, addr)
                    threading.Thread(target=self._run, args=(link,), daemon=True,
                                     name="tree-link").start()
                if link.busy:
                    link.queue.put((msg, outcome))
                    return True
                link.used = now
        if link is None:
            return self.grpc.forward(addr, msg, outcome)
        self._write_now(link, msg, outcome)
        return True

    def _write_now(self, link: _Link, msg: object, outcome: Outcome) -> None:
        """Write the frame from the trio thread without waiting: what the socket does
        not take now goes to the link's thread (in order: it writes all that follows
        until it catches up)."""
        conn = link.conn
        assert conn is not None
        frame = conn.tree_frame(self._encode(msg))
        try:
            n = conn.sock.send(frame)
        except BlockingIOError:
            n = 0
        except OSError as e:
            with self._lock:
                link.busy = True  # (nothing more written here; the thread ends it)
            self._failed(link, e, (msg, outcome))
            link.queue.put((None, _nothing))
            return
        self.counters.streamed += 1
        if n == len(frame):
            self.counters.written_at_once += 1
            return
        with self._lock:
            link.busy = True
            link.queue.put((frame[n:], outcome))

    def _encode(self, msg: object) -> bytes:
        return wire.tree_to_pb(self.members.me, msg).SerializeToString()

    def _stream_to(self, addr: str) -> tuple[str, int] | None:
        """The data channel of the peer at `addr` (None: it has none): parsed once per
        data port it announces."""
        p = self.members.peers.get(addr)
        if p is None or not self.channel.reaches(p):
            return None
        known = self._to.get(addr)
        if known is None or known[0] != p.data_port:
            known = self._to[addr] = (p.data_port, data_address(p))
        return known[1]

    def gone(self, addr: str) -> None:
        """`addr` was declared dead or restarted: its stream is dropped at once, its
        unsent bytes with it (a reset), and its queued messages fail as a stream's
        do. The next message to it opens a new stream: one through a cut would hold
        it behind bytes TCP retransmits with a backoff of seconds."""
        known = self._to.get(addr)
        with self._lock:
            link = self._links.pop(known[1], None) if known is not None else None
            if link is None:
                return
            link.open, link.busy, link.gone = False, True, True
            conn = link.conn
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
                conn.sock.shutdown(socket.SHUT_RDWR)  # (a write it waits in fails)
        link.queue.put((None, _nothing))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links = list(self._links.values())
            for link in links:
                link.busy = True
        for link in links:
            link.queue.put((None, _nothing))
        self.grpc.close()

    # -- the link's thread ---------------------------------------------------------------

    def _run(self, link: _Link) -> None:
        try:
            while True:
                try:
                    msg, outcome = link.queue.get(timeout=IDLE)
                except queue.Empty:
                    with self._lock:
                        if link.queue.empty() and time.monotonic() - link.used >= IDLE:
                            link.open = link.busy = False  # (a new one is made if needed)
                            return
                    continue
                if link.gone:
                    self._fail_queued(link, (msg, outcome))
                    return
                if msg is None:
                    return
                try:
                    conn = link.conn or self._connect(link)
                    if isinstance(msg, bytes):
                        _write(conn, msg)  # the rest of a frame the trio thread began
                    else:
                        self.counters.streamed += 1
                        _write(conn, conn.tree_frame(self._encode(msg)))
                except (OSError, Remote) as e:
                    self._failed(link, e, (msg, outcome))
                    return
                with self._lock:
                    if link.queue.empty() and link.conn.plain and not self._closed:
                        link.busy = False  # the trio thread writes the next one itself
        finally:
            if link.conn is not None:
                link.conn.close()

    def _connect(self, link: _Link) -> Conn:
        conn = self.channel.tree_stream(link.to)
        if conn.plain:
            conn.sock.setblocking(False)  # (the trio thread must never wait on it)
        self.counters.streams_opened += 1
        link.conn = conn
        return conn

    def _failed(self, link: _Link, e: Exception, first: Item) -> None:
        """The stream failed: this message and those queued behind it failed (their
        resends go by gRPC, as the peer's next messages for a while)."""
        if link.gone:  # (dropped on purpose: its messages fail, no gRPC spell)
            self._fail_queued(link, first)
            return
        self.counters.stream_failures += 1
        refused = isinstance(e, Remote)
        log.log(logging.WARNING if refused else logging.DEBUG,
                "tree stream to %s: %s; its tree messages go by gRPC for %.0f s",
                link.addr, e, REFUSED_DOWN if refused else DOWN)
        with self._lock:
            link.open = False
            self._down[link.to] = time.monotonic() + (REFUSED_DOWN if refused else DOWN)
        self._fail_queued(link, first)

    @staticmethod
    def _fail_queued(link: _Link, first: Item) -> None:
        left = [first]
        while not link.queue.empty():
            left.append(link.queue.get())
        for _, outcome in left:
            outcome(None, False)

    def status(self) -> dict[str, int]:
        with self._lock:
            open_now = sum(lk.open for lk in self._links.values())
        return {**vars(self.counters), **self.grpc.status(), "streams": open_now}


def _write(conn: Conn, data: bytes) -> None:
    """All of `data`, from the link's thread: on plain TCP (a socket that never
    blocks) waiting for room up to the stall timeout; on TLS as the socket does."""
    if not conn.plain:
        conn.sock.sendall(data)
        return
    view = memoryview(data)
    poll = select.poll()
    poll.register(conn.sock, select.POLLOUT)
    while view:
        try:
            view = view[conn.sock.send(view):]
        except BlockingIOError:
            if not poll.poll(STALL_TIMEOUT * 1000):
                raise TimeoutError(f"no room to write for {STALL_TIMEOUT:g} s") from None


def _nothing(reply: pb.TreeReply | None, late: bool) -> None:
    pass
