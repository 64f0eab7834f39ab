"""The bulk data channel: file bytes between daemons over plain TCP (or TLS),
beside gRPC, which stays the control plane (index, health, push offers).

Through gRPC every 1 MiB chunk was a protobuf message built and parsed in
Python; here each 4 MiB block crosses as one frame. One pass over each byte per
side: the sender authenticates a block (AES-GMAC, or encrypts it with AES-GCM
under --peer-encryption) and sends it, from a mapping of the file where huge
pages back the RAM tier (else read once into a buffer; mappings:
mtcfs.tiers.mapped); the receiver receives into a buffer, checks the tag and the
block's crc32c there and only then writes it into its file. Never a second read
of the file, and never a byte written that did not verify. The checks run in
worker threads (OpenSSL and crc32c release the GIL) while the connection's
thread moves the next block.

Security is no weaker than the gRPC calls' token:

- A connection counts only after a mutual challenge-response on the shared
  token: the server sends the wire's version, its settings and a fresh random
  nonce; the client answers with its settings, its own nonce and a keyed BLAKE3
  MAC of all of it; the server answers with a MAC of the same (under a different
  label). The token never travels; a recorded answer replayed on a new
  connection fails, the server's nonce being new. Settings that differ (one side
  encrypts, the other does not) and another version of the wire end the
  handshake with an error that says so, never with bytes misread.
- Every frame (control messages and data blocks) carries a 16-byte AES-GCM tag
  under a per-connection, per-direction AES-256 key (derived from the token and
  both nonces). Its nonce is the frame's number in that direction (a key never
  sees a nonce twice); the header (frame number, kind, offset, length) and the
  frame's bytes are authenticated (as associated data: AES-GMAC), or, with
  --peer-encryption, the bytes are encrypted and the header authenticated. A
  block cannot be altered, replayed, reordered, truncated, reflected or moved to
  another connection. A block counts only after its tag and its crc32c (against
  the index's block crc32cs) both matched.
- With --tls-* the connection is TLS (the ssl module), like the gRPC channel.

Wire format (version 2), after the handshake: frames of a 29-byte header (kind,
offset, length, tag) and `length` bytes. Kind C is a control message (JSON),
kind B one block (4 MiB, the last one shorter) of the file at `offset`, kind T
one tree message. Requests:
`push` (a replica: header, blocks in order, `end`; the receiver verifies the
whole file and answers), `fetch` (a block range of a held file) and `chunk`
(one chunk of a file the server restores from the durable tier, or has:
mtcfs.peer.restore; the server sends `wait` keepalives until the chunk is
verified there, or says it will not have it; the client counts the chunk only
once its recorded crc32c matched), and `tree`: from then on the connection
carries the sender's dissemination tree messages, one kind T frame each (a
serialized pb.TreeMessage, checked as the gRPC Forward call's), never answered
(mtcfs.peer.treelinks), until the sender closes it.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hmac
import inspect
import json
import logging
import os
import select
import socket
import ssl
import struct
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

import crc32c
from blake3 import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from google.protobuf.message import DecodeError

from mtcfs.core.checksums import (
    BLOCK,
    BlockVerifier,
    IntegrityError,
    block_count,
    crc32c_combine,
    unmap,
)
from mtcfs.peer import mover, security
from mtcfs.peer.security import BadRequest
from mtcfs.peer.server import PeerHandler, Refused
from mtcfs.peer.v1 import peer_pb2 as pb
from mtcfs.tiers.mapped import map_range
from mtcfs.tiers.ram import RamTierFull

log = logging.getLogger(__name__)

WIRE = b"MTCFSBK"  # + the wire's version, one digit
VERSION = 2  # 1: BLAKE3 MACs over digests (mtcfs before AES-GMAC)
MAGIC = WIRE + str(VERSION).encode()
NONCE = 32
MAC = 32  # the handshake's answers (keyed BLAKE3)
TAG = 16  # a frame's AES-GCM tag
# Frames up to this size have their GMAC computed over a copy of header and bytes in
# one OpenSSL call (the same tag: GCM's additional data is one stream).
SMALL_FRAME = 64 << 10
HEADER = struct.Struct("<cQI16s")  # kind, offset, length, tag
AAD = struct.Struct("<QcQI")  # what a frame's tag covers besides its bytes: number, header
ENCRYPTED = 0x01  # a setting bit in the handshake: --peer-encryption
CONTROL, DATA, TREE = b"C", b"B", b"T"
HANDSHAKE_TIMEOUT = 5.0
STALL_TIMEOUT = 5.0  # a connection with no progress for this long is dropped
REPLY_TIMEOUT = 60.0  # the receiver's answer to a whole push (verification, commit)
IDLE_TIMEOUT = 600.0  # a pooled connection with no request for this long is closed
MAX_CONTROL = security.MAX_MESSAGE
MAX_SERVER_CONNECTIONS = 64
KEEPALIVE = 1.0  # a server waiting for a chunk tells the client so this often
# Tree messages of one stream handed to the daemon and not yet taken there: the
# stream's thread waits beyond this (the sender's socket then fills and it waits too).
TREE_PENDING = 64
NOT_TREE = "a tree stream carries tree messages only"
VERIFIERS = 8  # threads that tag, check and write blocks (OpenSSL and crc32c release the GIL)


class BulkError(OSError):
    """The connection failed or its peer broke the protocol: it is dropped."""


class AuthError(BulkError):
    """The other side does not know the token (or replayed an old answer)."""


class Mismatch(BulkError):
    """The other side runs another version of the wire or other settings: no bytes
    can pass until the hosts agree (a configuration error, said as such)."""


class Remote(Exception):
    """The other side refused a request: `code` is a gRPC status code name."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class Keys:
    """The handshake key and the data key, derived from the shared token with BLAKE3's
    key derivation (distinct contexts), and this host's setting for the frames' bytes
    (`encrypt`: --peer-encryption). Without a token (--insecure) the keys derive from
    nothing: integrity against accidents only, as the gRPC calls are then open too."""

    def __init__(self, token: bytes | None, encrypt: bool = False) -> None:
        secret = token or b""
        self.encrypt = encrypt
        self.auth = blake3(secret, derive_key_context="mtcfs 2026 bulk channel handshake").digest()
        self.data = blake3(secret, derive_key_context="mtcfs 2026 bulk channel frames v2").digest()

    @property
    def flags(self) -> int:
        return ENCRYPTED if self.encrypt else 0

    def answer(self, label: bytes, server_flags: int, client_flags: int, server_nonce: bytes,
               client_nonce: bytes) -> bytes:
        said = MAGIC + bytes((server_flags, client_flags)) + server_nonce + client_nonce
        return blake3(label + said, key=self.auth).digest()

    def session(self, server_nonce: bytes, client_nonce: bytes) -> tuple[bytes, bytes]:
        """(client-to-server, server-to-client) AES-256 keys of one connection."""
        both = blake3(server_nonce + client_nonce, key=self.data).digest(length=64)
        return both[:32], both[32:]


