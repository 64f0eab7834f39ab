"""The peer RPC server: what this host answers to the other hosts of the job.

grpcio's server runs handlers in its own threads. Anything that touches the
namespace is handed to the trio thread (`trio.from_thread`), so the index has
one writer; file data moves in the handler threads with pread/pwrite on the
RAM tier's files, off the thread that serves FUSE.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any, Protocol

import grpc
import trio

from mtcfs.core.checksums import BlockVerifier, IntegrityError
from mtcfs.peer import mover, security
from mtcfs.peer.security import BadRequest
from mtcfs.peer.v1 import peer_pb2 as pb
from mtcfs.peer.v1 import peer_pb2_grpc as pb_grpc
from mtcfs.tiers.mapped import Pin
from mtcfs.tiers.ram import RamTierFull

log = logging.getLogger(__name__)

CHUNK = 1 << 20
KERNEL_SETTLE = 0.1  # seconds a broadcast's reply waits for its kernel notifications
TREE_REPLY_WAIT = 1.0  # seconds a forward's handler waits to answer with the range's ack
# Handlers that may wait so at once: the others answer at once (the ack follows as a
# call of its own), so that waiting handlers never fill the pool while forwards queue
# past their deadline behind them (then resent: more load where there is too much).
TREE_REPLY_WAITERS = 8
SNAPSHOT_BATCH = 1000  # entries per message (one message per entry costs 10x more)
MAX_SINCE = 365 * 24 * 3600.0  # a delta snapshot's reach back (longer: ask for all)


class Refused(Exception):
    """A request this host cannot serve now: the status code says why."""

    def __init__(self, code: grpc.StatusCode, msg: str) -> None:
        super().__init__(msg)
        self.code = code


class PeerHandler(Protocol):
    """What the service needs of the host around it (mtcfs.peer.service.PeerService).
    Methods marked "trio" run in the daemon's trio thread, the others in gRPC threads."""

    node_id: str

    def lamport(self) -> int: ...
    def health_reply(self) -> pb.HealthReply: ...
    def needs_poke(self, listen: str) -> bool: ...
    def poke(self, listen: str) -> None: ...  # trio
    def on_batch(self, batch: pb.ChangeBatch) -> int: ...  # trio
    # trio: a Reply, or None (`reply` False: the sender takes no reply, a tree stream's)
    def on_tree(self, request: pb.TreeMessage, reply: bool = True) -> Any: ...
    def kernel_settle(self, timeout: float) -> bool: ...
    def snapshot_for(self, from_node: str, listen: str, piece: int, since: float = 0.0
                     ) -> Iterator[list[pb.Entry]]: ...  # trio (and each piece too)
    def uncovered(self) -> list[str]: ...  # trio
    def held(self) -> list[pb.HeldFile]: ...  # trio
    def gone(self, addresses: list[str], reason: str) -> int: ...  # trio
    def begin_receive(self, e: pb.Entry) -> tuple[int, str]: ...  # trio
    def finish_receive(self, e: pb.Entry, above: list[pb.Entry], key: int,
                       tmp: str) -> bool: ...  # trio
    def abort_receive(self, key: int, tmp: str) -> None: ...  # trio
    def yield_to_writes(self, budget: float) -> float: ...
    def open_for_fetch(self, guid: str, version: int) -> tuple[int, int]: ...  # trio
    def open_to_send(self, guid: str, version: int) -> tuple[int, int, Pin]: ...  # trio
    async def serve_chunk(self, guid: str, version: int, offset: int, length: int,
                          wait: bool, timeout: float) -> tuple[str, int, int]: ...  # trio


