"""Many membership-and-index hosts in one process, in virtual time, over a
lossy in-process network: what the scale tests and bench/scale.py run.

Each SimHost runs mtcfs's own cores: mtcfs.peer.swim (membership) and
mtcfs.peer.grouped over mtcfs.peer.fanout (index dissemination: a group's
leader carries its batches down one tree), with replica partners from
mtcfs.peer.placement. Only the transport and the clock are the simulation's:
`Net` delivers each message after a random latency (reordering follows),
drops some (loss), and none across a partition or to a host that is down;
`Loop` is a discrete-event loop whose clock jumps to the next event.

What a host does with a batch is its store's: `IndexStore` is the real
replicated index (mtcfs.peer.index over a Namespace and a MetaStore),
`CompactStore` keeps only which batches the host applied, in a `Ledger` the
compact hosts share (each batch's entries once, a bit per host and batch);
its index (id -> newest entry, last writer wins as the index does) is merged
from them when asked for. So thousands of hosts fit in memory: the ledger
grows with batches x N/8 bytes, not with each host's copy of the whole index
(N^2 x files).

CPU: each host's handler calls (the cores, encoding for the byte count, the
store's apply) are timed with the thread's CPU clock; bytes are those of
the protobuf messages (mtcfs.peer.wire).
"""

from __future__ import annotations

import heapq
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from mtcfs.core.checksums import BLOCK
from mtcfs.core.namespace import Namespace
from mtcfs.core.store import MetaStore
from mtcfs.peer import fanout, grouped, placement, swim, wire
from mtcfs.peer.index import ReplicatedIndex
from mtcfs.peer.v1 import peer_pb2 as pb


