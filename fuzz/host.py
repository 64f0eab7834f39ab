"""One in-process daemon for the fuzz targets: a mount's parts built by
mtcfs.assembly as the daemon builds them (as tests/nofuse does), its trio loop in
a thread of its own, its gRPC server, data channel and membership datagrams
listening on loopback with a token. The targets send it what a peer can send and
check, in its trio thread, that the index stayed whole.

Its namespace starts with files of known ids (SEED_FILES), pushed to it through
its own PushFile call, so that seeds can name them (fetches, chunks, updates)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sqlite3
import struct
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import google_crc32c
import grpc
import trio

from mtcfs.assembly import Mount, build, open_ram
from mtcfs.config import build_options
from mtcfs.core.checksums import BLOCK
from mtcfs.core.namespace import ROOT, ROOT_GUID, Namespace
from mtcfs.core.store import MetaStore
from mtcfs.fs.kernel import KernelCache
from mtcfs.fs.passthrough import Passthrough
from mtcfs.peer import bulk, swim
from mtcfs.peer.v1 import peer_pb2 as pb

TOKEN = b"fuzz-token-0123456789abcdef"
NODE_ID = "fuzzhost"
PEER_NODE = "peer1"
SEED_DIR = "d0000000000000000000000000000001"
SEED_FILES = {  # id -> (name, content)
    "f0000000000000000000000000000001": (b"small", b"hello, peers\n" * 3),
    "f0000000000000000000000000000002": (b"bytes", bytes(range(256)) * 64),
}
START_LAMPORT = 10


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A free port of 5 digits (the seeds' placeholder addresses have that length)."""
    while True:
        with socket.socket(socket.AF_INET, kind) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 10000:
            return port


def seed_entries() -> list[pb.Entry]:
    """The seed namespace as a peer announces it: a directory and its files."""
    out = [pb.Entry(id=SEED_DIR, parent=ROOT_GUID, name=b"step_1", mode=0o40755,
                    lamport=START_LAMPORT, writer=PEER_NODE, mtime_ns=1, ctime_ns=1)]
    for guid, (name, data) in SEED_FILES.items():
        out.append(file_entry(guid, name, data))
    return out


def file_entry(guid: str, name: bytes, data: bytes, block: int = BLOCK) -> pb.Entry:
    return pb.Entry(id=guid, parent=SEED_DIR, name=name, mode=0o100644, size=len(data),
                    has_crc=True, crc32c=google_crc32c.value(data), version=1,
                    block_crcs=crcs_of(data, block), lamport=START_LAMPORT + 1,
                    writer=PEER_NODE, author=PEER_NODE, holders=[PEER_NODE],
                    mtime_ns=2, ctime_ns=2)


def crcs_of(data: bytes, block: int = BLOCK) -> bytes:
    """The packed crc32c of each block (as Entry.block_crcs carries them)."""
    return b"".join(struct.pack("<I", google_crc32c.value(data[o:o + block]))
                    for o in range(0, len(data), block))