class GrpcService(pb_grpc.PeerServicer):
    """The gRPC calls, each handed to the handler (in the trio thread where marked)."""

    def __init__(self, handler: PeerHandler, token: trio.lowlevel.TrioToken,
                 file_bytes: bool = True) -> None:
        self.handler = handler
        self.token = token
        # False with --peer-encryption over plain gRPC: file bytes only on the
        # (encrypting) data channel, never in clear here.
        self.file_bytes = file_bytes
        self._reply_waiters = threading.BoundedSemaphore(TREE_REPLY_WAITERS)

    def _bytes_allowed(self) -> None:
        if not self.file_bytes:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          "peer encryption is on here: file bytes go over the data channel "
                          "only (or gRPC with TLS)")

    def _in_trio(self, fn: Any, *args: Any) -> Any:
        return trio.from_thread.run_sync(fn, *args, trio_token=self.token)

    @staticmethod
    def _fail(context: grpc.ServicerContext, e: Exception) -> None:
        if isinstance(e, BadRequest):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if isinstance(e, Refused):
            context.abort(e.code, str(e))
        if isinstance(e, RamTierFull):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        if isinstance(e, IntegrityError):  # a replica that does not match its crc32cs
            context.abort(grpc.StatusCode.DATA_LOSS, str(e))
        raise e

    # -- index ---------------------------------------------------------------------

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthReply:
        if (request.listen and len(request.listen) < 300
                and self.handler.needs_poke(request.listen)):
            # A peer that calls us is up: do not wait for our next round to find out.
            self._in_trio(self.handler.poke, request.listen)
        return self.handler.health_reply()

    def Broadcast(self, request: pb.ChangeBatch, context: grpc.ServicerContext) -> pb.BatchReply:
        try:
            security.check_batch(request)
            applied = self._in_trio(self.handler.on_batch, request)
        except Exception as e:
            self._fail(context, e)
        # The acknowledgement says "applied here": let the kernel drop the names it
        # caches first (bounded: a notification can wait for a directory lock that a
        # local commit holds while it waits for the sender; see mtcfs.fs.kernel).
        self.handler.kernel_settle(KERNEL_SETTLE)
        return pb.BatchReply(applied=applied, lamport=self.handler.lamport())

    def Gone(self, request: pb.GoneRequest, context: grpc.ServicerContext) -> pb.GoneReply:
        try:
            security.check_gone(request)
            probing = self._in_trio(self.handler.gone, list(request.addresses), request.reason)
        except Exception as e:
            self._fail(context, e)
        return pb.GoneReply(probing=probing)

    def Forward(self, request: pb.TreeMessage,
                context: grpc.ServicerContext) -> pb.TreeReply:
        try:
            security.check_tree(request)
            reply = self._in_trio(self.handler.on_tree, request)
        except Exception as e:
            self._fail(context, e)
        # A batch: answer with its ack if this host's range applies it within a moment
        # (a leaf at once); else the ack follows as a call of its own.
        if reply is None:
            return pb.TreeReply()
        waits = self._reply_waiters.acquire(blocking=False)
        try:
            acked = reply.wait(TREE_REPLY_WAIT if waits else 0.0)
        finally:
            if waits:
                self._reply_waiters.release()
        if not acked:
            return pb.TreeReply()
        # "Applied here": let the kernel drop the names it caches first (bounded).
        self.handler.kernel_settle(KERNEL_SETTLE)
        return pb.TreeReply(acked=True)

    def Snapshot(self, request: pb.SnapshotRequest,
                 context: grpc.ServicerContext) -> Iterator[pb.ChangeBatch]:
        try:
            if request.from_node:
                security.check_node_id(request.from_node, "requester")
            if len(request.listen) > 300:
                raise BadRequest("listen address too long")
            if not 0 <= request.since_s <= MAX_SINCE:  # (NaN fails both)
                raise BadRequest(f"since_s must be 0 to {MAX_SINCE:.0f} seconds")
        except BadRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

        # In the trio thread: the requester counts for commits from this snapshot on.
        # Each piece is made there too when the stream wants it (the first leaves at
        # once; the requester applies it while the next is made).
        pieces = self._in_trio(self.handler.snapshot_for, request.from_node, request.listen,
                               SNAPSHOT_BATCH, request.since_s)
        while (piece := self._in_trio(next, pieces, None)) is not None:
            yield pb.ChangeBatch(from_node=self.handler.node_id, lamport=self.handler.lamport(),
                                 entries=piece)
        # Last: whose changes this snapshot may lack (the requester covers the others).
        yield pb.ChangeBatch(from_node=self.handler.node_id, lamport=self.handler.lamport(),
                             coverage=pb.Coverage(uncovered=self._in_trio(self.handler.uncovered)))

    def ListHeld(self, request: pb.ListHeldRequest,
                 context: grpc.ServicerContext) -> pb.ListHeldReply:
        return pb.ListHeldReply(node_id=self.handler.node_id,
                                files=self._in_trio(self.handler.held))

    # -- data ----------------------------------------------------------------------

    def PushFile(self, request_iterator: Iterator[pb.PushChunk],
                 context: grpc.ServicerContext) -> pb.PushReply:
        first = next(request_iterator, None)
        try:
            self._bytes_allowed()
            if first is None or not first.HasField("header"):
                raise BadRequest("the first message of a push must carry the header")
            header = first.header
            security.check_entry(header.entry)
            security.check_directories(header.above)
            security.check_path(header.path)
            e = header.entry
            if e.removed or not e.has_crc:
                raise BadRequest("a pushed file needs its crc32c")
            key, tmp = self._in_trio(self.handler.begin_receive, e)
        except Exception as exc:
            self._fail(context, exc)
        ok = False
        try:
            self._receive(first, request_iterator, e, tmp)
            ok = self._in_trio(self.handler.finish_receive, e, list(header.above), key, tmp)
        except Exception as exc:
            log.warning("replica of %s from %s rejected: %s", header.path, e.writer, exc)
            self._fail(context, exc)
        finally:
            if not ok:  # refused, failed or aborted: give back the space reserved
                self._in_trio(self.handler.abort_receive, key, tmp)
        return pb.PushReply(stored=ok, node_id=self.handler.node_id)

    def _receive(self, first: pb.PushChunk, rest: Iterator[pb.PushChunk], e: pb.Entry,
                 tmp: str) -> None:
        """Write the chunks in order, verifying each block and the whole file."""
        verify = BlockVerifier(e.size, e.crc32c, bytes(e.block_crcs) or None)
        fd = os.open(tmp, os.O_WRONLY)
        yielded = 0.0
        try:
            chunk: pb.PushChunk | None = first
            while chunk is not None:
                data = chunk.data  # each access of a bytes field copies it
                if data:
                    if chunk.offset != verify.offset:
                        raise BadRequest(f"chunk at {chunk.offset}, expected {verify.offset}")
                    if chunk.offset + len(data) > e.size:
                        raise BadRequest("more data than the file's size")
                    verify.feed(data)  # raises IntegrityError on a bad block
                    os.pwrite(fd, data, chunk.offset)
                    # This host's trainer is writing: let it have the CPU (bounded).
                    yielded += self.handler.yield_to_writes(mover.MAX_YIELD - yielded)
                chunk = next(rest, None)
            verify.finish()
        finally:
            os.close(fd)

    def FetchFile(self, request: pb.FetchRequest,
                  context: grpc.ServicerContext) -> Iterator[pb.DataChunk]:
        try:
            self._bytes_allowed()
            security.check_id(request.id)
            security.check_path(request.path)
            fd, size = self._in_trio(self.handler.open_for_fetch, request.id, request.version)
        except Exception as e:
            self._fail(context, e)
        try:
            end = size if request.length == 0 else min(size, request.offset + request.length)
            off = request.offset
            while off < end and context.is_active():
                data = os.pread(fd, min(CHUNK, end - off), off)
                if not data:
                    break
                yield pb.DataChunk(offset=off, data=data)
                off += len(data)
        finally:
            os.close(fd)


def start_server(handler: PeerHandler, listen: str, token: trio.lowlevel.TrioToken,
                 secret: bytes | None, tls: tuple[bytes, bytes, bytes | None] | None,
                 workers: int = 16, file_bytes: bool = True) -> tuple[grpc.Server, int]:
    """Start listening on `listen` only; returns the server and the bound port.
    file_bytes: whether replicas and reads may move over these calls."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="peer-rpc"),
        interceptors=[security.TokenInterceptor(secret)],
        options=[
            ("grpc.max_receive_message_length", security.MAX_MESSAGE),
            ("grpc.max_send_message_length", security.MAX_MESSAGE),
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_PeerServicer_to_server(GrpcService(handler, token, file_bytes), server)
    if tls is not None:
        cert, key, ca = tls
        creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                            require_client_auth=ca is not None)
    try:
        port = (server.add_secure_port(listen, creds) if tls is not None
                else server.add_insecure_port(listen))
    except RuntimeError:  # its message asks for GRPC_VERBOSITY: say what failed instead
        port = 0
    if port == 0:
        raise OSError(f"--listen {listen}: cannot bind (the port is in use, or the address "
                      "is not this host's)")
    server.start()
    return server, port
