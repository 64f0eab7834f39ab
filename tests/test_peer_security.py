"""The peer RPCs against a real daemon: the token gate, request validation, limits, TLS.

One daemon (--listen + --token-file, no peers, a 64 MiB RAM tier) serves the whole
module. Every RPC is called with raw gRPC stubs, as a hostile or broken peer would:
without the token, with a wrong one, or with the right token and malformed content.
Each refusal must carry the right status code and change nothing: the mount's tree
and contents, the index counters of `mtcfs status --json`, the RAM tier's usage and
its data/ and incoming/ directories, and what Snapshot and ListHeld return. The
same well-formed requests that the gate refuses without the token do change the
namespace with it (the last tests), so the negative tests could fail.
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import google_crc32c
import grpc
import pytest

from mtcfs import control
from mtcfs.config import mount_entry
from mtcfs.peer.v1 import peer_pb2 as pb
from mtcfs.peer.v1 import peer_pb2_grpc as pb_grpc

from support.certs import make_ca, make_cert
from support.gcs_server import closed_port, free_port
from support.mounts import MtcfsMount, dispose, mtcfs

MiB = 1 << 20
Code = grpc.StatusCode
SENDER = "node-zz"  # the node id a (fake) peer claims
LAMPORT = 1_000_000  # newer than anything the daemon has: a valid change would win
TIMEOUT = 10


def new_id() -> str:
    return uuid.uuid4().hex[:20]


def crc(data: bytes) -> int:
    return google_crc32c.value(data)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", "Bearer " + token),)


# -- the daemon ----------------------------------------------------------------------------------


@dataclass
class Node:
    mount: MtcfsMount
    addr: str
    token: str
    channel: grpc.Channel
    stub: pb_grpc.PeerStub
    files: dict[str, bytes]  # what the test wrote through the mount
    ids: dict[str, str]  # their global ids (from ListHeld)

    @property
    def md(self) -> tuple[tuple[str, str], ...]:
        return bearer(self.token)

    @property
    def ram_dir(self) -> Path:
        return self.mount.ram_dir


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """One daemon for the module (MtcfsMount, as conftest's make_mount, with its cleanup)."""
    tmp = tmp_path_factory.mktemp("peer-security")
    ram_root = Path("/dev/shm") / f"mtcfs-test-{uuid.uuid4().hex[:10]}"
    ram_root.mkdir()
    token = os.urandom(16).hex()
    (tmp / "token").write_text(token + "\n")
    mp = tmp / "mnt"
    mp.mkdir()
    port = free_port()
    m = MtcfsMount(mp, ram_root / "ram-a", "64MiB", "node-a",
                   ("--listen", f"127.0.0.1:{port}", "--token-file", str(tmp / "token")))
    channel = None
    try:
        m.start()
        files = {
            "step1/shard0": os.urandom(MiB + 123),
            "step1/shard1": b"small shard\n",
            "note.txt": b"hello\n",
        }
        (mp / "step1").mkdir()
        for rel, data in files.items():
            (mp / rel).write_bytes(data)
        (mp / "step1" / "latest").symlink_to("shard0")
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
            ("grpc.max_send_message_length", 64 * MiB),
            ("grpc.max_receive_message_length", 64 * MiB),
        ])
        stub = pb_grpc.PeerStub(channel)
        # (A plain close seals in the background: the last file may still be sealing.)
        deadline = time.monotonic() + 10
        while True:
            held = stub.ListHeld(pb.ListHeldRequest(), timeout=TIMEOUT,
                                 metadata=bearer(token))
            ids = {f.path: f.id for f in held.files}
            if set(ids) == set(files) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert set(ids) == set(files), held
        yield Node(m, f"127.0.0.1:{port}", token, channel, stub, files, ids)
    finally:
        if channel is not None:
            channel.close()
        dispose(m, ram_root)


# -- calling, and what "nothing changed" means ----------------------------------------------------


def rpc(fn: Callable[[], Any]) -> tuple[grpc.StatusCode, str, Any]:
    """Run one call; streams are read to the end. Returns (code, details, result)."""
    try:
        result = fn()
        if isinstance(result, grpc.Call) and hasattr(result, "__iter__"):
            result = list(result)
        return Code.OK, "", result
    except grpc.RpcError as e:
        return e.code(), e.details() or "", None


def expect(code: grpc.StatusCode, fn: Callable[[], Any], what: str) -> Any:
    got, details, result = rpc(fn)
    assert got == code, f"{what}: {got.name} ({details!r}), expected {code.name}"
    return result


def tree(root: Path) -> dict[str, tuple]:
    """Every name under the mount with its type, mode, size and contents (sha256)."""
    out: dict[str, tuple] = {}

    def walk(d: Path, rel: str) -> None:
        for de in sorted(os.scandir(d), key=lambda x: x.name):
            st = de.stat(follow_symlinks=False)
            r = rel + de.name
            if stat.S_ISDIR(st.st_mode):
                out[r + "/"] = ("dir", st.st_mode)
                walk(Path(de.path), r + "/")
            elif stat.S_ISLNK(st.st_mode):
                out[r] = ("symlink", os.readlink(de.path))
            elif stat.S_ISREG(st.st_mode):
                try:
                    digest = hashlib.sha256(Path(de.path).read_bytes()).hexdigest()
                except OSError as e:  # a file only an unreachable peer holds
                    digest = f"errno {e.errno}"
                out[r] = ("file", st.st_mode, st.st_size, digest)
            else:
                out[r] = ("other", st.st_mode)

    walk(root, "")
    return out


