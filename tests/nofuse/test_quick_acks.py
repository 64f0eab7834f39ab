"""A daemon's event loop busy for seconds (every host of a job saving at once on two
cores) still answers SWIM's pings and refutes suspicions at once: the thread that
reads the datagrams does (membership.QuickAcks), so that SWIM finds dead the hosts
that are gone, not the hosts that are busy.

The real `Membership` runs in a trio loop of its own thread, over real UDP sockets
on loopback with the job's key; a UDP socket of the test is its one peer and
answers its probes. "Busy" is a blocking call the test schedules into that loop
(time.sleep: to the datagram thread it looks as a CPU-bound save does).
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import trio

from mtcfs.peer import membership, swim
from mtcfs.peer.gossip import Codec
from mtcfs.peer.membership import Membership
from mtcfs.peer.v1 import peer_pb2 as pb

from support.gcs_server import free_port

pytestmark = pytest.mark.nofuse

BUSY_S = 3.0


class Peer:
    """The test's side: answers the host's probes; hands the acks of its own pings to
    the test with their arrival time."""

    def __init__(self, token: bytes) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.codec = Codec(self.addr, token)
        self.host = ""
        self.incarnation = time.time_ns() // 10**6
        self.acks: queue.Queue[tuple[float, pb.GossipMessage]] = queue.Queue()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def say(self, kind: int, seq: int, target: str = "",
            updates: tuple[pb.MemberUpdate, ...] = (), node_id: str = "node-fake") -> None:
        m = pb.GossipMessage(from_node=self.addr, kind=kind, seq=seq,
                             incarnation=self.incarnation, target=target, node_id=node_id,
                             updates=updates)
        host, port = self.host.rsplit(":", 1)
        self.sock.sendto(self.codec.seal(m, self.host), (host, int(port)))

    def _run(self) -> None:
        while not self.done.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            m = self.codec.open(data)
            if m is None:
                continue
            if m.kind == swim.PING:
                self.say(swim.ACK, m.seq, target=self.addr)
            elif m.kind == swim.ACK and m.seq >= 1000 or m.kind == swim.GOSSIP:
                self.acks.put((time.monotonic(), m))  # answers to the test's messages

    def acks_of(self, seq: int, within: float) -> list[tuple[float, pb.GossipMessage]]:
        out = []
        end = time.monotonic() + within
        while (left := end - time.monotonic()) > 0:
            try:
                at, m = self.acks.get(timeout=left)
            except queue.Empty:
                break
            if m.seq == seq:
                out.append((at, m))
        return out


class Host:
    """The Membership under test, run by trio in a thread of its own."""

    def __init__(self, peer: Peer, token: bytes) -> None:
        self.addr = f"127.0.0.1:{free_port()}"
        peer.host = self.addr
        self.members = Membership(self.addr, "node-a", [peer.addr], None, token, None)
        self.token: trio.lowlevel.TrioToken | None = None
        self._started = threading.Event()
        self._stop: trio.Event | None = None
        self.thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)
        self.thread.start()
        assert self._started.wait(10)

    async def _main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.members.run)
            self._started.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def busy(self, seconds: float) -> float:
        """Hold the event loop for `seconds` from now; returns when it ends."""
        assert self.token is not None
        self.token.run_sync_soon(time.sleep, seconds)
        return time.monotonic() + seconds

    def stop(self) -> None:
        assert self.token is not None and self._stop is not None
        self.token.run_sync_soon(self._stop.set)
        self.thread.join(10)
        self.members.close()


@pytest.fixture
def pair() -> Iterator[tuple[Host, Peer]]:
    token = os.urandom(16).hex().encode()
    peer = Peer(token)
    peer.thread.start()
    host = Host(peer, token)
    try:
        # The host learns its peer (alive) and tells it in its datagrams until the
        # news is spread: from then on its own acks carry none.
        peer.say(swim.PING, 999)
        swim_ = host.members.swim

        def heard() -> bool:
            m = swim_.members.get(peer.addr)
            return m is not None and m.incarnation == peer.incarnation

        deadline = time.monotonic() + 20
        while (not heard() or swim_._news) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert heard() and swim_.status()["alive"] == 2, swim_.status()
        assert not swim_._news
        yield host, peer
    finally:
        peer.done.set()
        host.stop()
        peer.thread.join(5)
        peer.sock.close()


def test_a_busy_loop_answers_pings_at_once_and_once(pair: tuple[Host, Peer]) -> None:
    host, peer = pair
    sent_before = host.members.quick.sent
    until = host.busy(BUSY_S)
    time.sleep(0.2)
    peer.say(swim.PING, 1000)
    sent = time.monotonic()
    acks = peer.acks_of(1000, within=until - sent + 1.5)  # the loop back, and a second
    assert acks, "no answer"
    first_at, first = acks[0]
    # Answered while the loop was held, at the host's incarnation, with no news.
    assert first_at < until - 0.5, (first_at - sent, until - sent)
    assert first.incarnation == host.members.swim.incarnation and not first.updates
    assert first.from_node == host.addr and first.target == host.addr
    # The loop, back, had no news to add: no second ack.
    assert len(acks) == 1, [(round(at - sent, 3), list(m.updates)) for at, m in acks[1:]]
    assert host.members.quick.sent > sent_before
    assert host.members.status()["datagrams"]["quick_acks"] == host.members.quick.sent
    # SWIM saw the ping all the same (its sender heard of, directly).
    assert host.members.swim.status()["alive"] == 2


def test_a_wedged_loop_answers_no_ping_until_it_comes_round(
        pair: tuple[Host, Peer], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    host, peer = pair
    monkeypatch.setattr(membership, "WEDGED", 1.0)
    until = host.busy(BUSY_S)
    time.sleep(1.5)  # past WEDGED: the loop has not come round
    peer.say(swim.PING, 1001)
    acks = peer.acks_of(1001, within=until - time.monotonic() + 2.0)
    assert acks, "the loop did not answer once back"
    assert acks[0][0] >= until - 0.05, "a wedged loop's ping was answered quickly"
    assert len(acks) == 1  # the loop's own ack: no quick one before it
    assert "has not come round for 1 s" in caplog.text
    assert "came round again" in caplog.text
    # Back to quick answers once it came round (WEDGED as the daemon has it: an idle
    # loop comes round about once a second).
    monkeypatch.setattr(membership, "WEDGED", 20.0)
    sent_before = host.members.quick.sent
    peer.say(swim.PING, 1002)
    assert peer.acks_of(1002, within=1.0)
    assert host.members.quick.sent == sent_before + 1


def test_a_busy_loop_refutes_a_suspicion_at_once(pair: tuple[Host, Peer]) -> None:
    host, peer = pair
    was = host.members.swim.incarnation
    refutations = host.members.swim.status()["refutations"]
    suspect = (pb.MemberUpdate(node=host.addr, state=swim.SUSPECT, incarnation=was),)
    until = host.busy(BUSY_S)
    time.sleep(0.2)
    # On a ping: its quick ack carries the higher incarnation (the refutation).
    peer.say(swim.PING, 1003, updates=suspect)
    acks = peer.acks_of(1003, within=1.0)
    assert acks and acks[0][0] < until - 0.5, "not answered while the loop was held"
    assert acks[0][1].incarnation == was + 1, acks[0][1]
    # On another message (gossip): answered with a message at that incarnation too.
    suspect = (pb.MemberUpdate(node=host.addr, state=swim.SUSPECT, incarnation=was + 1),)
    peer.say(swim.GOSSIP, 0, updates=suspect)
    answered = peer.acks_of(0, within=1.0)
    assert answered and answered[0][0] < until - 0.5
    assert answered[0][1].kind == swim.GOSSIP and answered[0][1].incarnation == was + 2
    # Once back, the loop does not refute the same suspicions again.
    time.sleep(until - time.monotonic() + 1.0)
    assert host.members.swim.incarnation == was + 2
    assert host.members.swim.status()["refutations"] == refutations + 2
    assert host.members.status()["datagrams"]["quick_refutations"] == 2


def test_a_peer_is_found_by_its_node_id_and_by_its_new_one(pair: tuple[Host, Peer]) -> None:
    """Membership.by_node (asked for each holder of each file a batch changes) is kept
    by membership version: a host at the same address that speaks with another node
    id (a replacement) is found by the new id at once, and no longer by the old."""
    host, peer = pair
    members = host.members
    assert members.by_node("node-fake") is members.peers[peer.addr]
    assert members.by_node("node-other") is None
    peer.say(swim.PING, 1001, node_id="node-new")
    deadline = time.monotonic() + 10
    while members.peers[peer.addr].node_id != "node-new" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert members.by_node("node-new") is members.peers[peer.addr]
    assert members.by_node("node-fake") is None
    assert members.is_live("node-new") and not members.is_live("node-fake")
