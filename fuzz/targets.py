"""The fuzz targets: what a peer can send to a daemon, sent to a real one (fuzz.host).

Each target takes the fuzzer's bytes and raises Finding when the daemon did what
it must never do for any input: an exception out of a handler (gRPC's UNKNOWN, a
data channel error logged as unexpected, an exception in the trio thread), a call
that does not end (wedged), an index that is no longer a tree (or a metadata store,
what a restart loads, that differs from it: checked every STORE_EVERY inputs), or a
refused input that changed the index. A refusal (INVALID_ARGUMENT, a bad MAC, a
dropped connection) is the expected answer to most inputs.

Input layouts (the seed corpus, fuzz.seeds, is written in them):

- grpc:        method byte | the request's bytes (PushFile: records u16le length | bytes)
- grpc-token:  method byte | token length byte | token | the request's bytes
- index:       0 = ChangeBatch, 1 = TreeMessage | its bytes, applied in the trio thread
- gossip:      mode byte | bytes. 0: a GossipMessage sealed by the configured peer's
               codec (valid token, fresh stamp); 1: a body under a valid MAC (to and
               stamp as given); 2: the datagram as given (no token)
- bulk, bulk-encrypted (the daemon with --peer-encryption; same layout):
               mode byte | bytes. 0: valid handshake, then records (kind byte, u32le
               length, bytes: kind 0 a tagged control frame, 1 a tagged data frame
               whose first 8 bytes are its offset, 2 raw bytes, 3 a tagged tree
               message frame, after a "tree" request); 1: the bytes as the
               client's handshake (no token); 2: valid handshake, then the bytes raw
"""

from __future__ import annotations

import logging
import socket
import ssl
import time
from collections.abc import Callable, Iterator

import grpc
from blake3 import blake3
from google.protobuf.message import DecodeError, Message

from fuzz.host import TOKEN, Host
from mtcfs.core.checksums import IntegrityError
from mtcfs.peer import bulk, gossip, security
from mtcfs.peer.server import Refused
from mtcfs.peer.v1 import peer_pb2 as pb
from mtcfs.tiers.ram import RamTierFull

STORE_EVERY = 100  # inputs between checks of the metadata store against memory
WEDGED = 15.0  # seconds: a call or connection that lasts longer is a finding

METHODS: list[tuple[str, str, type[Message]]] = [  # name, unary/stream shape, request type
    ("Health", "uu", pb.HealthRequest),
    ("Broadcast", "uu", pb.ChangeBatch),
    ("Forward", "uu", pb.TreeMessage),
    ("Snapshot", "us", pb.SnapshotRequest),
    ("PushFile", "su", pb.PushChunk),
    ("FetchFile", "us", pb.FetchRequest),
    ("ListHeld", "uu", pb.ListHeldRequest),
    ("Gossip", "uu", pb.GossipMessage),
    ("Gone", "uu", pb.GoneRequest),
]
# Answers that refuse an input; with these the index must be as it was before.
UNCHANGED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
             grpc.StatusCode.DATA_LOSS, grpc.StatusCode.RESOURCE_EXHAUSTED}
# Answers that refuse an input the handler accepted at first (it may have applied its
# entry: a push whose file changed meanwhile), or a method the server lacks.
REFUSED = UNCHANGED | {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
                       grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.OUT_OF_RANGE,
                       grpc.StatusCode.UNIMPLEMENTED}
# What the data channel may drop a connection for (anything else is a bug).
BULK_EXPECTED = (OSError, ssl.SSLError, security.BadRequest, IntegrityError, Refused,
                 RamTierFull, bulk.Remote)


class Finding(AssertionError):
    """The daemon did what it must not do for any input."""


def records(data: bytes) -> Iterator[bytes]:
    """u16le length | bytes, repeated (the rest as the last record)."""
    while data:
        n = int.from_bytes(data[:2], "little") if len(data) >= 2 else 0
        yield data[2:2 + n]
        data = data[2 + n:]


def parses(kind: type[Message], data: bytes) -> bool:
    try:
        kind.FromString(data)
    except DecodeError:
        return False
    return True


