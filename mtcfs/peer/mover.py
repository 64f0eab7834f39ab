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
from collections.abc import Callable
from typing import Any

import grpc

from mtcfs.peer import security
from mtcfs.peer.v1 import peer_pb2 as pb

CHUNK = 1 << 20
QUIET = 0.25  # the trainer is writing if it wrote within this many seconds
PAUSE = 0.02
MAX_YIELD = 30.0  # seconds one push may pause for the trainer's writes

_last_write: Any = None  # shared with the daemon: time.monotonic() of its last write

_channels: dict[str, tuple[grpc.Channel, Any]] = {}
_lock = threading.Lock()
PUSH_METHOD = "/mtcfs.peer.v1.Peer/PushFile"


def _push_call(addr: str, tls: tuple[bytes, bytes, bytes | None] | None) -> Any:
    """PushFile taking already serialized PushChunk messages (see _chunk_message)."""
    with _lock:
        if addr not in _channels:
            channel = security.open_channel(addr, tls)
            _channels[addr] = (channel, channel.stream_unary(
                PUSH_METHOD, request_serializer=None,
                response_deserializer=pb.PushReply.FromString))
        return _channels[addr][1]


def pause_while_writing(last_write: Callable[[], float], budget: float) -> float:
    """Sleep while the trainer wrote within QUIET seconds, at most `budget` seconds;
    returns the time paused. Pushes (here) and receives (in the daemon) both yield:
    a checkpoint save is a burst, its copies go right after it."""
    paused = 0.0
    while paused < budget and time.monotonic() - last_write() < QUIET:
        time.sleep(PAUSE)
        paused += PAUSE
    return paused


def init_worker(last_write: Any) -> None:
    """Die with the daemon: a killed daemon must not leave workers behind."""
    import ctypes
    import signal

    global _last_write
    _last_write = last_write
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the daemon died before the call above
        os._exit(0)


def _chunk_message(offset: int, data: bytes) -> bytes:
    """A serialized PushChunk{offset, data}, built with one copy of the data instead
    of two (message + serialization); the stub sends bytes as they are."""
    return b"".join((b"\x10", _varint(offset), b"\x1a", _varint(len(data)), data))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def push(addr: str, tls: tuple[bytes, bytes, bytes | None] | None,
         metadata: tuple[tuple[str, str], ...], header: bytes, data_path: str,
         size: int, timeout: float, stall: float,
         urgent: bool = False) -> tuple[str, str, bool]:
    """Stream one replica (`header`: its pb.PushHeader); returns (status code name,
    details, stored). An urgent push (an fsync waits for it, so its writer is
    blocked) does not yield."""
    try:
        fd = os.open(data_path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return ("NOT_FOUND", "the file's data is gone here", False)
    last = [time.monotonic()]
    yielded = [0.0]

    def yield_to_writes() -> None:
        """The daemon's trainer is writing: let it have the CPU, within a budget."""
        if _last_write is not None and not urgent:
            yielded[0] += pause_while_writing(lambda: _last_write.value,
                                              MAX_YIELD - yielded[0])
            last[0] = time.monotonic()  # paused on purpose: not a stall

    def chunks() -> Any:
        yield pb.PushChunk(header=pb.PushHeader.FromString(header)).SerializeToString()
        off = 0
        while off < size:
            yield_to_writes()
            data = os.pread(fd, min(CHUNK, size - off), off)
            if not data:
                return
            yield _chunk_message(off, data)
            off += len(data)
            last[0] = time.monotonic()

    try:
        fut = _push_call(addr, tls).future(chunks(), timeout=timeout, metadata=metadata)
        while True:
            try:
                reply = fut.result(timeout=0.5)
                return ("OK", "", bool(reply.stored))
            except grpc.FutureTimeoutError:
                if time.monotonic() - last[0] > stall:
                    fut.cancel()  # a peer that stopped taking data must not hold us
            except grpc.FutureCancelledError:
                return ("DEADLINE_EXCEEDED", f"the peer took no data for {stall:.0f} s", False)
            except grpc.RpcError as e:
                code = e.code()
                return (code.name if code else "UNKNOWN", e.details() or "", False)
    finally:
        os.close(fd)
