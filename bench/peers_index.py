"""Index-only peer nodes for the index-scale benchmark (bench/peers.py): many
`PeerTier`s without FUSE in one process, driven over stdin/stdout.

    .venv/bin/python bench/peers_index.py     (started by bench/peers.py)

The first line on stdin is the configuration (JSON):

    {"root": DIR, "secret": TOKEN, "membership": {NAME: VALUE, ...},
     "mine": [[node_id, port], ...], "all": [[node_id, port], ...]}

Each node of "mine" gets what a daemon has, minus FUSE: a MetaStore file and a
RamTier under DIR/<node_id> (DIR on /dev/shm, as a RAM dir), a Namespace, and a
PeerTier listening on 127.0.0.1:<port> with every other node of "all" as its
peers (replicas 0: the index only), started with `await tier.start(nursery)`:
its gRPC server, health loop and broadcast loop run as in a daemon.
The module constants of mtcfs.peer.membership named in "membership" (e.g.
HEALTH_INTERVAL, RETRY_INTERVAL) are set first: the bench slows the health
loops of the process that hosts dozens of nodes.

Then one request per line, one JSON reply per line ("ready" first):

- {"op": "go", "dirs": D, "files": F, "tag": T, "mode": "burst"|"trickle"}
  on the writer (the first node of "mine"): D new directories with F closed
  files each, each one made with ns.new_inode and announced with
  tier.index.changed(), as the filesystem does at mkdir and seal. "burst":
  all in one go (one batch per peer); "trickle": the event loop runs between
  two changes, as between two FUSE requests. Reply: {"t0": monotonic start}.
- {"op": "expect", "entries": E}: reply once every node here holds E entries
  (checked after each batch a node applies): {"first"/"last": monotonic time
  the first/last node got there, "cpu"/"seconds": CPU/wall seconds of this
  process since the request,
  "batches": batches received}.
- {"op": "stats"}: on the writer, once its broadcast queues are empty: CPU
  seconds since "go", batches and entries sent, bytes of the ChangeBatch
  messages sent.
- {"op": "idle", "seconds": S, "membership": {...}, "settle": W}: set those
  constants (a health loop asleep picks them up when it wakes), wait W
  seconds, then CPU seconds of this process per second over S, Health RPCs
  its nodes answered per second, and the constants now in effect.
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

from mtcfs.fs.namespace import CLOSED, ROOT, Namespace
from mtcfs.meta.store import MetaStore
from mtcfs.peer import membership
from mtcfs.peer.tier import PeerTier
from mtcfs.tiers.ram import RamTier


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Node:
    def __init__(self, root: str, node_id: str, port: int, peers: list[str], secret: bytes):
        d = os.path.join(root, node_id)
        os.makedirs(d, exist_ok=True)
        self.store = MetaStore(os.path.join(d, "meta.db"))
        self.ns = Namespace(self.store)
        self.ram = RamTier(d, 1 << 30)
        self.tier = PeerTier(
            self.ns, self.ram, node_id, f"127.0.0.1:{port}", peers, None, 0, secret, None
        )
        self.target = 0
        self.reached: float | None = None
        self.sent: list[Any] = []  # the ChangeBatch messages sent (sized after the run)
        on_batch = self.tier.on_batch

        def counted(batch: Any) -> int:
            n = on_batch(batch)
            if self.reached is None and self.entries() >= self.target:
                self.reached = time.monotonic()
                self.done.set()
            return n

        self.tier.on_batch = counted  # type: ignore[method-assign]
        self.done = trio.Event()
        self.health_served = 0  # Health RPCs this node answered
        health_reply = self.tier.health_reply

        def answered() -> Any:
            self.health_served += 1
            return health_reply()

        self.tier.health_reply = answered  # type: ignore[method-assign]

    def entries(self) -> int:
        return len(self.ns.inodes) - 1  # the root is no entry

    def count_sends(self) -> None:
        """Keep each Broadcast request, to size it after the timed part."""
        for p in self.tier.members.peers.values():
            call = p.stub.Broadcast

            def wrapped(msg: Any, _call: Any = call, **kw: Any) -> Any:
                self.sent.append(msg)
                return _call(msg, **kw)

            p.stub.Broadcast = wrapped

    def close(self) -> None:
        self.tier.stop()
        self.ram.close()
        self.store.close()


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
            fnode.state, fnode.version, fnode.size = CLOSED, 1, 1 << 20
            fnode.crc32c, fnode.block_crcs = 0x12345678, b"\x78\x56\x34\x12"
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
    secret = str(cfg["secret"]).encode()
    addrs = [f"127.0.0.1:{port}" for _, port in cfg["all"]]
    nodes: list[Node] = []
    try:
        async with trio.open_nursery() as nursery:
            for node_id, port in cfg["mine"]:
                me = f"127.0.0.1:{port}"
                nodes.append(
                    Node(cfg["root"], node_id, port, [a for a in addrs if a != me], secret)
                )
            t0 = time.monotonic()
            for n in nodes:
                await n.tier.start(nursery)
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
            while True:
                line = await _readline()
                if not line:
                    break
                req = json.loads(line)
                op = req["op"]
                if op == "go":
                    cpu0 = time.process_time()
                    writer.sent.clear()
                    s0 = (writer.tier.broadcaster.stats.batches_sent,
                          writer.tier.broadcaster.stats.entries_sent)
                    t = time.monotonic()
                    await _make(writer, req)
                    _reply({"t0": t, "made_s": time.monotonic() - t})
                elif op == "stats":
                    while writer.tier.broadcaster.pending():
                        await trio.sleep(0.001)
                    cpu = time.process_time() - cpu0
                    st = writer.tier.broadcaster.stats
                    _reply(
                        {
                            "cpu": cpu,
                            "batches": st.batches_sent - s0[0],
                            "entries": st.entries_sent - s0[1],
                            "bytes": sum(m.ByteSize() for m in writer.sent),
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
                    _set_membership(req.get("membership") or {})
                    await trio.sleep(float(req.get("settle", 1.5)))
                    c = time.process_time()
                    h = sum(n.health_served for n in nodes)
                    await trio.sleep(float(req["seconds"]))
                    _reply(
                        {
                            "cpu_per_s": (time.process_time() - c) / float(req["seconds"]),
                            "health_served_per_s": (sum(n.health_served for n in nodes) - h)
                            / float(req["seconds"]),
                            "membership": _membership_constants(),
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
    trio.run(_serve, cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
