"""The bulk data channel (mtcfs.peer.bulk): file bytes between daemons over TCP.

First the channel's server in-process, over a real RAM tier and real sockets, driven
as a hostile peer would: without the token, with a replayed handshake answer, with a
block whose crc32c is valid but whose MAC is not, with blocks out of range or too
large. Each is refused and leaves nothing behind (the RAM tier's usage, its
.incoming directory, what was stored). Then real daemons: replication to K peers
over the channel, striped restores from every holder, a holder SIGSTOPped or killed
halfway through a restore.
"""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import google_crc32c
import grpc
import pytest

from mtcfs.core.checksums import BLOCK, pack_crcs
from mtcfs.peer import bulk
from mtcfs.peer.bulk import HEADER, BulkPool, BulkServer, Keys
from mtcfs.peer.server import Refused
from mtcfs.peer.v1 import peer_pb2 as pb
from mtcfs.tiers.mapped import MappedFiles, Pin
from mtcfs.tiers.ram import RamTier

from support.mounts import (
    MtcfsMount,
    PeerCluster,
    blob,
    crc_of,
    data_files,
    file_crc,
    pstatus,
    wait_until,
    write,
)

MiB = 1 << 20
TOKEN = b"a-shared-token-of-32-bytes-12345"


# -- the channel in-process ----------------------------------------------------------------------


class Host:
    """What a daemon's peer tier does for the channel's server, over a real RAM tier:
    reserve, install or drop received replicas; open held files for readers."""

    node_id = "node-t"

    def __init__(self, ram: RamTier) -> None:
        self.ram = ram
        self.held: dict[str, tuple[int, int]] = {}  # guid -> (ino, size)
        self.stored: list[str] = []
        self.trees: list[tuple[pb.TreeMessage, bool]] = []  # tree messages, as taken
        self._lock = threading.Lock()

    def on_tree(self, m: pb.TreeMessage, reply: bool = True) -> None:
        self.trees.append((m, reply))

    def run(self, fn, *args):  # the daemon runs these in its trio thread: one at a time
        with self._lock:
            return fn(*args)

    def begin_receive(self, e: pb.Entry) -> tuple[int, str]:
        return self.ram.begin_incoming(e.size)

    def finish_receive(self, e: pb.Entry, above: list[pb.Entry], key: int, tmp: str) -> bool:
        ino = 1000 + len(self.stored)
        self.ram.install_incoming(key, tmp, ino)
        self.held[e.id] = (ino, e.size)
        self.stored.append(e.id)
        return True

    def abort_receive(self, key: int, tmp: str) -> None:
        self.ram.abort_incoming(key, tmp)

    def yield_to_writes(self, budget: float) -> float:
        return 0.0

    def open_for_fetch(self, guid: str, version: int) -> tuple[int, int]:
        if guid not in self.held:
            raise Refused(grpc.StatusCode.NOT_FOUND, "no such file here")
        ino, size = self.held[guid]
        return self.ram.open_read(ino), size

    def open_to_send(self, guid: str, version: int) -> tuple[int, int, Pin]:
        fd, size = self.open_for_fetch(guid, version)
        return fd, size, self.ram.mapped.pin(self.held[guid][0])


def entry_for(data: bytes, guid: str = "f1") -> pb.Entry:
    crcs = [google_crc32c.value(data[i:i + BLOCK]) for i in range(0, len(data), BLOCK)]
    return pb.Entry(id=guid, parent="p1", name=b"f", mode=0o100644, size=len(data),
                    crc32c=google_crc32c.value(data), has_crc=True, version=1,
                    writer="node-w", block_crcs=pack_crcs(crcs))


@pytest.fixture(params=["copied", "mapped"])
def channel(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Host, BulkServer]]:
    """The server over a RAM tier whose files are read into buffers to be sent, or
    (as on huge pages) sent from mappings of them."""
    ram = RamTier(str(tmp_path / "ram"), 256 * MiB)
    if request.param == "mapped":
        ram.mapped = MappedFiles(lambda: True)
    host = Host(ram)
    server = BulkServer(host, host.run, Keys(TOKEN), ("127.0.0.1", 0))
    server.start()
    yield host, server
    server.stop()


def addr(server: BulkServer) -> tuple[str, int]:
    return "127.0.0.1", server.port


def untouched(host: Host) -> None:
    """Nothing stored, nothing reserved, nothing left in .incoming."""
    assert host.stored == [], host.stored
    assert host.ram.used == 0, host.ram.used
    wait_until(lambda: not os.listdir(host.ram.incoming_dir), 5, what="an empty .incoming")


def write_tmp(tmp_path: Path, data: bytes) -> int:
    p = tmp_path / f"src-{len(data)}"
    p.write_bytes(data)
    return os.open(p, os.O_RDONLY)


def raw_session(server: BulkServer) -> bulk.Conn:
    """A connection that passed the handshake, for sending hand-made frames."""
    sock = socket.create_connection(addr(server), timeout=5)
    return bulk.client_handshake(sock, Keys(TOKEN))


def session_pair(encrypt: bool = False) -> tuple[bulk.Conn, bulk.Conn, socket.socket,
                                                 socket.socket]:
    """Two ends of one authenticated connection over a socketpair (no handshake)."""
    a, b = socket.socketpair()
    keys = Keys(TOKEN, encrypt).session(b"s" * 32, b"c" * 32)
    return (bulk.Conn(a, keys, client=True, encrypt=encrypt),
            bulk.Conn(b, keys, client=False, encrypt=encrypt), a, b)