def spans(start: int, end: int) -> list[tuple[int, int]]:
    """The (offset, length) of each block of bytes [start, end) (start on a boundary)."""
    return [(off, min(BLOCK, end - off)) for off in range(start, end, BLOCK)]


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise BulkError("connection closed by the other side")
        view = view[n:]


def _settings(flags: int) -> str:
    return "peer encryption on" if flags & ENCRYPTED else "peer encryption off"


class Sealer:
    """One direction's frames of one connection: the AES-GCM tag (and, when
    encrypting, the ciphertext) of each, numbered. Used by one thread at a time per
    frame; the frame number is taken by the connection's thread, in order."""

    def __init__(self, key: bytes, encrypt: bool) -> None:
        self.key = key
        self.encrypt = encrypt
        self.aead = AESGCM(key)

    @staticmethod
    def nonce(seq: int) -> bytes:
        return struct.pack("<4xQ", seq)  # a key (one direction) never sees a number twice

    def seal(self, seq: int, kind: bytes, offset: int, data: memoryview | bytes,
             out: memoryview | None = None) -> tuple[bytes, memoryview | bytes]:
        """(tag, the bytes to send): `data` itself with its GMAC, or its ciphertext
        (into `out`, len(data) + TAG bytes, when given)."""
        aad = AAD.pack(seq, kind, offset, len(data))
        if self.encrypt:
            n = len(data)
            if out is None:
                sealed = memoryview(self.aead.encrypt(self.nonce(seq), data, aad))
            else:
                self.aead.encrypt_into(self.nonce(seq), data, aad, out[:n + TAG])
                sealed = out
            return bytes(sealed[n:n + TAG]), sealed[:n]
        if len(data) <= SMALL_FRAME:  # the same tag in one call, not five (tree messages)
            return self.aead.encrypt(self.nonce(seq), b"", aad + bytes(data)), data
        enc = Cipher(algorithms.AES(self.key), modes.GCM(self.nonce(seq))).encryptor()
        enc.authenticate_additional_data(aad)
        enc.authenticate_additional_data(data)
        enc.finalize()
        return enc.tag, data

    def open(self, seq: int, kind: bytes, offset: int, data: memoryview, tag: bytes,
             out: memoryview | None = None) -> memoryview:
        """The frame's bytes once its tag matched (decrypted into `out` when
        encrypting); IntegrityError otherwise. `data` must have TAG spare bytes after
        it (its buffer's tail) when encrypting: the tag is put there for OpenSSL."""
        n = len(data)
        aad = AAD.pack(seq, kind, offset, n)
        try:
            if self.encrypt:
                whole = data.obj if isinstance(data, memoryview) else data
                body = memoryview(whole)[:n + TAG]
                body[n:] = tag
                if out is None:
                    return memoryview(self.aead.decrypt(self.nonce(seq), body, aad))
                self.aead.decrypt_into(self.nonce(seq), body, aad, out[:n])
                return out[:n]
            if n <= SMALL_FRAME:
                self.aead.decrypt(self.nonce(seq), tag, aad + bytes(data))
                return data
            dec = Cipher(algorithms.AES(self.key), modes.GCM(self.nonce(seq), tag)).decryptor()
            dec.authenticate_additional_data(aad)
            dec.authenticate_additional_data(data)
            dec.finalize()
            return data
        except InvalidTag:
            raise IntegrityError(f"bad tag on the frame at {offset} ({n} bytes)") from None