def counters(st: dict) -> dict[str, Any]:
    """The parts of `mtcfs status --json` that a refused request must not move."""
    p = st["peers"]
    return {
        "ram_used": st["ram"]["used"],
        "files": st["files"],
        "directories": st["directories"],
        "states": st["states"],
        "index": p["index"],
        **{k: p[k] for k in ("batches_received", "replicas_received",
                             "replica_bytes_received")},
    }


def listing(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if not n.startswith("."))


def state(n: Node, cli: bool = False) -> dict[str, Any]:
    """Everything a refused request must leave as it was. cli=True reads the status
    through `mtcfs status --json` (else the same reply over the control socket)."""
    st = n.mount.status(cli=True) if cli else control.request(str(n.mount.path), "status")["status"]
    snap = n.stub.Snapshot(pb.SnapshotRequest(from_node=SENDER), timeout=TIMEOUT, metadata=n.md)
    held = n.stub.ListHeld(pb.ListHeldRequest(), timeout=TIMEOUT, metadata=n.md)
    return {
        "tree": tree(n.mount.path),
        "status": counters(st),
        "data": listing(n.ram_dir / "data"),
        "incoming": listing(n.ram_dir / "data" / ".incoming"),
        "snapshot": sorted(e.SerializeToString(deterministic=True)
                           for batch in snap for e in batch.entries),
        "held": sorted(f.SerializeToString(deterministic=True) for f in held.files),
    }


def assert_unchanged(n: Node, before: dict[str, Any], what: str, cli: bool = False) -> None:
    # A rejected replica goes to trash/, which a worker empties: only then has its
    # space come back (with passthrough the RAM tier's use is what its tmpfs says).
    # The call's error can reach us before the replica is in trash/ (seen under load:
    # trash/ empty, ram_used still up by the rejected bytes): wait for the daemon to
    # settle back, up to 5 s, then compare.
    deadline = time.monotonic() + 5
    while True:
        idle = not listing(n.ram_dir / "data" / ".trash")
        after = state(n, cli)
        if (idle and after == before) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for key in before:
        assert after[key] == before[key], f"{what} changed the daemon's {key}"
    assert after["incoming"] == [], f"{what} left a partial replica in incoming/"
    # A rejected replica goes to trash/, which a worker empties: the space comes back.
    deadline = time.monotonic() + 5
    trash = n.ram_dir / "data" / ".trash"
    while listing(trash) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert listing(trash) == [], f"{what}: a rejected replica stays in trash/"


def assert_serving(n: Node) -> None:
    reply = n.stub.Health(pb.HealthRequest(from_node=SENDER), timeout=TIMEOUT, metadata=n.md)
    assert reply.node_id == "node-a"
    assert n.mount.proc is not None and n.mount.proc.poll() is None, n.mount.log()


# -- well-formed requests (the last tests show that they work with the token) ---------------------


def entry(**kw: Any) -> pb.Entry:
    """A valid new regular file at the root, newer than anything there."""
    fields: dict[str, Any] = dict(
        id=new_id(), parent="root", name=b"remote-" + new_id().encode(), mode=0o100644,
        uid=os.getuid(), gid=os.getgid(), mtime_ns=time.time_ns(), ctime_ns=time.time_ns(),
        size=12345, has_crc=True, crc32c=0x1234, version=1, holders=["node-gone"],
        lamport=LAMPORT, writer=SENDER)
    fields.update(kw)
    return pb.Entry(**fields)


def dir_entry(**kw: Any) -> pb.Entry:
    return entry(**{"mode": stat.S_IFDIR | 0o755, "size": 0, "has_crc": False, "crc32c": 0,
                    "version": 0, "holders": [], **kw})


def batch(*entries: pb.Entry, from_node: str = SENDER) -> pb.ChangeBatch:
    return pb.ChangeBatch(from_node=from_node, lamport=LAMPORT, entries=entries)


def marked(marker: pb.CaughtUp) -> pb.ChangeBatch:
    """A good entry with a catch-up marker (mtcfs.peer.catchup)."""
    b = good_batch()
    b.caught_up.CopyFrom(marker)
    return b


def good_batch() -> pb.ChangeBatch:
    d = dir_entry(name=b"remote-dir-" + new_id().encode())
    return batch(d, entry(parent=d.id, name=b"shard"))


PARENT = "127.0.0.1:9"  # the address a (fake) parent in a dissemination tree claims
_seq = iter(range(10**6, 10**7))


def forward(b: pb.ChangeBatch, **kw: Any) -> pb.TreeMessage:
    """A batch down a dissemination tree to the daemon, its range the whole ring."""
    fields: dict[str, Any] = dict(from_node=PARENT, origin=PARENT, seq=next(_seq), end="",
                                  batch=b)
    fields.update(kw)
    return pb.TreeMessage(**fields)


PUSH_DATA = os.urandom(3 * 256 * 1024 + 17)
PIECE = 256 * 1024


def push_entry(data: bytes = PUSH_DATA, **kw: Any) -> pb.Entry:
    return entry(**{"name": b"pushed-" + new_id().encode(), "size": len(data),
                    "crc32c": crc(data), "holders": [SENDER], **kw})


def pieces(data: bytes, start: int = 0) -> list[pb.PushChunk]:
    return [pb.PushChunk(offset=start + off, data=data[off:off + PIECE])
            for off in range(0, len(data), PIECE)]