def send_frame(c: bulk.Conn, kind: bytes, off: int, body: bytes, seq: int | None = None,
               tag_body: bytes | None = None) -> None:
    """A frame as the genuine sender would tag it (as frame `seq`, over `tag_body`),
    carrying `body`: what an attacker on the path can make of genuine frames."""
    tag, sealed = c.out.seal(c.sent if seq is None else seq, kind, off,
                             body if tag_body is None else tag_body)
    c.sent += 1
    c.sock.sendall(HEADER.pack(kind, off, len(body), tag) + bytes(sealed if tag_body is None
                                                                  else body))


def land(receiver: bulk.Conn, fd: int, spans: list[tuple[int, int]]) -> list[tuple]:
    with ThreadPoolExecutor(2) as verifier:
        return list(receiver.land_blocks(fd, spans, verifier))


@pytest.mark.parametrize("encrypt", [False, True], ids=["gmac", "encrypted"])
@pytest.mark.parametrize("piece", [1000, 64 * 1024 + 7])
def test_a_block_in_small_pieces_lands_whole(tmp_path, piece, encrypt):
    """Blocks that arrive in many small segments land whole, at their offsets, with
    the right crc32c, in both modes."""
    sender, receiver, a, _ = session_pair(encrypt)
    data = blob(piece, 2 * BLOCK - 12345)
    spans = bulk.spans(0, len(data))

    def send() -> None:
        for off, n in spans:
            tag, sealed = sender.out.seal(sender.sent, bulk.DATA, off, data[off:off + n])
            sender.sent += 1
            a.sendall(HEADER.pack(bulk.DATA, off, n, tag))
            body = bytes(sealed)
            for i in range(0, n, piece):  # a segment each (a Unix socket keeps them apart)
                a.sendall(body[i:i + piece])

    t = threading.Thread(target=send)
    t.start()
    fd = os.open(tmp_path / "dest", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        got = land(receiver, fd, spans)
    finally:
        os.close(fd)
        t.join()
        sender.close()
        receiver.close()
    assert [(off, n) for off, n, _ in got] == spans
    for off, n, crc in got:
        assert crc == google_crc32c.value(data[off:off + n])
    assert (tmp_path / "dest").read_bytes() == data


@pytest.mark.parametrize("encrypt", [False, True], ids=["gmac", "encrypted"])
def test_the_wire_carries_the_bytes_in_clear_only_without_encryption(tmp_path, encrypt):
    """What crosses the network: with --peer-encryption no stretch of the file's bytes
    (nor the control message's path) appears on the wire; without it they do (the
    frames are authenticated only). Either way the receiver gets the exact bytes."""
    sender, receiver, a, b = session_pair(encrypt)
    data = blob(77, BLOCK + 4321)
    src = tmp_path / "src"
    src.write_bytes(data)
    chunks: list[bytes] = []

    def record() -> None:
        while chunk := b.recv(1 << 20):
            chunks.append(chunk)

    recorder = threading.Thread(target=record)
    recorder.start()
    fd = os.open(src, os.O_RDONLY)
    try:
        sender.send_control({"op": "push", "path": "secret-step/model.pt"})
        with ThreadPoolExecutor(2) as ahead:
            assert sum(sender.send_blocks(fd, 0, len(data), ahead=ahead)) == len(data)
    finally:
        os.close(fd)
        a.shutdown(socket.SHUT_WR)
        recorder.join(10)
    wire = b"".join(chunks)
    sample = data[BLOCK // 2:BLOCK // 2 + 64]
    assert (sample in wire) is not encrypt
    assert (b"secret-step/model.pt" in wire) is not encrypt
    # The recorded stream, replayed into a fresh receiver of the same keys: exact bytes.
    c, d = socket.socketpair()
    keys = Keys(TOKEN, encrypt).session(b"s" * 32, b"c" * 32)
    replay = bulk.Conn(d, keys, client=False, encrypt=encrypt)
    feeder = threading.Thread(target=lambda: (c.sendall(wire), c.close()))
    feeder.start()
    assert replay.recv_control() == {"op": "push", "path": "secret-step/model.pt"}
    out = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        land(replay, out, bulk.spans(0, len(data)))
    finally:
        os.close(out)
        feeder.join(10)
    assert (tmp_path / "out").read_bytes() == data


@pytest.mark.parametrize("attack", ["flipped bit", "replayed block", "reordered",
                                    "other connection", "header changed", "truncated"])
def test_a_forged_block_is_rejected_and_nothing_of_it_is_written(tmp_path, attack):
    """Frames made from genuine ones, as an attacker on the path could: a bit flipped in
    the body, a block sent again, two swapped, a block from another connection (other
    nonces: other keys), a header whose offset moved, a block cut short by a closed
    connection. Each is rejected before it counts, and not a byte of it is written."""
    sender, receiver, a, _ = session_pair()
    data = blob(88, 2 * BLOCK)
    b0, b1 = data[:BLOCK], data[BLOCK:]

    def frame(seq: int, off: int, body: bytes, tagged: bytes | None = None,
              tag_off: int | None = None, by: bulk.Conn = sender) -> bytes:
        tag, _ = by.out.seal(seq, bulk.DATA, off if tag_off is None else tag_off,
                             body if tagged is None else tagged)
        return HEADER.pack(bulk.DATA, off, len(body), tag) + body

    if attack == "flipped bit":
        bad = bytearray(b0)
        bad[777] ^= 0x04
        wire = [frame(0, 0, bytes(bad), tagged=b0)]
    elif attack == "replayed block":
        # The genuine frame 0, then frame 0 again moved to where block 1 is due.
        wire = [frame(0, 0, b0), frame(0, BLOCK, b0, tag_off=0)]
    elif attack == "reordered":
        # Frame 1 first, its header moved to where block 0 is due (else refused there).
        wire = [frame(1, 0, b1, tag_off=BLOCK), frame(0, 0, b0)]
    elif attack == "other connection":
        other = Keys(TOKEN).session(b"S" * 32, b"C" * 32)
        wire = [frame(0, 0, b0, by=bulk.Conn(socket.socketpair()[0], other, client=True))]
    elif attack == "header changed":
        wire = [frame(0, 0, b0, tag_off=BLOCK)]  # tagged for offset BLOCK
    else:  # truncated: the connection closes a third of the way into the block
        wire = [frame(0, 0, b0)[:HEADER.size + BLOCK // 3]]

    def send() -> None:
        with contextlib.suppress(OSError):  # the receiver may hang up first
            for w in wire:
                a.sendall(w)
        a.close()

    sending = threading.Thread(target=send)
    sending.start()
    fd = os.open(tmp_path / "dest", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, len(data))
    counted: list[tuple] = []
    try:
        with pytest.raises((bulk.IntegrityError, bulk.BulkError)) as err, \
                ThreadPoolExecutor(2) as verifier:
            for got in receiver.land_blocks(fd, bulk.spans(0, len(data)), verifier):
                counted.append(got)
    finally:
        os.close(fd)
        receiver.close()
        sending.join(10)
    if attack != "truncated":
        assert isinstance(err.value, bulk.IntegrityError) and "tag" in str(err.value)
    landed = (tmp_path / "dest").read_bytes()
    if attack == "replayed block":  # the genuine first block landed; the replay did not
        assert [(o, n) for o, n, _ in counted] in ([], [(0, BLOCK)])
        assert landed == b0 + bytes(BLOCK)
    else:
        assert counted == [] and landed == bytes(len(data)), attack


def test_push_and_fetch(channel, tmp_path):
    host, server = channel
    data = blob(1, 9 * MiB + 1)
    e = entry_for(data)
    pool = BulkPool(Keys(TOKEN), None, 2)
    fd = write_tmp(tmp_path, data)
    assert pool.push(addr(server), fd, e, "d/f", lambda: None, host.ram.mapped.enabled
                     ) == ("OK", "", True)
    ino, size = host.held["f1"]
    assert Path(host.ram.path(ino)).read_bytes() == data
    # Blocks 1..2 of it (the last one short) into a sparse file, each reported once verified.
    out = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    got: list[tuple[int, int]] = []
    pool.fetch(addr(server), out, "f1", 1, "d/f", size, e.block_crcs, 1, 3,
               lambda off, n: got.append((off, n)))
    assert got == [(BLOCK, BLOCK), (2 * BLOCK, MiB + 1)]
    assert os.pread(out, 5 * MiB + 1, BLOCK) == data[BLOCK:]
    assert server.status()["replicas_received"] == 1
    pool.close()


def test_encrypted_push_and_fetch(tmp_path):
    """--peer-encryption on both sides: a replica and a read arrive exact."""
    host = Host(RamTier(str(tmp_path / "ram"), 64 * MiB))
    server = BulkServer(host, host.run, Keys(TOKEN, encrypt=True), ("127.0.0.1", 0))
    server.start()
    try:
        data = blob(9, 2 * BLOCK + 99)
        e = entry_for(data)
        pool = BulkPool(Keys(TOKEN, encrypt=True), None, 1)
        assert pool.push(addr(server), write_tmp(tmp_path, data), e, "d/f",
                         lambda: None) == ("OK", "", True)
        out = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
        pool.fetch(addr(server), out, "f1", 1, "d/f", len(data), e.block_crcs, 0, 3,
                   lambda off, n: None)
        assert os.pread(out, len(data) + 1, 0) == data
        assert server.status()["encrypted"] is True
    finally:
        server.stop()


@pytest.mark.parametrize("server_encrypts", [True, False])
def test_encryption_on_one_side_only_fails_with_a_clear_error(tmp_path, server_encrypts):
    host = Host(RamTier(str(tmp_path / "ram"), 64 * MiB))
    server = BulkServer(host, host.run, Keys(TOKEN, encrypt=server_encrypts),
                        ("127.0.0.1", 0))
    server.start()
    try:
        data = blob(10, 100)
        pool = BulkPool(Keys(TOKEN, encrypt=not server_encrypts), None, 1)
        with pytest.raises(bulk.Mismatch, match="--peer-encryption alike on every host"):
            pool._open(addr(server))
        code, details, stored = pool.push(addr(server), write_tmp(tmp_path, data),
                                          entry_for(data), "d/f", lambda: None)
        assert (code, stored) == ("UNAVAILABLE", False)
        assert "peer encryption" in details, details
        untouched(host)
    finally:
        server.stop()


def test_an_older_wire_version_fails_with_a_clear_error():
    """A host of the previous version (BLAKE3 MACs, MTCFSBK1): the handshake stops with
    an error naming both versions, before any frame."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)

        def old_server() -> None:
            s, _ = listener.accept()
            with s, contextlib.suppress(ConnectionResetError):  # the new host hangs up
                s.sendall(b"MTCFSBK1" + os.urandom(32))
                s.recv(1)

        t = threading.Thread(target=old_server, daemon=True)
        t.start()
        with pytest.raises(bulk.Mismatch, match="version 1, this host version 2"):
            BulkPool(Keys(TOKEN), None, 1)._open(listener.getsockname())
        t.join(5)


def test_wrong_token_is_refused_and_changes_nothing(channel, tmp_path):
    host, server = channel
    data = blob(2, 5 * MiB)
    pool = BulkPool(Keys(b"another-token-that-is-long-enough"), None, 1)
    code, details, stored = pool.push(addr(server), write_tmp(tmp_path, data), entry_for(data),
                                      "d/f", lambda: None)
    assert (code, stored) == ("UNAVAILABLE", False), details  # closed on it at the handshake
    wait_until(lambda: server.rejected == 1, 5)
    untouched(host)


HELLO = len(bulk.MAGIC) + 1 + 32  # magic, settings, the server's nonce


def test_forged_connection_without_the_token(channel):
    host, server = channel
    with socket.create_connection(addr(server), timeout=5) as s:
        hello = s.recv(HELLO, socket.MSG_WAITALL)
        assert hello[:8] == bulk.MAGIC
        s.sendall(b"\0" + os.urandom(64))  # settings, a nonce and a guessed answer
        assert s.recv(1) == b""  # closed: no answer, no session
        # Frames sent anyway change nothing.
        with pytest.raises(OSError):
            for _ in range(50):
                s.sendall(HEADER.pack(b"C", 0, 2, b"\0" * 16) + b"{}")
                time.sleep(0.01)
    wait_until(lambda: server.rejected == 1, 5)
    untouched(host)


def test_replayed_challenge_answer_is_refused(channel):
    host, server = channel
    keys = Keys(TOKEN)
    # A genuine peer's handshake, recorded on the wire.
    with socket.create_connection(addr(server), timeout=5) as s:
        nonce = s.recv(HELLO, socket.MSG_WAITALL)[9:]
        mine = os.urandom(32)
        answer = b"\0" + mine + keys.answer(b"client", 0, 0, nonce, mine)
        s.sendall(answer)
        assert s.recv(32, socket.MSG_WAITALL) == keys.answer(b"server", 0, 0, nonce, mine)
    # Replayed on a new connection: the server's nonce is new, the answer is stale.
    with socket.create_connection(addr(server), timeout=5) as s:
        assert s.recv(HELLO, socket.MSG_WAITALL)[9:] != nonce
        s.sendall(answer)
        assert s.recv(32) == b""
    wait_until(lambda: server.rejected == 1, 5)
    untouched(host)


def test_client_refuses_a_server_without_the_token():
    """Mutual: a server that cannot answer the client's challenge gets no data (it
    relays the client's answer as its own: reflected, that fails too)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)

        def impostor() -> None:
            s, _ = listener.accept()
            with s:
                s.sendall(bulk.MAGIC + b"\0" + os.urandom(32))
                answer = s.recv(65, socket.MSG_WAITALL)
                s.sendall(answer[33:])
                s.recv(1)

        t = threading.Thread(target=impostor, daemon=True)
        t.start()
        with pytest.raises(bulk.AuthError):
            BulkPool(Keys(TOKEN), None, 1)._open(listener.getsockname())
        t.join(5)


def test_block_with_valid_crc_but_no_valid_tag_is_refused(channel):
    """A bit flipped on the wire, with block crcs that match the flipped bytes: the
    crc32c check alone would pass; the tag (over what the sender sent) does not."""
    host, server = channel
    data = bytearray(blob(3, BLOCK))
    sent = bytes(data)
    data[12345] ^= 0x10
    flipped = bytes(data)
    c = raw_session(server)
    c.send_control({"op": "push", "path": "d/f",
                    "entry": base64.b64encode(entry_for(flipped).SerializeToString()).decode()})
    assert c.recv_control() == {"ok": True}
    send_frame(c, b"B", 0, flipped, tag_body=sent)  # the genuine sender's tag
    reply = c.recv_control()
    assert reply["error"] == "DATA_LOSS" and "tag" in reply["details"], reply
    c.close()
    untouched(host)


@pytest.mark.parametrize("case", ["wrong offset", "beyond the end", "oversize", "short"])
def test_out_of_range_block_is_refused(channel, case):
    host, server = channel
    data = blob(4, 2 * BLOCK)
    c = raw_session(server)
    c.send_control({"op": "push", "path": "d/f",
                    "entry": base64.b64encode(entry_for(data).SerializeToString()).decode()})
    assert c.recv_control() == {"ok": True}
    off, body = {"wrong offset": (BLOCK, data[BLOCK:]),
                 "beyond the end": (2 * BLOCK, data[:BLOCK]),
                 "oversize": (0, data[:BLOCK] + b"x"),
                 "short": (0, data[:100])}[case]
    try:
        send_frame(c, b"B", off, body)  # a valid tag: the range is the fault
        reply = c.recv_control()
        assert reply["error"] == "INVALID_ARGUMENT", reply
    except OSError:
        pass  # refused on the header and closed: the body's rest met a reset connection
    c.close()
    wait_until(lambda: server.refused == 1, 5, what="the push refused")
    untouched(host)


@pytest.mark.parametrize("case", ["beyond the end", "unaligned", "unknown file"])
def test_bad_fetch_is_refused(channel, tmp_path, case):
    host, server = channel
    data = blob(5, BLOCK + 10)
    pool = BulkPool(Keys(TOKEN), None, 1)
    assert pool.push(addr(server), write_tmp(tmp_path, data), entry_for(data), "d/f",
                     lambda: None)[0] == "OK"
    c = raw_session(server)
    req = {"op": "fetch", "id": "f1", "version": 1, "path": "d/f", "offset": 0, "length": 0}
    req.update({"beyond the end": {"offset": 4 * BLOCK}, "unaligned": {"offset": 7},
                "unknown file": {"id": "nope"}}[case])
    c.send_control(req)
    reply = c.recv_control()
    assert reply["error"] in ("INVALID_ARGUMENT", "NOT_FOUND"), reply
    c.close()


def test_a_copy_evicted_under_a_request_is_not_found_without_a_traceback(channel, tmp_path,
                                                                        caplog):
    """A holder asked for a file it dropped a moment ago (evicted while still listed as
    a holder or a restore source): NOT_FOUND, so the reader asks elsewhere; nothing
    logged as an unexpected failure."""
    host, server = channel
    data = blob(8, BLOCK + 3)
    e = entry_for(data)
    pool = BulkPool(Keys(TOKEN), None, 1)
    assert pool.push(addr(server), write_tmp(tmp_path, data), e, "d/f", lambda: None)[0] == "OK"
    ino, _ = host.held["f1"]
    os.unlink(host.ram.path(ino))  # evicted under the request
    out = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    with caplog.at_level("WARNING", logger="mtcfs.peer.bulk"), \
            pytest.raises(bulk.Remote) as err:
        pool.fetch(addr(server), out, "f1", 1, "d/f", len(data), e.block_crcs, 0, 2,
                   lambda off, n: None)
    assert err.value.code == "NOT_FOUND", err.value
    assert not [r for r in caplog.records if "failed" in r.getMessage()], caplog.text


def test_a_rotted_block_at_the_holder_is_not_counted(channel, tmp_path):
    """The reader's side: a holder whose copy rotted sends it with a valid tag (it
    read the rotted bytes); the block's crc32c against the index fails, so it is
    never reported good."""
    host, server = channel
    data = blob(6, 2 * BLOCK)
    e = entry_for(data)
    pool = BulkPool(Keys(TOKEN), None, 1)
    assert pool.push(addr(server), write_tmp(tmp_path, data), e, "d/f", lambda: None)[0] == "OK"
    ino, _ = host.held["f1"]
    with open(host.ram.path(ino), "r+b") as f:  # the holder's copy rots under it
        f.seek(BLOCK + 3)
        f.write(b"\xff")
    out = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    got: list[tuple[int, int]] = []
    with pytest.raises(bulk.IntegrityError, match="crc32c"):
        pool.fetch(addr(server), out, "f1", 1, "d/f", len(data), e.block_crcs, 0, 2,
                   lambda off, n: got.append((off, n)))
    assert got == [(0, BLOCK)]  # the good block only


# -- real daemons --------------------------------------------------------------------------------

# The RAM tiers with huge pages, as on a node where the probe picks them: senders then
# send from mappings of the files (mtcfs.tiers.mapped). The other suites'
# daemons take the probe's choice, which on a VM that hands memory back is often none.
MAPPED = ("--huge-pages", "always")




def held_by(m: MtcfsMount, crc: int, size: int) -> bool:
    """A data file in the host's RAM tier with this size and crc32c."""
    return any(p.stat().st_size == size and file_crc(p) == crc for p in data_files(m.ram_dir))


@pytest.mark.parametrize("size", [0, 600, bulk.SMALL_FRAME, bulk.SMALL_FRAME + 1])
def test_a_small_frames_tag_is_the_streamed_gmac(size):
    """Small frames take their GMAC in one call over a copy: the same tag as the
    streamed computation the wire defines (and larger frames use), and a changed
    byte, header or frame number fails it."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    key, data = os.urandom(32), os.urandom(size)
    sealer = bulk.Sealer(key, encrypt=False)
    tag, sent = sealer.seal(7, bulk.TREE, 0, data)
    enc = Cipher(algorithms.AES(key), modes.GCM(bulk.Sealer.nonce(7))).encryptor()
    enc.authenticate_additional_data(bulk.AAD.pack(7, bulk.TREE, 0, size))
    enc.authenticate_additional_data(data)
    enc.finalize()
    assert tag == enc.tag and bytes(sent) == data
    assert bytes(sealer.open(7, bulk.TREE, 0, memoryview(data), tag)) == data
    forged = bytearray(data + b"x")[:max(size, 1)]
    forged[0] ^= 1
    for seq, kind, body in ((8, bulk.TREE, data), (7, bulk.CONTROL, data),
                            (7, bulk.TREE, bytes(forged))):
        with pytest.raises(bulk.IntegrityError):
            sealer.open(seq, kind, 0, memoryview(body), tag)


def send_tree(conn: bulk.Conn, body: bytes) -> None:
    conn.sock.sendall(conn.tree_frame(body))


def tree_message(seq: int, **kw) -> pb.TreeMessage:
    return pb.TreeMessage(from_node="127.0.0.1:1", origin="127.0.0.1:2", seq=seq, **kw)


def test_a_tree_stream_hands_its_messages_over_in_order(channel):
    """A peer's tree stream: every message reaches the host in the order sent, taken
    without a reply; the stream ends when its sender closes it."""
    host, server = channel
    pool = BulkPool(Keys(TOKEN), None, 1)
    conn = pool.tree_stream(addr(server))
    sent = [tree_message(i, end="127.0.0.1:3",
                         batch=pb.ChangeBatch(from_node="node-w",
                                              entries=[entry_for(b"x" * i, f"g{i}")]))
            for i in range(1, 201)]
    for m in sent:
        send_tree(conn, m.SerializeToString())
    wait_until(lambda: len(host.trees) == len(sent), 10, what="every tree message taken")
    assert [m for m, _ in host.trees] == sent
    assert not any(reply for _, reply in host.trees)
    conn.close()
    st = server.status()
    assert st["tree_streams"] == 1 and st["tree_messages"] == len(sent), st
    assert st["requests_refused"] == 0, st


@pytest.mark.parametrize("bad", ["not protobuf", "no writer", "a control message"])
def test_a_bad_tree_message_ends_its_stream_and_reaches_no_one(channel, bad):
    host, server = channel
    conn = BulkPool(Keys(TOKEN), None, 1).tree_stream(addr(server))
    send_tree(conn, tree_message(1, ack=True, start="127.0.0.1:4").SerializeToString())
    if bad == "not protobuf":
        send_tree(conn, b"\xff" * 40)
    elif bad == "no writer":
        send_tree(conn, pb.TreeMessage(from_node="127.0.0.1:1", seq=2).SerializeToString())
    else:
        conn.send_control({"op": "push"})
    # The server answers with the reason and closes the stream.
    conn.sock.settimeout(5)
    with pytest.raises(bulk.Remote) as e:
        conn.recv_reply()
    assert e.value.code == "INVALID_ARGUMENT", e.value
    wait_until(lambda: server.status()["requests_refused"] == 1, 5, what="counted refused")
    assert [m.seq for m, _ in host.trees] == [1]  # the good one before it, nothing after
    conn.close()


def test_replication_over_the_data_channel(make_cluster):
    c = make_cluster(3, replicas=2, extra=MAPPED)
    a = c["a"]
    assert all(c[n].status()["huge_pages"]["in_use"] for n in "abc")  # (so: mapped)
    knows_data_ports(a)  # (learned from the peers' health replies, a moment after start)
    files = {"r/one": b"\x5a", "r/five": blob(11, 5 * MiB), "r/nine": blob(12, 9 * MiB + 1)}
    for rel, data in files.items():
        write(a, rel, data)
    # The index changes went down the trees on the data channel's streams, not gRPC.
    for name in "abc":
        wait_until(lambda name=name: pstatus(c[name])["tree"]["transport"]["streamed"] > 0,
                   10, what=f"{name} streams tree messages")
        tree = pstatus(c[name])["tree"]
        assert tree["transport"]["by_grpc"] == tree["transport"]["stream_failures"] == 0, tree
        assert tree["acks_in_replies"] == 0, tree  # (acks are messages of their own)
    for rel, data in files.items():
        st = wait_until(lambda rel=rel: (s := a.state(rel))["replicas"] == 2 and s, 30,
                        what=f"{rel} with 2 replicas")
        assert sorted(st["holders"]) == ["node-a", "node-b", "node-c"], st
        for name in ("b", "c"):  # K verified copies, byte for byte, on every holder
            assert held_by(c[name], crc_of(data), len(data)), (name, rel)
            assert (c[name].path / rel).read_bytes() == data
    s = pstatus(a)
    assert s["bulk_replicas_sent"] == s["replicas_sent"] == 2 * len(files), s
    assert s["data_port"], s
    for name in ("b", "c"):
        ch = pstatus(c[name])["data_channel"]
        assert ch["replicas_received"] == len(files), ch
        assert ch["handshakes_refused"] == ch["requests_refused"] == 0, ch


def holders_and_reader(c: PeerCluster, rel: str) -> tuple[list[str], str]:
    """The hosts holding a's file (a and its replica's host) and the one that does not."""
    st = wait_until(lambda: (s := c["a"].state(rel))["replicas"] == 1 and s, 30,
                    what=f"{rel} replicated")
    by_node = {m.node_id: name for name, m in c.hosts.items()}
    holders = [by_node[h] for h in st["holders"]]
    reader = next(n for n in c.hosts if n not in holders)
    # (The replica's announcement may ride with a later batch: up to 1 s.)
    wait_until(lambda: sorted(c[reader].state(rel)["holders"]) == sorted(st["holders"]), 10,
               what=f"{reader} knows where {rel}'s copies are")
    return holders, reader


def knows_data_ports(m: MtcfsMount) -> None:
    wait_until(lambda: all(p["alive"] and p["data_port"] for p in pstatus(m)["peers"]), 10,
               what=f"{m.node_id} knows its peers' data ports")


def test_striped_restore_reads_from_every_holder(make_cluster):
    c = make_cluster(3, replicas=1, extra=MAPPED)
    data = write(c["a"], "s/big", blob(21, 96 * MiB + 123))
    holders, reader = holders_and_reader(c, "s/big")
    knows_data_ports(c[reader])
    assert (c[reader].path / "s/big").read_bytes() == data
    s = pstatus(c[reader])
    by_source = s["bytes_fetched_by_source"]
    assert set(by_source) == {c[h].node_id for h in holders}, by_source
    assert sum(by_source.values()) == len(data), by_source
    assert s["bulk_fetched_bytes"] == len(data) and s["integrity_errors"] == 0, s


def test_a_ranged_read_far_into_a_remote_file_is_served_first(make_cluster):
    """A resharded load reads slices of other hosts' files: a read near the end of a
    large file that is not here is served once its own block arrived, not after
    everything before it (the fetch goes on from there, then fills the rest)."""
    c = make_cluster(3, replicas=1, extra=MAPPED)
    size = 512 * MiB
    data = write(c["a"], "r/big", b"".join(blob(61 + i, 64 * MiB) for i in range(8)))
    _, reader = holders_and_reader(c, "r/big")
    knows_data_ports(c[reader])
    m = c[reader]

    def arrived() -> int:
        return sum(p.stat().st_blocks * 512 for p in data_files(m.ram_dir))

    fd = os.open(m.path / "r/big", os.O_RDONLY)
    try:
        off = size - 8 * MiB
        got = os.pread(fd, 4 * MiB, off)
        here = arrived()
        assert got == data[off:off + 4 * MiB]
        # In file order the read would wait for all 504 MiB in front of it. Served
        # first, it waits for one block while the fetch's other connections go on
        # with theirs: 140-260 MiB had arrived here, idle and under the suite's load.
        assert here < off, f"{here >> 20} MiB had arrived before the read was served"
        wait_until(lambda: m.status()["fetch"]["fetching"] == 0 and arrived() >= size, 30,
                   what="the rest of the file fetched")
    finally:
        os.close(fd)
    assert file_crc(m.path / "r/big") == crc_of(data)


def test_opening_one_file_of_a_remote_step_fetches_the_others_ahead(make_cluster):
    """A load on a host that holds none of a step reads its files one after the other:
    the first open of one of them starts fetching the step's other files (those live
    peers hold) in the background, so they are here, or under way, when opened."""
    c = make_cluster(3, replicas=1, extra=MAPPED)
    shards = {f"step_7/__{i}_0.distcp": blob(70 + i, 8 * MiB + i) for i in range(4)}
    for rel, data in shards.items():
        write(c["a"], rel, data)
    write(c["a"], "step_7/.metadata", b"meta")  # the commit marker, last
    _, reader = holders_and_reader(c, "step_7/__3_0.distcp")
    m = c[reader]
    knows_data_ports(m)
    with open(m.path / "step_7/__0_0.distcp", "rb") as f:
        assert f.read(4096) == shards["step_7/__0_0.distcp"][:4096]
    # Never opened on the reader, each of the others arrives whole and verified.
    want = {crc_of(d) for d in shards.values()}
    wait_until(lambda: want <= {file_crc(p) for p in data_files(m.ram_dir)}, 30,
               what="the step's other shards fetched ahead")
    assert m.status()["fetch"]["integrity_errors"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["sigstop", "kill9"])
def test_restore_survives_a_holder_lost_halfway(make_cluster, fault):
    """One holder is stopped (SIGSTOP: its connections stay open, silent) or killed
    (-9) once a quarter of the file arrived: its remaining blocks come from the other
    holder, and the reader gets the file's exact bytes."""
    c = make_cluster(3, replicas=1, extra=MAPPED)
    size = 320 * MiB
    data = write(c["a"], "h/big", b"".join(blob(31 + i, 64 * MiB) for i in range(5)))
    want = crc_of(data)
    del data
    holders, reader = holders_and_reader(c, "h/big")
    victim = next(h for h in holders if h != "a") if fault == "sigstop" else "a"
    knows_data_ports(c[reader])
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(file_crc(c[reader].path / "h/big")))
    t0 = time.monotonic()
    t.start()

    def arrived() -> int:
        return sum(p.stat().st_blocks * 512 for p in data_files(c[reader].ram_dir))

    wait_until(lambda: arrived() >= size // 4, 30, interval=0.002, what="a quarter arrived")
    proc = c[victim].proc
    assert proc is not None
    try:
        if fault == "sigstop":
            proc.send_signal(signal.SIGSTOP)
        else:
            c.kill9(victim)
        t.join(60)
        assert not t.is_alive(), "the restore did not finish"
        took = time.monotonic() - t0
        assert got == [want]
    finally:
        if fault == "sigstop":
            proc.send_signal(signal.SIGCONT)
    # The reader has every byte; the fetch is counted once it ended (it may still be
    # dropping its connections to a stopped holder).
    s = wait_until(lambda: (s := pstatus(c[reader]))["bytes_fetched_by_source"] and s, 30,
                   what="the fetch counted")
    by_source = s["bytes_fetched_by_source"]
    print(f"{fault}: restored {size >> 20} MiB in {took:.1f} s; by source {by_source}")
    assert sum(by_source.values()) == size, by_source
    assert by_source.get(c[victim].node_id, 0) < size, by_source
    assert s["integrity_errors"] == 0, s


def test_tls_data_channel(tmp_path):
    """With --tls-*: TLS with client certificates signed by the CA; a client without
    one (or with another CA's) and a client speaking plain TCP get nothing."""
    pytest.importorskip("cryptography")
    from support.certs import make_ca, make_cert

    ca, other = make_ca("mtcfs test CA"), make_ca("another CA")
    cert, key = make_cert(ca, "node-a")
    server_tls, client_tls = bulk.tls_contexts((cert, key, ca[2]))
    host = Host(RamTier(str(tmp_path / "ram"), 64 * MiB))
    server = BulkServer(host, host.run, Keys(TOKEN), ("127.0.0.1", 0), server_tls)
    server.start()
    try:
        data = blob(7, BLOCK + 5)
        fd = write_tmp(tmp_path, data)
        stranger = bulk.tls_contexts((*make_cert(other, "stranger"), ca[2]))[1]
        for tls in (stranger, None):  # another CA's certificate; no TLS at all
            code, _, stored = BulkPool(Keys(TOKEN), tls, 1).push(
                addr(server), fd, entry_for(data), "d/f", lambda: None)
            assert (code, stored) == ("UNAVAILABLE", False)
        wait_until(lambda: server.rejected == 2, 5)
        untouched(host)
        pool = BulkPool(Keys(TOKEN), client_tls, 1)
        assert pool.push(addr(server), fd, entry_for(data), "d/f", lambda: None) == ("OK", "",
                                                                                     True)
        ino, _ = host.held["f1"]
        assert Path(host.ram.path(ino)).read_bytes() == data
    finally:
        server.stop()


def test_mixed_cluster_falls_back_to_grpc(make_cluster):
    """A host without a data channel (as an older version: data_port 0) gets and sends
    replicas over gRPC; a reader with one stripes over the holders that have one."""
    c = make_cluster(3, replicas=1, start=False)
    c.define("b", extra=("--data-connections", "0"))
    c.start("a", "b", "c")
    a, b, reader = c["a"], c["b"], c["c"]
    assert pstatus(b)["data_port"] is None and pstatus(a)["data_port"]
    from_b = write(b, "m/from-b", blob(41, 6 * MiB + 7))
    st = wait_until(lambda: (s := b.state("m/from-b"))["replicas"] == 1 and s, 30,
                    what="b's file replicated")
    assert pstatus(b)["replicas_sent"] == 1 and pstatus(b)["bulk_replicas_sent"] == 0
    holder = next(m for m in (a, reader) if m.node_id in st["holders"])
    assert held_by(holder, crc_of(from_b), len(from_b))
    # A file on a whose replica went to b (over gRPC) or to c (over the channel).
    from_a = write(a, "m/from-a", blob(42, 6 * MiB + 9))
    st = wait_until(lambda: (s := a.state("m/from-a"))["replicas"] == 1 and s, 30,
                    what="a's file replicated")
    bulk_sent = pstatus(a)["bulk_replicas_sent"]
    assert bulk_sent == (0 if "node-b" in st["holders"] else 1), (st, bulk_sent)
    for m in (a, b, reader):
        assert (m.path / "m/from-a").read_bytes() == from_a, m.node_id
        assert (m.path / "m/from-b").read_bytes() == from_b, m.node_id
    assert pstatus(b)["bulk_fetched_bytes"] == 0
    # Tree messages: b's all by gRPC; a's to c on a stream, to b by gRPC.
    b_sent = pstatus(b)["tree"]["transport"]
    assert b_sent["streamed"] == 0 and b_sent["by_grpc"] > 0, b_sent
    a_sent = pstatus(a)["tree"]["transport"]
    assert a_sent["streamed"] > 0 and a_sent["by_grpc"] > 0, a_sent
    assert pstatus(reader)["data_channel"]["tree_messages"] > 0


def replica_part_way(m: MtcfsMount, size: int) -> bool:
    """A replica of `size` bytes is arriving at m: less than 3/4 of it there so far."""
    for p in (m.ram_dir / "data" / ".incoming").iterdir():
        try:
            if 0 < p.stat().st_blocks * 512 < size * 3 // 4:
                return True
        except FileNotFoundError:  # renamed into place meanwhile
            pass
    return False


def test_replica_cut_short_by_a_killed_sender_is_not_kept(make_cluster):
    """kill -9 of the writer mid-push: the receiver keeps nothing of it and counts no
    copy; a read there fails (EIO: no copy is reachable), never wrong bytes."""
    c = make_cluster(2, replicas=1, extra=MAPPED)
    a, b = c["a"], c["b"]
    size = 256 * MiB
    write(a, "k/big", b"".join(blob(51 + i, 64 * MiB) for i in range(4)))
    incoming = b.ram_dir / "data" / ".incoming"
    wait_until(lambda: replica_part_way(b, size), 30, interval=0.001,
               what="a replica part-way to b")
    c.kill9("a")
    wait_until(lambda: not list(incoming.iterdir()), 15, what="b's .incoming emptied")
    st = b.state("k/big")
    if "node-b" in st["holders"]:
        pytest.skip("the replica completed before the kill (too fast to cut)")
    assert not [p for p in data_files(b.ram_dir) if p.stat().st_size == size], st
    with pytest.raises(OSError) as err:
        (b.path / "k/big").read_bytes()
    assert err.value.errno == 5


def test_a_receiver_killed_mid_push_leaves_the_replica_to_another_host(make_cluster):
    """kill -9 of the host receiving a replica, part-way (the writer sends from a
    mapping of its file): the writer's push fails without harm to it, and once the
    receiver is found dead the replica goes to the third host, byte for byte."""
    c = make_cluster(3, replicas=1, extra=MAPPED)
    a = c["a"]
    knows_data_ports(a)
    size = 256 * MiB
    data = write(a, "k/big", b"".join(blob(71 + i, 64 * MiB) for i in range(4)))

    def receiving() -> str | None:
        return next((name for name in ("b", "c") if replica_part_way(c[name], size)), None)

    victim = wait_until(receiving, 30, interval=0.001, what="a replica part-way")
    c.kill9(victim)
    other = "c" if victim == "b" else "b"
    st = wait_until(lambda: (s := a.state("k/big"))["replicas"] >= 1
                    and c[other].node_id in s["holders"] and s, 60,
                    what=f"the replica on {other}")
    assert c[victim].node_id not in st["holders"], st
    assert held_by(c[other], crc_of(data), len(data))
    assert (c[other].path / "k/big").read_bytes() == data
    assert file_crc(a.path / "k/big") == crc_of(data)  # the writer's copy is intact
    assert pstatus(a)["integrity_errors"] == 0
