"""Tree messages on the data channel's streams (mtcfs.peer.treelinks) over real
sockets and a real channel server (mtcfs.peer.bulk.BulkServer), without FUSE.

The membership is a plain table of peers (what TreeLinks reads of it), and the
gRPC transport behind the streams is a recorder: the real one is driven by the
multi-daemon tests (tests/test_bulk.py: a host without a data channel)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from mtcfs.peer import fanout
from mtcfs.peer.bulk import BulkPool, BulkServer, Keys
from mtcfs.peer.datachannel import DataChannel
from mtcfs.peer.membership import Peer
from mtcfs.peer.treelinks import TreeLinks
from mtcfs.peer.v1 import peer_pb2 as pb

from support.mounts import wait_until

TOKEN = b"a-shared-token-of-32-bytes-12345"
ADDR = "127.0.0.1:7001"  # the receiver's gRPC address (nothing listens: never called)


class Receiver:
    """The receiving daemon's side: takes tree messages in order; `gate` holds it
    (its stream's thread then stops reading, and the sender's socket fills)."""

    def __init__(self) -> None:
        self.got: list[pb.TreeMessage] = []
        self.gate = threading.Event()
        self.gate.set()

    def run(self, fn: Any, *args: Any) -> Any:
        self.gate.wait(30)
        return fn(*args)

    def on_tree(self, m: pb.TreeMessage, reply: bool = True) -> None:
        assert not reply
        self.got.append(m)


@dataclass
class Members:
    me: str = "127.0.0.1:7000"
    peers: dict[str, Peer] = field(default_factory=dict)


class Grpc:
    """Records what went by gRPC."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    def forward(self, addr: str, msg: object, outcome: Any) -> bool:
        self.sent.append((addr, msg))
        return False

    def close(self) -> None:
        pass

    def status(self) -> dict[str, int]:
        return {"by_grpc": len(self.sent)}


def links_to(port: int) -> tuple[TreeLinks, Grpc]:
    members = Members()
    members.peers[ADDR] = Peer(ADDR, None, node_id="node-r", alive=True,  # type: ignore[arg-type]
                               data_port=port)
    channel = DataChannel(BulkPool(Keys(TOKEN), None, 1), lambda h, t: None)  # type: ignore
    grpc = Grpc()
    return TreeLinks(members, channel, grpc), grpc  # type: ignore[arg-type]


def forward(seq: int, entries: int) -> fanout.Forward:
    batch = pb.ChangeBatch(from_node="node-w", entries=[
        pb.Entry(id=f"g{seq}x{k}", parent="p1", name=b"f" * 200, mode=0o100644, size=k,
                 version=1, writer="node-w") for k in range(entries)])
    return fanout.Forward("127.0.0.1:7002", seq, "127.0.0.1:7003", batch, batch.ByteSize())


def failed_outcomes() -> tuple[list[int], Any]:
    failed: list[int] = []

    def outcome(reply: pb.TreeReply | None, late: bool) -> None:
        failed.append(1)
        assert reply is None

    return failed, outcome


@contextlib.contextmanager
def receiving() -> Iterator[tuple[Receiver, BulkServer, TreeLinks, Grpc, list[int], Any]]:
    """A receiving channel server and this host's links to it; closed after."""
    receiver = Receiver()
    server = BulkServer(receiver, receiver.run, Keys(TOKEN), ("127.0.0.1", 0))  # type: ignore
    server.start()
    links, grpc = links_to(server.port)
    failed, outcome = failed_outcomes()
    try:
        yield receiver, server, links, grpc, failed, outcome
    finally:
        links.close()
        server.stop()


def test_messages_arrive_in_order_also_when_the_receivers_socket_is_full():
    """The sender writes frames itself while the socket takes them whole; once the
    receiver stops reading, its thread finishes the frame cut short and what
    queued behind it, and everything arrives once, in order."""
    with receiving() as (receiver, server, links, grpc, failed, outcome):
        sent = []
        for seq in range(1, 21):
            sent.append(seq)
            assert links.forward(ADDR, forward(seq, 1), outcome)
        wait_until(lambda: len(receiver.got) == 20, 10, what="the first messages")
        receiver.gate.clear()  # the receiver stops taking them: its socket fills
        for seq in range(21, 1201):
            sent.append(seq)
            assert links.forward(ADDR, forward(seq, 40), outcome)
        st = links.status()
        assert st["written_at_once"] < st["streamed"], st  # (some went by the thread)
        receiver.gate.set()
        wait_until(lambda: len(receiver.got) == len(sent), 30, what="every message")
        assert [m.seq for m in receiver.got] == sent
        assert all(len(m.batch.entries) == (1 if m.seq <= 20 else 40) for m in receiver.got)
        assert not failed and not grpc.sent
        assert links.status()["streams_opened"] == 1
        assert server.status()["tree_messages"] == len(sent)


def test_a_peer_whose_channel_does_not_answer_gets_its_messages_by_grpc():
    """A stream that cannot connect fails its message (the broadcaster resends it)
    and the peer's next messages go by gRPC for a while."""
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    links, grpc = links_to(port)
    failed, outcome = failed_outcomes()
    try:
        assert links.forward(ADDR, forward(1, 1), outcome)  # (taken: the thread connects)
        wait_until(lambda: failed, 10, what="the message failed")
        assert links.status()["stream_failures"] == 1
        assert links.forward(ADDR, forward(2, 1), outcome) is False  # by gRPC
        assert [(a, m.seq) for a, m in grpc.sent] == [(ADDR, 2)]  # type: ignore[attr-defined]
    finally:
        links.close()


def test_a_peer_without_a_data_channel_gets_every_message_by_grpc():
    links, grpc = links_to(0)
    failed, outcome = failed_outcomes()
    assert links.forward(ADDR, forward(1, 1), outcome) is False
    assert len(grpc.sent) == 1 and links.status()["streams_opened"] == 0
    links.close()


def test_a_host_declared_gone_gets_a_new_stream_and_what_its_old_one_held_fails():
    """A host declared dead (or restarted) while its stream is full: the stream is
    dropped at once, what it held fails (the tree resends what it must), and the
    next message goes down a new stream, not behind the old one's bytes, and not
    by gRPC."""
    with receiving() as (receiver, server, links, grpc, failed, outcome):
        assert links.forward(ADDR, forward(1, 1), outcome)
        wait_until(lambda: len(receiver.got) == 1, 10, what="the first message")
        receiver.gate.clear()  # as a host cut off: nothing more is read
        for seq in range(2, 1202):
            assert links.forward(ADDR, forward(seq, 40), outcome)
        wait_until(lambda: links.status()["written_at_once"] < links.status()["streamed"], 10,
                   what="the stream to fill")
        links.gone(ADDR)
        wait_until(lambda: failed, 10, what="the held messages to fail")
        receiver.gate.set()
        assert links.forward(ADDR, forward(5000, 1), outcome)
        wait_until(lambda: any(m.seq == 5000 for m in receiver.got), 10,
                   what="the message on the new stream")
        st = links.status()
        assert st["streams_opened"] == 2 and st["stream_failures"] == 0, st
        assert not grpc.sent