def push(e: pb.Entry, chunks: list[pb.PushChunk], path: str | None = None,
         above: list[pb.Entry] = ()) -> list[pb.PushChunk]:
    header = pb.PushHeader(entry=e, path=e.name.decode() if path is None else path,
                           above=above)
    return [pb.PushChunk(header=header), *chunks]


def good_push() -> tuple[pb.Entry, list[pb.PushChunk]]:
    e = push_entry()
    return e, push(e, pieces(PUSH_DATA))


# -- without the right token: UNAUTHENTICATED, nothing read, nothing changed ----------------------

BAD_TOKENS: dict[str, Callable[[str], tuple[tuple[str, str], ...] | None]] = {
    "no metadata": lambda t: None,
    "wrong token": lambda t: bearer("w" * len(t)),
    "last byte differs": lambda t: bearer(t[:-1] + ("0" if t[-1] != "0" else "1")),
    "one byte short": lambda t: bearer(t[:-1]),
    "one byte more": lambda t: bearer(t + "0"),
    "no Bearer prefix": lambda t: (("authorization", t),),
    "empty": lambda t: (("authorization", ""),),
    "other key": lambda t: (("x-token", "Bearer " + t),),
}

CALLS: dict[str, Callable[[Node, Any], Any]] = {
    "Health": lambda n, md: n.stub.Health(pb.HealthRequest(from_node=SENDER), timeout=TIMEOUT,
                                         metadata=md),
    "Broadcast": lambda n, md: n.stub.Broadcast(good_batch(), timeout=TIMEOUT, metadata=md),
    "Snapshot": lambda n, md: n.stub.Snapshot(pb.SnapshotRequest(from_node=SENDER),
                                             timeout=TIMEOUT, metadata=md),
    "PushFile": lambda n, md: n.stub.PushFile(iter(good_push()[1]), timeout=TIMEOUT,
                                             metadata=md),
    "FetchFile": lambda n, md: n.stub.FetchFile(pb.FetchRequest(id=n.ids["step1/shard1"]),
                                               timeout=TIMEOUT, metadata=md),
    "ListHeld": lambda n, md: n.stub.ListHeld(pb.ListHeldRequest(), timeout=TIMEOUT,
                                             metadata=md),
    "Forward": lambda n, md: n.stub.Forward(forward(good_batch()), timeout=TIMEOUT, metadata=md),
}


@pytest.mark.parametrize("method", list(CALLS))
def test_every_rpc_needs_the_token(node: Node, method: str) -> None:
    before = state(node)
    for how, metadata in BAD_TOKENS.items():
        md = metadata(node.token)
        # Streams must fail before yielding anything: rpc() reads them to the end.
        expect(Code.UNAUTHENTICATED, lambda md=md: CALLS[method](node, md),
               f"{method} with {how}")
        assert_unchanged(node, before, f"{method} with {how}")
    # The same call with the token goes through (mutating ones are checked at the end).
    if method in ("Health", "Snapshot", "FetchFile", "ListHeld"):
        result = expect(Code.OK, lambda: CALLS[method](node, node.md), f"{method} with the token")
        if method == "FetchFile":
            assert b"".join(c.data for c in result) == node.files["step1/shard1"]
        assert_unchanged(node, before, f"{method} with the token")


# -- Broadcast with the token but malformed: INVALID_ARGUMENT, nothing applied --------------------

BAD_BATCHES: dict[str, Callable[[], pb.ChangeBatch]] = {
    "name ..": lambda: batch(entry(name=b"..")),
    "name .": lambda: batch(entry(name=b".")),
    "name with /": lambda: batch(entry(name=b"a/b")),
    "absolute name": lambda: batch(entry(name=b"/etc")),
    "name with NUL": lambda: batch(entry(name=b"a\0b")),
    "300-byte name": lambda: batch(entry(name=b"n" * 300)),
    "256-byte name": lambda: batch(entry(name=b"n" * 256)),
    "empty name": lambda: batch(entry(name=b"")),
    "id ../x": lambda: batch(entry(id="../x")),
    "id ../../etc": lambda: batch(entry(id="../../etc")),
    "absolute id": lambda: batch(entry(id="/etc/passwd")),
    "id with -": lambda: batch(entry(id="abc-def")),
    "id with .": lambda: batch(entry(id="abc.def")),
    "id with space": lambda: batch(entry(id="abc def")),
    "non-ASCII id": lambda: batch(entry(id="abcé")),
    "empty id": lambda: batch(entry(id="")),
    "65-char id": lambda: batch(entry(id="a" * 65)),
    "entry for the root": lambda: batch(dir_entry(id="root", parent=new_id())),
    "tombstone of the root": lambda: batch(pb.Entry(id="root", removed=True, lamport=LAMPORT,
                                                    writer=SENDER)),
    "tombstone with id ../x": lambda: batch(pb.Entry(id="../x", removed=True, lamport=LAMPORT,
                                                     writer=SENDER)),
    "parent ../x": lambda: batch(entry(parent="../x")),
    "parent /": lambda: batch(entry(parent="/")),
    "empty parent": lambda: batch(entry(parent="")),
    "its own parent": lambda: batch(dir_entry(id="selfparent1", parent="selfparent1")),
    "holder ../x": lambda: batch(entry(holders=["../x"])),
    "empty holder": lambda: batch(entry(holders=[""])),
    "holder with space": lambda: batch(entry(holders=["node a"])),
    "holder starting with -": lambda: batch(entry(holders=["-rf"])),
    "non-ASCII holder": lambda: batch(entry(holders=["nodé"])),
    "64-char holder": lambda: batch(entry(holders=["n" * 64])),
    "1025 holders": lambda: batch(entry(holders=[f"n{i}" for i in range(1025)])),
    "writer ../x": lambda: batch(entry(writer="../x")),
    "sender ''": lambda: batch(entry(), from_node=""),
    "sender a/b": lambda: batch(entry(), from_node="a/b"),
    "block crcs of odd length": lambda: batch(entry(block_crcs=b"\0" * 5)),
    "symlink target of 4096 bytes": lambda: batch(entry(mode=stat.S_IFLNK | 0o777,
                                                        target=b"t" * 4096)),
    "mode without a type": lambda: batch(entry(mode=0o644)),
    "type 0o170000 (not a file type)": lambda: batch(entry(mode=0o170644)),
    "links of a directory": lambda: batch(entry(
        mode=stat.S_IFDIR | 0o755, links=[pb.Link(parent="p" * 10, name=b"x")])),
    "link with a bad name": lambda: batch(entry(links=[pb.Link(parent="p" * 10, name=b"../x")])),
    "2000 links": lambda: batch(entry(links=[pb.Link(parent="p" * 10, name=b"n%d" % i)
                                             for i in range(2000)])),
    "mode beyond 16 bits": lambda: batch(entry(mode=0o1100644)),
    "size 2**64-1": lambda: batch(entry(size=2**64 - 1)),
    "lamport 2**64-1": lambda: batch(entry(lamport=2**64 - 1)),
    "20000 entries": lambda: batch(*[dir_entry(name=b"d%d" % i) for i in range(20000)]),
    "a good entry, then a bad one": lambda: batch(dir_entry(), entry(name=b"..")),
    "a catch-up marker of 100001 hosts": lambda: marked(
        pb.CaughtUp(hosts=[f"10.0.0.1:{i}" for i in range(100_001)])),
    "a catch-up marker with an empty host": lambda: marked(pb.CaughtUp(hosts=[""])),
    "a catch-up marker with a 301-byte host": lambda: marked(pb.CaughtUp(hosts=["h" * 301])),
    "a catch-up marker from NaN": lambda: marked(pb.CaughtUp(hosts=["10.0.0.1:1"],
                                                             since_unix=float("nan"))),
    "a catch-up marker from before 1970": lambda: marked(pb.CaughtUp(hosts=["10.0.0.1:1"],
                                                                     since_unix=-1.0)),
}


