"""A daemon whose process stalls (stopped with SIGSTOP, as a starved host's is by
the scheduler) reads the datagrams that came meanwhile before SWIM's timers judge:
an ack waiting in its socket when it resumes is an answer, not a missed probe.

The daemon has one configured peer: a UDP socket of this test that answers every
ping with an ACK sealed with the job's key. For some of the daemon's probes the
test stops the daemon first, then answers, and resumes it after the probe's
deadline has passed: without reading first, half of those wake-ups would run the
timers first (trio orders a batch at random) and suspect the peer.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mtcfs import control
from mtcfs.peer import swim
from mtcfs.peer.gossip import Codec
from mtcfs.peer.v1 import peer_pb2 as pb

from support.fakepeer import DaemonAndSocket, daemon_with_fake_peer
from support.mounts import MtcfsMount

# Timing: the fake peer must answer the unstalled probes within 0.5 s.
pytestmark = pytest.mark.serial

FAKE_NODE = "node-fake"
STALLS = 6
STALL_S = 1.5  # beyond the daemon's probe deadline (0.5 s)


class FakePeer:
    """Answers the daemon's pings; stops the daemon around the next `stall` ones."""

    def __init__(self, d: DaemonAndSocket) -> None:
        self.d = d
        self.codec = Codec(d.fake, d.token)
        self.incarnation = time.time_ns() // 10**6
        self.pid = 0
        self.stall = 0  # pings still to answer while the daemon is stopped
        self.stalled = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def say(self, kind: int, seq: int, target: str = "") -> None:
        m = pb.GossipMessage(from_node=self.d.fake, kind=kind, seq=seq,
                             incarnation=self.incarnation, target=target, node_id=FAKE_NODE)
        self.d.send(self.codec.seal(m, self.d.addr))

    def _run(self) -> None:
        while not self.done.is_set():
            try:
                data = self.d.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            m = self.codec.open(data)
            if m is None or m.kind != swim.PING:
                continue
            if self.stall and self.pid:
                self.stall -= 1
                os.kill(self.pid, signal.SIGSTOP)
                try:
                    self.say(swim.ACK, m.seq, target=self.d.fake)  # waits in its socket
                    time.sleep(STALL_S)
                finally:
                    os.kill(self.pid, signal.SIGCONT)
                self.stalled += 1
            else:
                self.say(swim.ACK, m.seq, target=self.d.fake)


@pytest.fixture
def daemon_and_peer(tmp_path: Path) -> Iterator[tuple[MtcfsMount, FakePeer]]:
    with daemon_with_fake_peer(tmp_path) as d:
        m = d.mount
        assert m.proc is not None
        peer = FakePeer(d)
        try:
            peer.thread.start()
            yield m, peer
        finally:
            peer.done.set()
            if m.proc.poll() is None:
                os.kill(m.proc.pid, signal.SIGCONT)
            peer.thread.join(5)


def swim_status(m: MtcfsMount) -> dict:
    return control.request(str(m.path), "status")["status"]["peers"]["membership"]["swim"]


def test_a_stalled_daemon_reads_the_acks_that_came_before_it_judges(
        daemon_and_peer: tuple[MtcfsMount, FakePeer]) -> None:
    m, peer = daemon_and_peer
    assert m.proc is not None
    peer.say(swim.PING, 1)  # the daemon learns the peer alive
    deadline = time.monotonic() + 10
    while swim_status(m)["alive"] < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    before = swim_status(m)
    assert before["alive"] == 2 and before["suspect"] == 0, before
    peer.pid = m.proc.pid
    for _ in range(STALLS):
        # One stall at a time, each from a healthy daemon (its probe deadline 0.5 s:
        # two probes answered in time bring its health score back to 0).
        while swim_status(m)["health"] > 0 and time.monotonic() < deadline + 60:
            time.sleep(0.2)
        deadline = time.monotonic() + 60
        peer.stall = 1
        while peer.stall and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
    after = swim_status(m)
    assert peer.stalled == STALLS
    assert after["late_ticks"] > before["late_ticks"], after  # it did stall
    assert after["suspicions"] == before["suspicions"], after
    assert after["suspect"] == 0 and after["dead"] == 0, after
