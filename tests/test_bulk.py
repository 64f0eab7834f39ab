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

from mtcfs.checksums import BLOCK, pack_crcs
from mtcfs.peer import bulk
from mtcfs.peer.bulk import HEADER, BulkPool, BulkServer, Keys
from mtcfs.peer.server import Refused
from mtcfs.peer.v1 import peer_pb2 as pb
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
        self._lock = threading.Lock()

    def run(self, fn, *args):  # the daemon runs these in its trio thread: one at a time
        with self._lock:
            return fn(*args)

    def begin_receive(self, e: pb.Entry) -> tuple[int, str]:
        return self.ram.begin_incoming(e.size)

    def finish_receive(self, e: pb.Entry, key: int, tmp: str) -> bool:
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


def entry_for(data: bytes, guid: str = "f1") -> pb.Entry:
    crcs = [google_crc32c.value(data[i:i + BLOCK]) for i in range(0, len(data), BLOCK)]
    return pb.Entry(id=guid, parent="p1", name=b"f", mode=0o100644, size=len(data),
                    crc32c=google_crc32c.value(data), has_crc=True, version=1,
                    writer="node-w", block_crcs=pack_crcs(crcs))


@pytest.fixture
def channel(tmp_path: Path) -> Iterator[tuple[Host, BulkServer]]:
    ram = RamTier(str(tmp_path / "ram"), 256 * MiB)
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


@pytest.mark.parametrize("piece", [1000, 64 * 1024 + 7])
def test_a_block_in_small_pieces_lands_whole(tmp_path, piece):
    """A block that arrives in many small segments: the receiver's pipe fills its
    slots before the file's next MiB boundary and writes what it holds, then goes on.
    The bytes land whole, at their offsets, and their digest and crc32c are right."""
    a, b = socket.socketpair()
    key = Keys(TOKEN).session(b"s" * 32, b"c" * 32)
    sender = bulk.Conn(a, key, client=True)
    receiver = bulk.Conn(b, key, client=False)
    data = blob(piece, 2 * BLOCK - 12345)
    spans = bulk.spans(0, len(data))

    def send() -> None:
        for off, n in spans:
            block = data[off:off + n]
            mac = sender._mac(sender.out_dir, sender.sent, bulk.DATA, off, block)
            sender.sent += 1
            a.sendall(HEADER.pack(bulk.DATA, off, n, mac))
            for i in range(0, n, piece):  # a segment each (a Unix socket keeps them apart)
                a.sendall(block[i:i + piece])

    t = threading.Thread(target=send)
    t.start()
    fd = os.open(tmp_path / "dest", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, len(data))
        with ThreadPoolExecutor(2) as verifier:
            got = list(receiver.land_blocks(fd, spans, verifier))
    finally:
        os.close(fd)
        t.join()
        sender.close()
        receiver.close()
    assert [(off, n) for off, n, _, _ in got] == spans
    for off, n, digest, crc in got:
        assert digest == bulk.digest_of(data[off:off + n])
        assert crc == google_crc32c.value(data[off:off + n])
    assert (tmp_path / "dest").read_bytes() == data


def test_push_and_fetch(channel, tmp_path):
    host, server = channel
    data = blob(1, 9 * MiB + 1)
    e = entry_for(data)
    pool = BulkPool(Keys(TOKEN), None, 2)
    fd = write_tmp(tmp_path, data)
    assert pool.push(addr(server), fd, e, "d/f", lambda: None) == ("OK", "", True)
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


def test_wrong_token_is_refused_and_changes_nothing(channel, tmp_path):
    host, server = channel
    data = blob(2, 5 * MiB)
    pool = BulkPool(Keys(b"another-token-that-is-long-enough"), None, 1)
    code, details, stored = pool.push(addr(server), write_tmp(tmp_path, data), entry_for(data),
                                      "d/f", lambda: None)
    assert (code, stored) == ("UNAVAILABLE", False), details  # closed on it at the handshake
    wait_until(lambda: server.rejected == 1, 5)
    untouched(host)