@pytest.mark.parametrize("case", list(BAD_BATCHES))
def test_malformed_broadcast_is_refused(node: Node, case: str) -> None:
    before = state(node)
    expect(Code.INVALID_ARGUMENT,
           lambda: node.stub.Broadcast(BAD_BATCHES[case](), timeout=TIMEOUT, metadata=node.md),
           f"Broadcast with {case}")
    assert_unchanged(node, before, f"Broadcast with {case}")


# -- Forward (a batch down a dissemination tree) with the token but malformed --------------------

# A forward's batch goes through the same checks as a Broadcast's (above): a few of
# those cases here, and what is a tree message's own.
BAD_FORWARDS: dict[str, Callable[[], pb.TreeMessage]] = {
    **{f"batch with {case}": (lambda make=BAD_BATCHES[case]: forward(make()))
       for case in ("name ..", "id ../x", "entry for the root", "parent ../x",
                    "holder ../x", "sender a/b", "lamport 2**64-1", "20000 entries",
                    "a good entry, then a bad one", "a catch-up marker from NaN",
                    "a catch-up marker with an empty host")},
    "batch number 0": lambda: forward(good_batch(), seq=0),
    "batch number 2**63": lambda: forward(good_batch(), seq=2**63),
    "no sender": lambda: forward(good_batch(), from_node=""),
    "no origin": lambda: forward(good_batch(), origin=""),
    "sender of 400 chars": lambda: forward(good_batch(), from_node="a" * 400),
    "range end of 400 chars": lambda: forward(good_batch(), end="a" * 400),
    "ack without its range": lambda: pb.TreeMessage(from_node=PARENT, origin=PARENT, seq=5,
                                                    ack=True),
}


@pytest.mark.parametrize("case", list(BAD_FORWARDS))
def test_malformed_forward_is_refused(node: Node, case: str) -> None:
    before = state(node)
    expect(Code.INVALID_ARGUMENT,
           lambda: node.stub.Forward(BAD_FORWARDS[case](), timeout=TIMEOUT, metadata=node.md),
           f"Forward with {case}")
    assert_unchanged(node, before, f"Forward with {case}")


def test_an_ack_for_no_batch_changes_nothing(node: Node) -> None:
    before = state(node)
    ack = pb.TreeMessage(from_node=PARENT, origin=node.addr, seq=123, ack=True, start=PARENT,
                         end=node.addr)
    expect(Code.OK, lambda: node.stub.Forward(ack, timeout=TIMEOUT, metadata=node.md),
           "an ack of a batch never sent")
    assert_unchanged(node, before, "an ack of a batch never sent")


# -- PushFile with the token but malformed or corrupt: refused, no replica kept -------------------


def _bad_block_crcs() -> list[pb.PushChunk]:
    # Block crcs consistent with the declared file crc; the data of the block differs.
    e = push_entry(block_crcs=struct.pack("<I", crc(PUSH_DATA)))
    corrupt = bytearray(PUSH_DATA)
    corrupt[1000] ^= 0xFF
    return push(e, pieces(bytes(corrupt)))


