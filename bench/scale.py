"""Thousands of hosts: membership and index dissemination, simulated with the real code.

    .venv/bin/python bench/run.py --only scale --hosts 100,300,1000
    .venv/bin/python bench/scale.py --hosts 100,300,1000 [--real 16]   (no root needed)

Per N: N SimHosts (tests/support/simnet.py) running mtcfs.peer.swim and
mtcfs.peer.fanout in virtual time over an in-process network (latency
0.2-2 ms, --loss of the messages dropped), 16 of them with the real
replicated index, the rest with a compact one (stamps only). Phases:

1. warm-up, then a steady window with no save: CPU (thread CPU time of each
   host's handlers per simulated second: cores, protobuf sizing, its store)
   and bytes sent + received per host per second;
2. --steps saves: the committer makes the step's tmp directory; every host
   writes 8 files in it and fsyncs (its batch goes down its tree; the fsync
   returns when every live host applied it); once all have, the committer
   renames the directory (the commit: it returns when every live host has
   the rename). converge: from the commit call until a host has the whole step
   (p99 over hosts and steps); commit: the rename's call to its return;
3. 10 hosts killed at once: detect = for each live host, the time until it
   marks all 10 dead (p99); partner_detect: the slowest replica partner of a
   killed host; then a save with the 10 dead (commit_with_dead_s);
4. a replacement for one of them (same node id) joins through one live host:
   SYNC, refutation of its death, gossip until every live host marks it alive
   (virtual time); and its index: one snapshot of --entries entries pulled from
   one host (a process of its own making protobuf pieces of 1,000 as they are
   taken) and applied piece by piece to a real index (wall time, outside the
   virtual clock). join_s = the later of the two: the host is live, its index in
   memory. join_stored_s: its store has the snapshot's rows too (they are
   written after, as mtcfs.peer.join.LaterRows writes them).

The last line printed is a JSON list, one object per N (a single N: a list of one).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import multiprocessing
import os
import random
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from common import Context, Row  # noqa: E402  (bench/common.py)

from mtcfs.peer import grouped, placement  # noqa: E402
from mtcfs.peer.index import applying_snapshot, gc_paused  # noqa: E402
from mtcfs.peer.join import ROWS_PER_SLICE  # noqa: E402
from mtcfs.peer.server import SNAPSHOT_BATCH  # noqa: E402
from mtcfs.peer.tier import MAX_BATCH  # noqa: E402
from mtcfs.peer.v1 import peer_pb2 as pb  # noqa: E402

from support import simnet  # noqa: E402

FILES_PER_HOST = 8  # a step's files per host (shards, metadata)
# Each of them: 2 GiB per host and step, 20 TB a step at 10,000 hosts (a model of
# about 1.3 trillion parameters with its Adam state). Its index entry carries a
# crc32c per 4 MiB block: 64 of them, 256 bytes.
FILE_BYTES = 256 << 20
KILLED = 10


def p99(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]


class Scenario:
    def __init__(self, n: int, seed: int, loss: float, real: int, root: str,
                 kills: int = KILLED, net: Any = None, group: int = 0) -> None:
        """net: hosts already made (support.grpcnet), else simulated ones; group: hosts
        per dissemination group (mtcfs.peer.grouped; 0: its choice)."""
        self.n = n
        self.kills = kills
        self.rng = random.Random(seed)
        ids = simnet.node_ids(n)
        self.committer = ids[0]
        self.real = [ids[0], *self.rng.sample(ids[1:], min(real, n) - 1)]
        if net is None:
            net = simnet.cluster(n, seed=seed, loss=loss, real_index=self.real, root=root,
                                 group=group)
        self.net = net
        self.loop = net.loop
        # The hosts' state lives as long as the run: out of the collector's passes (at
        # 10,000 hosts a full pass walks gigabytes, in some host's timed handler).
        gc.collect()
        gc.freeze()
        # Hosts time their handlers only in the steady window (the CPU figure): the
        # clock's two reads per call are 5 % of the simulation's own cost.
        self._timing(False)
        # The hosts' code runs under this lock over gRPC (their threads); here, unneeded.
        self.guard = getattr(self.loop, "lock", None) or contextlib.nullcontext()
        self.lamport = 0
        self.step_of: dict[tuple[str, int], int] = {}
        self.step_need: dict[int, int] = {}
        self.step_have: dict[tuple[str, int], int] = {}
        self.step_done: dict[tuple[str, int], float] = {}
        self._bundle_steps: dict[grouped.Bundle, dict[int, int]] = {}
        for h in self.net.hosts.values():
            h.on_batch = self._on_batch

    def _timing(self, on: bool) -> None:
        if hasattr(self.net, "timing"):  # (simulated hosts: the gRPC ones always time)
            self.net.timing = on

    def live(self) -> list[simnet.SimHost]:
        return [h for h in self.net.hosts.values() if h.up]

    def _on_batch(self, host: simnet.SimHost, parts: Sequence[grouped.Part],
                  bundle: grouped.Bundle | None) -> None:
        if bundle is not None and parts is bundle.parts:
            # A whole bundle: its batches per step counted once, not once per host.
            counts = self._bundle_steps.get(bundle)
            if counts is None:
                counts = self._bundle_steps[bundle] = self._steps_in(parts)
        else:
            counts = self._steps_in(parts)
        for step, n in counts.items():
            key = (host.node, step)
            have = self.step_have[key] = self.step_have.get(key, 0) + n
            if have == self.step_need[step]:
                self.step_done[key] = self.loop.now

    def _steps_in(self, parts: Sequence[grouped.Part]) -> dict[int, int]:
        counts: dict[int, int] = {}
        for p in parts:
            step = self.step_of.get((p.origin, p.seq))
            if step is not None:
                counts[step] = counts.get(step, 0) + 1
        return counts

    def _publish(self, host: simnet.SimHost, step: int, entries: list[pb.Entry]) -> int:
        # The batch's (origin, seq) is known before it goes out: the writer applies
        # it locally first (it counts for the writer too).
        with self.guard:
            seq = host.tree.published() + 1
            self.step_of[(host.node, seq)] = step
            key = (host.node, step)
            self.step_have[key] = self.step_have.get(key, 0) + 1
            if self.step_have[key] == self.step_need[step]:
                self.step_done[key] = self.loop.now
            # (each is an fsync's or a commit's: waited for)
            got = host.publish(pb.ChangeBatch(from_node=host.node, entries=entries,
                                              waited=True))
        assert got == seq
        return seq

    def _tick(self) -> int:
        self.lamport += 1
        return self.lamport

    def save(self, step: int, limit: float = 30.0) -> dict[str, float]:
        """One checkpoint step as Orbax saves it on every host."""
        live = self.live()
        c = self.net.hosts[self.committer]
        self.step_need[step] = len(live) + 2  # every host's files, the mkdir, the rename
        dir_id = f"step{step}"
        t0 = self.loop.now
        sent0 = sum(h.sent.messages for h in live)
        mk = self._publish(c, step, [simnet.entry(dir_id, "root", f"step_{step}.tmp",
                                                   self._tick(), c.node, is_dir=True)])
        done = self.loop.run_until_true(lambda: c.tree.complete(mk), limit)
        assert done is not None, "mkdir did not complete"
        fsyncs = {}
        for h in live:
            es = [simnet.entry(f"s{step}-{h.node}-{k}", dir_id, f"{h.node}-{k}", self._tick(),
                               h.node, size=FILE_BYTES) for k in range(FILES_PER_HOST)]
            fsyncs[h.node] = self._publish(h, step, es)
        done = self.loop.run_until_true(
            lambda: all(self.net.hosts[n].tree.complete(s) for n, s in fsyncs.items()
                        if self.net.hosts[n].up), limit)
        assert done is not None, "fsyncs did not complete"
        fsync_s = self.loop.now - t0
        t_commit = self.loop.now
        rename = self._publish(c, step, [simnet.entry(dir_id, "root", f"step_{step}",
                                                       self._tick(), c.node, is_dir=True)])
        done = self.loop.run_until_true(lambda: c.tree.complete(rename), limit, step=0.001)
        assert done is not None, "commit did not complete"
        commit_s = done - t_commit
        everyone = self.loop.run_until_true(
            lambda: all((h.node, step) in self.step_done for h in self.live()), limit)
        if everyone is None:
            missing = {h.node: self.step_have.get((h.node, step), 0) for h in self.live()
                       if (h.node, step) not in self.step_done}
            revived = sum(h.revivals for h in self.live())
            deaths = {h.node: h.swim.counters.deaths for h in self.live() if h.swim.counters.deaths}
            lacking = {h.node: sorted(b for b, st in self.step_of.items() if st == step
                                      and b not in h.batches) for h in self.live()
                       if (h.node, step) not in self.step_done}
            print(f"{deaths=} {lacking=}", file=sys.stderr)
            raise AssertionError(f"step {step} did not reach every host ({revived} revivals; of "
                                 f"{self.step_need[step]} batches, they have {missing})")
        conv = [self.step_done[(h.node, step)] - t_commit for h in self.live()]
        # Messages each host sent from the mkdir to the commit, all kinds (membership's
        # too): what the dissemination of a save costs a host.
        sent = (sum(h.sent.messages for h in live) - sent0) / len(live)
        return {"commit_s": commit_s, "converge_p99_s": p99(conv), "fsync_s": fsync_s,
                "messages_per_host": sent,
                "converge_from_start_p99_s": p99([c + t_commit - t0 for c in conv])}

    def window(self, seconds: float) -> dict[str, float]:
        """Steady state: CPU and bytes per host over `seconds` of simulated time."""
        live = self.live()
        cpu0 = {h.node: h.cpu for h in live}
        b0 = {h.node: h.sent.bytes + h.received.bytes for h in live}
        m0 = {h.node: h.sent.messages for h in live}
        t0, p0 = self.loop.now, time.process_time()
        self._timing(True)
        try:
            self.loop.run_until(t0 + seconds)
        finally:
            self._timing(False)
        span = self.loop.now - t0
        process = (time.process_time() - p0) / span / len(live) * 100
        cpu = [(h.cpu - cpu0[h.node]) / span * 100 for h in live]
        byt = [(h.sent.bytes + h.received.bytes - b0[h.node]) / span for h in live]
        msgs = [(h.sent.messages - m0[h.node]) / span for h in live]
        return {"cpu_pct_per_host": p99(cpu), "cpu_pct_per_host_mean": sum(cpu) / len(cpu),
                "bytes_per_host_s": p99(byt), "bytes_per_host_s_mean": sum(byt) / len(byt),
                "messages_sent_per_host_s": sum(msgs) / len(msgs),
                "process_cpu_pct_per_host": process}

    def kill(self) -> tuple[dict[str, float], list[str]]:
        spare = [n for n in self.net.hosts if n not in self.real]
        if len(spare) < self.kills:  # every host has the real index (the gRPC check)
            spare = [n for n in self.net.hosts if n != self.committer]
        victims = self.rng.sample(spare, self.kills)
        ring = next(iter(self.net.hosts.values())).ring
        partners = {v: placement.partners(ring, v, 1, lambda n: True) for v in victims}
        tk = self.loop.now
        for v in victims:
            self.net.kill(v)
        live = self.live()
        done = self.loop.run_until_true(
            lambda: all(all(v in h.marked_dead for v in victims) for h in live), 60, 0.05)
        assert done is not None, "the dead were not all detected"
        detect = [max(h.marked_dead[v] for v in victims) - tk for h in live]
        partner = [self.net.hosts[p].marked_dead[v] - tk for v in victims
                   for p in partners[v] if self.net.hosts[p].up]
        false = sum(1 for h in live for d in h.marked_dead if d not in victims)
        return {"detect_s": p99(detect), "detect_max_s": max(detect),
                "partner_detect_max_s": max(partner), "false_deaths": false}, victims

    def join_membership(self, node: str) -> float:
        """A replacement host with a dead host's node id: time until every live host
        marks it alive (virtual)."""
        ring = next(iter(self.net.hosts.values())).ring
        seed = placement.partners(ring, node, 1, lambda n: self.net.hosts[n].up)[0]
        serve = getattr(self.net, "serve", None)
        if serve is not None:
            serve(node)
        with self.guard:
            h = simnet.add_host(self.net, node)
            h.on_batch = self._on_batch
            t0 = self.loop.now
            h.join(seed)
        others = [x for x in self.live() if x is not h]
        done = self.loop.run_until_true(
            lambda: all(node in x.marked_alive and x.swim.is_live(node) for x in others), 30)
        assert done is not None, "the replacement host was not seen alive everywhere"
        return done - t0

    def real_agree(self) -> bool:
        """The real indexes and the compact ones hold the same stamps."""
        with self.guard:
            digests = [self.net.hosts[n].store.digest() for n in self.real
                       if self.net.hosts[n].up]
            others = [h.store for h in self.live() if h.node not in self.real]
            ref = (others[0] if others else self.net.hosts[self.committer].store).digest()
            return all(d == ref for d in digests)

    def close(self) -> None:
        for n in self.real:
            store = self.net.hosts[n].store
            if isinstance(store, simnet.IndexStore):
                store.close()
        gc.unfreeze()


def _build_source(entries: int, root: str,
                  now: Callable[[], float] | None = None) -> simnet.IndexStore:
    """A real index of `entries` files: 10 steps of FILES_PER_HOST files per host."""
    src = simnet.IndexStore("source", os.path.join(root, "snap-source"), now=now)
    hosts = max(1, entries // (10 * FILES_PER_HOST))
    lam = 0
    for step in range(10):
        lam += 1
        src.index.apply([simnet.entry(f"d{step}", "root", f"step_{step}", lam, "h0000",
                                      is_dir=True)])
        for h in range(hosts):
            lam += 1
            src.index.apply([simnet.entry(f"f{step}-{h}-{k}", f"d{step}", f"h{h}-{k}", lam,
                                          f"h{h:04d}", size=FILE_BYTES)
                             for k in range(FILES_PER_HOST)])
    return src


def _serve_snapshot(conn: Any, entries: int, root: str) -> None:
    """The source host (a process of its own): on request, its snapshot in pieces of
    SNAPSHOT_BATCH, each made when the stream takes the previous one (as the daemon's
    Snapshot stream makes them); then its CPU seconds and its index's digest."""
    src = _build_source(entries, root)
    conn.send("ready")
    conn.recv()
    c0 = time.process_time()
    for piece in src.index.snapshot_pieces(SNAPSHOT_BATCH):
        conn.send_bytes(pb.ChangeBatch(from_node="source", entries=piece).SerializeToString())
    conn.send_bytes(b"")
    conn.send((time.process_time() - c0, src.digest()))
    src.close()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def snapshot_join(entries: int, root: str) -> dict[str, float]:
    """A joiner pulls one snapshot of `entries` entries from a source host and applies
    each piece as it arrives (in slices of MAX_BATCH, as PeerTier._catch_up does) to
    a fresh real index. Each side is a process of its own (another host: on this
    2-core machine, a core of its own), so making the next piece overlaps applying
    this one as it does between two daemons; the pipe between them holds about one
    piece, as the gRPC stream's flow control does. The joiner is a new process, as a
    replacement's daemon is: not this one, whose heap a simulation of thousands of
    hosts has grown and freed (the same apply took 25 % more CPU in it)."""
    fork, spawn = multiprocessing.get_context("fork"), multiprocessing.get_context("spawn")
    ours, theirs = fork.Pipe()
    result, result_end = spawn.Pipe()
    source = fork.Process(target=_serve_snapshot, args=(theirs, entries, root), daemon=True)
    source.start()
    joiner = spawn.Process(target=_join_snapshot, args=(ours, result_end, root), daemon=True)
    try:
        joiner.start()
        if not result.poll(600):
            raise RuntimeError("the snapshot joiner gave no result")
        out = result.recv()
        joiner.join(timeout=30)
        source.join(timeout=30)
    finally:
        for proc in (joiner, source):
            if proc.is_alive():
                proc.kill()
    assert isinstance(out, dict), out
    return out


