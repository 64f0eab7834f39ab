"""The index trees under load: what keeps a slow job from sending itself into a retry
storm (64 daemons on two cores: forwards resent every 10 s to every child that had
not acked, and quickly again after each call that passed its deadline at a busy
receiver, while the receivers' handlers sat waiting for acks).

The handler test drives the real gRPC service class with a stand-in for the
daemon's peer handler (its batch is never acked): no network is needed to show
how many handlers wait. The deadline test runs a real gRPC server (a stand-in
servicer that answers a forward too late) and the daemon's real sending thread."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from typing import Any

import grpc
import pytest
import trio

from mtcfs.peer import dissemination, fanout, grouped, server
from mtcfs.peer.dissemination import Reply
from mtcfs.peer.v1 import peer_pb2 as pb
from mtcfs.peer.v1 import peer_pb2_grpc as pb_grpc


def test_the_daemons_tree_resends_to_a_child_that_does_not_ack_ever_less_often() -> None:
    tree = fanout.Fanout("h0", lambda: ["h1"], lambda origin, seq, payload: None,
                         retry=dissemination.TREE_RETRY, max_backoff=dissemination.TREE_BACKOFF)
    _, out = tree.publish(b"batch", 5, now=0.0)
    assert [dst for dst, _ in out] == ["h1"]
    resent = []
    now = 0.0
    while now < 200.0:
        now += 0.5
        if tree.tick(now):
            resent.append(now)
    gaps = [b - a for a, b in zip([0.0, *resent[:-1]], resent, strict=True)]
    assert gaps[:5] == [5.0, 10.0, 20.0, 40.0, 40.0], gaps
    assert len(resent) == 7  # every 10 s it was 20 (the old schedule)


class _NeverAcked:
    """Stands in for the daemon's peer handler: every forward is taken, none is acked."""

    def __init__(self) -> None:
        self.replies: list[Reply] = []

    def on_tree(self, msg: pb.TreeMessage) -> Reply:
        r = Reply()
        self.replies.append(r)
        return r


def test_only_a_few_forward_handlers_wait_for_their_ack_at_once() -> None:
    handler = _NeverAcked()
    took: list[float] = []
    lock = threading.Lock()

    async def serve() -> None:
        svc = server.GrpcService(handler, trio.lowlevel.current_trio_token())  # type: ignore[arg-type]
        msg = pb.TreeMessage(from_node="h1", origin="h1", seq=1, end="h9",
                             batch=pb.ChangeBatch(from_node="h1"))

        def one() -> None:
            t0 = time.monotonic()
            reply = svc.Forward(msg, _Context())
            assert not reply.acked
            with lock:
                took.append(time.monotonic() - t0)

        async with trio.open_nursery() as nursery:
            for _ in range(12):
                nursery.start_soon(trio.to_thread.run_sync, one)

    trio.run(serve)
    waited = [t for t in took if t >= server.TREE_REPLY_WAIT * 0.9]
    assert len(took) == 12
    assert len(waited) <= 8, took  # the others answered at once, their acks to follow
    assert len(took) - len(waited) >= 4
    # Each handler that gave up left its ack to a call of its own.
    assert all(r.abandoned for r in handler.replies)


class _Context:
    def abort(self, code: Any, details: str) -> None:
        raise AssertionError(f"aborted: {code} {details}")


class _Slow(pb_grpc.PeerServicer):
    """A stand-in peer whose forward handler answers after the caller's deadline (a
    busy receiver): only the call's deadline is under test, not the daemon's handler."""

    def Forward(self, request: pb.TreeMessage, context: Any) -> pb.TreeReply:
        time.sleep(0.6)
        return pb.TreeReply()


class _Members:
    """What TreeCalls asks of the membership: a stub for an address, this host's id."""

    me = "h0"
    metadata = ()

    def __init__(self, stub: pb_grpc.PeerStub) -> None:
        self.stub = stub

    def stub_for(self, addr: str) -> pb_grpc.PeerStub:
        return self.stub


def test_a_forward_whose_deadline_passed_is_left_to_the_trees_timer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The real sending thread over real gRPC: a call that passed its deadline at a
    slow receiver comes back as late, and a late forward counts as the last attempt
    (no quick resends onto the busy receiver); a forward that failed otherwise (the
    receiver gone) and a late hand-over to a leader keep their quick resends."""
    monkeypatch.setattr(dissemination, "BROADCAST_TIMEOUT", 0.2)
    srv = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_PeerServicer_to_server(_Slow(), srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    calls = dissemination.TreeCalls(_Members(pb_grpc.PeerStub(channel)))  # type: ignore[arg-type]
    got: list[tuple[pb.TreeReply | None, bool]] = []
    done = threading.Event()
    try:
        forward = fanout.Forward("h0", 1, "h9", pb.ChangeBatch(from_node="h0"), 10)
        calls.forward("h1", forward, lambda reply, late: (got.append((reply, late)), done.set()))
        assert done.wait(10)
    finally:
        calls.close()
        channel.close()
        srv.stop(None)
    assert got == [(None, True)]
    assert dissemination.failed_attempt(forward, True, 0) == dissemination.RESENDS
    assert dissemination.failed_attempt(forward, False, 0) == 0
    carry = grouped.Carry(grouped.Part("h0", 1, pb.ChangeBatch(from_node="h0"), 10))
    assert dissemination.failed_attempt(carry, True, 1) == 1