class Loop:
    """Virtual time: callbacks run in time order; the clock jumps between them."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._n = 0

    def at(self, t: float, fn: Callable[..., None], *args: object) -> None:
        self._n += 1
        heapq.heappush(self._heap, (t, self._n, fn, args))

    def after(self, dt: float, fn: Callable[..., None], *args: object) -> None:
        self.at(self.now + dt, fn, *args)

    def run_until(self, t: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= t:
            when, _, fn, args = heapq.heappop(heap)
            self.now = when
            fn(*args)
        self.now = max(self.now, t)

    def run_until_true(self, cond: Callable[[], bool], limit: float,
                       step: float = 0.01) -> float | None:
        """Run until cond() holds (checked every `step`); the time then, or None."""
        end = self.now + limit
        while self.now < end:
            if cond():
                return self.now
            self.run_until(self.now + step)
        return self.now if cond() else None


class Store(Protocol):
    def apply(self, origin: str, seq: int, batch: pb.ChangeBatch) -> None: ...

    def apply_bundle(self, bundle: grouped.Bundle,
                     parts: Sequence[grouped.Part]) -> None: ...

    def digest(self) -> dict[str, tuple[int, str]]: ...

    def snapshot(self) -> list[pb.Entry]: ...


class Ledger:
    """The batches a simulation's hosts applied: each batch's entries once and, per
    batch, one bit per host that applied it. A batch is one writer's, by (origin,
    seq), or a bundle of several writers' (mtcfs.peer.grouped) as a whole: one
    mark per host for the bundle, not one per writer's batch in it."""

    def __init__(self) -> None:
        self.entries: dict[object, list[pb.Entry]] = {}
        self.applied: dict[object, bytearray] = {}
        self.slots: dict[str, int] = {}
        # Each writer's batch -> the bundles that carry it (usually one; a second
        # when it also went down its writer's own tree).
        self.bundles_of: dict[tuple[str, int], list[grouped.Bundle]] = {}
        # Bundles with a batch that another bundle carries too: a host applies those
        # batches one by one (it may have had them from the other).
        self.shared: dict[grouped.Bundle, set[tuple[str, int]]] = {}
        self.registered: set[grouped.Bundle] = set()

    def slot(self, node: str) -> int:
        return self.slots.setdefault(node, len(self.slots))

    def register(self, bundle: grouped.Bundle) -> None:
        """A bundle seen for the first time (a bundle of one is marked by its batch's
        key, not as a bundle)."""
        if bundle in self.registered:
            return
        self.registered.add(bundle)
        if len(bundle.parts) > 1:
            self.entries[bundle] = [e for p in bundle.parts for e in p.payload.entries]
        for p in bundle.parts:
            key = (p.origin, p.seq)
            others = self.bundles_of.setdefault(key, [])
            for other in others:
                self.shared.setdefault(other, set()).add(key)
                self.shared.setdefault(bundle, set()).add(key)
            others.append(bundle)

    def mark(self, slot: int, key: object, entries: Iterable[pb.Entry] | None = None) -> None:
        if entries is not None and not self.entries.get(key):
            self.entries[key] = list(entries)
        bits = self.applied.get(key)
        if bits is None:
            bits = self.applied[key] = bytearray(max(64, len(self.slots) + 7) // 8)
        if slot // 8 >= len(bits):
            bits.extend(bytes(slot // 8 + 1 - len(bits)))
        bits[slot // 8] |= 1 << (slot % 8)

    def _has(self, slot: int, key: object) -> bool:
        bits = self.applied.get(key)
        return bits is not None and slot // 8 < len(bits) and bool(bits[slot // 8]
                                                                  & (1 << (slot % 8)))

    def has(self, slot: int, key: tuple[str, int]) -> bool:
        """Whether the host of `slot` applied writer's batch `key` (alone or in a bundle)."""
        return self._has(slot, key) or any(self._has(slot, b)
                                           for b in self.bundles_of.get(key, ()))

    def keys_of(self, slot: int) -> list[object]:
        return [k for k in self.applied if self._has(slot, k)]


class BatchSet:
    """The writers' batches one host applied (`(origin, seq) in host.batches`), kept in
    the ledger."""

    def __init__(self, ledger: Ledger, node: str) -> None:
        self.ledger = ledger
        self.slot = ledger.slot(node)

    def add(self, key: object) -> None:
        self.ledger.mark(self.slot, key)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and self.ledger.has(self.slot, key)


class CompactStore:
    """An index reduced to the batches applied (in the shared ledger) and what came
    otherwise (a reconciliation's snapshot); merged id -> newest entry, last writer
    wins, when asked for. The entries are the sender's (no copy per host)."""

    def __init__(self, ledger: Ledger | None = None, node: str = "") -> None:
        self.ledger = ledger if ledger is not None else Ledger()
        self.slot = self.ledger.slot(node)
        self.loose: dict[str, pb.Entry] = {}  # from snapshots, not batches

    def apply(self, origin: str, seq: int, batch: pb.ChangeBatch) -> None:
        if origin and seq:
            self.ledger.mark(self.slot, (origin, seq), batch.entries)
        else:
            self.merge(batch.entries)

    def apply_bundle(self, bundle: grouped.Bundle,
                     parts: Sequence[grouped.Part]) -> None:
        """A bundle whose batches (`parts` of them: those this host lacked) are all
        applied here now."""
        self.ledger.mark(self.slot, bundle)

    def merge(self, entries: Iterable[pb.Entry]) -> None:
        _merge_into(self.loose, entries)

    @property
    def entries(self) -> dict[str, pb.Entry]:
        out = dict(self.loose)
        for key in self.ledger.keys_of(self.slot):
            _merge_into(out, self.ledger.entries.get(key, ()))
        return out

    def digest(self) -> dict[str, tuple[int, str]]:
        return {g: (e.lamport, e.writer) for g, e in self.entries.items()}

    def snapshot(self) -> list[pb.Entry]:
        return list(self.entries.values())


def _merge_into(have: dict[str, pb.Entry], entries: Iterable[pb.Entry]) -> None:
    for e in entries:
        old = have.get(e.id)
        if old is None or (e.lamport, e.writer) > (old.lamport, old.writer):
            have[e.id] = e


class IndexStore:
    """The real replicated index of one host (its metadata store in a temp dir)."""

    def __init__(self, node_id: str, root: str,
                 now: Callable[[], float] | None = None) -> None:
        os.makedirs(root, exist_ok=True)
        self.meta = MetaStore(os.path.join(root, "meta.db"))
        self.index = ReplicatedIndex(Namespace(self.meta), node_id, now=now)

    def apply(self, origin: str, seq: int, batch: pb.ChangeBatch) -> None:
        self.index.apply(list(batch.entries))

    def apply_bundle(self, bundle: grouped.Bundle,
                     parts: Sequence[grouped.Part]) -> None:
        self.index.apply([e for p in parts for e in p.payload.entries])

    def snapshot(self) -> list[pb.Entry]:
        return list(self.index.snapshot())

    def digest(self) -> dict[str, tuple[int, str]]:
        out = {n.guid: (n.lamport, n.writer) for n in self.index.ns.inodes.values()
               if self.index.visible(n)}
        for g, (lam, w, _) in self.index.tombstones.items():
            out[g] = (lam, w)
        return out

    def close(self) -> None:
        self.meta.close()


@dataclass
class Traffic:
    messages: int = 0
    bytes: int = 0


@dataclass
class SimHost:
    """One host: SWIM membership and tree dissemination, as a daemon would run them."""

    node: str
    net: Net
    store: Store
    members: Iterable[str]
    ring: list[str]
    replicas: int = 1
    config: swim.SwimConfig | None = None
    fanout_degree: int = fanout.FANOUT
    group: int = 0  # hosts per dissemination group (grouped.group_size; 0: its choice)
    group_turn: float = 0.0  # seconds each host of a group leads (0: the first, always)
    cpu: float = 0.0  # thread CPU seconds in this host's code
    sent: Traffic = field(default_factory=Traffic)
    received: Traffic = field(default_factory=Traffic)
    marked_dead: dict[str, float] = field(default_factory=dict)
    marked_alive: dict[str, float] = field(default_factory=dict)
    batches: BatchSet = field(init=False)
    revivals: int = 0  # times this host learnt it had been declared dead
    snapshot_entries: int = 0  # entries pulled by reconciliation snapshots
    # Called with the writers' batches applied here (a bundle's: `parts` is
    # `bundle.parts` itself unless some were left out; bundle None: one at a time).
    on_batch: Callable[[SimHost, Sequence[grouped.Part], grouped.Bundle | None],
                       None] | None = None

    def __post_init__(self) -> None:
        loop = self.net.loop
        self.batches = BatchSet(self.net.ledger, self.node)
        self.swim = swim.Swim(self.node, self.members, self, self.net.rng, self.config,
                              partners=self._partners, now=loop.now)
        self.tree = grouped.GroupedFanout(self.node, self.swim.live, self._deliver,
                                          group=self.group, fanout=self.fanout_degree,
                                          turn=grouped.wall_turn(self.group_turn,
                                                                 lambda: loop.now))
        self._out: list[tuple[str, object]] = []
        self._flush_at: float | None = None  # when a leader's gathered batches leave
        self._ring_at = self.ring.index(self.node)
        self.up = True
        loop.after(self.net.rng.random() * swim.TICK, self._tick)

    def _partners(self) -> list[str]:
        return placement.partners(self.ring, self.node, self.replicas, self.swim.is_live,
                                  self._ring_at)

    # -- membership events (SwimListener) -----------------------------------------------

    def member_alive(self, node: str) -> None:
        self.marked_alive[node] = self.net.loop.now
        self.marked_dead.pop(node, None)
        self._out += self.tree.alive(node, self.net.loop.now)

    def member_dead(self, node: str) -> None:
        self.marked_dead[node] = self.net.loop.now
        self._out += self.tree.dead(node, self.net.loop.now)

    def member_restarted(self, node: str) -> None:
        self._out += self.tree.restarted(node, self.net.loop.now)

    def declared_dead(self) -> None:
        """Reconcile with one live host, as the daemon's catch-up does: pull its
        snapshot, and send it (and everyone) what this host wrote (one batch)."""
        self.revivals += 1
        self.net.loop.after(0.01, self._reconcile)

    def _reconcile(self) -> None:
        if not self.up:
            return
        same_kind = [n for n in self.swim.live() if n in self.net.hosts
                     and type(self.net.hosts[n].store) is type(self.store)
                     and self.net.hosts[n].up]
        if not same_kind:
            # Cut off alone, it holds every other host dead: once one is back, pull.
            self.net.loop.after(0.5, self._reconcile)
            return
        source = self.net.hosts[self.net.rng.choice(same_kind)]
        t0 = time.thread_time()
        snap = source.store.snapshot()
        self.store.apply("", 0, pb.ChangeBatch(entries=snap))
        self.snapshot_entries += len(snap)
        mine = [e for e in self.store.snapshot() if e.writer == self.node]
        self.cpu += time.thread_time() - t0
        if mine:
            self.publish(pb.ChangeBatch(from_node=self.node, entries=mine))

    def _deliver(self, parts: Sequence[grouped.Part], bundle: grouped.Bundle | None) -> None:
        if bundle is not None:
            self.net.ledger.register(bundle)
        if bundle is None or len(bundle.parts) == 1:
            fresh: Sequence[grouped.Part] = [
                p for p in parts if (p.origin, p.seq) not in self.batches]
            for p in fresh:  # (one may have come down two trees: its leader's, its own)
                assert isinstance(p.payload, pb.ChangeBatch)
                self._applied(p.origin, p.seq, p.payload)
            bundle = None
        else:
            # A bundle as a whole: one mark in the ledger; its batches one by one only
            # where another bundle carries some of them too.
            ledger = self.net.ledger
            shared = ledger.shared.get(bundle)
            fresh = parts
            if shared:
                fresh = [p for p in parts if (p.origin, p.seq) not in shared
                         or (p.origin, p.seq) not in self.batches]
            self.store.apply_bundle(bundle, fresh)
            if not (isinstance(self.store, CompactStore) and self.store.ledger is ledger):
                self.batches.add(bundle)
        if self.on_batch is not None and fresh:
            self.on_batch(self, fresh, bundle)

    def _applied(self, origin: str, seq: int, batch: pb.ChangeBatch) -> None:
        self.store.apply(origin, seq, batch)
        if not (isinstance(self.store, CompactStore) and self.store.ledger is self.net.ledger):
            self.batches.add((origin, seq))  # (a compact store's apply marked it)

    # -- driving ------------------------------------------------------------------------

    def _clock(self) -> float:
        """The thread's CPU clock while the harness measures CPU (Net.timing): two
        reads per handler call cost the simulation 5 % when nobody looks."""
        return time.thread_time() if self.net.timing else 0.0

    def _tick(self) -> None:
        if not self.up:
            return
        now = self.net.loop.now
        t0 = self._clock()
        out = self.swim.tick(now) + self.tree.tick(now)
        self._send(out, t0)
        self.net.loop.after(swim.TICK, self._tick)

    def receive(self, src: str, msg: object) -> None:
        if not self.up:
            return
        now = self.net.loop.now
        t0 = self._clock()
        if isinstance(msg, swim.Message):
            out: list = self.swim.on_message(src, msg, now)
        else:
            out = self.tree.on_message(src, msg, now)  # type: ignore[arg-type]
        self._send(out, t0)

    def publish(self, batch: pb.ChangeBatch) -> int:
        t0 = self._clock()
        seq, out = self.tree.publish(batch, batch.ByteSize(), self.net.loop.now,
                                     urgent=batch.waited)
        self._applied(self.node, seq, batch)
        self._send(out, t0)
        return seq

    def join(self, seed: str) -> None:
        t0 = self._clock()
        self._send(self.swim.join(seed), t0)

    def _flush(self) -> None:
        self._flush_at = None
        at = self.tree.flush_at
        if not self.up or at is None:
            return
        if at > self.net.loop.now:
            self._send([], self._clock())  # (schedules it again)
            return
        t0 = self._clock()
        self._send(self.tree.flush(self.net.loop.now), t0)

    def _send(self, out: list, t0: float) -> None:
        out += self._out
        self._out = []
        at = self.tree.flush_at
        if at is not None and self._flush_at is None:
            self._flush_at = at
            self.net.loop.at(at, self._flush)
        sized = []
        sent = self.sent
        for dst, msg in out:
            if isinstance(msg, swim.Message):
                n = wire.gossip_to_pb(self.node, msg).ByteSize()
            else:
                n = wire.tree_size(self.node, msg)
            sized.append((dst, msg, n))
            sent.messages += 1
            sent.bytes += n
        if self.net.timing:
            self.cpu += time.thread_time() - t0
        send = self.net.send
        for dst, msg, n in sized:
            send(self.node, dst, msg, n)


class Net:
    """The in-process network: latency, loss, partitions, hosts down."""

    def __init__(self, loop: Loop, rng: random.Random,
                 latency: tuple[float, float] = (0.0002, 0.002), loss: float = 0.0) -> None:
        self.loop = loop
        self.rng = rng
        self.latency = latency
        self.loss = loss
        self.hosts: dict[str, SimHost] = {}
        self.ledger = Ledger()  # the batches each host applied
        self.side: dict[str, int] = {}  # partition side of a host (0 unless partitioned)
        self.timing = True  # hosts time their handlers (host.cpu); off: not counted

    def send(self, src: str, dst: str, msg: object, nbytes: int) -> None:
        rand = self.rng.random
        if self.loss and rand() < self.loss:
            return
        if self.side and self.side.get(src, 0) != self.side.get(dst, 0):
            return
        lo, hi = self.latency
        loop = self.loop
        loop.at(loop.now + lo + (hi - lo) * rand(), self._deliver, src, dst, msg, nbytes)

    def _deliver(self, src: str, dst: str, msg: object, nbytes: int) -> None:
        h = self.hosts.get(dst)
        if h is None or not h.up:
            return
        h.received.messages += 1
        h.received.bytes += nbytes
        h.receive(src, msg)

    def partition(self, minority: Iterable[str]) -> None:
        for n in minority:
            self.side[n] = 1

    def heal(self) -> None:
        self.side.clear()

    def kill(self, node: str) -> None:
        self.hosts[node].up = False


def node_ids(n: int) -> list[str]:
    return [f"h{i:04d}" for i in range(n)]


def cluster(n: int, *, seed: int = 0, loss: float = 0.0, real_index: Iterable[str] = (),
            root: str | None = None, config: swim.SwimConfig | None = None,
            replicas: int = 1, fanout_degree: int = fanout.FANOUT, group: int = 0,
            group_turn: float = 0.0) -> Net:
    """n hosts, all alive, each knowing every other (as from --peers); the hosts of
    `real_index` run the real replicated index (under `root`), the rest a CompactStore;
    `group_turn`: --peer-group-turn, on the simulated clock."""
    loop = Loop()
    net = Net(loop, random.Random(seed), loss=loss)
    ids = node_ids(n)
    ring = placement.ring([(i, "") for i in ids])
    real = set(real_index)
    if real and root is None:  # (the caller removes it; tests pass a temporary one)
        root = tempfile.mkdtemp(prefix="mtcfs-sim-")
    for i in ids:
        store: Store = (IndexStore(i, os.path.join(root or "", i)) if i in real
                        else CompactStore(net.ledger, i))
        net.hosts[i] = SimHost(i, net, store, ids, ring, replicas=replicas, config=config,
                               fanout_degree=fanout_degree, group=group,
                               group_turn=group_turn)
    return net


def add_host(net: Net, node: str, *, store: Store | None = None) -> SimHost:
    """A (replacement) host that knows no one yet: it joins through a seed."""
    ring = next(iter(net.hosts.values())).ring
    if node not in ring:
        ring = placement.ring([(i, "") for i in [*ring, node]])
    h = SimHost(node, net, store or CompactStore(net.ledger, node), (), ring)
    net.hosts[node] = h
    return h


def entry(guid: str, parent: str, name: str, lamport: int, writer: str,
          is_dir: bool = False, size: int = 0) -> pb.Entry:
    """An index entry as ReplicatedIndex.entry_of makes one (a sealed file or a dir):
    a file carries a crc32c per 4 MiB block of its size, as a sealed one does."""
    mode = (0o40755 if is_dir else 0o100644)
    e = pb.Entry(id=guid, parent=parent, name=name.encode(), mode=mode, size=size,
                 lamport=lamport, writer=writer, author=writer, mtime_ns=lamport,
                 ctime_ns=lamport)
    if not is_dir:
        e.version, e.has_crc, e.crc32c = 1, True, 0x1234ABCD
        e.holders.append(writer)
        blocks = -(-size // BLOCK)
        if blocks:
            e.block_crcs = (guid.encode() * (4 * blocks // max(1, len(guid)) + 1))[:4 * blocks]
    return e
