"""The simulation's hosts over real gRPC on loopback, in real time: the check
that the simulation's figures hold outside it (bench/scale.py --check-grpc).

The same SimHost (support.simnet: mtcfs.peer.swim, mtcfs.peer.fanout and a
store) is driven by a wall-clock loop, and its messages travel as the
Gossip and Forward RPCs of peer.proto (mtcfs.peer.wire), one way, each
host with its own gRPC server on 127.0.0.1. One lock serializes the hosts'
code (the cores are single-threaded state machines, as in a daemon's trio
thread); gRPC's own threads do the rest.
"""

from __future__ import annotations

import heapq
import random
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from mtcfs.peer import swim, wire
from mtcfs.peer.v1 import peer_pb2 as pb
from mtcfs.peer.v1 import peer_pb2_grpc as pb_grpc

from support import simnet


class RealLoop:
    """simnet.Loop's interface in wall-clock time: callbacks run on one thread."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._t0 = time.monotonic()
        self._heap: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._n = 0
        self._wake = threading.Condition(self.lock)
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="realloop", daemon=True)
        self._thread.start()

    @property
    def now(self) -> float:
        return time.monotonic() - self._t0

    def at(self, t: float, fn: Callable[..., None], *args: object) -> None:
        with self.lock:
            self._n += 1
            heapq.heappush(self._heap, (t, self._n, fn, args))
            self._wake.notify()

    def after(self, dt: float, fn: Callable[..., None], *args: object) -> None:
        self.at(self.now + dt, fn, *args)

    def _run(self) -> None:
        with self.lock:
            while not self._stopped:
                now = self.now
                if self._heap and self._heap[0][0] <= now:
                    _, _, fn, args = heapq.heappop(self._heap)
                    fn(*args)
                else:
                    wait = self._heap[0][0] - now if self._heap else 0.05
                    self._wake.wait(min(wait, 0.05))

    def run_until(self, t: float) -> None:
        while self.now < t:
            time.sleep(min(0.05, t - self.now))

    def run_until_true(self, cond: Callable[[], bool], limit: float,
                       step: float = 0.01) -> float | None:
        end = self.now + limit
        while True:
            with self.lock:
                if cond():
                    return self.now
            if self.now >= end:
                return None
            time.sleep(step)

    def stop(self) -> None:
        with self.lock:
            self._stopped = True
            self._wake.notify()
        self._thread.join()


class _Servicer(pb_grpc.PeerServicer):
    """One host's service; node "": the shared server's, which reads the host a call
    is for from its metadata."""

    def __init__(self, net: GrpcNet, node: str) -> None:
        self.net, self.node = net, node

    def _to(self, context: Any) -> str:
        if self.node:
            return self.node
        return dict(context.invocation_metadata()).get(TO, "")

    def Gossip(self, request: pb.GossipMessage, context: Any) -> pb.OneWay:
        src, msg = wire.gossip_from_pb(request)
        with self.net.loop.lock:
            self.net.deliver(src, self._to(context), msg, request.ByteSize())
        return pb.OneWay()

    def Forward(self, request: pb.TreeMessage, context: Any) -> pb.OneWay:
        src, msg = wire.tree_from_pb(request)
        with self.net.loop.lock:
            self.net.deliver(src, self._to(context), msg, request.ByteSize())
        return pb.OneWay()


TO = "mtcfs-to"  # the shared server: which host a call is for


class GrpcNet:
    """simnet.Net's interface over gRPC: each host a server on a loopback port."""

    def __init__(self, loop: RealLoop, rng: random.Random, ports: dict[str, int],
                 shared: bool = False) -> None:
        """shared: one gRPC server (one poller, 4 threads) listens on every host's port
        and hands each call to the host named in its metadata: in one Python process,
        a server per host costs more CPU than the hosts' code (see docs/peers.md)."""
        self.loop = loop
        self.shared = shared
        self.rng = rng
        self.ports = ports
        self.hosts: dict[str, simnet.SimHost] = {}
        self.side: dict[str, int] = {}
        self._servers: dict[str, grpc.Server] = {}
        self._stubs: dict[str, pb_grpc.PeerStub] = {}
        self._channels: list[grpc.Channel] = []
        self._calls: set[grpc.Future] = set()

    def serve(self, node: str) -> None:
        if self.shared:
            return  # every port is the shared server's (serve_all), a killed host's too
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_PeerServicer_to_server(_Servicer(self, node), server)
        server.add_insecure_port(f"127.0.0.1:{self.ports[node]}")
        server.start()
        self._servers[node] = server

    def serve_all(self) -> None:
        if not self.shared:
            for node in self.ports:
                self.serve(node)
            return
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_PeerServicer_to_server(_Servicer(self, ""), server)
        for port in self.ports.values():
            server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        self._servers[""] = server

    def _stub(self, dst: str) -> pb_grpc.PeerStub:
        stub = self._stubs.get(dst)
        if stub is None:
            ch = grpc.insecure_channel(f"127.0.0.1:{self.ports[dst]}")
            self._channels.append(ch)
            stub = self._stubs[dst] = pb_grpc.PeerStub(ch)
        return stub

    def send(self, src: str, dst: str, msg: object, nbytes: int) -> None:
        if self.side.get(src, 0) != self.side.get(dst, 0):
            return
        stub = self._stub(dst)
        # One way: the result (an empty reply, or an error) is not awaited, but the
        # future is kept until done (gRPC cancels a call whose future is collected).
        to = ((TO, dst),)
        if isinstance(msg, swim.Message):
            f = stub.Gossip.future(wire.gossip_to_pb(src, msg), timeout=2.0, metadata=to)
        else:
            f = stub.Forward.future(wire.tree_to_pb(src, msg), timeout=2.0,  # type: ignore[arg-type]
                                    metadata=to)
        self._calls.add(f)
        f.add_done_callback(self._calls.discard)

    def deliver(self, src: str, dst: str, msg: object, nbytes: int) -> None:
        h = self.hosts.get(dst)
        if h is None or not h.up:
            return
        h.received.messages += 1
        h.received.bytes += nbytes
        h.receive(src, msg)

    def kill(self, node: str) -> None:
        with self.loop.lock:
            self.hosts[node].up = False
        if not self.shared:  # shared: its port stays open, what comes in is dropped
            self._servers.pop(node).stop(0)

    def close(self) -> None:
        self.loop.stop()
        for s in self._servers.values():
            s.stop(0)
        for ch in self._channels:
            ch.close()


def cluster(ports: dict[str, int], root: str, *, seed: int = 0,
            shared: bool = False) -> GrpcNet:
    """len(ports) hosts with the real index, all alive, each knowing every other."""
    import os

    from mtcfs.peer import placement

    net = GrpcNet(RealLoop(), random.Random(seed), ports, shared)
    ids = sorted(ports)
    net.serve_all()
    ring = placement.ring([(i, "") for i in ids])
    with net.loop.lock:
        for node in ids:
            store = simnet.IndexStore(node, os.path.join(root, node))
            net.hosts[node] = simnet.SimHost(node, net, store, ids, ring)  # type: ignore[arg-type]
    return net
