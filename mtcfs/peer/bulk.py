"""The bulk data channel: file bytes between daemons over plain TCP (or TLS),
beside gRPC, which stays the control plane (index, health, push offers).

Through gRPC every 1 MiB chunk was a protobuf message built and parsed in
Python; here the sender hands the kernel a sendfile() from the RAM file and
the receiver splice()s each block from the socket through a pipe into the
destination file (one copy, in the kernel; the pipe gathers up to the file's
next MiB boundary first, see Conn._splice_into), then checks it through a
mapping of the file in a second thread while the next block arrives. Receiving into a
buffer and pwrite()ing it copied every byte twice, and the checks waited for
the socket and the socket for the checks.

Security is no weaker than the gRPC calls' token:

- A connection counts only after a mutual challenge-response on the shared
  token: the server sends a fresh random nonce, the client answers with its own
  nonce and a keyed BLAKE3 MAC of both, the server answers with a MAC of both
  too (under a different label). The token never travels; a recorded answer
  replayed on a new connection fails, the server's nonce being new.
- Every frame (control messages and data blocks) carries a keyed BLAKE3 MAC
  under a per-connection key (derived from the token and both nonces) over the
  direction, a frame counter, the frame's header and the BLAKE3 digest of its
  bytes (hash-then-MAC: as strong as the MAC of the bytes themselves while
  BLAKE3 resists collisions): a block cannot be altered, replayed, reordered or
  reflected. A block counts only after its MAC and its crc32c (against the
  index's block crc32cs) both matched. It lands in its file first, but only in
  a file no one reads before it counts: a replica's temporary file, or the
  private file a download fills, whose readers wait for verified ranges.
- Because the MAC covers a digest, a host that knows a block's digest already
  does not read the block to send it: `BlockHashes` remembers the digests of
  blocks this host sent or verified (a push computes them once on the writer
  and verifies them on the replica's holder), so serving a restore is a bare
  sendfile(). A remembered digest that no longer matches the bytes (a file
  changed in place) fails the receiver's MAC check: never served as good.
- With --tls-* the connection is TLS (the ssl module), like the gRPC channel.

Wire format, after the handshake: frames of a 45-byte header (kind, offset,
length, MAC) and `length` bytes. Kind C is a control message (JSON), kind B one
block (4 MiB, the last one shorter) of the file at `offset`. Requests:
`push` (a replica: header, blocks in order, `end`; the receiver verifies the
whole file and answers), `fetch` (a block range of a held file) and `chunk`
(one chunk of a file the server restores from the durable tier, or has:
mtcfs.peer.restore; the server sends `wait` keepalives until the chunk is
verified there, or says it will not have it; the client counts the chunk only
once its recorded crc32c matched).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hmac
import inspect
import json
import logging
import mmap
import os
import select
import socket
import ssl
import struct
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

import crc32c
import google_crc32c
from blake3 import blake3

from mtcfs.checksums import BLOCK, BlockVerifier, IntegrityError, block_count, crc32c_combine
from mtcfs.peer import mover, security
from mtcfs.peer.security import BadRequest
from mtcfs.peer.server import PeerHandler, Refused
from mtcfs.peer.v1 import peer_pb2 as pb
from mtcfs.tiers.ram import RamTierFull

log = logging.getLogger(__name__)

MAGIC = b"MTCFSBK1"
NONCE = 32
MAC = 32
HEADER = struct.Struct("<cQI32s")  # kind, offset, length, MAC
CONTROL, DATA = b"C", b"B"
HANDSHAKE_TIMEOUT = 5.0
STALL_TIMEOUT = 5.0  # a connection with no progress for this long is dropped
REPLY_TIMEOUT = 60.0  # the receiver's answer to a whole push (verification, commit)
IDLE_TIMEOUT = 600.0  # a pooled connection with no request for this long is closed
MAX_CONTROL = security.MAX_MESSAGE
MAX_SERVER_CONNECTIONS = 64
KEEPALIVE = 1.0  # a server waiting for a chunk tells the client so this often
PIPE_SIZE = 1 << 20  # the pipe a connection splices received blocks through
VERIFIERS = 8  # threads that check landed blocks (BLAKE3 and crc32c release the GIL)


class BulkError(OSError):
    """The connection failed or its peer broke the protocol: it is dropped."""


class AuthError(BulkError):
    """The other side does not know the token (or replayed an old answer)."""


class Remote(Exception):
    """The other side refused a request: `code` is a gRPC status code name."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class Keys:
    """The handshake key and the data key, derived from the shared token with BLAKE3's
    key derivation (distinct contexts). Without a token (--insecure) they derive from
    nothing: integrity against accidents only, as the gRPC calls are then open too."""

    def __init__(self, token: bytes | None) -> None:
        secret = token or b""
        self.auth = blake3(secret, derive_key_context="mtcfs 2026 bulk channel handshake").digest()
        self.data = blake3(secret, derive_key_context="mtcfs 2026 bulk channel frames").digest()

    def answer(self, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
        return blake3(label + server_nonce + client_nonce, key=self.auth).digest()

    def session(self, server_nonce: bytes, client_nonce: bytes) -> bytes:
        return blake3(server_nonce + client_nonce, key=self.data).digest()


class BlockHashes:
    """BLAKE3 digests of blocks this host sent or verified, by (file id, version) and
    (offset, length): what lets a sender skip reading a block to MAC it. Bounded
    (least recently used files go first); shared by the server and the pool's
    threads."""

    def __init__(self, max_blocks: int = 65536) -> None:
        self.max_blocks = max_blocks  # 64Ki blocks: 256 GiB of data, about 10 MiB here
        self._files: OrderedDict[tuple[str, int], dict[tuple[int, int], bytes]] = OrderedDict()
        self._count = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, guid: str, version: int, offset: int, length: int) -> bytes | None:
        with self._lock:
            blocks = self._files.get((guid, version))
            digest = blocks.get((offset, length)) if blocks is not None else None
            if digest is None:
                self.misses += 1
                return None
            self._files.move_to_end((guid, version))
            self.hits += 1
            return digest

    def put(self, guid: str, version: int, offset: int, length: int, digest: bytes) -> None:
        with self._lock:
            blocks = self._files.setdefault((guid, version), {})
            self._files.move_to_end((guid, version))
            if (offset, length) not in blocks:
                self._count += 1
            blocks[(offset, length)] = digest
            while self._count > self.max_blocks and len(self._files) > 1:
                _, gone = self._files.popitem(last=False)
                self._count -= len(gone)

    def status(self) -> dict[str, int]:
        return {"block_digests_kept": self._count, "block_digest_hits": self.hits,
                "block_digest_misses": self.misses}


