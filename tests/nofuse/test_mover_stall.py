"""A gRPC replica push (mtcfs.peer.mover, the fallback when a peer's data channel
is unreachable) to a peer that stops taking data ends as a failed push, with a
status that says so, not as an exception out of the worker: seen at 64 daemons
on 2 cores, where the replicator logged a FutureCancelledError traceback."""

from __future__ import annotations

import os
import threading
import time
from concurrent import futures

import grpc
import pytest

from mtcfs.peer import mover
from mtcfs.peer.v1 import peer_pb2 as pb

pytestmark = [pytest.mark.nofuse]


def test_a_push_to_a_peer_that_takes_no_data_fails_as_a_stall(tmp_path) -> None:
    release = threading.Event()

    def take_nothing(requests, context):  # holds the call, reads no chunk
        release.wait(30)
        return pb.PushReply()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "mtcfs.peer.v1.Peer", {"PushFile": grpc.stream_unary_rpc_method_handler(
            take_nothing, request_deserializer=pb.PushChunk.FromString,
            response_serializer=pb.PushReply.SerializeToString)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    data = tmp_path / "f"
    size = 64 << 20  # far beyond what flow control lets through unread
    with open(data, "wb") as f:
        f.truncate(size)
    try:
        t0 = time.monotonic()
        code, details, stored = mover.push(
            f"127.0.0.1:{port}", None, (),
            pb.PushHeader(entry=pb.Entry(id="f" * 32, size=size), path="f").SerializeToString(),
            str(data), size, timeout=60, stall=1.0, urgent=True)
        assert (code, stored) == ("DEADLINE_EXCEEDED", False), (code, details)
        assert "took no data" in details
        assert time.monotonic() - t0 < 10
    finally:
        release.set()
        server.stop(0)
        os.unlink(data)