def test_forged_connection_without_the_token(channel):
    host, server = channel
    with socket.create_connection(addr(server), timeout=5) as s:
        hello = s.recv(40, socket.MSG_WAITALL)
        assert hello[:8] == bulk.MAGIC
        s.sendall(os.urandom(64))  # a nonce and a guessed answer
        assert s.recv(1) == b""  # closed: no answer, no session
        # Frames sent anyway change nothing.
        with pytest.raises(OSError):
            for _ in range(50):
                s.sendall(HEADER.pack(b"C", 0, 2, b"\0" * 32) + b"{}")
                time.sleep(0.01)
    wait_until(lambda: server.rejected == 1, 5)
    untouched(host)


def test_replayed_challenge_answer_is_refused(channel):
    host, server = channel
    keys = Keys(TOKEN)
    # A genuine peer's handshake, recorded on the wire.
    with socket.create_connection(addr(server), timeout=5) as s:
        nonce = s.recv(40, socket.MSG_WAITALL)[8:]
        mine = os.urandom(32)
        answer = mine + keys.answer(b"client", nonce, mine)
        s.sendall(answer)
        assert s.recv(32, socket.MSG_WAITALL) == keys.answer(b"server", nonce, mine)
    # Replayed on a new connection: the server's nonce is new, the answer is stale.
    with socket.create_connection(addr(server), timeout=5) as s:
        assert s.recv(40, socket.MSG_WAITALL)[8:] != nonce
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
                s.sendall(bulk.MAGIC + os.urandom(32))
                answer = s.recv(64, socket.MSG_WAITALL)
                s.sendall(answer[32:])
                s.recv(1)

        t = threading.Thread(target=impostor, daemon=True)
        t.start()
        with pytest.raises(bulk.AuthError):
            BulkPool(Keys(TOKEN), None, 1)._open(listener.getsockname())
        t.join(5)


def test_block_with_valid_crc_but_no_valid_mac_is_refused(channel):
    """A bit flipped on the wire, with block crcs that match the flipped bytes: the
    crc32c check alone would pass; the MAC (over what the sender sent) does not."""
    host, server = channel
    data = bytearray(blob(3, BLOCK))
    sent = bytes(data)
    data[12345] ^= 0x10
    flipped = bytes(data)
    c = raw_session(server)
    c.send_control({"op": "push", "path": "d/f",
                    "entry": base64.b64encode(entry_for(flipped).SerializeToString()).decode()})
    assert c.recv_control() == {"ok": True}
    mac = c._mac(c.out_dir, c.sent, b"B", 0, sent)  # the genuine sender's MAC
    c.sent += 1
    c.sock.sendall(HEADER.pack(b"B", 0, len(flipped), mac) + flipped)
    reply = c.recv_control()
    assert reply["error"] == "DATA_LOSS" and "MAC" in reply["details"], reply
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
    mac = c._mac(c.out_dir, c.sent, b"B", off, body)  # a valid MAC: the range is the fault
    c.sent += 1
    try:
        c.sock.sendall(HEADER.pack(b"B", off, len(body), mac) + body)
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


def test_fetched_block_with_bad_mac_is_not_counted(channel, tmp_path):
    """The reader's side: a block whose MAC does not match is never reported good (it
    lands in the private file being filled, which no one reads before a block counts),
    and its digest is not remembered for serving it on."""
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
    pool = BulkPool(Keys(TOKEN), None, 1)  # one that knows no digest of the file
    with pytest.raises(bulk.IntegrityError):
        pool.fetch(addr(server), out, "f1", 1, "d/f", len(data), e.block_crcs, 0, 2,
                   lambda off, n: got.append((off, n)))
    assert got == [(0, BLOCK)]  # the good block only
    assert pool.hashes.get("f1", 1, 0, BLOCK) is not None
    assert pool.hashes.get("f1", 1, BLOCK, BLOCK) is None