def digest_of(data: memoryview | bytes) -> bytes:
    """What a frame's MAC covers of its bytes (BLAKE3 releases the GIL on large inputs)."""
    return blake3(data).digest()


def _digest_and_crc_at(fd: int, offset: int, length: int) -> tuple[bytes, int]:
    """The BLAKE3 digest and crc32c of bytes the file holds at [offset, offset+length),
    read through a mapping (no copy). google-crc32c takes only bytes objects; the
    crc32c package takes any buffer."""
    skew = offset % mmap.ALLOCATIONGRANULARITY
    if os.fstat(fd).st_size < offset + length:  # a mapped page past the end is SIGBUS
        raise BulkError(f"the file shrank below {offset + length} bytes while it was filled")
    with (mmap.mmap(fd, length + skew, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                    prot=mmap.PROT_READ, offset=offset - skew) as m,
          memoryview(m) as whole, whole[skew:] as view):
        return blake3(view).digest(), crc32c.crc32c(view)


def spans(start: int, end: int) -> list[tuple[int, int]]:
    """The (offset, length) of each block of bytes [start, end) (start on a boundary)."""
    return [(off, min(BLOCK, end - off)) for off in range(start, end, BLOCK)]


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise BulkError("connection closed by the other side")
        view = view[n:]