class _Buffers:
    """Two block buffers (with room for a tag) and, when encrypting, two for the
    other side of the cipher: block i uses pair i % 2 while i + 1 is moved."""

    def __init__(self, encrypt: bool) -> None:
        self.raw = [memoryview(bytearray(BLOCK + TAG)) for _ in range(2)]
        self.clear = [memoryview(bytearray(BLOCK + TAG)) for _ in range(2)] if encrypt \
            else self.raw


class Conn:
    """One authenticated connection: tagged frames both ways, reused block buffers."""

    def __init__(self, sock: socket.socket, keys: tuple[bytes, bytes], client: bool,
                 encrypt: bool = False) -> None:
        self.sock = sock
        out_key, in_key = keys if client else keys[::-1]
        self.out = Sealer(out_key, encrypt)
        self.inn = Sealer(in_key, encrypt)
        self.encrypt = encrypt
        self.sent = 0  # frames sent / received: each tag's nonce is its frame's number
        self.received = 0
        self.adopted = False  # a tree stream now read by the daemon's trio thread
        self._hdr = bytearray(HEADER.size)
        self._plain = not isinstance(sock, ssl.SSLSocket)
        if self._plain:
            secs = int(STALL_TIMEOUT)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                            struct.pack("ll", secs, int((STALL_TIMEOUT - secs) * 1e6)))

    @functools.cached_property
    def bufs(self) -> _Buffers:
        """Made at the first block (a connection for control messages needs none)."""
        return _Buffers(self.encrypt)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def stale(self) -> bool:
        """An idle connection with something to read was closed (or broken) by the other
        side: not reused."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    # -- sending ---------------------------------------------------------------------

    def _send_frame(self, kind: bytes, offset: int, tag: bytes, body: memoryview | bytes
                    ) -> None:
        self.sent += 1
        head = HEADER.pack(kind, offset, len(body), tag)
        if self._plain and len(body) > 4096:
            self.sock.sendall(head, socket.MSG_MORE)  # one segment with the body's start
            self.sock.sendall(body)
        else:
            self.sock.sendall(head + bytes(body))

    def send_control(self, msg: dict[str, Any]) -> None:
        body = json.dumps(msg, separators=(",", ":")).encode()
        tag, sealed = self.out.seal(self.sent, CONTROL, 0, body)
        self._send_frame(CONTROL, 0, tag, sealed)

    def tree_frame(self, body: bytes) -> bytes:
        """The next frame of a tree stream, carrying `body`, as bytes to send (counted
        as sent: the caller sends it, or drops the connection)."""
        tag, sealed = self.out.seal(self.sent, TREE, 0, body)
        self.sent += 1
        return HEADER.pack(TREE, 0, len(sealed), tag) + bytes(sealed)

    @property
    def plain(self) -> bool:
        """Plain TCP (no TLS): its socket can be read and written without blocking."""
        return self._plain

    def _read_sealed(self, fd: int, seq: int, offset: int, length: int, i: int
                     ) -> tuple[bytes, memoryview]:
        """Block `offset` of fd read once into buffer pair i, tagged (or encrypted)
        as frame `seq`: (tag, the bytes to send)."""
        view = self.bufs.clear[i][:length]
        if os.preadv(fd, [view], offset) != length:
            raise BulkError(f"the file is shorter than {offset + length} bytes")
        return self.out.seal(seq, DATA, offset, view, self.bufs.raw[i])

    def _mapped_sealed(self, view: memoryview, base: int, seq: int, offset: int,
                       length: int, i: int) -> tuple[bytes, memoryview]:
        """Block `offset` tagged where it lies in the file's mapping `view` (from `base`),
        sent from there (or encrypted into buffer i)."""
        data = view[offset - base:offset - base + length]
        return self.out.seal(seq, DATA, offset, data, self.bufs.raw[i] if self.encrypt
                             else None)

    def send_blocks(self, fd: int, offset: int, end: int,
                    before: Callable[[], None] | None = None,
                    ahead: Executor | None = None, mapped: bool = False) -> Iterator[int]:
        """The blocks of bytes [offset, end) of the open file fd; yields each block's
        length once sent. Each is read and tagged in `ahead`'s threads one block ahead,
        while this thread sends the block before. Bytes that changed since the file's
        seal fail the receiver's crc32c check: never counted there.

        `mapped` (the caller holds a pin on the file: mtcfs.tiers.mapped): blocks are
        tagged and sent where they lie in a mapping of the file, never copied into a
        buffer (on a huge-page tmpfs, 15 % less of the sender's CPU per GiB in the
        daemon: docs/benchmarks.md); a range with a hole in it is read as without."""
        blocks = spans(offset, end)
        jobs: dict[int, Future[tuple[bytes, memoryview]]] = {}
        first = self.sent
        view = map_range(fd, offset, end) if mapped else None

        def sealed(i: int) -> tuple[bytes, memoryview]:
            if view is not None:
                return self._mapped_sealed(view, offset, first + i, *blocks[i], i % 2)
            return self._read_sealed(fd, first + i, *blocks[i], i % 2)

        def read_ahead(i: int) -> None:
            if ahead is not None and i < len(blocks) and i not in jobs:
                jobs[i] = ahead.submit(sealed, i)

        try:
            for i, (off, n) in enumerate(blocks):
                if before is not None:
                    before()
                read_ahead(i)
                job = jobs.pop(i, None)
                tag, body = job.result() if job is not None else sealed(i)
                read_ahead(i + 1)  # into the other buffers: this one is being sent
                if self.sent != first + i:
                    raise BulkError("frames sent out of order")
                self._send_frame(DATA, off, tag, body)
                yield n
        finally:
            for job in jobs.values():  # none left unless the caller stopped early
                if not job.cancel():
                    with contextlib.suppress(Exception):
                        job.result()  # its buffer must be free before the next use
            jobs.clear()
            body = None  # (the last slice of the mapping)
            unmap(view)

    # -- receiving -------------------------------------------------------------------

    def recv_header(self) -> tuple[bytes, int, int, bytes]:
        recv_exact(self.sock, memoryview(self._hdr))
        kind, offset, length, tag = HEADER.unpack(self._hdr)
        if kind not in (CONTROL, DATA, TREE):
            raise BulkError(f"unknown frame kind {kind!r}")
        if length > (BLOCK if kind == DATA else MAX_CONTROL):
            raise BadRequest(f"frame of {length} bytes: too large")
        return kind, offset, length, tag

    def _recv_into(self, view: memoryview) -> None:
        """Exactly len(view) bytes; TimeoutError after STALL_TIMEOUT without any."""
        if not self._plain:
            recv_exact(self.sock, view)
            return
        # MSG_WAITALL waits for the whole block only on a blocking socket (Python's
        # timeouts make it non-blocking): blocking for this call, bounded by the
        # kernel's receive timeout (SO_RCVTIMEO, set to the stall timeout).
        timeout = self.sock.gettimeout()
        self.sock.settimeout(None)
        try:
            while view:
                n = self.sock.recv_into(view, len(view), socket.MSG_WAITALL)
                if n == 0:
                    raise BulkError("connection closed by the other side")
                view = view[n:]
        except BlockingIOError:
            raise TimeoutError(f"no data for {STALL_TIMEOUT:g} s") from None
        finally:
            self.sock.settimeout(timeout)

    def land_blocks(self, fd: int, blocks: Iterable[tuple[int, int]], verifier: Executor
                    ) -> Iterator[tuple[int, int, int]]:
        """Receive the data frames of `blocks` ((offset, length), in this order) and
        write each into the file fd at its offset once its tag matched; yield (offset,
        length, crc32c) for each after it was written (IntegrityError on a bad tag:
        nothing of that block is written; BulkError for a frame out of place,
        TimeoutError for a stall). The caller checks the crc32c before the block
        counts. The tag, crc32c and write run in `verifier`'s threads while this thread
        receives the next block. (Received into a buffer, not into a mapping of the
        file: that saved nothing measurable in the daemon, alternated A/B, since a
        page faulted in through a mapping is zeroed first, which a write skips.)"""
        pending: tuple[Future[int], int, int] | None = None
        job: Future[int] | None = None
        try:
            for i, (off, n) in enumerate(blocks):
                try:
                    tag = self._data_header(off, n)
                    seq = self.received
                    self.received += 1
                    # Into buffer pair i % 2: the job of block i - 2 that used it was
                    # waited for (yielded) before block i - 1 was received.
                    self._recv_into(self.bufs.raw[i % 2][:n])
                except (OSError, BadRequest):
                    if pending is not None:  # a forged block before the cut says why first
                        pending[0].result()
                    raise
                job = verifier.submit(self._check_and_write, fd, seq, off, n, tag, i % 2)
                if pending is not None:
                    yield self._landed(*pending)
                pending = (job, off, n)
            if pending is not None:
                yield self._landed(*pending)
        finally:
            for left in (pending[0] if pending else None, job):
                if left is not None:  # its buffers must be free before the next use
                    with contextlib.suppress(Exception):
                        left.result()

    def _check_and_write(self, fd: int, seq: int, off: int, n: int, tag: bytes, i: int
                         ) -> int:
        data = self.inn.open(seq, DATA, off, self.bufs.raw[i][:n], tag, self.bufs.clear[i])
        crc = crc32c.crc32c(data)
        view = data
        while view:
            view = view[os.pwrite(fd, view, off + len(data) - len(view)):]
        return crc

    @staticmethod
    def _landed(job: Future[int], off: int, n: int) -> tuple[int, int, int]:
        return off, n, job.result()

    def _data_header(self, off: int, n: int) -> bytes:
        """The header of the data frame due next (the block at off of n bytes): its tag."""
        try:
            kind, got, length, tag = self.recv_header()
        except BlockingIOError:
            raise TimeoutError(f"no data for {STALL_TIMEOUT:g} s") from None
        if kind != DATA or got != off or length != n:
            raise BulkError(f"{'block' if kind == DATA else 'control message'} at {got} of "
                            f"{length} bytes; expected the block at {off} of {n}")
        return tag

    def open_next(self, kind: bytes, offset: int, body: memoryview, tag: bytes
                  ) -> memoryview:
        """The next received frame's bytes once its tag matched (`body`: a view of a
        buffer with TAG spare bytes after it, see Sealer.open); counted received."""
        opened = self.inn.open(self.received, kind, offset, body, tag)
        self.received += 1
        return opened

    def _recv_sealed(self, want: bytes, wrong: type[Exception], why: str) -> memoryview:
        """The next frame, which must be of kind `want` (else `wrong(why)`)."""
        kind, offset, length, tag = self.recv_header()
        if kind != want:
            raise wrong(why)
        raw = memoryview(bytearray(length + TAG))
        recv_exact(self.sock, raw[:length])
        return self.open_next(kind, offset, raw[:length], tag)

    def recv_control(self) -> dict[str, Any]:
        body = self._recv_sealed(CONTROL, BulkError,
                                 "a data block where a control message was due")
        try:
            msg = json.loads(bytes(body))
        except ValueError:
            raise BadRequest("a control message that is not JSON") from None
        if not isinstance(msg, dict):
            raise BadRequest("a control message that is not an object")
        return msg

    def recv_tree(self) -> bytes:
        """The next tree message of a stream (its bytes, tag checked)."""
        return bytes(self._recv_sealed(TREE, BadRequest, NOT_TREE))

    def recv_reply(self) -> dict[str, Any]:
        msg = self.recv_control()
        if "error" in msg:
            raise Remote(str(msg["error"]), str(msg.get("details", "")))
        return msg


class TreeFrames:
    """A tree stream's messages from its bytes as they arrive, for a reader that never
    blocks (the daemon's trio thread): whole frames only, each tag checked."""

    def __init__(self, conn: Conn) -> None:
        self.conn = conn
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The messages completed by `data` (IntegrityError, BadRequest: drop the
        stream)."""
        buf = self._buf
        buf += data
        out: list[bytes] = []
        at = 0
        while len(buf) - at >= HEADER.size:
            kind, offset, length, tag = HEADER.unpack_from(buf, at)
            if kind != TREE:
                raise BadRequest(NOT_TREE)
            if length > MAX_CONTROL:
                raise BadRequest(f"frame of {length} bytes: too large")
            start = at + HEADER.size
            if len(buf) - start < length:
                break
            raw = bytearray(length + TAG)  # (room for the tag when decrypting)
            raw[:length] = buf[start:start + length]
            out.append(bytes(self.conn.open_next(TREE, offset, memoryview(raw)[:length], tag)))
            at = start + length
        del buf[:at]
        return out


# -- handshakes ----------------------------------------------------------------------


def _check_version(magic: bytes, where: str) -> None:
    if magic == MAGIC:
        return
    if magic[:len(WIRE)] == WIRE:
        theirs = magic[len(WIRE):].decode("ascii", "replace")
        raise Mismatch(f"{where} speaks data channel version {theirs}, this host version "
                       f"{VERSION}: run the same mtcfs on every host of the job")
    raise BulkError(f"{where} is not an mtcfs data channel")


def server_handshake(sock: socket.socket, keys: Keys) -> Conn:
    sock.settimeout(HANDSHAKE_TIMEOUT)
    server_nonce = os.urandom(NONCE)
    sock.sendall(MAGIC + bytes((keys.flags,)) + server_nonce)
    got = bytearray(1 + NONCE + MAC)
    recv_exact(sock, memoryview(got))
    flags, client_nonce, answer = got[0], bytes(got[1:1 + NONCE]), bytes(got[1 + NONCE:])
    if not hmac.compare_digest(answer, keys.answer(b"client", keys.flags, flags,
                                                   server_nonce, client_nonce)):
        raise AuthError("the client does not know the peer token (or runs another "
                        "version of mtcfs)")
    if flags != keys.flags:  # (the client saw it first, and said so on its side)
        raise Mismatch(f"the client has {_settings(flags)}, this host {_settings(keys.flags)}"
                       f": set --peer-encryption alike on every host")
    sock.sendall(keys.answer(b"server", keys.flags, flags, server_nonce, client_nonce))
    sock.settimeout(STALL_TIMEOUT)
    return Conn(sock, keys.session(server_nonce, client_nonce), client=False,
                encrypt=keys.encrypt)


def client_handshake(sock: socket.socket, keys: Keys) -> Conn:
    sock.settimeout(HANDSHAKE_TIMEOUT)
    hello = bytearray(len(MAGIC) + 1 + NONCE)
    view = memoryview(hello)
    recv_exact(sock, view[:len(MAGIC)])  # an older server sends fewer bytes after it
    _check_version(bytes(hello[:len(MAGIC)]), "the peer")
    recv_exact(sock, view[len(MAGIC):])
    flags, server_nonce = hello[len(MAGIC)], bytes(hello[len(MAGIC) + 1:])
    if flags != keys.flags:
        raise Mismatch(f"the peer has {_settings(flags)}, this host {_settings(keys.flags)}: "
                       f"set --peer-encryption alike on every host")
    client_nonce = os.urandom(NONCE)
    sock.sendall(bytes((keys.flags,)) + client_nonce
                 + keys.answer(b"client", flags, keys.flags, server_nonce, client_nonce))
    answer = bytearray(MAC)
    recv_exact(sock, memoryview(answer))
    if not hmac.compare_digest(bytes(answer), keys.answer(b"server", flags, keys.flags,
                                                          server_nonce, client_nonce)):
        raise AuthError("the server does not know the peer token")
    sock.settimeout(STALL_TIMEOUT)
    return Conn(sock, keys.session(server_nonce, client_nonce), client=True,
                encrypt=keys.encrypt)


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


class _Tls:
    """A connection's TLS layer over its socket, or none (plain TCP: `context` None)."""

    def __init__(self, context: ssl.SSLContext | None) -> None:
        self.wrappers: list[ssl.SSLContext] = [context] if context else []

    def server_side(self, sock: socket.socket) -> socket.socket:
        for context in self.wrappers:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            sock = context.wrap_socket(sock, server_side=True)
        return sock

    def client_side(self, sock: socket.socket, host: str) -> socket.socket:
        for context in self.wrappers:
            sock = context.wrap_socket(sock, server_hostname=host)
        return sock


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
    if isinstance(e, FileNotFoundError):
        return "NOT_FOUND"
    return "UNAVAILABLE"


class InThreads:
    """Tree streams read on their connections' threads (a server without trio)."""

    def adopt(self, conn: Conn, read: Callable[[Conn], Awaitable[None]]) -> bool:
        return False


class TrioReaders(InThreads):
    """Tree streams on plain TCP read in the daemon's trio thread: a task per stream,
    each message handled where it is read."""

    def __init__(self, token: Any) -> None:
        self.token = token

    def adopt(self, conn: Conn, read: Callable[[Conn], Awaitable[None]]) -> bool:
        if not conn.plain:
            return False  # (TLS: read on its thread)
        import trio

        try:
            self.token.run_sync_soon(trio.lowlevel.spawn_system_task, read, conn)
        except trio.RunFinishedError:
            return False
        return True


class BulkServer:
    """Accepts data connections on `listen`; a thread per connection (bounded) serves
    its requests one after the other. What touches the namespace runs through
    `in_owner` (the daemon: in its trio thread), like the gRPC service; a tree
    stream's messages through `post`, which hands them over without waiting (the
    daemon: trio's run_sync_soon; by default `in_owner`, waited for)."""

    def __init__(self, handler: PeerHandler, in_owner: Callable[..., Any], keys: Keys,
                 listen: tuple[str, int], tls: ssl.SSLContext | None = None,
                 max_connections: int = MAX_SERVER_CONNECTIONS,
                 verifier: Executor | None = None,
                 post: Callable[[Callable[[], None]], object] | None = None,
                 streams: InThreads | None = None) -> None:
        """`streams`: who reads tree streams (TrioReaders: the daemon's trio thread, on
        plain TCP; by default each on its connection's thread, through `post`)."""
        self.handler = handler
        self.post = post or in_owner
        self.streams = streams or InThreads()
        self._own_verifier = verifier is None  # else whoever passed it shuts it down
        self.verifier = verifier or ThreadPoolExecutor(VERIFIERS, "bulk-verify")
        self.in_owner = in_owner
        self.keys = keys
        self.tls = _Tls(tls)
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
        self.tree_streams = 0  # tree streams opened by peers
        self.tree_messages = 0  # tree messages received on them
        self._stopped = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="bulk-accept", daemon=True)

    def status(self) -> dict[str, int]:
        return {"port": self.port, "handshakes_refused": self.rejected,
                "requests_refused": self.refused, "replicas_received": self.pushes_received,
                "bytes_received": self.bytes_received, "bytes_served": self.bytes_served,
                "restore_bytes_served": self.chunk_bytes_served,
                "tree_streams": self.tree_streams, "tree_messages": self.tree_messages,
                "wire_version": VERSION, "encrypted": self.keys.encrypt}

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
                sock = self.tls.server_side(sock)
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
            if conn is None or not conn.adopted:  # (an adopted one: its reader closes it)
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
            elif op == "tree":
                self._tree(conn)
                return False  # the stream ended with its connection
            else:
                raise BadRequest(f"unknown request {str(op)[:40]!r}")
            return True
        except (BulkError, ssl.SSLError, TimeoutError, ConnectionError):
            # (a sender killed mid-push resets the connection: dropped, no traceback)
            self.refused += op == "push"  # a replica cut short (or a bad MAC): not stored
            raise
        except Exception as e:
            self.refused += 1
            if not isinstance(e, (BadRequest, Refused, RamTierFull, IntegrityError,
                                  FileNotFoundError)):  # (evicted a moment ago)
                log.exception("data channel: %s failed", op)
            with contextlib.suppress(OSError):
                conn.send_control({"error": _code_of(e), "details": str(e)[:500]})
            return False

    # -- a tree stream (index changes and their acks) -----------------------------------

    def _tree(self, conn: Conn) -> None:
        """Tree messages from one peer, one after the other, until it closes: each
        checked like the gRPC Forward call's and handed to the daemon without waiting
        (no reply: acks travel as messages of their own, on the receiver's stream to
        the sender). Read by the daemon's trio thread where it takes the stream (no
        thread hand-over per message), else here (up to TREE_PENDING at a time)."""
        conn.send_control({"ok": True})
        self.tree_streams += 1
        if self.streams.adopt(conn, self._read_tree):
            conn.adopted = True
            return
        pending = threading.Semaphore(TREE_PENDING)
        while not self._stopped:
            conn.sock.settimeout(IDLE_TIMEOUT)
            try:
                body = conn.recv_tree()
            except (BulkError, TimeoutError, ConnectionError):
                return  # closed by the sender (an idle stream ends), or gone
            m = self._tree_message(body)
            pending.acquire()
            self.post(functools.partial(self._on_tree, m, pending))

    def _tree_message(self, body: bytes) -> pb.TreeMessage:
        try:
            m = pb.TreeMessage.FromString(body)
        except DecodeError:
            raise BadRequest("a tree message that does not parse") from None
        security.check_tree(m)
        self.tree_messages += 1
        return m

    async def _read_tree(self, conn: Conn) -> None:
        """A tree stream read in the daemon's trio thread (TrioReaders), until its
        sender closes it or breaks the protocol (then dropped, as in _tree)."""
        import trio

        sock = conn.sock
        sock.setblocking(False)
        frames = TreeFrames(conn)
        try:
            while not self._stopped:
                await trio.lowlevel.wait_readable(sock)
                try:
                    data = sock.recv(1 << 20)
                except BlockingIOError:
                    continue
                if not data:
                    return  # closed by the sender (an idle stream ends)
                for body in frames.feed(data):
                    self._hand_over(self._tree_message(body))
        except (BadRequest, IntegrityError) as e:
            self.refused += 1
            log.warning("data channel: tree stream dropped: %s", e)
        except OSError:
            pass  # reset by the sender, or the server stopping
        except Exception:  # (a system task: an exception would end the daemon)
            log.exception("data channel: tree stream failed")
        finally:
            conn.close()
            with self._lock:
                self._conns.discard(sock)

    def _on_tree(self, m: pb.TreeMessage, pending: threading.Semaphore) -> None:
        try:
            self._hand_over(m)
        finally:
            pending.release()

    def _hand_over(self, m: pb.TreeMessage) -> None:
        """A tree message to the daemon (in its trio thread), which sends no reply."""
        try:
            self.handler.on_tree(m, False)
        except Exception as e:  # (the daemon stopping, a message it cannot take)
            log.debug("tree message from %s: %s", m.from_node, e)

    # -- push (a replica arriving) ---------------------------------------------------

    def _push(self, conn: Conn, msg: dict[str, Any]) -> None:
        above = msg.get("above", [])
        if not isinstance(above, list):
            raise BadRequest("a push's directories must be a list")
        try:
            e = pb.Entry.FromString(base64.b64decode(str(msg.get("entry", "")), validate=True))
            dirs = [pb.Entry.FromString(base64.b64decode(str(d), validate=True))
                    for d in above]
        except (ValueError, DecodeError):  # (protobuf's DecodeError is no ValueError)
            raise BadRequest("a push needs its entry") from None
        path = str(msg.get("path", ""))
        security.check_entry(e)
        security.check_directories(dirs)
        security.check_path(path)
        if e.removed or not e.has_crc or not e.block_crcs:
            raise BadRequest("a pushed file needs its crc32c and block crc32cs")
        verify = BlockVerifier(e.size, e.crc32c, bytes(e.block_crcs))
        key, tmp = self.in_owner(self.handler.begin_receive, e)
        ok = False
        try:
            conn.send_control({"ok": True})
            fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC)
            yielded = 0.0
            try:
                for off, length, crc in conn.land_blocks(fd, spans(0, e.size), self.verifier):
                    verify.feed_crc(length, crc)  # raises IntegrityError on a bad crc32c
                    self.bytes_received += length
                    if off + length < e.size:
                        # This host's trainer is writing: let it have the CPU (bounded).
                        # (Not after the last block: nothing is left to take, and the
                        # sender's change may wait for this copy.)
                        yielded += self.handler.yield_to_writes(mover.MAX_YIELD - yielded)
                verify.finish()
                if conn.recv_control().get("op") != "end":
                    raise BadRequest("expected the end of the push")
            finally:
                os.close(fd)
            conn.sock.settimeout(REPLY_TIMEOUT)
            ok = self.in_owner(self.handler.finish_receive, e, dirs, key, tmp)
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
        fd, size, pin = self.in_owner(self.handler.open_to_send, guid, version)
        try:
            if offset > size:
                raise BadRequest(f"offset {offset} is beyond the file's {size} bytes")
            end = size if length == 0 else min(size, offset + length)
            conn.send_control({"ok": True, "size": size})
            for n in conn.send_blocks(fd, offset, end, ahead=self.verifier,
                                      mapped=pin.mapped):
                self.bytes_served += n
        finally:
            pin.release()
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
            for n in conn.send_blocks(fd, offset, end, ahead=self.verifier):
                self.bytes_served += n
                self.chunk_bytes_served += n
        finally:
            os.close(fd)


