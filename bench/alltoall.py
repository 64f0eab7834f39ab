"""Today's all-to-all design in the scale harness, for comparison (bench/scale.py
--alltoall N).

A MODEL, not the daemon's code: the all-to-all health checks the daemon used
before SWIM (their constants below, as they were in mtcfs.peer.membership) and
mtcfs.peer.dissemination, restated as a sans-IO host: every peer
health-checked every HEALTH_INTERVAL (RETRY_INTERVAL while failing), a check
failing after HEALTH_TIMEOUT, DEAD_AFTER failures in a row mark it dead;
every change sent by its writer to every peer on one ordered queue per peer
(one batch in flight per peer, sent again when the call times out after
BROADCAST_TIMEOUT); a commit returns when every peer not known
dead acked everything published before it. Messages are sized as the real
ones (HealthRequest/HealthReply, ChangeBatch/BatchReply) and run over the
same simulated network (support.simnet.Net) in virtual time.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from mtcfs.peer.tier import BROADCAST_TIMEOUT
from mtcfs.peer.v1 import peer_pb2 as pb

from support import simnet

# The daemon's all-to-all health checks, as they were.
HEALTH_INTERVAL = 1.0
RETRY_INTERVAL = 0.25
HEALTH_TIMEOUT = 1.0
DEAD_AFTER = 3


@dataclass(slots=True)
class _Peer:
    failures: int = 0
    alive: bool = True
    next_check: float = 0.0
    pending: int = 0  # seq of the health check in flight (0: none)
    sent_at: float = 0.0
    queue: deque = field(default_factory=deque)  # (publish number, batch)
    in_flight: int = 0
    batch_sent_at: float = 0.0
    acked: int = 0


@dataclass(frozen=True, slots=True)
class Msg:
    kind: str  # health, reply, batch, ack
    seq: int
    batch: pb.ChangeBatch | None = None


class AllToAllHost:
    def __init__(self, node: str, peers: list[str], net: simnet.Net,
                 store: simnet.CompactStore) -> None:
        self.node, self.net, self.store = node, net, store
        now = net.loop.now
        rng = net.rng
        self.peers = {p: _Peer(next_check=now + rng.random() * HEALTH_INTERVAL)
                      for p in peers if p != node}
        self.up = True
        self.cpu = 0.0
        self.sent = simnet.Traffic()
        self.received = simnet.Traffic()
        self.marked_dead: dict[str, float] = {}
        self.batches: set[tuple[str, int]] = set()
        self.published = 0
        self._seq = 0
        net.loop.after(rng.random() * 0.05, self._tick)

    def _send(self, dst: str, msg: Msg) -> None:
        if msg.kind == "health":
            n = pb.HealthRequest(from_node=self.node, listen="10.0.0.1:7000").ByteSize()
        elif msg.kind == "reply":
            n = pb.HealthReply(node_id=self.node, ram_free=1 << 36, data_port=7467).ByteSize()
        elif msg.kind == "batch":
            assert msg.batch is not None
            n = msg.batch.ByteSize()
        else:
            n = pb.BatchReply(applied=8, lamport=msg.seq).ByteSize()
        self.sent.messages += 1
        self.sent.bytes += n
        self.net.send(self.node, dst, msg, n)

    def _tick(self) -> None:
        if not self.up:
            return
        t0 = time.thread_time()
        now = self.net.loop.now
        for name, p in self.peers.items():
            if p.pending and now >= p.sent_at + HEALTH_TIMEOUT:
                p.pending = 0
                self._failed(name, p, now)
            if p.in_flight and now >= p.batch_sent_at + BROADCAST_TIMEOUT:
                p.in_flight = 0  # the call timed out: sent again
                self._flush(name, p)
            if not p.pending and now >= p.next_check:
                self._seq += 1
                p.pending, p.sent_at = self._seq, now
                self._send(name, Msg("health", self._seq))
        self.cpu += time.thread_time() - t0
        self.net.loop.after(0.05, self._tick)

    def _failed(self, name: str, p: _Peer, now: float) -> None:
        p.failures += 1
        p.next_check = now + RETRY_INTERVAL
        if p.alive and p.failures >= DEAD_AFTER:
            p.alive = False
            self.marked_dead[name] = now

    def receive(self, src: str, msg: Msg) -> None:
        if not self.up:
            return
        t0 = time.thread_time()
        now = self.net.loop.now
        p = self.peers[src]
        if msg.kind == "health":
            self._send(src, Msg("reply", msg.seq))
        elif msg.kind == "reply" and msg.seq == p.pending:
            p.pending, p.failures = 0, 0
            p.next_check = now + HEALTH_INTERVAL
            if not p.alive:
                p.alive = True
                self.marked_dead.pop(src, None)
        elif msg.kind == "batch":
            assert msg.batch is not None
            self.store.apply(src, msg.seq, msg.batch)
            self.batches.add((src, msg.seq))
            self._send(src, Msg("ack", msg.seq))
        elif msg.kind == "ack" and msg.seq == p.in_flight:
            p.queue.popleft()
            p.acked, p.in_flight = msg.seq, 0
            self._flush(src, p)
        self.cpu += time.thread_time() - t0

    def publish(self, batch: pb.ChangeBatch) -> int:
        t0 = time.thread_time()
        self.published += 1
        self.store.apply(self.node, self.published, batch)
        self.batches.add((self.node, self.published))
        for name, p in self.peers.items():
            p.queue.append((self.published, batch))
            self._flush(name, p)
        self.cpu += time.thread_time() - t0
        return self.published

    def _flush(self, name: str, p: _Peer) -> None:
        if p.in_flight or not p.queue or not p.alive:
            return
        seq, batch = p.queue[0]
        p.in_flight, p.batch_sent_at = seq, self.net.loop.now
        self._send(name, Msg("batch", seq, batch))

    def complete(self, seq: int) -> bool:
        """The commit rule: every peer not known dead acked seq."""
        return all(p.acked >= seq for p in self.peers.values()
                   if p.alive or p.failures < DEAD_AFTER)


def run(n: int, *, seed: int, loss: float, steady: float, kills: int) -> dict[str, object]:
    """Steady window, one save (commit and convergence), then `kills` hosts killed."""
    import random

    from scale import FILES_PER_HOST, p99

    loop = simnet.Loop()
    net = simnet.Net(loop, random.Random(seed), loss=loss)
    ids = simnet.node_ids(n)
    hosts = {i: AllToAllHost(i, ids, net, simnet.CompactStore()) for i in ids}
    net.hosts = hosts  # type: ignore[assignment]
    loop.run_until(5.0)
    live = list(hosts.values())
    cpu0 = {h.node: h.cpu for h in live}
    b0 = {h.node: h.sent.bytes + h.received.bytes for h in live}
    m0 = {h.node: h.sent.messages for h in live}
    t0 = loop.now
    loop.run_until(t0 + steady)
    cpu = [(h.cpu - cpu0[h.node]) / steady * 100 for h in live]
    byt = [(h.sent.bytes + h.received.bytes - b0[h.node]) / steady for h in live]
    out: dict[str, object] = {
        "design": "all-to-all (model)", "hosts": n, "loss": loss,
        "cpu_pct_per_host": p99(cpu), "bytes_per_host_s": p99(byt),
        "messages_sent_per_host_s": sum(h.sent.messages - m0[h.node] for h in live)
        / n / steady}
    # A save: every host's files, then the committer's rename.
    c = hosts[ids[0]]
    seqs = {}
    for h in live:
        es = [simnet.entry(f"s-{h.node}-{k}", "root", f"{h.node}-{k}", 1, h.node)
              for k in range(FILES_PER_HOST)]
        seqs[h.node] = h.publish(pb.ChangeBatch(from_node=h.node, entries=es, waited=True))
    done = loop.run_until_true(lambda: all(hosts[x].complete(s) for x, s in seqs.items()),
                               120.0)
    out["fsync_s"] = None if done is None else done - t0 - steady
    tc = loop.now
    rename = c.publish(pb.ChangeBatch(from_node=c.node, waited=True, entries=[
        simnet.entry("d", "root", "step_1", 2, c.node, is_dir=True)]))
    done = loop.run_until_true(lambda: c.complete(rename), 60.0, 0.001)
    out["commit_s"] = None if done is None else done - tc
    every = loop.run_until_true(lambda: all((c.node, rename) in h.batches for h in live), 60.0,
                                0.001)
    out["converge_s"] = None if every is None else every - tc
    victims = net.rng.sample(ids[1:], kills)
    tk = loop.now
    for v in victims:
        hosts[v].up = False
    rest = [h for h in live if h.up]
    done = loop.run_until_true(lambda: all(all(v in h.marked_dead for v in victims)
                                           for h in rest), 30.0, 0.05)
    out["detect_s"] = None if done is None else p99(
        [max(h.marked_dead[v] for v in victims) - tk for h in rest])
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}
