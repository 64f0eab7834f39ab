"""SWIM membership in real daemons: every host a network namespace (support.netns)
running one foreground `mtcfs mount` (real FUSE mounts, real sockets).

- a daemon killed with -9 is marked dead by every other host within the
  detection bound;
- a SIGSTOPped daemon is suspected, and refutes once resumed (never declared dead
  when it is back within the suspicion timeout);
- a replacement host (same node id and address, empty RAM dir) joins from ONE
  snapshot and sees the whole tree as soon as its mount is live; the others pull
  nothing from it;
- an fsync on one host is visible on every other host the moment it returns.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mtcfs.config import mount_entry
from mtcfs.peer.membership import DAEMON_SWIM

from support.mounts import force_unmount, wait_until
from support.netns import (  # noqa: F401 - cluster_factory is a fixture
    Cluster,
    cluster_factory,
    netns_unavailable,
)
from support.netns_hosts import PORT, Node

pytestmark = [
    pytest.mark.skipif(netns_unavailable() is not None, reason=netns_unavailable() or ""),
    pytest.mark.serial,  # detection and refutation bounds: must not share the machine
]

HOSTS = 4
# Probe period, no ack, suspicion timeout, and the news reaching every host: the bound
# within which every host must mark a killed one dead (loaded test machine: x2).
DETECT_BOUND = 2 * (2 * DAEMON_SWIM.period + DAEMON_SWIM.suspicion_timeout(HOSTS) + 1.0)
# A stopped host is suspected once a probe of it went unanswered: a probe comes within
# a period or two (each host probes one member per period), its deadline is a period.
STOP_AT_MOST = 4 * DAEMON_SWIM.period + 1.0


class Job:
    def __init__(self, cluster: Cluster, root: Path, ram_root: Path) -> None:
        self.cluster = cluster
        self.root = root
        self.ram_root = ram_root
        self.token = root / "peer-token"
        self.token.write_text(uuid.uuid4().hex + uuid.uuid4().hex + "\n")
        self.token.chmod(0o600)
        self.nodes: list[Node] = []
        self.retired: list[Node] = []

    def node(self, i: int, ram: str = "") -> Node:
        hosts = self.cluster.hosts
        host = hosts[i]
        others = ",".join(f"{h.addr}:{PORT}" for h in hosts if h is not host)
        args = ["--listen", f"{host.addr}:{PORT}", "--peers", others, "--token-file",
                str(self.token), "--replicas", "1"]
        mp = self.root / f"mnt-h{i}"
        mp.mkdir(exist_ok=True)
        return Node(host, f"h{i}", mp, self.ram_root / f"ram-h{i}{ram}",
                    self.root / f"h{i}{ram}.log", args, ram_size="1GiB")

    def start(self) -> list[Node]:
        self.nodes = [self.node(i) for i in range(len(self.cluster.hosts))]
        for n in self.nodes:
            n.spawn()
        for n in self.nodes:
            n.wait_live()
        self.wait_mesh(self.nodes)
        return self.nodes

    def wait_mesh(self, nodes: list[Node], timeout: float = 30) -> None:
        for n in nodes:
            want = {m.node_id for m in nodes if m is not n}
            wait_until(lambda n=n, want=want: n.live_peers() >= want, timeout,
                       what=f"{n.node_id} to see {sorted(want)} alive")

    def replace(self, old: Node) -> Node:
        """A replacement host: same node id and address, an empty RAM dir."""
        i = self.nodes.index(old)
        new = self.node(i, ram=f"-r{len(self.retired)}")
        self.retired.append(old)
        self.nodes[i] = new
        new.spawn()
        new.wait_live()
        return new

    def logs(self) -> str:
        return "\n".join(f"===== {n.node_id} ({n.host.addr}) =====\n{n.log()}"
                         for n in [*self.retired, *self.nodes])

    def close(self) -> None:
        for n in self.nodes:
            if n.proc is not None and n.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    n.proc.send_signal(signal.SIGCONT)
            if mount_entry(str(n.mp)) is not None:
                subprocess.run(["fusermount3", "-uz", str(n.mp)], capture_output=True)
        for n in self.nodes:
            with contextlib.suppress(Exception):
                n.stop()
            force_unmount(str(n.mp))


@pytest.fixture
def make_job(cluster_factory, tmp_path: Path, ram_root: Path,  # noqa: F811
             request: pytest.FixtureRequest) -> Iterator[Callable[[int], Job]]:
    jobs: list[Job] = []

    def make(hosts: int = HOSTS) -> Job:
        root = tmp_path / f"job{len(jobs)}"
        root.mkdir()
        job = Job(cluster_factory(hosts), root, ram_root)
        jobs.append(job)
        return job

    yield make
    rep = getattr(request.node, "rep_call", None)
    for job in jobs:
        if rep is not None and rep.failed:
            print(job.logs()[-40000:])
        job.close()


def swim_of(n: Node) -> dict:
    return n.pstatus()["membership"]["swim"]


def test_killed_host_is_marked_dead_within_the_bound(make_job) -> None:
    job = make_job()
    nodes = job.start()
    victim, others = nodes[-1], nodes[:-1]
    t0 = time.monotonic()
    victim.kill9()
    seen: dict[str, float] = {}
    deadline = t0 + DETECT_BOUND + 5
    while len(seen) < len(others) and time.monotonic() < deadline:
        for n in others:
            if n.node_id not in seen and victim.node_id not in n.live_peers():
                seen[n.node_id] = time.monotonic() - t0
        time.sleep(0.05)
    print(f"\n[swim] kill -9 -> marked dead: {sorted(seen.values())} "
          f"(bound {DETECT_BOUND:.1f} s)")
    assert len(seen) == len(others), f"not marked dead everywhere: {seen}"
    assert max(seen.values()) <= DETECT_BOUND, seen
    # The others still see each other.
    for n in others:
        assert n.live_peers() >= {m.node_id for m in others if m is not n}


def test_stopped_host_is_suspected_then_refutes(make_job) -> None:
    job = make_job()
    nodes = job.start()
    victim, others = nodes[0], nodes[1:]
    before = {n.node_id: swim_of(n) for n in nodes}
    assert victim.proc is not None
    # Stopped until a host suspects it, and resumed at once: it then has the whole
    # suspicion timeout to refute, so it is never declared dead. (A fixed window
    # shorter than that timeout ended, once in a loaded run, before any probe of
    # it had timed out: a probe that finds it stopped needs up to two periods.)
    victim.proc.send_signal(signal.SIGSTOP)
    suspected = False
    t0 = time.monotonic()
    try:
        while not suspected and time.monotonic() - t0 < STOP_AT_MOST:
            suspected = any(s["suspect"] or s["suspicions"] > before[n.node_id]["suspicions"]
                            for n, s in ((n, swim_of(n)) for n in others))
            if not suspected:
                time.sleep(0.02)
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    assert suspected, f"no host suspected the stopped one in {STOP_AT_MOST:.1f} s"
    # It hears of the suspicion and refutes with a higher incarnation.
    wait_until(lambda: swim_of(victim)["refutations"] > before[victim.node_id]["refutations"],
               10, what="the stopped host to refute")
    assert swim_of(victim)["incarnation"] > before[victim.node_id]["incarnation"]
    wait_until(lambda: all(swim_of(n)["suspect"] == 0 for n in others), 10,
               what="the suspicion to clear")
    for n in others:
        assert swim_of(n)["deaths"] == before[n.node_id]["deaths"], swim_of(n)
        assert victim.node_id in n.live_peers()


def test_replacement_joins_from_one_snapshot(make_job) -> None:
    job = make_job()
    nodes = job.start()
    for i, n in enumerate(nodes):
        for k in range(20):
            n.write(f"step_1/h{i}-{k}.bin", os.urandom(1000 + k))
        os.fsync(os.open(n.mp / "step_1", os.O_RDONLY))
    want = sorted(os.listdir(nodes[0].mp / "step_1"))
    assert len(want) == 20 * len(nodes)
    victim = nodes[-1]
    others = nodes[:-1]
    victim.kill9()
    wait_until(lambda: all(victim.node_id not in n.live_peers() for n in others), 20,
               what="the victim marked dead")
    pulled_before = {n.node_id: n.pstatus()["snapshots_pulled"] for n in others}
    t0 = time.monotonic()
    new = job.replace(victim)
    took = time.monotonic() - t0
    # Live: the whole tree is there at once, from one snapshot.
    assert sorted(os.listdir(new.mp / "step_1")) == want
    assert new.pstatus()["snapshots_pulled"] == 1, new.pstatus()
    print(f"\n[swim] replacement live in {took:.2f} s (daemon start included), "
          f"one snapshot of {len(want) + 1} entries")
    job.wait_mesh(job.nodes)
    # The others took nothing from it (it had nothing of its own).
    for n in others:
        assert n.pstatus()["snapshots_pulled"] == pulled_before[n.node_id]


def test_fsync_visible_everywhere_when_it_returns(make_job) -> None:
    job = make_job()
    nodes = job.start()
    for round_ in range(10):
        writer = nodes[round_ % len(nodes)]
        rel = f"vis/r{round_}-{writer.node_id}.bin"
        data = os.urandom(4096 + round_)
        (writer.mp / "vis").mkdir(exist_ok=True)
        fd = os.open(writer.mp / rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        # fsync returned: every other host has the file, at its size, now.
        for n in nodes:
            if n is not writer:
                st = os.stat(n.mp / rel)
                assert st.st_size == len(data), (n.node_id, rel, st.st_size)
