"""The index trees under load: what keeps a slow job from sending itself into a retry
storm (64 daemons on two cores: forwards resent every 10 s to every child that had
not acked, and quickly again after each call that passed its deadline at a busy
receiver, while the receivers' handlers sat waiting for acks).

The handler test drives the real gRPC service class with a stand-in for the
daemon's peer handler (its batch is never acked): no network is needed to show
how many handlers wait."""

from __future__ import annotations

import threading
import time
from typing import Any

import trio

from mtcfs.peer import dissemination, fanout, server
from mtcfs.peer.dissemination import Reply
from mtcfs.peer.v1 import peer_pb2 as pb


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
