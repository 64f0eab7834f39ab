"""Peer RPC security: a shared token on every call, validated names and sizes.

The token travels as call metadata ("authorization: Bearer <token>") and is
compared in constant time. With TLS it is encrypted on the wire; without, run
on a trusted network (the job's VPC).
"""

from __future__ import annotations

import hmac
import re
import stat
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from mtcfs.core.namespace import ROOT_GUID
from mtcfs.peer.v1 import peer_pb2 as pb

AUTH_KEY = "authorization"
MAX_NAME = 255
MAX_PATH = 4096
MAX_ID = 64
MAX_NODE_ID = 63
MAX_ENTRIES_PER_BATCH = 10_000
MAX_BLOCK_CRCS = 4 * (1 << 20)  # 4 MiB of crcs: files up to 4 TiB in 4 MiB blocks
MAX_LINKS = 1024  # further names of a hard-linked file
MAX_MESSAGE = 16 << 20
MAX_MERGED_IDS = 100_000  # a directory's ids: one per host that made it at once
MAX_COUNTER = 1 << 62
MAX_ANCESTRY = 64  # directories a pushed replica carries above its file
# What the filesystem makes (device nodes are inert: mounts are nodev).
ENTRY_TYPES = (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, stat.S_IFIFO, stat.S_IFSOCK,
               stat.S_IFCHR, stat.S_IFBLK)


class BadRequest(ValueError):
    """Becomes INVALID_ARGUMENT; the request changed nothing."""


def open_channel(addr: str, tls: tuple[bytes, bytes, bytes | None] | None) -> grpc.Channel:
    """A client channel to a peer (the daemon's and the push workers' alike): message
    limits, quick reconnects, keepalive to notice a silent peer, mutual TLS if set."""
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE),
        ("grpc.max_send_message_length", MAX_MESSAGE),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 3_000),
    ]
    if tls is None:
        return grpc.insecure_channel(addr, options=options)
    cert, key, ca = tls
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                         certificate_chain=cert)
    return grpc.secure_channel(addr, creds, options=options)


def call_metadata(token: bytes | None) -> tuple[tuple[str, str], ...]:
    return ((AUTH_KEY, "Bearer " + token.decode()),) if token else ()