BAD_PUSHES: dict[str, tuple[grpc.StatusCode, Callable[[], list[pb.PushChunk]]]] = {
    "an empty stream": (Code.INVALID_ARGUMENT, lambda: []),
    "no header": (Code.INVALID_ARGUMENT, lambda: pieces(PUSH_DATA)),
    "a header without crc": (Code.INVALID_ARGUMENT, lambda: push(
        push_entry(has_crc=False, crc32c=0), pieces(PUSH_DATA))),
    "a tombstone header": (Code.INVALID_ARGUMENT, lambda: push(
        pb.Entry(id=new_id(), removed=True, lamport=LAMPORT, writer=SENDER), [])),
    "a header named ..": (Code.INVALID_ARGUMENT, lambda: push(push_entry(name=b".."),
                                                             pieces(PUSH_DATA))),
    "a header with id ../x": (Code.INVALID_ARGUMENT, lambda: push(push_entry(id="../x"),
                                                                 pieces(PUSH_DATA))),
    "a header for the root": (Code.INVALID_ARGUMENT, lambda: push(push_entry(id="root"),
                                                                 pieces(PUSH_DATA))),
    "a header with path ../../etc/passwd": (Code.INVALID_ARGUMENT, lambda: push(
        push_entry(), pieces(PUSH_DATA), path="../../etc/passwd")),
    "an absolute path": (Code.INVALID_ARGUMENT, lambda: push(push_entry(), pieces(PUSH_DATA),
                                                             path="/etc/passwd")),
    "data beyond the declared size": (Code.INVALID_ARGUMENT, lambda: push(
        push_entry(PUSH_DATA[:-10]), pieces(PUSH_DATA))),
    "a chunk after the end": (Code.INVALID_ARGUMENT, lambda: push(
        push_entry(), [*pieces(PUSH_DATA), pb.PushChunk(offset=len(PUSH_DATA), data=b"x")])),
    "chunks out of order": (Code.INVALID_ARGUMENT, lambda: push(
        push_entry(), [pieces(PUSH_DATA)[i] for i in (0, 2, 1, 3)])),
    "a gap": (Code.INVALID_ARGUMENT, lambda: push(
        push_entry(), [pieces(PUSH_DATA)[i] for i in (0, 2, 3)])),
    "a chunk sent twice": (Code.INVALID_ARGUMENT, lambda: push(
        push_entry(), [pieces(PUSH_DATA)[i] for i in (0, 1, 1, 2, 3)])),
    "a wrong crc": (Code.DATA_LOSS, lambda: push(push_entry(crc32c=crc(PUSH_DATA) ^ 1),
                                                 pieces(PUSH_DATA))),
    "less data than the size": (Code.DATA_LOSS, lambda: push(
        push_entry(), pieces(PUSH_DATA)[:-1])),
    "a corrupt block": (Code.DATA_LOSS, _bad_block_crcs),
    "block crcs that contradict the crc": (Code.DATA_LOSS, lambda: push(
        push_entry(block_crcs=struct.pack("<I", 7)), pieces(PUSH_DATA))),
    "a file among the directories above": (Code.INVALID_ARGUMENT, lambda: push(
        push_entry(), pieces(PUSH_DATA), above=[push_entry()])),
    "a tombstone among the directories above": (Code.INVALID_ARGUMENT, lambda: push(
        push_entry(), pieces(PUSH_DATA),
        above=[pb.Entry(id=new_id(), removed=True, lamport=LAMPORT, writer=SENDER)])),
    "a directory above named ..": (Code.INVALID_ARGUMENT, lambda: push(
        push_entry(), pieces(PUSH_DATA), above=[dir_entry(name=b"..")])),
    "65 directories above": (Code.INVALID_ARGUMENT, lambda: push(
        push_entry(), pieces(PUSH_DATA), above=[dir_entry() for _ in range(65)])),
}


@pytest.mark.parametrize("case", list(BAD_PUSHES))
def test_bad_push_is_rejected(node: Node, case: str) -> None:
    code, chunks = BAD_PUSHES[case]
    before = state(node)
    expect(code, lambda: node.stub.PushFile(iter(chunks()), timeout=TIMEOUT, metadata=node.md),
           f"PushFile with {case}")
    assert_unchanged(node, before, f"PushFile with {case}")


def test_push_beyond_the_ram_tier_is_refused(node: Node) -> None:
    before = state(node)
    free = node.stub.Health(pb.HealthRequest(), timeout=TIMEOUT, metadata=node.md).ram_free
    assert 0 < free <= 64 * MiB
    for size in (free + 1, 100 * MiB, 2**61):
        e = push_entry(PUSH_DATA, size=size)  # the header is checked before any data
        expect(Code.RESOURCE_EXHAUSTED,
               lambda e=e: node.stub.PushFile(iter(push(e, pieces(PUSH_DATA))), timeout=TIMEOUT,
                                              metadata=node.md),
               f"PushFile of {size} bytes into a 64 MiB RAM tier")
        assert_unchanged(node, before, f"PushFile of {size} bytes")
    assert_serving(node)


# -- FetchFile -----------------------------------------------------------------------------------

BAD_FETCHES: dict[str, tuple[grpc.StatusCode, Callable[[Node], pb.FetchRequest]]] = {
    "id ../../etc": (Code.INVALID_ARGUMENT, lambda n: pb.FetchRequest(id="../../etc")),
    "absolute id": (Code.INVALID_ARGUMENT, lambda n: pb.FetchRequest(id="/etc/passwd")),
    "empty id": (Code.INVALID_ARGUMENT, lambda n: pb.FetchRequest()),
    "non-ASCII id": (Code.INVALID_ARGUMENT, lambda n: pb.FetchRequest(id="abcé")),
    "path ../x": (Code.INVALID_ARGUMENT,
                  lambda n: pb.FetchRequest(id=n.ids["note.txt"], path="../x")),
    "unknown id": (Code.NOT_FOUND, lambda n: pb.FetchRequest(id=new_id())),
    "another version": (Code.FAILED_PRECONDITION,
                        lambda n: pb.FetchRequest(id=n.ids["note.txt"], version=999)),
}