def _join_snapshot(conn: Any, result: Any, root: str) -> None:
    """The joiner's process (snapshot_join): its figures, or what failed, to `result`."""
    try:
        result.send(_pull_and_apply(conn, root))
    except BaseException as e:  # noqa: BLE001 (handed to the parent, which raises)
        result.send(f"{type(e).__name__}: {e}")


def _pull_and_apply(conn: Any, root: str) -> dict[str, float]:
    if conn.recv() != "ready":
        raise RuntimeError("the snapshot source did not start")
    rss0 = _rss()
    dst = simnet.IndexStore("joiner", os.path.join(root, "snap-joiner"))
    size = pieces = 0
    first = 0.0
    t0, c0 = time.perf_counter(), time.process_time()
    conn.send("go")
    with applying_snapshot(dst.index.ns):  # for the whole pull, as SnapshotPuller.pull
        while piece := conn.recv_bytes():
            if not pieces:
                first = time.perf_counter() - t0
            pieces += 1
            size += len(piece)
            b = pb.ChangeBatch()
            b.ParseFromString(piece)
            got = list(b.entries)
            for i in range(0, len(got), MAX_BATCH):
                dst.index.apply(got[i:i + MAX_BATCH])
    t1, c1 = time.perf_counter(), time.process_time()
    # Joined: the index is in memory. Then its rows are stored, as LaterRows does.
    while dst.meta.rows_later:
        dst.meta.write_later(ROWS_PER_SLICE)
    t2, c2 = time.perf_counter(), time.process_time()
    # The index's memory: the process's growth (the namespace and the index in
    # memory) and its metadata store (SQLite in the RAM dir: tmpfs pages).
    rss = _rss() - rss0
    db = sum(f.stat().st_size for f in Path(root, "snap-joiner").iterdir())
    serve_cpu, digest = conn.recv()
    ok = dst.digest() == digest
    dst.close()
    if not ok:
        raise AssertionError("the joiner's index differs from its source's")
    per = 100_000 / max(1, len(digest))
    return {"snapshot_entries": len(digest), "snapshot_bytes": size,
            "index_rss_bytes_per_100k_entries": round(rss * per),
            "index_store_bytes_per_100k_entries": round(db * per),
            "snapshot_s": t1 - t0, "snapshot_first_piece_s": first,
            "snapshot_stored_s": t2 - t0,
            # CPU seconds: the wall-clock figure above swings with the machine's load
            "snapshot_serve_cpu_s": serve_cpu, "snapshot_apply_cpu_s": c1 - c0,
            "snapshot_store_cpu_s": c2 - c1}