def test_a_held_replica_is_served_without_a_pass_for_its_macs(channel, tmp_path):
    """The digests a push verified on the holder (and computed on the writer) are what
    later MACs cover: the holder sendfile()s the blocks without reading them first.
    A rotted block still fails the reader's MAC check (test above)."""
    host, server = channel
    data = blob(7, 3 * BLOCK + 5)
    e = entry_for(data)
    writer = BulkPool(Keys(TOKEN), None, 1)
    assert writer.push(addr(server), write_tmp(tmp_path, data), e, "d/f", lambda: None)[0] == "OK"
    assert writer.hashes.status()["block_digests_kept"] == 4
    assert server.hashes.status()["block_digests_kept"] == 4
    reader = BulkPool(Keys(TOKEN), None, 1)
    out = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    for _ in range(2):
        reader.fetch(addr(server), out, "f1", 1, "d/f", len(data), e.block_crcs, 0, 4,
                     lambda off, n: None)
        assert os.pread(out, len(data) + 1, 0) == data
    st = server.hashes.status()
    assert (st["block_digest_hits"], st["block_digest_misses"]) == (8, 0), st
    assert reader.hashes.status()["block_digests_kept"] == 4  # it can serve them alike


# -- real daemons --------------------------------------------------------------------------------




def held_by(m: MtcfsMount, crc: int, size: int) -> bool:
    """A data file in the host's RAM tier with this size and crc32c."""
    return any(p.stat().st_size == size and file_crc(p) == crc for p in data_files(m.ram_dir))


def test_replication_over_the_data_channel(make_cluster):
    c = make_cluster(3, replicas=2)
    a = c["a"]
    knows_data_ports(a)  # (learned from the peers' health replies, a moment after start)
    files = {"r/one": b"\x5a", "r/five": blob(11, 5 * MiB), "r/nine": blob(12, 9 * MiB + 1)}
    for rel, data in files.items():
        write(a, rel, data)
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
    return holders, next(n for n in c.hosts if n not in holders)


def knows_data_ports(m: MtcfsMount) -> None:
    wait_until(lambda: all(p["alive"] and p["data_port"] for p in pstatus(m)["peers"]), 10,
               what=f"{m.node_id} knows its peers' data ports")


def test_striped_restore_reads_from_every_holder(make_cluster):
    c = make_cluster(3, replicas=1)
    data = write(c["a"], "s/big", blob(21, 96 * MiB + 123))
    holders, reader = holders_and_reader(c, "s/big")
    knows_data_ports(c[reader])
    assert (c[reader].path / "s/big").read_bytes() == data
    s = pstatus(c[reader])
    by_source = s["bytes_fetched_by_source"]
    assert set(by_source) == {c[h].node_id for h in holders}, by_source
    assert sum(by_source.values()) == len(data), by_source
    assert s["bulk_fetched_bytes"] == len(data) and s["integrity_errors"] == 0, s


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["sigstop", "kill9"])
def test_restore_survives_a_holder_lost_halfway(make_cluster, fault):
    """One holder is stopped (SIGSTOP: its connections stay open, silent) or killed
    (-9) once a quarter of the file arrived: its remaining blocks come from the other
    holder, and the reader gets the file's exact bytes."""
    c = make_cluster(3, replicas=1)
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
    s = pstatus(c[reader])
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


def test_replica_cut_short_by_a_killed_sender_is_not_kept(make_cluster):
    """kill -9 of the writer mid-push: the receiver keeps nothing of it and counts no
    copy; a read there fails (EIO: no copy is reachable), never wrong bytes."""
    c = make_cluster(2, replicas=1)
    a, b = c["a"], c["b"]
    size = 256 * MiB
    write(a, "k/big", b"".join(blob(51 + i, 64 * MiB) for i in range(4)))
    incoming = b.ram_dir / "data" / ".incoming"

    def partial() -> bool:
        for p in incoming.iterdir():
            try:
                if 0 < p.stat().st_blocks * 512 < size * 3 // 4:
                    return True
            except FileNotFoundError:  # renamed into place meanwhile
                pass
        return False

    wait_until(partial, 30, interval=0.001, what="a replica part-way to b")
    c.kill9("a")
    wait_until(lambda: not list(incoming.iterdir()), 15, what="b's .incoming emptied")
    st = b.state("k/big")
    if "node-b" in st["holders"]:
        pytest.skip("the replica completed before the kill (too fast to cut)")
    assert not [p for p in data_files(b.ram_dir) if p.stat().st_size == size], st
    with pytest.raises(OSError) as err:
        (b.path / "k/big").read_bytes()
    assert err.value.errno == 5