@pytest.mark.parametrize("case", list(BAD_FETCHES))
def test_bad_fetch_is_refused(node: Node, case: str) -> None:
    code, request = BAD_FETCHES[case]
    before = state(node)
    expect(code, lambda: node.stub.FetchFile(request(node), timeout=TIMEOUT, metadata=node.md),
           f"FetchFile with {case}")
    assert_unchanged(node, before, f"FetchFile with {case}")


BAD_SNAPSHOTS: dict[str, pb.SnapshotRequest] = {
    "requester ../x": pb.SnapshotRequest(from_node="../x"),
    "listen of 400 chars": pb.SnapshotRequest(from_node=SENDER, listen="a" * 400),
    "since -1 s": pb.SnapshotRequest(from_node=SENDER, since_s=-1),
    "since NaN": pb.SnapshotRequest(from_node=SENDER, since_s=float("nan")),
    "since inf": pb.SnapshotRequest(from_node=SENDER, since_s=float("inf")),
    "since 10**12 s": pb.SnapshotRequest(from_node=SENDER, since_s=1e12),
}


@pytest.mark.parametrize("case", list(BAD_SNAPSHOTS))
def test_bad_snapshot_request_is_refused(node: Node, case: str) -> None:
    before = state(node)
    expect(Code.INVALID_ARGUMENT,
           lambda: node.stub.Snapshot(BAD_SNAPSHOTS[case], timeout=TIMEOUT, metadata=node.md),
           f"Snapshot with {case}")
    assert_unchanged(node, before, f"Snapshot with {case}")


def test_a_delta_snapshot_holds_the_recent_changes_only(node: Node) -> None:
    """since_s: what changed on the node lately. Everything the node has was made
    since it started (empty), well within an hour: the delta of an hour is the whole
    snapshot, and one of a moment ago (after a change of its own) holds that change
    alone."""
    full = expect(Code.OK, lambda: node.stub.Snapshot(
        pb.SnapshotRequest(from_node=SENDER), timeout=TIMEOUT, metadata=node.md), "Snapshot")
    whole = sorted(e.id for b in full for e in b.entries)
    hour = expect(Code.OK, lambda: node.stub.Snapshot(
        pb.SnapshotRequest(from_node=SENDER, since_s=3600), timeout=TIMEOUT,
        metadata=node.md), "Snapshot of the last hour")
    assert sorted(e.id for b in hour for e in b.entries) == whole
    time.sleep(1.5)
    os.utime(node.mount.path / "step1" / "shard1", (1, 1))  # a change of its own
    node.mount.status()  # (settled)
    recent = expect(Code.OK, lambda: node.stub.Snapshot(
        pb.SnapshotRequest(from_node=SENDER, since_s=1), timeout=TIMEOUT,
        metadata=node.md), "Snapshot of the last second")
    got = [e for b in recent for e in b.entries]
    assert [e.id for e in got] == [node.ids["step1/shard1"]], got
    assert got[0].mtime_ns == 10**9


def test_fetch_serves_ranges_of_held_files(node: Node) -> None:
    data = node.files["step1/shard0"]
    req = pb.FetchRequest(id=node.ids["step1/shard0"], offset=MiB - 5, length=100,
                          path="step1/shard0")
    chunks = expect(Code.OK, lambda: node.stub.FetchFile(req, timeout=TIMEOUT, metadata=node.md),
                    "FetchFile of a range")
    assert b"".join(c.data for c in chunks) == data[MiB - 5:MiB + 95]
    chunks = expect(Code.OK, lambda: node.stub.FetchFile(
        pb.FetchRequest(id=node.ids["step1/shard0"]), timeout=TIMEOUT, metadata=node.md),
        "FetchFile of a whole file")
    assert b"".join(c.data for c in chunks) == data


# -- limits --------------------------------------------------------------------------------------


def test_message_over_16_mib_is_refused_and_the_daemon_keeps_serving(node: Node) -> None:
    before = state(node)
    big = 17 * MiB
    expect(Code.RESOURCE_EXHAUSTED, lambda: node.stub.Broadcast(
        batch(entry(mode=stat.S_IFLNK | 0o777, target=b"t" * big)), timeout=TIMEOUT,
        metadata=node.md), "a 17 MiB Broadcast")
    assert_unchanged(node, before, "a 17 MiB Broadcast")
    assert_serving(node)
    # A valid push header, then one 17 MiB chunk: the reservation must be given back.
    data = os.urandom(big)
    e = push_entry(data)
    expect(Code.RESOURCE_EXHAUSTED, lambda: node.stub.PushFile(
        iter(push(e, [pb.PushChunk(offset=0, data=data)])), timeout=TIMEOUT, metadata=node.md),
        "a push with a 17 MiB chunk")
    assert_unchanged(node, before, "a push with a 17 MiB chunk")
    assert_serving(node)


# -- the same requests with the token change the namespace (the negatives could fail) ------------