# -- the client side -----------------------------------------------------------------


class BulkPool:
    """Connections to peers' data channels: at most `connections` per peer, kept open
    and reused; used from worker threads (every call blocks)."""

    def __init__(self, keys: Keys, tls: ssl.SSLContext | None, connections: int,
                 verifier: Executor | None = None) -> None:
        self.keys = keys
        self._own_verifier = verifier is None  # else whoever passed it shuts it down
        self.verifier = verifier or ThreadPoolExecutor(VERIFIERS, "bulk-verify")
        self.tls = _Tls(tls)
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
            sock = self.tls.client_side(sock, addr[0])
            return client_handshake(sock, self.keys)
        except BaseException:
            sock.close()
            raise

    # -- requests --------------------------------------------------------------------

    def tree_stream(self, addr: tuple[str, int]) -> Conn:
        """A connection of its own (not pooled) that carries this host's tree messages
        to `addr` from now on (Conn.tree_frame) until it is closed. Remote if the peer
        refuses (an mtcfs without tree streams: its gRPC Forward call remains)."""
        c = self._open(addr)
        try:
            c.send_control({"op": "tree"})
            c.recv_reply()
        except BaseException:
            c.close()
            raise
        return c

    def push(self, addr: tuple[str, int], fd: int, entry: pb.Entry, path: str,
             yield_to_writes: Callable[[], None], mapped: bool = False,
             above: Sequence[pb.Entry] = ()) -> tuple[str, str, bool]:
        """Push one replica (fd: the file, open; `mapped`: the caller holds a pin on it,
        see Conn.send_blocks; `above`: its directories, outermost first); returns
        (status code name, details, stored) as the gRPC push does."""
        size = entry.size
        request = {"op": "push", "path": path,
                   "entry": base64.b64encode(entry.SerializeToString()).decode()}
        if above:
            request["above"] = [base64.b64encode(d.SerializeToString()).decode()
                                for d in above]
        try:
            with self.conn(addr) as c:
                c.send_control(request)
                c.recv_reply()
                try:
                    for _ in c.send_blocks(fd, 0, size, yield_to_writes, self.verifier,
                                           mapped):
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
            for i, (off, length, crc) in enumerate(
                    c.land_blocks(fd, spans(offset, end), self.verifier)):
                if crc != want[i]:
                    e = IntegrityError(f"block at {off}: crc32c mismatch")
                    e.bad_range = (off, off + length)
                    raise e
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
            for _, n, block_crc in c.land_blocks(fd, spans(offset, offset + length),
                                                 self.verifier):
                whole = crc32c_combine(whole, block_crc, n)
            if whole != crc:
                e = IntegrityError(f"chunk at {offset}: crc32c mismatch")
                e.bad_range = (offset, offset + length)
                raise e
            return True