class Conn:
    """One authenticated connection: MAC'd frames both ways, a reused block buffer."""

    def __init__(self, sock: socket.socket, key: bytes, client: bool) -> None:
        self.sock = sock
        self.key = key
        self.out_dir, self.in_dir = (b"c", b"s") if client else (b"s", b"c")
        self.sent = 0  # frames sent / received: each MAC covers its frame's number
        self.received = 0
        self.buf = bytearray(BLOCK)
        self.view = memoryview(self.buf)
        self._hdr = bytearray(HEADER.size)
        self._pipe: tuple[int, int] | None = None  # for splice(), made at first use
        self._spare: memoryview | None = None  # a second buffer, to read one block ahead
        if not isinstance(sock, ssl.SSLSocket):
            secs = int(STALL_TIMEOUT)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                            struct.pack("ll", secs, int((STALL_TIMEOUT - secs) * 1e6)))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        if self._pipe is not None:
            for p in self._pipe:
                os.close(p)
            self._pipe = None

    def stale(self) -> bool:
        """An idle connection with something to read was closed (or broken) by the other
        side: not reused."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    def _mac(self, direction: bytes, seq: int, kind: bytes, offset: int,
             data: memoryview | bytes) -> bytes:
        return self._mac_of(direction, seq, kind, offset, len(data), digest_of(data))

    def _mac_of(self, direction: bytes, seq: int, kind: bytes, offset: int, length: int,
                digest: bytes) -> bytes:
        header = direction + struct.pack("<QcQI", seq, kind, offset, length)
        return blake3(header + digest, key=self.key).digest()

    # -- sending ---------------------------------------------------------------------

    def send_control(self, msg: dict[str, Any]) -> None:
        body = json.dumps(msg, separators=(",", ":")).encode()
        mac = self._mac(self.out_dir, self.sent, CONTROL, 0, body)
        self.sent += 1
        self.sock.sendall(HEADER.pack(CONTROL, 0, len(body), mac) + body)

    def send_block(self, f: Any, fd: int, offset: int, length: int,
                   digest: bytes | None = None) -> bytes:
        """One block of the open file `fd` (`f`: a file object over it), handed to the
        kernel (sendfile); returns its digest. Without a known `digest` the block is
        read once for it first. Bytes that changed since fail the receiver's check:
        never counted there."""
        if digest is None:
            digest = self._read_digest(fd, offset, length, self.view)
        mac = self._mac_of(self.out_dir, self.sent, DATA, offset, length, digest)
        self.sent += 1
        self.sock.sendall(HEADER.pack(DATA, offset, length, mac))
        if self.sock.sendfile(f, offset, length) != length:
            raise BulkError(f"the file is shorter than {offset + length} bytes")
        return digest

    @staticmethod
    def _read_digest(fd: int, offset: int, length: int, buf: memoryview) -> bytes:
        view = buf[:length]
        if os.preadv(fd, [view], offset) != length:
            raise BulkError(f"the file is shorter than {offset + length} bytes")
        return digest_of(view)

    def send_blocks(self, f: Any, fd: int, offset: int, end: int, hashes: BlockHashes,
                    guid: str, version: int, before: Callable[[], None] | None = None,
                    ahead: Executor | None = None) -> Iterator[int]:
        """The blocks of bytes [offset, end) of a file (guid, version), with the digests
        `hashes` knows (and learning the others); yields each block's length once sent.
        A digest not known is computed in `ahead`'s threads, one block ahead, while the
        kernel sends the block before (a read and BLAKE3 release the GIL)."""
        blocks = spans(offset, end)
        known: dict[int, bytes | None] = {}
        jobs: dict[int, Future[bytes]] = {}

        def digest_of_span(i: int) -> bytes | None:
            if i not in known:
                off, n = blocks[i]
                known[i] = hashes.get(guid, version, off, n)
            return known[i]

        def read_ahead(i: int) -> None:
            if ahead is None or i >= len(blocks) or i in jobs or digest_of_span(i):
                return
            if self._spare is None:
                self._spare = memoryview(bytearray(BLOCK))
            buf = self.view if i % 2 else self._spare  # the job before used the other one
            jobs[i] = ahead.submit(self._read_digest, fd, *blocks[i], buf)

        for i, (off, n) in enumerate(blocks):
            if before is not None:
                before()
            read_ahead(i)
            job = jobs.pop(i, None)
            digest = digest_of_span(i) or (job.result() if job is not None else None)
            read_ahead(i + 1)
            sent = self.send_block(f, fd, off, n, digest)
            if known.pop(i) is None:
                hashes.put(guid, version, off, n, sent)
            yield n
        for job in jobs.values():  # none left unless the caller stopped early
            job.cancel()

    # -- receiving -------------------------------------------------------------------

    def recv_header(self) -> tuple[bytes, int, int, bytes]:
        recv_exact(self.sock, memoryview(self._hdr))
        kind, offset, length, mac = HEADER.unpack(self._hdr)
        if kind not in (CONTROL, DATA):
            raise BulkError(f"unknown frame kind {kind!r}")
        if length > (MAX_CONTROL if kind == CONTROL else BLOCK):
            raise BadRequest(f"frame of {length} bytes: too large")
        return kind, offset, length, mac

    def recv_body(self, kind: bytes, offset: int, length: int, mac: bytes) -> memoryview:
        """The frame's bytes, once their MAC matched (BulkError otherwise)."""
        view = memoryview(bytearray(length)) if kind == CONTROL else self.view[:length]
        recv_exact(self.sock, view)
        self._check_mac(kind, offset, view, mac)
        return view

    def _check_mac(self, kind: bytes, offset: int, data: memoryview | bytes, mac: bytes
                   ) -> bytes:
        """The next received frame's MAC (IntegrityError when it does not match);
        returns the digest of its bytes."""
        digest = digest_of(data)
        want = self._mac_of(self.in_dir, self.received, kind, offset, len(data), digest)
        self.received += 1
        if not hmac.compare_digest(want, mac):
            raise IntegrityError(f"bad MAC on the frame at {offset} ({len(data)} bytes)")
        return digest

    def recv_data(self, offset: int, length: int, mac: bytes) -> tuple[bytes, bytes]:
        """A data block's bytes, once their MAC matched, as bytes (what crc32c takes),
        and their digest: received straight into a new bytes object where the socket
        allows it, so the block is not copied once more."""
        data = b""
        if not isinstance(self.sock, ssl.SSLSocket):
            # MSG_WAITALL waits for the whole block only on a blocking socket (Python's
            # timeouts make it non-blocking): blocking for this call, bounded by the
            # kernel's receive timeout (SO_RCVTIMEO, set to the stall timeout).
            timeout = self.sock.gettimeout()
            self.sock.settimeout(None)
            try:
                data = self.sock.recv(length, socket.MSG_WAITALL)
                if not data:
                    raise BulkError("connection closed by the other side")
            except BlockingIOError:
                pass  # the receive timeout ran out: the loop below times out too
            finally:
                self.sock.settimeout(timeout)
        if len(data) < length:  # (TLS, a timeout or a signal cut it short)
            view = self.view[:length]
            view[:len(data)] = data
            recv_exact(self.sock, view[len(data):])
            data = bytes(view)
        return data, self._check_mac(DATA, offset, data, mac)

    def land_blocks(self, fd: int, blocks: Iterable[tuple[int, int]], verifier: Executor
                    ) -> Iterator[tuple[int, int, bytes, int]]:
        """Receive the data frames of `blocks` ((offset, length), in this order) into the
        file `fd` at their offsets; yield (offset, length, digest, crc32c) for each once
        its MAC matched (IntegrityError otherwise; BulkError for a frame out of place,
        TimeoutError for a stall). The caller checks the crc32c before the block counts.

        The bytes land before they are checked: `fd` must be a file nobody reads before
        its blocks count, and that nobody shrinks meanwhile (checked through a mapping).
        Over TLS the bytes pass through Python (ssl cannot splice) and are checked first."""
        if isinstance(self.sock, ssl.SSLSocket):
            for off, n in blocks:
                data, digest = self.recv_data(off, n, self._data_header(off, n))
                os.pwrite(fd, data, off)
                yield off, n, digest, google_crc32c.value(data)
            return
        pending: tuple[Future[tuple[bytes, int]], int, int, int, bytes] | None = None
        timeout = self.sock.gettimeout()
        # Blocking, for splice(); each call bounded by the receive timeout (SO_RCVTIMEO).
        self.sock.settimeout(None)
        try:
            for off, n in blocks:
                mac = self._data_header(off, n)
                seq = self.received
                self.received += 1
                self._splice_into(fd, off, n)
                # Checked in another thread while the next block arrives.
                job = verifier.submit(_digest_and_crc_at, fd, off, n)
                if pending is not None:
                    yield self._landed(*pending)
                pending = (job, seq, off, n, mac)
            if pending is not None:
                yield self._landed(*pending)
        except BlockingIOError:
            raise TimeoutError(f"no data for {STALL_TIMEOUT:g} s") from None
        finally:
            self.sock.settimeout(timeout)

    def _data_header(self, off: int, n: int) -> bytes:
        """The header of the data frame due next (the block at off of n bytes): its MAC."""
        try:
            kind, got, length, mac = self.recv_header()
        except BlockingIOError:
            raise TimeoutError(f"no data for {STALL_TIMEOUT:g} s") from None
        if kind != DATA or got != off or length != n:
            raise BulkError(f"{'block' if kind == DATA else 'control message'} at {got} of "
                            f"{length} bytes; expected the block at {off} of {n}")
        return mac

    def _splice_into(self, fd: int, off: int, n: int) -> None:
        """n bytes from the socket into fd at off: socket -> pipe -> file, in the kernel."""
        if self._pipe is None:
            r, w = os.pipe2(os.O_CLOEXEC)
            with contextlib.suppress(OSError):  # a smaller pipe only means more calls
                fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
            self._pipe = (r, w)
        r, w = self._pipe
        sock = self.sock.fileno()
        while n:
            # The pipe fills up to the file's next PIPE_SIZE boundary before it is written:
            # tmpfs zeroes all of a new huge page but the bytes of its first write, so
            # writing each socket read as it came (often 64-256 KiB) zeroed about every
            # byte once more (perf: memset as costly as the copy itself).
            want = min(n, PIPE_SIZE - off % PIPE_SIZE)
            got = 0
            while got < want:
                try:
                    # Non-blocking on the pipe once it holds bytes: EAGAIN when its slots
                    # are full before `want` (a socket's small buffers) -- write those.
                    more = os.splice(sock, w, want - got, flags=os.SPLICE_F_MOVE | (
                        os.SPLICE_F_NONBLOCK if got else 0))
                except BlockingIOError:
                    if not got:
                        raise  # the receive timeout ran out
                    break
                if more == 0:
                    raise BulkError("connection closed by the other side")
                got += more
            n -= got
            while got:
                put = os.splice(r, fd, got, offset_dst=off, flags=os.SPLICE_F_MOVE)
                got -= put
                off += put

    def _landed(self, job: Future[tuple[bytes, int]], seq: int, off: int, n: int, mac: bytes
                ) -> tuple[int, int, bytes, int]:
        digest, crc = job.result()
        want = self._mac_of(self.in_dir, seq, DATA, off, n, digest)
        if not hmac.compare_digest(want, mac):
            raise IntegrityError(f"bad MAC on the frame at {off} ({n} bytes)")
        return off, n, digest, crc

    def recv_control(self) -> dict[str, Any]:
        kind, offset, length, mac = self.recv_header()
        if kind != CONTROL:
            raise BulkError("a data block where a control message was due")
        body = self.recv_body(kind, offset, length, mac)
        try:
            msg = json.loads(bytes(body))
        except ValueError:
            raise BadRequest("a control message that is not JSON") from None
        if not isinstance(msg, dict):
            raise BadRequest("a control message that is not an object")
        return msg

    def recv_reply(self) -> dict[str, Any]:
        msg = self.recv_control()
        if "error" in msg:
            raise Remote(str(msg["error"]), str(msg.get("details", "")))
        return msg