def flap_catch_up(entries: int, root: str) -> dict[str, float]:
    """A host back after a short absence (a partition healed, a false death), during
    which one step was written (FILES_PER_HOST files per host): what one catch-up
    pull costs when the source sends its whole index against only what changed
    there (the delta of the absence + the designated puller's margins). Both sides
    are real indexes; the requester already has everything but the step. CPU seconds
    of the source (making and encoding the pieces) and the requester (decoding,
    applying); after a flap one host of the other side makes such a pull and
    republishes what it got down the tree."""
    from mtcfs.peer.catchup import DELTA_MARGIN, HANDOFF_SLACK

    away = 10.0
    clock = [0.0]
    src = _build_source(entries, os.path.join(root, "flap"), now=lambda: clock[0])
    hosts = max(1, entries // (10 * FILES_PER_HOST))
    old = list(src.index.snapshot())
    clock[0] += 3600.0  # the index was built an hour ago; then the host was away:
    lam = 10 * (hosts + 1) + 1
    src.index.apply([simnet.entry("d-new", "root", "step_new", lam, "h0000",
                                  is_dir=True)])
    for h in range(hosts):
        lam += 1
        src.index.apply([simnet.entry(f"n-{h}-{k}", "d-new", f"h{h}-{k}", lam,
                                      f"h{h:04d}", size=FILE_BYTES)
                         for k in range(FILES_PER_HOST)])
    clock[0] += away
    out: dict[str, float] = {"flap_changed_entries": hosts * FILES_PER_HOST + 1}
    reach = away + DELTA_MARGIN + HANDOFF_SLACK
    for name, pieces in (("full", lambda: src.index.snapshot_pieces(SNAPSHOT_BATCH)),
                         ("delta", lambda: src.index.delta_pieces(reach, SNAPSHOT_BATCH))):
        dst = simnet.IndexStore("back", os.path.join(root, f"flap-{name}"))
        for i in range(0, len(old), MAX_BATCH):
            dst.index.apply(old[i:i + MAX_BATCH])
        c0 = time.process_time()
        wire = [pb.ChangeBatch(from_node="source", entries=p).SerializeToString()
                for p in pieces()]
        c1 = time.process_time()
        with gc_paused():
            for data in wire:
                b = pb.ChangeBatch()
                b.ParseFromString(data)
                got = list(b.entries)
                for i in range(0, len(got), MAX_BATCH):
                    dst.index.apply(got[i:i + MAX_BATCH])
        c2 = time.process_time()
        if dst.digest() != src.digest():
            raise AssertionError(f"the {name} catch-up left the indexes different")
        out[f"flap_{name}_entries"] = sum(
            len(pb.ChangeBatch.FromString(d).entries) for d in wire)
        out[f"flap_{name}_serve_cpu_s"] = c1 - c0
        out[f"flap_{name}_apply_cpu_s"] = c2 - c1
        dst.close()
    src.close()
    return out


def measure(s: Scenario, steps: int, steady: float) -> dict[str, Any]:
    """The phases common to the simulation and the gRPC check."""
    s.loop.run_until(s.loop.now + 5.0)  # warm-up: everyone probed a few times
    out: dict[str, Any] = {"hosts": s.n, "real_index_hosts": len(s.real),
                           "group": next(iter(s.net.hosts.values())).tree.status()["group"]}
    out.update(s.window(steady))
    saves = [s.save(k) for k in range(1, steps + 1)]
    out["commit_s"] = max(x["commit_s"] for x in saves)
    out["converge_p99_s"] = max(x["converge_p99_s"] for x in saves)
    out["converge_from_start_p99_s"] = max(x["converge_from_start_p99_s"] for x in saves)
    out["fsync_s"] = max(x["fsync_s"] for x in saves)
    out["save_messages_per_host"] = max(x["messages_per_host"] for x in saves)
    det, victims = s.kill()
    out["killed"] = len(victims)
    out.update(det)
    with_dead = s.save(steps + 1)
    out["commit_with_dead_s"] = with_dead["commit_s"]
    out["index_agree"] = s.real_agree()
    out["join_membership_s"] = s.join_membership(victims[0])
    return out


def run_one(n: int, *, seed: int, loss: float, real: int, steps: int, entries: int,
            steady: float, group: int = 0) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="mtcfs-scale-", dir="/dev/shm")
    try:
        # The real indexes first, in a process as small as a daemon's: with the
        # simulation's N hosts in memory, Python's garbage collector walks them all
        # while 80,000 entries are applied (6.0 CPU-s at 1,000 hosts against 3.2).
        gc.collect()
        snap = snapshot_join(entries, root)
        flap = flap_catch_up(entries, root)
        started = time.process_time()
        s = Scenario(n, seed, loss, real, root, group=group)
        try:
            out = measure(s, steps, steady)
            out["simulated_s"] = round(s.loop.now, 1)
            out["sim_cpu_s"] = round(time.process_time() - started, 1)
        finally:
            s.close()
        out["loss"] = loss
        del out["process_cpu_pct_per_host"]  # the simulator's own, not a host's
        out.update(snap)
        out["join_s"] = max(out["join_membership_s"], snap["snapshot_s"])
        out["join_stored_s"] = snap["snapshot_stored_s"]
        out.update(flap)
        # After a flap the returning host serves one pull, the designated host's of
        # the other side (mtcfs.peer.catchup), which republishes it down the tree:
        # each other host applies it once (as it applied the pull it made before).
        # Before, every host that saw it dead pulled: N-1 pulls to serve.
        out["flap_serve_cpu_s"] = flap["flap_delta_serve_cpu_s"]
        out["flap_apply_cpu_s_per_host"] = flap["flap_delta_apply_cpu_s"]
        out["flap_serve_cpu_s_one_pull_per_host"] = (n - 1) * flap["flap_delta_serve_cpu_s"]
        out["flap_serve_cpu_s_whole_index"] = (n - 1) * flap["flap_full_serve_cpu_s"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def check_grpc(n: int, *, seed: int, steps: int, steady: float,
               shared: bool = False) -> dict[str, Any]:
    """The same scenario on n hosts twice: simulated, and over gRPC on loopback in real
    time (every host with the real index, no injected loss, n // 8 killed)."""
    from support import grpcnet

    kills = max(1, n // 8)
    out: dict[str, Any] = {}
    for kind in ("sim", "grpc"):
        root = tempfile.mkdtemp(prefix=f"mtcfs-check-{kind}-", dir="/dev/shm")
        net = None
        if kind == "grpc":
            net = grpcnet.cluster({node: free_port() for node in simnet.node_ids(n)}, root,
                                  seed=seed, shared=shared)
        s = Scenario(n, seed, 0.0, n, root, kills=kills, net=net)
        try:
            r = measure(s, steps, steady)
        finally:
            if net is not None:
                net.close()
            s.close()
            shutil.rmtree(root, ignore_errors=True)
        if kind == "sim":
            del r["process_cpu_pct_per_host"]
        out[kind] = {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parse_hosts(text: str) -> list[int]:
    try:
        hosts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--hosts: not a comma list of numbers: {text}") from None
    if not hosts or any(h < 2 * KILLED + 2 for h in hosts):
        raise argparse.ArgumentTypeError(f"--hosts: each at least {2 * KILLED + 2}")
    return hosts


KEEP_STEPS = 3  # steps a joiner's snapshot holds (--keep-steps)


def join_entries(n: int) -> int:
    """The joiner's index at N hosts: 8 files per host and step, KEEP_STEPS steps (at
    least the 80,000 entries measured from the start)."""
    return max(80_000, n * FILES_PER_HOST * KEEP_STEPS)


def real_hosts(n: int) -> int:
    """Hosts with the real index: 16, or 8 beyond 3,000 hosts (each holds every step's
    entries in memory: about 2.9 KB each, 0.7 GB per host at 10,000 hosts)."""
    return 16 if n <= 3000 else 8


# Targets at 1,000 hosts (issue 14); a figure's Row carries its target at every N.
TARGETS = {"converge_p99_s": 2.0, "commit_s": 1.0, "detect_s": 10.0, "join_s": 5.0,
           "cpu_pct_per_host": 2.0}
UNITS = {"converge_p99_s": "s", "commit_s": "s", "detect_s": "s", "join_s": "s",
         "join_stored_s": "s", "cpu_pct_per_host": "%", "bytes_per_host_s": "B/s"}


def group(ctx: Context) -> list[Row]:
    """bench/run.py's "scale" group: one simulation per --hosts value; the figures as
    Rows (no reference: the targets are absolute) and, as the last line, JSON."""
    rows: list[Row] = []
    for n in ctx.hosts:
        r = run_one(n, seed=1, loss=0.001, real=real_hosts(n), steps=2,
                    entries=join_entries(n), steady=10.0)
        ctx.last_line.append(r)
        for key, unit in UNITS.items():
            rows.append(Row("scale", f"{n} hosts: {key}", unit, [float(r[key])],
                            higher_is_better=False, max_value=TARGETS.get(key),
                            note="simulated (bench/scale.py)"))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/scale.py", description=__doc__.split("\n")[0])
    p.add_argument("--hosts", type=parse_hosts, default=parse_hosts("100,300,1000"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--loss", type=float, default=0.001, help="messages dropped [0.001]")
    p.add_argument("--real", type=int, default=16, help="hosts with the real index [16]")
    p.add_argument("--steps", type=int, default=2, help="saves measured [2]")
    p.add_argument("--entries", type=int, default=80_000, help="the joiner's index [80000]")
    p.add_argument("--steady", type=float, default=10.0, help="steady window, s [10]")
    p.add_argument("--group", type=int, default=0,
                   help="hosts per dissemination group (0: automatic, 1: none) [0]")
    p.add_argument("--check-grpc", type=int, metavar="N", default=0,
                   help="instead: the scenario on N hosts simulated and over gRPC on loopback")
    p.add_argument("--shared-server", action="store_true",
                   help="--check-grpc: one gRPC server for all the hosts' ports")
    p.add_argument("--alltoall", action="store_true",
                   help="instead: today's all-to-all design (a model, bench/alltoall.py)")
    args = p.parse_args(argv)
    if args.alltoall:
        import alltoall

        out = []
        for n in args.hosts:
            r = alltoall.run(n, seed=args.seed, loss=args.loss, steady=args.steady,
                             kills=KILLED)
            print(json.dumps(r), file=sys.stderr, flush=True)
            out.append(r)
        print(json.dumps(out))
        return 0
    if args.check_grpc:
        print(json.dumps(check_grpc(args.check_grpc, seed=args.seed, steps=args.steps,
                                    steady=args.steady, shared=args.shared_server)))
        return 0
    results = []
    for n in args.hosts:
        r = run_one(n, seed=args.seed, loss=args.loss, real=args.real, steps=args.steps,
                    entries=args.entries, steady=args.steady, group=args.group)
        print(json.dumps(r), file=sys.stderr, flush=True)
        results.append(r)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