def read_in_child(path: Path, offset: int = 0) -> str:
    """Read through the mount in a child process (a hang cannot block the test)."""
    code = ("import os, sys\n"
            "try:\n"
            "    fd = os.open(sys.argv[1], os.O_RDONLY)\n"
            "    d = os.pread(fd, 65536, int(sys.argv[2]))\n"
            "    print('data', len(d), d.count(0))\n"
            "except OSError as e:\n"
            "    print('errno', e.errno)\n")
    r = subprocess.run([sys.executable, "-c", code, str(path), str(offset)], capture_output=True,
                       text=True, timeout=60)
    return r.stdout.strip()


def test_well_formed_broadcast_is_applied(node: Node) -> None:
    before = state(node, cli=True)
    b = good_batch()
    d, f = b.entries
    reply = expect(Code.OK, lambda: node.stub.Broadcast(b, timeout=TIMEOUT, metadata=node.md),
                   "a well-formed Broadcast")
    assert reply.applied == 2
    assert reply.lamport >= LAMPORT
    path = node.mount.path / d.name.decode() / "shard"
    assert path.parent.is_dir()
    assert path.stat().st_size == f.size
    st = node.mount.state(str(path.relative_to(node.mount.path)))
    assert st["holders"] == ["node-gone"] and st["size"] == f.size, st
    # Its only holder is not reachable: reading fails, it never returns zeros.
    assert read_in_child(path) == "errno 5"
    assert read_in_child(path, 4096) == "errno 5"
    after = state(node, cli=True)
    assert after["status"]["index"]["entries"] == before["status"]["index"]["entries"] + 2
    assert after["status"]["batches_received"] == before["status"]["batches_received"] + 1
    # The failed fetch holds no RAM (an emptied data file may stay for a retry).
    assert after["status"]["ram_used"] == before["status"]["ram_used"]
    assert after["incoming"] == []


class _Parent(pb_grpc.PeerServicer):
    """A parent in a dissemination tree: a real gRPC server that keeps what it gets."""

    def __init__(self) -> None:
        self.got: list[tuple[pb.TreeMessage, dict[str, str]]] = []

    def Forward(self, request: pb.TreeMessage, context: grpc.ServicerContext) -> pb.OneWay:
        self.got.append((request, dict(context.invocation_metadata())))
        return pb.OneWay()