class Targets:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.channel = grpc.insecure_channel(host.listen, options=[
            ("grpc.max_send_message_length", security.MAX_MESSAGE),
            ("grpc.max_receive_message_length", security.MAX_MESSAGE)])
        self.sender = gossip.Codec(host.peer, TOKEN)  # the configured peer's codec
        self.gossip_key = gossip.gossip_key(TOKEN)
        self.keys = bulk.Keys(TOKEN, encrypt=host.encrypt)
        self.runs = 0
        self.bulk_log = _Captured()
        logging.getLogger("mtcfs.peer.bulk").addHandler(self.bulk_log)
        logging.getLogger("mtcfs.peer.bulk").setLevel(logging.WARNING)
        # The seeds' placeholder addresses (fuzz.seeds), of the same length.
        self._places = ((b"127.0.0.1:PEERP", host.peer.encode()),
                        (b"127.0.0.1:HOSTP", host.listen.encode()))
        assert all(len(a) == len(b) for a, b in self._places)
        targets = {"grpc": self.grpc, "grpc-token": self.grpc_token, "index": self.index,
                   "gossip": self.gossip, "bulk": self.bulk, "bulk-encrypted": self.bulk}
        self.by_name: dict[str, Callable[[bytes], None]] = {
            name: self._placed(fn) for name, fn in targets.items()}

    def _placed(self, fn: Callable[[bytes], None]) -> Callable[[bytes], None]:
        def run(data: bytes) -> None:
            for place, addr in self._places:
                data = data.replace(place, addr)
            fn(data)
            self.runs += 1
            if self.runs % STORE_EVERY == 0:
                self.host.check_store()  # what a restart would load: no change lost

        return run

    # -- gRPC ------------------------------------------------------------------------

    def grpc(self, data: bytes) -> None:
        if data:
            self._call(data[0], data[1:], TOKEN)

    def grpc_token(self, data: bytes) -> None:
        if len(data) < 2:
            return
        n = data[1]
        # Metadata values are printable ASCII (gRPC refuses others before sending).
        token = bytes(b if 32 <= b < 127 else 32 + b % 95 for b in data[2:2 + n])
        self._call(data[0], data[2 + n:], token)

    def _call(self, which: int, payload: bytes, token: bytes) -> None:
        name, shape, kind = METHODS[which % len(METHODS)]
        authorized = token == TOKEN
        before = self.host.digest()
        path = "/mtcfs.peer.v1.Peer/" + name
        md = self.host.metadata(token)
        code, details = grpc.StatusCode.OK, ""
        try:
            if shape == "uu":
                self.channel.unary_unary(path)(payload, metadata=md, timeout=WEDGED)
            elif shape == "us":
                for _ in self.channel.unary_stream(path)(payload, metadata=md, timeout=WEDGED):
                    pass
            else:
                self.channel.stream_unary(path)(records(payload), metadata=md,
                                                timeout=WEDGED)
        except grpc.RpcError as e:
            code = e.code()
            details = e.details()
        if not authorized and code not in (grpc.StatusCode.UNAUTHENTICATED,
                                           grpc.StatusCode.UNIMPLEMENTED):
            raise Finding(f"{name} with a wrong token answered {code}")
        whole = list(records(payload)) if shape == "su" else [payload]
        if code == grpc.StatusCode.INTERNAL and all(parses(kind, m) for m in whole):
            raise Finding(f"{name}: INTERNAL for a request that parses: {details}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise Finding(f"{name} wedged: no answer within {WEDGED:g} s")
        if code not in REFUSED | {grpc.StatusCode.OK, grpc.StatusCode.INTERNAL}:
            raise Finding(f"{name} answered {code}: {details}")
        refused = code in UNCHANGED or code == grpc.StatusCode.INTERNAL
        if refused and self.host.digest() != before:
            raise Finding(f"{name} refused ({code}) but the index changed")
        self.host.check_index()

    # -- the index, directly ---------------------------------------------------------

    def index(self, data: bytes) -> None:
        if not data:
            return
        tier = self.host.tier
        try:
            if data[0] & 1:
                m = pb.TreeMessage.FromString(data[1:])
                security.check_tree(m)
                self.host.call(tier.service.on_tree, m)
            else:
                batch = pb.ChangeBatch.FromString(data[1:])
                security.check_batch(batch)
                self.host.call(tier.service.on_batch, batch)
        except (DecodeError, security.BadRequest):
            return
        self.host.check_index()

    # -- membership datagrams --------------------------------------------------------

    def gossip(self, data: bytes) -> None:
        if not data:
            return
        mode, payload = data[0] % 3, data[1:]
        if mode == 0:
            try:
                m = pb.GossipMessage.FromString(payload)
            except DecodeError:
                return
            datagram = self.sender.seal(m, self.host.listen)
        elif mode == 1:
            body = gossip.MAGIC + payload
            datagram = body + blake3(body, key=self.gossip_key).digest()
        else:
            datagram = payload
        dropped = self.host.tier.members.codec.dropped
        before = sum(vars(dropped).values())
        self.host.call(self.host.tier.members.receive, datagram, time.monotonic())
        self.host.check_swim()
        # Without the token's MAC a datagram is dropped (counted), so it changes nothing.
        if mode == 2 and sum(vars(dropped).values()) != before + 1:
            raise Finding("a datagram without a valid MAC was not dropped")

    # -- the data channel --------------------------------------------------------------

    def bulk(self, data: bytes) -> None:
        if not data:
            return
        mode, payload = data[0] % 3, data[1:]
        before = self.host.digest() if mode == 1 else 0
        self.bulk_log.records.clear()
        with socket.create_connection(("127.0.0.1", self.host.data_port), timeout=WEDGED) as s:
            try:
                if mode == 1:
                    s.sendall(payload)
                else:
                    conn = bulk.client_handshake(s, self.keys)
                    s.settimeout(WEDGED)
                    if mode == 0:
                        self._frames(conn, payload)
                    else:
                        s.sendall(payload)
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the server dropped the connection before it had it all: fine
            _drain(s)
        for r in self.bulk_log.records:
            if r.levelno >= logging.ERROR:  # log.exception: an unexpected failure
                why = r.exc_info[1] if r.exc_info else None
                raise Finding(f"data channel: {r.getMessage()}: {why!r}")
            e = r.args[0] if isinstance(r.args, tuple) and r.args else None
            if isinstance(e, BaseException) and not isinstance(e, BULK_EXPECTED):
                raise Finding(f"data channel: {type(e).__name__}: {r.getMessage()}")
        if mode == 1 and self.host.digest() != before:
            raise Finding("a connection without the token changed the index")
        self.host.check_index()

    @staticmethod
    def _frames(conn: bulk.Conn, payload: bytes) -> None:
        while payload:
            kind = payload[0] % 4
            n = int.from_bytes(payload[1:5], "little") if len(payload) >= 5 else 0
            body, payload = payload[5:5 + n], payload[5 + n:]
            if kind == 0:
                send_sealed(conn, bulk.CONTROL, 0, body)
            elif kind == 1:
                offset = int.from_bytes(body[:8], "little")
                send_sealed(conn, bulk.DATA, offset, body[8:])
            elif kind == 3:
                send_sealed(conn, bulk.TREE, 0, body)
            else:
                conn.sock.sendall(body)


def send_sealed(conn: bulk.Conn, kind: bytes, offset: int, body: bytes) -> None:
    """A frame with a valid tag as the client's next (what Conn.send_control does for
    a control message, for any bytes and either kind)."""
    tag, sealed = conn.out.seal(conn.sent, kind, offset, body)
    conn._send_frame(kind, offset, tag, sealed)


def _drain(s: socket.socket) -> None:
    """Read until the server closes the connection; Finding if it does not."""
    deadline = time.monotonic() + WEDGED
    s.settimeout(WEDGED)
    try:
        while s.recv(1 << 16):
            if time.monotonic() > deadline:
                raise Finding(f"data channel: the server still sends after {WEDGED:g} s")
    except TimeoutError:
        raise Finding(f"data channel wedged: the connection still open {WEDGED:g} s "
                      "after the client's last byte") from None
    except ConnectionResetError:
        pass


class _Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


NAMES = ("grpc", "grpc-token", "index", "gossip", "bulk", "bulk-encrypted")
ENCRYPTED = {"bulk-encrypted"}  # targets whose daemon runs with --peer-encryption
