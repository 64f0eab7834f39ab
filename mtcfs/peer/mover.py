"""Replica pushes, run in worker processes beside the daemon.

Streaming a file through gRPC costs Python work per chunk (building and
serializing 1 MiB messages) that, inside the daemon, competes for the GIL
with the thread serving FUSE writes: the trainer's next checkpoint would
slow down while the previous one replicates. These functions run in a small
process pool (spawned, so nothing of the daemon's FUSE session is inherited);
they read the file from the RAM tier by path and stream it, and report only
the outcome. The receiver verifies every block, so a file that changed under
the push is refused, never stored.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import grpc

from mtcfs.peer import security
from mtcfs.peer.v1 import peer_pb2 as pb
from mtcfs.peer.v1 import peer_pb2_grpc as pb_grpc

CHUNK = 1 << 20

_channels: dict[str, tuple[grpc.Channel, pb_grpc.PeerStub]] = {}
_lock = threading.Lock()


def _stub(addr: str, tls: tuple[bytes, bytes, bytes | None] | None) -> pb_grpc.PeerStub:
    with _lock:
        if addr not in _channels:
            options = [
                ("grpc.max_receive_message_length", security.MAX_MESSAGE),
                ("grpc.max_send_message_length", security.MAX_MESSAGE),
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.keepalive_timeout_ms", 3_000),
            ]
            if tls is not None:
                cert, key, ca = tls
                creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                                     certificate_chain=cert)
                channel = grpc.secure_channel(addr, creds, options=options)
            else:
                channel = grpc.insecure_channel(addr, options=options)
            _channels[addr] = (channel, pb_grpc.PeerStub(channel))
        return _channels[addr][1]


def init_worker() -> None:
    """Die with the daemon: a killed daemon must not leave workers behind."""
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the daemon died before the call above
        os._exit(0)


def warm_up() -> int:
    """Run once per worker at start-up, so the first push does not pay the imports."""
    return os.getpid()


def push(addr: str, tls: tuple[bytes, bytes, bytes | None] | None,
         metadata: tuple[tuple[str, str], ...], entry: bytes, path: str, data_path: str,
         size: int, timeout: float, stall: float) -> tuple[str, str, bool]:
    """Stream one replica; returns (status code name, details, stored)."""
    try:
        fd = os.open(data_path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return ("NOT_FOUND", "the file's data is gone here", False)
    last = [time.monotonic()]

    def chunks() -> Any:
        yield pb.PushChunk(header=pb.PushHeader(entry=pb.Entry.FromString(entry), path=path))
        off = 0
        while off < size:
            data = os.pread(fd, min(CHUNK, size - off), off)
            if not data:
                return
            yield pb.PushChunk(offset=off, data=data)
            off += len(data)
            last[0] = time.monotonic()

    try:
        fut = _stub(addr, tls).PushFile.future(chunks(), timeout=timeout, metadata=metadata)
        while True:
            try:
                reply = fut.result(timeout=0.5)
                return ("OK", "", bool(reply.stored))
            except grpc.FutureTimeoutError:
                if time.monotonic() - last[0] > stall:
                    fut.cancel()  # a peer that stopped taking data must not hold us
            except grpc.RpcError as e:
                code = e.code()
                return (code.name if code else "UNKNOWN", e.details() or "", False)
    finally:
        os.close(fd)