# -- handshakes ----------------------------------------------------------------------


def server_handshake(sock: socket.socket, keys: Keys) -> Conn:
    sock.settimeout(HANDSHAKE_TIMEOUT)
    server_nonce = os.urandom(NONCE)
    sock.sendall(MAGIC + server_nonce)
    got = bytearray(NONCE + MAC)
    recv_exact(sock, memoryview(got))
    client_nonce, answer = bytes(got[:NONCE]), bytes(got[NONCE:])
    if not hmac.compare_digest(answer, keys.answer(b"client", server_nonce, client_nonce)):
        raise AuthError("the client does not know the peer token")
    sock.sendall(keys.answer(b"server", server_nonce, client_nonce))
    sock.settimeout(STALL_TIMEOUT)
    return Conn(sock, keys.session(server_nonce, client_nonce), client=False)


def client_handshake(sock: socket.socket, keys: Keys) -> Conn:
    sock.settimeout(HANDSHAKE_TIMEOUT)
    hello = bytearray(len(MAGIC) + NONCE)
    recv_exact(sock, memoryview(hello))
    if bytes(hello[:len(MAGIC)]) != MAGIC:
        raise BulkError("not an mtcfs data channel")
    server_nonce, client_nonce = bytes(hello[len(MAGIC):]), os.urandom(NONCE)
    sock.sendall(client_nonce + keys.answer(b"client", server_nonce, client_nonce))
    answer = bytearray(MAC)
    recv_exact(sock, memoryview(answer))
    if not hmac.compare_digest(bytes(answer), keys.answer(b"server", server_nonce,
                                                          client_nonce)):
        raise AuthError("the server does not know the peer token")
    sock.settimeout(STALL_TIMEOUT)
    return Conn(sock, keys.session(server_nonce, client_nonce), client=True)