def test_well_formed_forward_is_applied_once_and_acked_to_its_sender(node: Node) -> None:
    from concurrent import futures

    parent = _Parent()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_PeerServicer_to_server(parent, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        me = f"127.0.0.1:{port}"
        before = state(node, cli=True)
        b = good_batch()
        d, f = b.entries
        # A range of the whole ring: the daemon (no peers) is a leaf, and answers with
        # the ack in the reply.
        msg = forward(b, from_node=me, origin=me)
        reply = expect(Code.OK, lambda: node.stub.Forward(msg, timeout=TIMEOUT,
                                                          metadata=node.md),
                       "a well-formed Forward")
        assert reply.acked
        path = node.mount.path / d.name.decode() / "shard"
        assert path.stat().st_size == f.size
        mid = state(node, cli=True)
        assert mid["status"]["index"]["entries"] == before["status"]["index"]["entries"] + 2
        assert mid["status"]["batches_received"] == before["status"]["batches_received"] + 1
        # The same batch again (a retry after a lost reply): acked, not applied again.
        reply = expect(Code.OK, lambda: node.stub.Forward(msg, timeout=TIMEOUT,
                                                          metadata=node.md),
                       "the same Forward again")
        assert reply.acked
        after = state(node, cli=True)
        assert after["status"]["batches_received"] == mid["status"]["batches_received"]
        assert after["status"]["index"] == mid["status"]["index"]
        assert parent.got == []  # no separate ack: the replies carried them
    finally:
        server.stop(0)


def test_well_formed_push_is_stored(node: Node) -> None:
    before = state(node, cli=True)
    e, chunks = good_push()
    reply = expect(Code.OK, lambda: node.stub.PushFile(iter(chunks), timeout=TIMEOUT,
                                                       metadata=node.md),
                   "a well-formed PushFile")
    assert reply.stored and reply.node_id == "node-a"
    path = node.mount.path / e.name.decode()
    assert path.read_bytes() == PUSH_DATA
    held = node.stub.ListHeld(pb.ListHeldRequest(), timeout=TIMEOUT, metadata=node.md)
    assert e.id in {h.id for h in held.files}
    after = state(node, cli=True)
    assert after["status"]["ram_used"] >= before["status"]["ram_used"] + len(PUSH_DATA)
    assert after["status"]["replicas_received"] == before["status"]["replicas_received"] + 1
    assert len(after["data"]) == len(before["data"]) + 1 and after["incoming"] == []
    # Sent again: this node already holds that version.
    expect(Code.ALREADY_EXISTS, lambda: node.stub.PushFile(iter(chunks), timeout=TIMEOUT,
                                                           metadata=node.md), "the same push again")
    assert_unchanged(node, after, "the same push again")


def test_a_push_with_its_directories_is_stored_under_them(node: Node) -> None:
    """A replica brings the directories above its file (its writer's batch naming them
    may come later): they are made here, the file stored in them."""
    step = dir_entry(name=b"step-" + new_id().encode())
    shard = dir_entry(parent=step.id, name=b"shard")
    e = push_entry(parent=shard.id)
    reply = expect(Code.OK, lambda: node.stub.PushFile(
        iter(push(e, pieces(PUSH_DATA), path="s/shard/f", above=[step, shard])),
        timeout=TIMEOUT, metadata=node.md), "a PushFile with its directories")
    assert reply.stored
    path = node.mount.path / step.name.decode() / "shard" / e.name.decode()
    assert path.read_bytes() == PUSH_DATA


# -- the command line: peers need a secret -------------------------------------------------------


@pytest.mark.parametrize("how", ["--peers", "--peers-file"])
def test_peers_without_a_token_are_a_usage_error(tmp_path: Path, ram_root: Path, how: str) -> None:
    mp = tmp_path / "mp"
    mp.mkdir()
    peers = f"127.0.0.1:{closed_port()}"
    if how == "--peers-file":
        (tmp_path / "peers").write_text(peers + "\n")
        peers = str(tmp_path / "peers")
    r = mtcfs("mount", str(mp), "--ram-dir", str(ram_root / "ram"), "--listen",
              f"127.0.0.1:{free_port()}", how, peers)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--token-file" in lines[0] and "--insecure" in lines[0], r.stderr
    assert mount_entry(str(mp)) is None


def test_short_token_is_a_usage_error(tmp_path: Path, ram_root: Path) -> None:
    mp = tmp_path / "mp"
    mp.mkdir()
    (tmp_path / "token").write_text("short\n")
    r = mtcfs("mount", str(mp), "--ram-dir", str(ram_root / "ram"), "--listen",
              f"127.0.0.1:{free_port()}", "--token-file", str(tmp_path / "token"))
    assert r.returncode == 2, r.stderr
    assert "at least 16 bytes" in r.stderr
    assert mount_entry(str(mp)) is None


# -- TLS -----------------------------------------------------------------------------------------


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_tls_with_client_certificates(make_mount, tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    ca = make_ca("mtcfs test CA")
    other_ca = make_ca("some other CA")
    files: dict[str, Path] = {}
    for name, (cert, key) in {"a": make_cert(ca, "node-a"), "b": make_cert(ca, "node-b"),
                              "stranger": make_cert(other_ca, "stranger")}.items():
        files[name + ".crt"] = tmp_path / f"{name}.crt"
        files[name + ".key"] = tmp_path / f"{name}.key"
        files[name + ".crt"].write_bytes(cert)
        files[name + ".key"].write_bytes(key)
    (tmp_path / "ca.crt").write_bytes(ca[2])
    token = os.urandom(16).hex()
    (tmp_path / "token").write_text(token)
    port_a, port_b, dead = free_port(), free_port(), closed_port()

    def tls_args(name: str, port: int, peers: str) -> tuple[str, ...]:
        return ("--listen", f"127.0.0.1:{port}", "--peers", peers,
                "--token-file", str(tmp_path / "token"), "--tls-cert", str(files[name + ".crt"]),
                "--tls-key", str(files[name + ".key"]), "--tls-ca", str(tmp_path / "ca.crt"))

    # a starts while none of its peers is reachable (b is not up yet, the other is closed).
    a = make_mount("a", extra=tls_args("a", port_a, f"127.0.0.1:{dead},127.0.0.1:{port_b}"))
    assert a.status()["peers"]["live_peers"] == 0
    b = make_mount("b", extra=tls_args("b", port_b, f"127.0.0.1:{port_a}"))
    # The nodes find each other over mutual TLS (membership's client side) ...
    for m in (a, b):
        wait_for(lambda m=m: m.status()["peers"]["live_peers"] == 1, f"{m.node_id} sees its peer")
    # ... and a file written on a reaches b (Broadcast, then PushFile or FetchFile).
    data = os.urandom(300_000)
    (a.path / "over-tls.bin").write_bytes(data)
    wait_for(lambda: (b.path / "over-tls.bin").exists(), "the file on b")
    assert (b.path / "over-tls.bin").read_bytes() == data
    peers_a = {p["address"]: p for p in a.status()["peers"]["peers"]}
    assert not peers_a[f"127.0.0.1:{dead}"]["alive"]

    ca_pem = ca[2]
    cert_a, key_a = files["a.crt"].read_bytes(), files["a.key"].read_bytes()

    def health(channel: grpc.Channel, md: Any = None) -> tuple[grpc.StatusCode, Any]:
        md = md or bearer(token)
        with channel:
            code, details, reply = rpc(lambda: pb_grpc.PeerStub(channel).Health(
                pb.HealthRequest(from_node="test"), timeout=5, metadata=md))
        return code, reply or details

    target = f"127.0.0.1:{port_a}"
    code, reply = health(grpc.secure_channel(target, grpc.ssl_channel_credentials(
        ca_pem, private_key=key_a, certificate_chain=cert_a)))
    assert code == Code.OK and reply.node_id == "node-a", reply
    # TLS does not replace the token.
    code, _ = health(grpc.secure_channel(target, grpc.ssl_channel_credentials(
        ca_pem, private_key=key_a, certificate_chain=cert_a)), bearer("x" * len(token)))
    assert code == Code.UNAUTHENTICATED
    refused = {
        "plaintext": grpc.insecure_channel(target),
        "no client certificate": grpc.secure_channel(
            target, grpc.ssl_channel_credentials(ca_pem)),
        "a client certificate from another CA": grpc.secure_channel(
            target, grpc.ssl_channel_credentials(
                ca_pem, private_key=files["stranger.key"].read_bytes(),
                certificate_chain=files["stranger.crt"].read_bytes())),
        "a server it does not trust": grpc.secure_channel(
            target, grpc.ssl_channel_credentials(
                other_ca[2], private_key=key_a, certificate_chain=cert_a)),
    }
    for how, channel in refused.items():
        code, details = health(channel)
        assert code == Code.UNAVAILABLE, f"{how}: {code.name} ({details})"
