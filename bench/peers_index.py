"""Index-only peer nodes for the index-scale benchmark (bench/peers.py): many
in-process mounts without FUSE in one process, driven over stdin/stdout.

    .venv/bin/python bench/peers_index.py     (started by bench/peers.py)

The first line on stdin is the configuration (JSON):

    {"root": DIR, "token_file": PATH, "membership": {NAME: VALUE, ...},
     "mine": [[node_id, port], ...], "all": [[node_id, port], ...]}

Each node of "mine" is a mount's parts as the daemon builds them
(mtcfs.assembly.build, as tests/nofuse does: no kernel, so no FUSE): a
MetaStore and a RAM tier under DIR/<node_id> (DIR on /dev/shm), and a peer
tier listening on 127.0.0.1:<port> with every other node of "all" as its
peers (replicas 0, no data channel: the index only), started as a daemon
starts it: its gRPC server, SWIM membership and dissemination tree run as in
a daemon. The module constants of mtcfs.peer.membership named in
"membership" are set first.

Then one request per line, one JSON reply per line ("ready" first):

- {"op": "go", "dirs": D, "files": F, "tag": T, "mode": "burst"|"trickle"}
  on the writer (the first node of "mine"): D new directories with F closed
  files each, each one made with ns.new_inode and announced with
  index.changed(), as the filesystem does at mkdir and seal. "burst": all in
  one go; "trickle": the event loop runs between two changes, as between two
  FUSE requests. Then the commit rule: wait_applied, as an fsync or a step's
  commit does. Reply: {"t0": monotonic start, "made_s", "commit_s": from t0
  until wait_applied returned, "late": the hosts it did not hear from}.
- {"op": "expect", "entries": E}: reply once every node here holds E entries
  (checked after each batch a node applies): {"first"/"last": monotonic time
  the first/last node got there, "cpu"/"seconds": CPU/wall seconds of this
  process since the request, "batches": batches received}.
- {"op": "stats"}: on the writer, once its batches reached every host: CPU
  seconds since "go", batches and entries published, messages and bytes of the
  tree messages it sent (forwards and acks).
- {"op": "idle", "seconds": S, "settle": W}: wait W seconds, then CPU seconds
  of this process per second over S, and the datagrams its nodes sent per second.
- {"op": "lookup", "rounds": R}: time ns.child() (one name in a directory) and
  a three-level path walk over every name here, R rounds: ns per call.
- {"op": "quit"}.

CLOCK_MONOTONIC is the same clock in every process, so the bench compares
the writer's "t0" with a receiver's "last".
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from typing import Any

import trio

from mtcfs.assembly import Mount, build, open_ram
from mtcfs.config import build_options
from mtcfs.core.namespace import ROOT
from mtcfs.core.store import MetaStore
from mtcfs.core.versions import Versions
from mtcfs.fs.kernel import KernelCache
from mtcfs.fs.passthrough import Passthrough
from mtcfs.peer import membership, wire


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Node:
    def __init__(self, root: str, node_id: str, port: int, peers: list[str],
                 token_file: str) -> None:
        d = os.path.join(root, node_id)
        mnt = os.path.join(root, f"mnt-{node_id}")
        os.makedirs(mnt, exist_ok=True)
        opts = build_options(mnt, {
            "ram_dir": d, "ram_size": "64MiB", "node_id": node_id, "data_path": "fuse",
            "listen": f"127.0.0.1:{port}", "peers": ",".join(peers),
            "token_file": token_file, "replicas": 0, "data_connections": 0,
            "commit_timeout": 30.0}, None)
        self.store = MetaStore(os.path.join(d, "meta.db"))
        kernel = KernelCache(lambda parent, name: None, lambda ino: None)  # no kernel
        self.mount: Mount = build(opts, self.store, open_ram(opts, own_tmpfs=False), kernel,
                                  Passthrough.unused())
        self.ns = self.mount.ns
        tier = self.mount.peers
        assert tier is not None
        self.tier = tier
        self.target = 0
        self.reached: float | None = None
        self.done = trio.Event()
        self.sent_messages = 0
        self.sent_bytes = 0
        # A tree (this mtcfs) or per-peer streams (before it: the A/B of docs/peers.md).
        self.tree = hasattr(tier.broadcaster, "tree")
        owner, name = (tier.broadcaster, "_deliver") if self.tree else (tier, "on_batch")
        deliver = getattr(owner, name)

        def counted(batch: Any) -> Any:
            out = deliver(batch)
            if self.reached is None and self.entries() >= self.target:
                self.reached = time.monotonic()
                self.done.set()
            return out

        setattr(owner, name, counted)

    def entries(self) -> int:
        return len(self.ns.inodes) - 1  # the root is no entry

    def count_sends(self) -> None:
        """Count the messages this node sends, and their bytes."""
        if not self.tree:
            for p in self.tier.members.peers.values():
                call = p.stub.Broadcast

                def wrapped(msg: Any, _call: Any = call, **kw: Any) -> Any:
                    self.sent_messages += 1
                    self.sent_bytes += msg.ByteSize()
                    return _call(msg, **kw)

                p.stub.Broadcast = wrapped
            return
        send = self.tier.broadcaster._send  # one tree message's gRPC call
        me = self.tier.members.me

        def counted(addr: str, msg: Any, attempt: int = 0) -> None:
            self.sent_messages += 1
            self.sent_bytes += wire.tree_size(me, msg)
            send(addr, msg, attempt)

        self.tier.broadcaster._send = counted

    def close(self) -> None:
        self.mount.stop()
        self.mount.close()


def _set_membership(values: dict[str, float]) -> None:
    for name, value in values.items():
        if hasattr(membership, name):  # a constant this mtcfs does not have: ignored
            setattr(membership, name, float(value))


def _membership_constants() -> dict[str, float]:
    return {k: v for k, v in vars(membership).items() if k.isupper() and isinstance(v, float)}


async def _readline() -> str:
    return await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)


async def _make(node: Node, req: dict[str, Any]) -> None:
    ns, index = node.ns, node.tier.index
    root = ns.inodes[ROOT]
    trickle = req.get("mode") == "trickle"
    tag = str(req["tag"])
    for d in range(int(req["dirs"])):
        dnode = ns.new_inode(root, f"{tag}-d{d:03d}".encode(), stat.S_IFDIR | 0o755, 0, 0)
        index.changed(dnode)
        if trickle:
            await trio.sleep(0)
        for f in range(int(req["files"])):
            fnode = ns.new_inode(dnode, f"f{f:04d}.distcp".encode(), stat.S_IFREG | 0o644, 0, 0)
            # A sealed version (its content made up: nobody reads it).
            Versions.adopted(fnode, 1, 1 << 20, 0x12345678, b"\x78\x56\x34\x12", fnode.author)
            fnode.holders = [node.tier.node_id]
            index.changed(fnode)
            if trickle:
                await trio.sleep(0)


def _lookup(node: Node, rounds: int) -> dict[str, float]:
    ns = node.ns
    root = ns.inodes[ROOT]
    pairs = []
    for dino in root.children.values() if root.children else []:
        d = ns.inodes[dino]
        for name in d.children or {}:
            pairs.append((d.name, name))
    if not pairs:
        return {"child_ns": 0.0, "walk_ns": 0.0, "names": 0}
    child = ns.child
    t0 = time.perf_counter()
    for _ in range(rounds):
        for _dname, _name in pairs:  # the loop's own cost, subtracted below
            pass
    base = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(rounds):
        for dname, _name in pairs:
            child(root, dname)
    one = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(rounds):
        for dname, name in pairs:
            child(child(root, dname), name)  # type: ignore[arg-type]
    two = time.perf_counter() - t0
    n = rounds * len(pairs)
    return {
        "child_ns": max(0.0, one - base) / n * 1e9,
        "walk_ns": max(0.0, two - base) / n * 1e9,
        "names": len(pairs),
    }


async def _serve(cfg: dict[str, Any]) -> None:
    _set_membership(cfg.get("membership") or {})
    addrs = [f"127.0.0.1:{port}" for _, port in cfg["all"]]
    nodes: list[Node] = []
    try:
        async with trio.open_nursery() as nursery:
            for node_id, port in cfg["mine"]:
                me = f"127.0.0.1:{port}"
                nodes.append(Node(cfg["root"], node_id, port, [a for a in addrs if a != me],
                                  cfg["token_file"]))
            t0 = time.monotonic()
            async with trio.open_nursery() as starting:  # each waits for its peers
                for n in nodes:
                    starting.start_soon(n.mount.start_peers, nursery)
            writer = nodes[0]
            writer.count_sends()
            _reply(
                {
                    "ready": True,
                    "start_s": time.monotonic() - t0,
                    "live": [len(n.tier.members.live()) for n in nodes],
                    "entries": [n.entries() for n in nodes],
                    "snapshots_pulled": sum(n.tier.stats.snapshots_pulled for n in nodes),
                    "cpu_s": time.process_time(),
                }
            )
            cpu0 = time.process_time()
            s0 = (0, 0, 0, 0)
            while True:
                line = await _readline()
                if not line:
                    break
                req = json.loads(line)
                op = req["op"]
                if op == "go":
                    cpu0 = time.process_time()
                    st = writer.tier.broadcaster.stats
                    s0 = (st.batches_sent, st.entries_sent, writer.sent_messages,
                          writer.sent_bytes)
                    t = time.monotonic()
                    await _make(writer, req)
                    made = time.monotonic() - t
                    late = await writer.tier.wait_applied("bench commit")
                    _reply({"t0": t, "made_s": made, "commit_s": time.monotonic() - t,
                            "late": late})
                elif op == "stats":
                    while not writer.tier.broadcaster.quiet():
                        await trio.sleep(0.001)
                    st = writer.tier.broadcaster.stats
                    _reply(
                        {
                            "cpu": time.process_time() - cpu0,
                            "batches": st.batches_sent - s0[0],
                            "entries": st.entries_sent - s0[1],
                            "messages": writer.sent_messages - s0[2],
                            "bytes": writer.sent_bytes - s0[3],
                        }
                    )
                elif op == "expect":
                    cpu0 = time.process_time()
                    started = time.monotonic()
                    b0 = sum(n.tier.stats.batches_received for n in nodes)
                    for n in nodes:
                        n.target = int(req["entries"])
                        n.reached = None
                        n.done = trio.Event()
                        if n.entries() >= n.target:
                            n.reached = time.monotonic()
                            n.done.set()
                    with trio.move_on_after(float(req.get("timeout", 120))):
                        for n in nodes:
                            await n.done.wait()
                    missing = [n.tier.node_id for n in nodes if n.reached is None]
                    _reply(
                        {
                            "last": max((n.reached or 0.0) for n in nodes),
                            "first": min((n.reached or 0.0) for n in nodes),
                            "cpu": time.process_time() - cpu0,
                            "seconds": time.monotonic() - started,
                            "batches": sum(n.tier.stats.batches_received for n in nodes) - b0,
                            "missing": missing,
                        }
                    )
                elif op == "idle":
                    await trio.sleep(float(req.get("settle", 1.5)))

                    def datagrams() -> int:
                        return sum(n.tier.members.endpoint.sent for n in nodes
                                   if n.tier.members.endpoint is not None)

                    c, g = time.process_time(), datagrams()
                    await trio.sleep(float(req["seconds"]))
                    _reply(
                        {
                            "cpu_per_s": (time.process_time() - c) / float(req["seconds"]),
                            "datagrams_per_s": (datagrams() - g) / float(req["seconds"]),
                        }
                    )
                elif op == "lookup":
                    _reply(_lookup(nodes[-1], int(req.get("rounds", 20))))
                elif op == "quit":
                    break
            nursery.cancel_scope.cancel()
    finally:
        for n in nodes:
            n.close()


def main() -> int:
    cfg = json.loads(sys.stdin.readline())
    profile = os.environ.get("MTCFS_INDEX_PROFILE")  # a path: cProfile of the trio thread
    if profile and len(cfg["mine"]) > 1:
        import cProfile

        cProfile.runctx("trio.run(_serve, cfg)", globals(), {"cfg": cfg, "trio": trio,
                                                            "_serve": _serve}, profile)
    else:
        trio.run(_serve, cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