# -- TLS -----------------------------------------------------------------------------


def tls_contexts(tls: tuple[bytes, bytes, bytes | None] | None
                 ) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """(server, client) contexts from the same PEM certificate, key and CA as the gRPC
    channel: with a CA, both sides must present a certificate it signed; without,
    servers are checked against the system's roots (as gRPC does) and clients are not."""
    if tls is None:
        return None, None
    cert, key, ca = tls
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    # load_cert_chain reads files only: a private copy for the moment it reads them.
    with tempfile.TemporaryDirectory(prefix="mtcfs-tls-") as d:
        cert_path, key_path = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
        for path, data in ((cert_path, cert), (key_path, key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        server.load_cert_chain(cert_path, key_path)
        client.load_cert_chain(cert_path, key_path)
    if ca is not None:
        server.verify_mode = ssl.CERT_REQUIRED
        server.load_verify_locations(cadata=ca.decode())
        client.load_verify_locations(cadata=ca.decode())
    else:
        client.load_default_certs()
    return server, client


# -- the server ----------------------------------------------------------------------


def in_trio(token: Any) -> Callable[..., Any]:
    """Run a handler method in the daemon's trio thread (from a connection's thread)."""
    import trio

    def run(fn: Callable[..., Any], *args: Any) -> Any:
        if inspect.iscoroutinefunction(fn):
            return trio.from_thread.run(fn, *args, trio_token=token)
        return trio.from_thread.run_sync(fn, *args, trio_token=token)

    return run



def _code_of(e: BaseException) -> str:
    if isinstance(e, BadRequest):
        return "INVALID_ARGUMENT"
    if isinstance(e, Refused):
        return e.code.name
    if isinstance(e, RamTierFull):
        return "RESOURCE_EXHAUSTED"
    if isinstance(e, IntegrityError):
        return "DATA_LOSS"
    return "UNAVAILABLE"


class BulkServer:
    """Accepts data connections on `listen`; a thread per connection (bounded) serves
    its requests one after the other. What touches the namespace runs through
    `in_owner` (the daemon: in its trio thread), like the gRPC service."""

    def __init__(self, handler: PeerHandler, in_owner: Callable[..., Any], keys: Keys,
                 listen: tuple[str, int], tls: ssl.SSLContext | None = None,
                 max_connections: int = MAX_SERVER_CONNECTIONS,
                 hashes: BlockHashes | None = None, verifier: Executor | None = None) -> None:
        self.handler = handler
        self._own_verifier = verifier is None  # else whoever passed it shuts it down
        self.verifier = verifier or ThreadPoolExecutor(VERIFIERS, "bulk-verify")
        self.in_owner = in_owner
        self.keys = keys
        self.hashes = hashes if hashes is not None else BlockHashes()
        self.tls = tls
        self.slots = threading.BoundedSemaphore(max_connections)
        family = socket.AF_INET6 if ":" in listen[0] else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind(listen)
        except OSError as e:
            self.sock.close()
            raise OSError(e.errno, f"data channel: cannot listen on {listen[0]}:{listen[1]}: "
                                   f"{e.strerror}") from None
        self.sock.listen(128)
        self.port: int = self.sock.getsockname()[1]
        self.rejected = 0  # connections refused at the handshake
        self.refused = 0  # requests refused (bad, out of range, bad MAC or crc32c, full)
        self.pushes_received = 0  # replicas stored
        self.bytes_received = 0
        self.bytes_served = 0
        self.chunk_bytes_served = 0  # of bytes_served, to peers restoring the same file
        self._stopped = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="bulk-accept", daemon=True)

    def status(self) -> dict[str, int]:
        return {"port": self.port, "handshakes_refused": self.rejected,
                "requests_refused": self.refused, "replicas_received": self.pushes_received,
                "bytes_received": self.bytes_received, "bytes_served": self.bytes_served,
                "restore_bytes_served": self.chunk_bytes_served, **self.hashes.status()}

    def start(self) -> int:
        self._thread.start()
        return self.port

    def stop(self) -> None:
        self._stopped = True
        if self._own_verifier:
            self.verifier.shutdown(wait=False)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        with self._lock:
            for s in list(self._conns):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def _accept(self) -> None:
        while not self._stopped:
            try:
                sock, _ = self.sock.accept()
            except OSError:
                if self._stopped:
                    return
                continue
            if not self.slots.acquire(blocking=False):
                sock.close()  # too many connections: the client falls back or retries
                continue
            threading.Thread(target=self._serve, args=(sock,), name="bulk-conn",
                             daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        raw = sock  # what stop() shuts down (a TLS socket wraps it)
        with self._lock:
            self._conns.add(raw)
        conn: Conn | None = None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                if self.tls is not None:
                    sock.settimeout(HANDSHAKE_TIMEOUT)
                    sock = self.tls.wrap_socket(sock, server_side=True)
                conn = server_handshake(sock, self.keys)
            except (OSError, ssl.SSLError) as e:
                self.rejected += 1
                log.warning("data channel: connection refused: %s", e)
                return
            while not self._stopped:
                conn.sock.settimeout(IDLE_TIMEOUT)  # kept in the client's pool meanwhile
                try:
                    msg = conn.recv_control()
                except (BulkError, TimeoutError):
                    return  # closed by the client (the normal end), or idle too long
                conn.sock.settimeout(STALL_TIMEOUT)
                if not self._request(conn, msg):
                    return
        except Exception as e:  # a broken connection must not take the server down
            log.warning("data channel: connection dropped: %s", e)
        finally:
            if conn is not None:
                conn.close()
            with contextlib.suppress(OSError):
                sock.close()
            with contextlib.suppress(OSError):
                raw.close()
            with self._lock:
                self._conns.discard(raw)
            self.slots.release()

    def _request(self, conn: Conn, msg: dict[str, Any]) -> bool:
        """Serve one request; False when the connection must be dropped (a refusal in the
        middle of a stream leaves it out of step)."""
        op = msg.get("op")
        try:
            if op == "push":
                self._push(conn, msg)
            elif op == "fetch":
                self._fetch(conn, msg)
            elif op == "chunk":
                self._chunk(conn, msg)
            else:
                raise BadRequest(f"unknown request {str(op)[:40]!r}")
            return True
        except (BulkError, ssl.SSLError, TimeoutError):
            self.refused += op == "push"  # a replica cut short (or a bad MAC): not stored
            raise
        except Exception as e:
            self.refused += 1
            if not isinstance(e, (BadRequest, Refused, RamTierFull, IntegrityError)):
                log.exception("data channel: %s failed", op)
            with contextlib.suppress(OSError):
                conn.send_control({"error": _code_of(e), "details": str(e)[:500]})
            return False

    # -- push (a replica arriving) ---------------------------------------------------

    def _push(self, conn: Conn, msg: dict[str, Any]) -> None:
        try:
            e = pb.Entry.FromString(base64.b64decode(str(msg.get("entry", "")), validate=True))
        except ValueError:
            raise BadRequest("a push needs its entry") from None
        path = str(msg.get("path", ""))
        security.check_entry(e)
        security.check_path(path)
        if e.removed or not e.has_crc or not e.block_crcs:
            raise BadRequest("a pushed file needs its crc32c and block crc32cs")
        verify = BlockVerifier(e.size, e.crc32c, bytes(e.block_crcs))
        digests: list[tuple[int, int, bytes]] = []
        key, tmp = self.in_owner(self.handler.begin_receive, e)
        ok = False
        try:
            conn.send_control({"ok": True})
            fd = os.open(tmp, os.O_RDWR | os.O_CLOEXEC)  # read too: checked in a mapping
            yielded = 0.0
            try:
                for offset, length, digest, crc in conn.land_blocks(fd, spans(0, e.size),
                                                                    self.verifier):
                    verify.feed_crc(length, crc)  # raises IntegrityError on a bad crc32c
                    digests.append((offset, length, digest))
                    self.bytes_received += length
                    # This host's trainer is writing: let it have the CPU (bounded).
                    yielded += self.handler.yield_to_writes(mover.MAX_YIELD - yielded)
                verify.finish()
                if conn.recv_control().get("op") != "end":
                    raise BadRequest("expected the end of the push")
            finally:
                os.close(fd)
            conn.sock.settimeout(REPLY_TIMEOUT)
            ok = self.in_owner(self.handler.finish_receive, e, key, tmp)
            if ok:  # serving this replica later needs no pass over it for its MACs
                for offset, length, digest in digests:
                    self.hashes.put(e.id, e.version, offset, length, digest)
        except Exception as exc:
            log.warning("replica of %s from %s rejected: %s", path, e.writer, exc)
            raise
        finally:
            if not ok:  # refused, failed or cut: give back the space reserved
                self.in_owner(self.handler.abort_receive, key, tmp)
        self.pushes_received += bool(ok)
        conn.send_control({"ok": True, "stored": bool(ok)})

    # -- fetch (a reader elsewhere) --------------------------------------------------

    def _fetch(self, conn: Conn, msg: dict[str, Any]) -> None:
        guid, path = str(msg.get("id", "")), str(msg.get("path", ""))
        version, offset, length = (msg.get(k, 0) for k in ("version", "offset", "length"))
        security.check_id(guid)
        security.check_path(path)
        if not all(isinstance(v, int) and 0 <= v < security.MAX_COUNTER
                   for v in (version, offset, length)):
            raise BadRequest("bad version, offset or length")
        if offset % BLOCK:
            raise BadRequest(f"offset {offset} is not on a block boundary")
        fd, size = self.in_owner(self.handler.open_for_fetch, guid, version)
        try:
            if offset > size:
                raise BadRequest(f"offset {offset} is beyond the file's {size} bytes")
            end = size if length == 0 else min(size, offset + length)
            conn.send_control({"ok": True, "size": size})
            with open(fd, "rb", buffering=0, closefd=False) as f:
                for n in conn.send_blocks(f, fd, offset, end, self.hashes, guid, version,
                                          ahead=self.verifier):
                    self.bytes_served += n
        finally:
            os.close(fd)


    # -- chunk (a peer restoring the same file) ---------------------------------------

    def _chunk(self, conn: Conn, msg: dict[str, Any]) -> None:
        guid, path = str(msg.get("id", "")), str(msg.get("path", ""))
        version, offset, length = (msg.get(k, 0) for k in ("version", "offset", "length"))
        wait = bool(msg.get("wait"))
        security.check_id(guid)
        security.check_path(path)
        if not all(isinstance(v, int) and 0 <= v < security.MAX_COUNTER
                   for v in (version, offset, length)) or not length:
            raise BadRequest("bad version, offset or length")
        while True:
            state, fd, size = self.in_owner(self.handler.serve_chunk, guid, version, offset,
                                            length, wait, KEEPALIVE)
            if state != "wait":
                break
            try:
                conn.send_control({"wait": True})  # still coming: the client keeps waiting
            except OSError as e:  # it gave up (its restore stopped, or it took it elsewhere)
                raise BulkError(f"the client left: {e}") from None
        if state != "ready":
            conn.send_control({"ok": True, "have": False})
            return
        try:
            end = offset + length
            if end > size:
                raise BadRequest(f"bytes {offset}-{end} are beyond the file's {size}")
            conn.send_control({"ok": True, "have": True, "size": size})
            with open(fd, "rb", buffering=0, closefd=False) as f:
                for n in conn.send_blocks(f, fd, offset, end, self.hashes, guid, version,
                                          ahead=self.verifier):
                    self.bytes_served += n
                    self.chunk_bytes_served += n
        finally:
            os.close(fd)


# -- the client side -----------------------------------------------------------------


class BulkPool:
    """Connections to peers' data channels: at most `connections` per peer, kept open
    and reused; used from worker threads (every call blocks)."""

    def __init__(self, keys: Keys, tls: ssl.SSLContext | None, connections: int,
                 hashes: BlockHashes | None = None, verifier: Executor | None = None) -> None:
        self.keys = keys
        self._own_verifier = verifier is None  # else whoever passed it shuts it down
        self.verifier = verifier or ThreadPoolExecutor(VERIFIERS, "bulk-verify")
        self.tls = tls
        self.hashes = hashes if hashes is not None else BlockHashes()
        self.connections = connections
        self._idle: dict[tuple[str, int], list[Conn]] = {}
        self._slots: dict[tuple[str, int], threading.BoundedSemaphore] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        if self._own_verifier:
            self.verifier.shutdown(wait=False)
        with self._lock:
            for conns in self._idle.values():
                for c in conns:
                    c.close()
            self._idle.clear()

    @contextlib.contextmanager
    def conn(self, addr: tuple[str, int], wait: float = STALL_TIMEOUT) -> Iterator[Conn]:
        """An authenticated connection to `addr`, back to the pool after a clean use and
        dropped after any error (it may be out of step)."""
        with self._lock:
            slots = self._slots.setdefault(addr, threading.BoundedSemaphore(self.connections))
        if not slots.acquire(timeout=wait):
            raise BulkError(f"all {self.connections} data connections to {addr[0]}:{addr[1]} "
                            f"are busy")
        try:
            c = self._take(addr) or self._open(addr)
            try:
                yield c
            except BaseException:
                c.close()
                raise
            c.sock.settimeout(STALL_TIMEOUT)
            with self._lock:
                self._idle.setdefault(addr, []).append(c)
        finally:
            slots.release()

    def _take(self, addr: tuple[str, int]) -> Conn | None:
        while True:
            with self._lock:
                idle = self._idle.get(addr)
                c = idle.pop() if idle else None
            if c is None or not c.stale():
                return c
            c.close()

    def _open(self, addr: tuple[str, int]) -> Conn:
        sock = socket.create_connection(addr, timeout=HANDSHAKE_TIMEOUT)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_hostname=addr[0])
            return client_handshake(sock, self.keys)
        except BaseException:
            sock.close()
            raise

    # -- requests --------------------------------------------------------------------

    def push(self, addr: tuple[str, int], fd: int, entry: pb.Entry, path: str,
             yield_to_writes: Callable[[], None]) -> tuple[str, str, bool]:
        """Push one replica (fd: the file, open); returns (status code name, details,
        stored) as the gRPC push does."""
        size = entry.size
        try:
            with self.conn(addr) as c:
                c.send_control({"op": "push", "path": path,
                                "entry": base64.b64encode(entry.SerializeToString()).decode()})
                c.recv_reply()
                try:
                    with open(fd, "rb", buffering=0, closefd=False) as f:
                        for _ in c.send_blocks(f, fd, 0, size, self.hashes, entry.id,
                                               entry.version, yield_to_writes, self.verifier):
                            pass
                    c.send_control({"op": "end"})
                except OSError:
                    # Refused mid-stream (a block that did not verify)? Its answer says why.
                    c.sock.settimeout(1.0)
                    c.recv_reply()
                    raise
                c.sock.settimeout(REPLY_TIMEOUT)
                reply = c.recv_reply()
            return "OK", "", bool(reply.get("stored"))
        except Remote as e:
            return e.code, e.details, False
        except (OSError, ssl.SSLError, IntegrityError, BadRequest) as e:
            return "UNAVAILABLE", f"data channel: {e}", False

    def fetch(self, addr: tuple[str, int], fd: int, guid: str, version: int, path: str,
              size: int, block_crcs: bytes, first: int, last: int,
              on_block: Callable[[int, int], None]) -> None:
        """Blocks [first, last) of a held file into fd at their offsets, each reported
        through on_block (in this thread) once its MAC and crc32c matched. Raises
        BulkError, Remote or IntegrityError (the connection is dropped; blocks reported
        so far stay good)."""
        if len(block_crcs) != 4 * block_count(size):
            raise IntegrityError("the block crc32cs do not match the file's size")
        want = struct.unpack_from(f"<{last - first}I", block_crcs, 4 * first)
        offset, end = first * BLOCK, min(size, last * BLOCK)
        with self.conn(addr) as c:
            c.send_control({"op": "fetch", "id": guid, "version": version, "path": path,
                            "offset": offset, "length": end - offset})
            reply = c.recv_reply()
            if reply.get("size") != size:
                raise Remote("FAILED_PRECONDITION", f"{reply.get('size')} bytes there, "
                                                    f"{size} here")
            for i, (off, length, digest, crc) in enumerate(
                    c.land_blocks(fd, spans(offset, end), self.verifier)):
                if crc != want[i]:
                    e = IntegrityError(f"block at {off}: crc32c mismatch")
                    e.bad_range = (off, off + length)
                    raise e
                self.hashes.put(guid, version, off, length, digest)
                on_block(off, length)

    def fetch_chunk(self, addr: tuple[str, int], fd: int, guid: str, version: int, path: str,
                    offset: int, length: int, crc: int, wait: bool,
                    stop: Callable[[], bool] | None = None) -> bool:
        """One chunk of a file the server restores (or has) into fd at `offset`, good
        only once every frame's MAC and the chunk's whole crc32c matched (the caller
        shows no reader, and serves no peer, a byte of it before). wait: the server
        keeps the request open while the chunk is still coming there (stop(): the
        caller gives up waiting, at the next keepalive). Returns False when the server
        will not have it; raises BulkError, Remote or IntegrityError (the connection is
        dropped; the chunk is not good)."""
        with self.conn(addr) as c:
            c.send_control({"op": "chunk", "id": guid, "version": version, "path": path,
                            "offset": offset, "length": length, "wait": wait})
            reply = c.recv_reply()
            while reply.get("wait"):
                if stop is not None and stop():
                    raise BulkError("the restore stopped waiting for the chunk")
                reply = c.recv_reply()
            if not reply.get("have"):
                return False
            whole = 0
            digests = []
            for at, n, digest, block_crc in c.land_blocks(fd, spans(offset, offset + length),
                                                           self.verifier):
                whole = crc32c_combine(whole, block_crc, n)
                digests.append((at, n, digest))
            if whole != crc:
                e = IntegrityError(f"chunk at {offset}: crc32c mismatch")
                e.bad_range = (offset, offset + length)
                raise e
            for at, n, digest in digests:
                self.hashes.put(guid, version, at, n, digest)
            return True