class TokenInterceptor(grpc.ServerInterceptor):
    """Rejects every call without the right token before its handler runs."""

    def __init__(self, token: bytes | None) -> None:
        self._expected = b"Bearer " + token if token else None

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong peer token")

        def deny_stream(request_iterator: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong peer token")

        self._deny = {
            (False, False): grpc.unary_unary_rpc_method_handler(deny),
            (False, True): grpc.unary_stream_rpc_method_handler(deny),
            (True, False): grpc.stream_unary_rpc_method_handler(deny_stream),
            (True, True): grpc.stream_stream_rpc_method_handler(deny_stream),
        }

    def intercept_service(self, continuation: Callable[[Any], Any],
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if self._expected is None or handler is None:
            return handler
        got = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_KEY:
                got = value.encode() if isinstance(value, str) else value
        if hmac.compare_digest(got, self._expected):
            return handler
        return self._deny[(handler.request_streaming, handler.response_streaming)]


# What --node-id accepts (mtcfs.config); ASCII only: str.isalnum() takes any script's letters.
NODE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")  # MAX_NODE_ID in all


# Node ids found good (every entry names its writer and holders: the same few
# thousand ids, checked once each), bounded against a peer that sends new ones.
_GOOD_NODE_IDS: set[str] = set()
MAX_GOOD_NODE_IDS = 65_536


def check_node_id(node_id: str, what: str = "node id") -> None:
    if node_id in _GOOD_NODE_IDS:
        return
    if not NODE_ID_RE.fullmatch(node_id):
        raise BadRequest(f"bad {what} {node_id[:80]!r}")
    if len(_GOOD_NODE_IDS) < MAX_GOOD_NODE_IDS:
        _GOOD_NODE_IDS.add(node_id)


def check_id(guid: str, what: str = "id") -> None:
    if not guid or len(guid) > MAX_ID or not (guid.isascii() and guid.isalnum()):
        raise BadRequest(f"bad {what} {guid[:80]!r}")


def check_name(name: bytes) -> None:
    if not name or len(name) > MAX_NAME or b"/" in name or b"\0" in name or name in (
            b".", b".."):
        raise BadRequest(f"bad name {name[:80]!r}")


def check_path(path: str) -> None:
    """A path relative to the mount root, as peers and the bucket use it."""
    if not path:
        return
    if (len(path) > MAX_PATH or path.startswith("/") or "\0" in path
            or any(p in ("", ".", "..") for p in path.split("/"))):
        raise BadRequest(f"bad path {path[:80]!r}")
    for p in path.split("/"):
        if len(p.encode("utf-8", "surrogateescape")) > MAX_NAME:
            raise BadRequest(f"bad path {path[:80]!r}: a name is too long")


def check_directories(entries: Sequence[pb.Entry]) -> None:
    """The directories a pushed replica carries (above its file)."""
    if len(entries) > MAX_ANCESTRY:
        raise BadRequest(f"more than {MAX_ANCESTRY} directories above a pushed file")
    for d in entries:
        check_entry(d)
        if d.removed or not stat.S_ISDIR(d.mode):
            raise BadRequest("what a push carries above its file must be directories")


def check_entry(e: pb.Entry) -> None:
    check_id(e.id)
    if e.id == ROOT_GUID:  # never sent (not visible); a change or tombstone of it is an attack
        raise BadRequest("the root is not a peer entry")
    if e.writer:
        check_node_id(e.writer, "writer")
    if e.author:
        check_node_id(e.author, "author")
    # uint64 on the wire; SQLite and stat() take int64 (the lamport clock must still tick).
    if max(e.lamport, e.size, e.version, e.persisted_version, e.rdev) >= MAX_COUNTER:
        raise BadRequest("lamport, size, version or device number out of range")
    if e.removed:
        return
    if e.mode > 0o177777 or stat.S_IFMT(e.mode) not in ENTRY_TYPES:
        raise BadRequest(f"bad mode {e.mode:o}")
    check_id(e.parent, "parent id")
    check_name(e.name)
    if len(e.target) > 4095:
        raise BadRequest("symlink target too long")
    if len(e.holders) > 1024 or len(e.dropped) > 1024 or len(e.sources) > 1024:
        raise BadRequest("too many holders")
    for h in [*e.holders, *e.dropped, *e.sources]:
        check_node_id(h, "holder")
    if len(e.block_crcs) > MAX_BLOCK_CRCS or len(e.block_crcs) % 4:
        raise BadRequest("bad block crcs")
    if len(e.links) > MAX_LINKS or (e.links and stat.S_ISDIR(e.mode)):
        raise BadRequest("too many links, or links of a directory")
    for link in e.links:
        check_id(link.parent, "link parent id")
        check_name(link.name)
        if link.parent == e.id:
            raise BadRequest("a link inside the linked entry")
    if e.id == e.parent:
        raise BadRequest("an entry cannot be its own parent")
    if e.merged_ids:
        if not stat.S_ISDIR(e.mode) or len(e.merged_ids) > MAX_MERGED_IDS:
            raise BadRequest("merged ids of a non-directory, or too many")
        for gid in e.merged_ids:
            check_id(gid, "merged id")
            if gid in (ROOT_GUID, e.parent):
                raise BadRequest("a directory merged with the root or its own parent")


MAX_ADDRESS = 300  # host:port, or a range's end (an address and a NUL)
MAX_HOSTS = 100_000  # addresses in a catch-up marker or a coverage list


def check_tree(m: pb.TreeMessage) -> None:
    """A message down or up a dissemination tree (mtcfs.peer.fanout)."""
    for what, value in (("sender", m.from_node), ("origin", m.origin), ("range end", m.end),
                        ("range start", m.start)):
        if len(value) > MAX_ADDRESS:
            raise BadRequest(f"{what} too long")
    if not m.from_node or not m.origin:
        raise BadRequest("a tree message names its sender and the batch's writer")
    if m.seq < 1 or m.seq >= MAX_COUNTER:
        raise BadRequest("batch number out of range")
    if m.ack + m.carry + bool(m.carried) > 1:
        raise BadRequest("a tree message is one of an ack, a hand-over and a reply to one")
    if m.ack:
        if not m.start:
            raise BadRequest("an ack names its range")
    elif m.carried:
        if len(m.carried) > MAX_ENTRIES_PER_BATCH:
            raise BadRequest(f"too many batches listed ({len(m.carried)})")
        if any(not 1 <= s < MAX_COUNTER for s in m.carried):
            raise BadRequest("batch number out of range")
    else:
        check_batch(m.batch)
        if m.carry and m.batch.parts:
            raise BadRequest("a hand-over is one writer's batch")


def check_gone(m: pb.GoneRequest) -> None:
    """Hosts said to be gone (the controller's word): addresses and a reason, bounded."""
    if len(m.addresses) > MAX_HOSTS:
        raise BadRequest(f"too many hosts listed ({len(m.addresses)})")
    for a in m.addresses:
        if not a or len(a) > MAX_ADDRESS:
            raise BadRequest("an address is empty or too long")
    if len(m.reason) > MAX_PATH:
        raise BadRequest("reason too long")


def check_batch(batch: pb.ChangeBatch) -> None:
    check_node_id(batch.from_node, "sender")
    if len(batch.entries) > MAX_ENTRIES_PER_BATCH:
        raise BadRequest(f"too many entries ({len(batch.entries)})")
    for e in batch.entries:
        check_entry(e)
    hosts = [*batch.caught_up.hosts, *batch.coverage.uncovered]
    if len(hosts) > MAX_HOSTS:
        raise BadRequest(f"too many hosts listed ({len(hosts)})")
    if any(not h or len(h) > MAX_ADDRESS for h in hosts):
        raise BadRequest("bad host address in a catch-up marker or a coverage list")
    if not 0 <= batch.caught_up.since_unix < 1e11:  # (NaN fails both)
        raise BadRequest("a catch-up marker's start out of range")
    if batch.parts:
        check_parts(batch)


def check_parts(batch: pb.ChangeBatch) -> None:
    """A bundle's writers (mtcfs.peer.grouped): each names its batch, and their entries
    add up to the bundle's."""
    if len(batch.parts) > MAX_ENTRIES_PER_BATCH:
        raise BadRequest(f"too many parts ({len(batch.parts)})")
    if len(batch.parts) > 1 and (batch.HasField("caught_up") or batch.HasField("coverage")):
        raise BadRequest("a catch-up marker or a coverage list in a bundle")
    for p in batch.parts:
        if not p.origin or len(p.origin) > MAX_ADDRESS:
            raise BadRequest("a part's writer is empty or too long")
        if not 1 <= p.seq < MAX_COUNTER:
            raise BadRequest("a part's batch number out of range")
        check_node_id(p.from_node, "part's writer")
    if sum(p.entries for p in batch.parts) != len(batch.entries):
        raise BadRequest("a bundle's parts do not add up to its entries")