class Host:
    """The daemon under test. `call(fn, *args)` runs fn in its trio thread."""

    def __init__(self, encrypt: bool = False) -> None:
        self.encrypt = encrypt  # --peer-encryption: the data channel's frames encrypted
        self.tmp = tempfile.mkdtemp(prefix="mtcfs-fuzz-")
        self.port = free_port()
        self.listen = f"127.0.0.1:{self.port}"
        # A configured peer that never runs: datagrams "from" it reach SWIM's logic.
        self.peer = f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}"
        self.mount: Mount | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        self._cancel: trio.CancelScope | None = None
        self._ready = threading.Event()
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fuzz-host", daemon=True)

    # -- the trio thread ---------------------------------------------------------------

    def start(self) -> Host:
        self._thread.start()
        self._ready.wait(60)
        if self.failure is not None or self.mount is None:
            raise RuntimeError(f"the fuzz host did not start: {self.failure!r}")
        self._seed()
        return self

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as e:  # the daemon's loop died: every target reports it
            self.failure = e
            self._ready.set()

    async def _main(self) -> None:
        token_file = os.path.join(self.tmp, "token")
        with open(token_file, "wb") as f:
            f.write(TOKEN)
        mnt = os.path.join(self.tmp, "mnt")
        os.mkdir(mnt)
        opts = build_options(mnt, {
            "ram_dir": os.path.join(self.tmp, "ram"), "ram_size": "64MiB",
            "node_id": NODE_ID, "data_path": "fuse", "listen": self.listen,
            "peers": self.peer, "token_file": token_file, "replicas": 0,
            "commit_timeout": 1, "data_listen": "127.0.0.1:0",
            "peer_encryption": self.encrypt}, None)
        store = MetaStore(os.path.join(opts.ram_dir, "meta.db"))
        kernel = KernelCache(lambda parent, name: None, lambda ino: None)  # no kernel
        self.mount = build(opts, store, open_ram(opts, own_tmpfs=False), kernel,
                           Passthrough.unused())
        async with trio.open_nursery() as nursery:
            self._cancel = nursery.cancel_scope
            await self.mount.start_peers(nursery)
            self.mount.run_background(nursery)
            self.token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await trio.sleep_forever()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if not self._thread.is_alive():
            raise RuntimeError(f"the daemon's trio loop died: {self.failure!r}")
        return trio.from_thread.run_sync(fn, *args, trio_token=self.token)

    def stop(self) -> None:
        if self._cancel is not None and self._thread.is_alive():
            trio.from_thread.run_sync(self._cancel.cancel, trio_token=self.token)
            self._thread.join(10)
        if self.mount is not None:
            self.mount.stop()
            self.mount.close()
        shutil.rmtree(self.tmp, ignore_errors=True)  # its RAM dir, token, store copies

    # -- parts -------------------------------------------------------------------------

    @property
    def tier(self) -> Any:
        assert self.mount is not None and self.mount.peers is not None
        return self.mount.peers

    @property
    def data_port(self) -> int:
        return self.tier.data_port

    def metadata(self, token: bytes | None = TOKEN) -> tuple[tuple[str, str], ...]:
        return (("authorization", "Bearer " + token.decode("latin-1")),) if token else ()

    def _seed(self) -> None:
        """The seed directory and files, their bytes pushed as a peer pushes a replica."""
        with grpc.insecure_channel(self.listen) as ch:
            md = self.metadata()
            batch = pb.ChangeBatch(from_node=PEER_NODE, lamport=START_LAMPORT,
                                   entries=seed_entries()[:1])
            ch.unary_unary("/mtcfs.peer.v1.Peer/Broadcast")(batch.SerializeToString(),
                                                           metadata=md, timeout=10)
            for e in seed_entries()[1:]:
                _, data = SEED_FILES[e.id]
                if self.encrypt:  # file bytes over the data channel only
                    self._push_bulk(e, data)
                    continue
                chunks = [pb.PushChunk(header=pb.PushHeader(entry=e), offset=0, data=data)]
                reply = pb.PushReply.FromString(ch.stream_unary("/mtcfs.peer.v1.Peer/PushFile")(
                    iter([c.SerializeToString() for c in chunks]), metadata=md, timeout=10))
                assert reply.stored, f"seed file {e.id} not stored"

    def _push_bulk(self, e: pb.Entry, data: bytes) -> None:
        path = os.path.join(self.tmp, e.id)
        with open(path, "wb") as f:
            f.write(data)
        pool = bulk.BulkPool(bulk.Keys(TOKEN, encrypt=True), None, 1)
        fd = os.open(path, os.O_RDONLY)
        try:
            code, details, stored = pool.push(("127.0.0.1", self.data_port), fd, e,
                                              "step_1/seed", lambda: None)
        finally:
            os.close(fd)
            pool.close()
        assert stored, f"seed file {e.id} not stored: {code} {details}"

    # -- what must hold after any input ----------------------------------------------

    def digest(self) -> int:
        """The index's state (entries, names, tombstones, waiting entries), in the
        trio thread: a refused input must leave it as it was."""
        return self.call(self._digest)

    def _digest(self) -> int:
        ns, index = self.tier.index.ns, self.tier.index
        nodes = tuple(sorted(
            (n.ino, n.guid, n.parent, n.name, n.mode, n.uid, n.gid, n.size, n.version,
             n.lamport, n.writer, n.crc32c, n.linked, tuple(n.links), tuple(n.holders),
             n.persisted_version, n.block_crcs, n.target) for n in ns.inodes.values()))
        pending = sum(len(v) for v in index.pending.values())
        return hash((nodes, tuple(sorted(index.tombstones.items())), pending,
                     tuple(sorted(index.ids.aliases.items()))))

    def check_index(self) -> None:
        """The namespace is a tree whose names and ids agree (AssertionError if not)."""
        self.call(self._check_index)

    def _check_index(self) -> None:
        ns = self.tier.index.ns
        inodes = ns.inodes
        for ino, n in inodes.items():
            if n.children is not None:
                for name, child in n.children.items():
                    c = inodes.get(child)
                    assert c is not None, f"{ino}/{name!r} names a missing inode {child}"
                    assert (ino, name) in c.names(), f"{ino}/{name!r} -> {child}: not its name"
            if ino == ROOT or not n.linked:
                continue
            assert ns.by_guid.get(n.guid) == ino, f"id {n.guid} does not map to {ino}"
            for p, name in n.names():
                d = inodes.get(p)
                assert d is not None and d.children is not None, f"{ino}: parent {p} gone"
                assert d.children.get(name) == ino, f"{ino}: not in {p} as {name!r}"
            up, steps = n, 0
            while up.ino != ROOT:  # every node reaches the root: no cycle
                up = inodes[up.parent]
                steps += 1
                assert steps <= len(inodes), f"{ino}: its parents make a cycle"

    def check_store(self) -> None:
        """What a restarted daemon would load (a copy of the metadata store) is the
        namespace in memory: every name, id, size and version (AssertionError if not)."""
        self.call(self._check_store)

    def _check_store(self) -> None:
        ns = self.tier.index.ns
        copy = os.path.join(self.tmp, "meta-copy.db")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(copy)
        dest = sqlite3.connect(copy)
        try:
            ns.store.db.backup(dest)
        finally:
            dest.close()
        store = MetaStore(copy)
        try:
            again = Namespace(store)
        finally:
            store.close()

        def view(n: Namespace) -> dict[str, tuple[object, ...]]:
            return {n.path_of(i): (i.guid, i.mode, i.size, i.version, i.crc32c, i.lamport)
                    for i in n.inodes.values() if i.linked and not (i.is_file and i.dirty)}

        here, loaded = view(ns), view(again)
        differing = [(p, here[p], loaded[p]) for p in here if p in loaded and here[p] != loaded[p]]
        assert here == loaded, (f"the store differs from memory: only in memory "
                                f"{sorted(set(here) - set(loaded))[:5]}, only stored "
                                f"{sorted(set(loaded) - set(here))[:5]}, differing "
                                f"(path, in memory, stored) {differing[:5]}")

    def check_swim(self) -> None:
        self.call(self._check_swim)

    def _check_swim(self) -> None:
        s = self.tier.members.swim
        assert s._live == sorted(n for n, m in s.members.items() if m.state != swim.DEAD)
        assert s._dead == {n for n, m in s.members.items() if m.state == swim.DEAD}
        assert s._suspects == {n for n, m in s.members.items() if m.state == swim.SUSPECT}
        assert s.me not in s.members
