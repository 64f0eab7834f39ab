"""Membership datagrams (mtcfs.peer.gossip) against a real daemon: forged,
unauthenticated, misdirected, stale and replayed datagrams change nothing; an
authentic one is heard.

The daemon has one configured peer: a UDP socket of this test, which speaks
SWIM's messages sealed with the job's key (or not).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from mtcfs import control
from mtcfs.peer import swim
from mtcfs.peer.gossip import MAC_LEN, MAGIC, Codec
from mtcfs.peer.v1 import peer_pb2 as pb

from support.fakepeer import DaemonAndSocket, daemon_with_fake_peer

FAKE_NODE = "node-fake"


class Setup(DaemonAndSocket):
    def membership(self) -> dict[str, Any]:
        return control.request(str(self.mount.path), "status")["status"]["peers"]["membership"]

    def peer(self) -> dict[str, Any]:
        peers = control.request(str(self.mount.path), "status")["status"]["peers"]["peers"]
        return next(p for p in peers if p["address"] == self.fake)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    with daemon_with_fake_peer(tmp_path_factory.mktemp("gossip-security"),
                               ("--commit-timeout", "3")) as d:
        yield Setup(d.mount, d.addr, d.fake, d.sock, d.token)


def message(s: Setup, kind: int, incarnation: int, **kw: Any) -> pb.GossipMessage:
    return pb.GossipMessage(from_node=s.fake, kind=kind, seq=kw.pop("seq", 1),
                            incarnation=incarnation, node_id=FAKE_NODE, **kw)


def answers(s: Setup, seq: int, within: float = 3.0) -> pb.GossipMessage | None:
    """The daemon's ACK of our ping `seq`, opened with the job's key."""
    codec = Codec(s.fake, s.token)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            data = s.sock.recv(65536)
        except TimeoutError:
            continue
        m = codec.open(data)
        if m is not None and m.kind == swim.ACK and m.seq == seq:
            return m
    return None


def settle() -> None:
    time.sleep(0.5)


def test_forged_datagrams_change_nothing(setup: Setup) -> None:
    s = setup
    before = s.membership()
    swim_before = {k: before["swim"][k] for k in ("incarnation", "refutations")}
    inc = time.time_ns() // 10**6
    # A SUSPECT of the daemon itself would make it refute (its incarnation goes up),
    # and an ALIVE of the fake peer would make it alive: neither may happen.
    suspect_you = [pb.MemberUpdate(node=s.addr, state=swim.SUSPECT,
                                   incarnation=before["swim"]["incarnation"])]
    good = Codec(s.fake, s.token)
    wrong_key = Codec(s.fake, b"not the token of this job")
    no_key = Codec(s.fake, None)
    sealed = good.seal(message(s, swim.PING, inc, seq=11, updates=suspect_you), s.addr)
    forged: dict[str, bytes] = {
        "another token": wrong_key.seal(message(s, swim.PING, inc, updates=suspect_you),
                                        s.addr),
        "no token (--insecure's key)": no_key.seal(
            message(s, swim.PING, inc, updates=suspect_you), s.addr),
        "no MAC": sealed[:-MAC_LEN],
        "MAC of another body": MAGIC + b"\x08\x01" + sealed[-MAC_LEN:],
        "one bit flipped": sealed[:20] + bytes([sealed[20] ^ 1]) + sealed[21:],
        "garbage": os.urandom(200),
        "empty": b"",
        "for another host": good.seal(message(s, swim.PING, inc, seq=12,
                                              updates=suspect_you), "127.0.0.1:1"),
    }
    old = Codec(s.fake, s.token, clock=lambda: time.time_ns() - 120 * 10**9)
    forged["two minutes old"] = old.seal(message(s, swim.PING, inc, seq=13,
                                                 updates=suspect_you), s.addr)
    for data in forged.values():
        s.send(data)
    settle()
    after = s.membership()
    assert {k: after["swim"][k] for k in swim_before} == swim_before, after
    assert not s.peer()["alive"], s.peer()
    dropped = after["datagrams"]["dropped"]
    assert dropped["bad_mac"] - before["datagrams"]["dropped"]["bad_mac"] >= 5, dropped
    assert dropped["misdirected"] > before["datagrams"]["dropped"]["misdirected"], dropped
    assert dropped["stale"] > before["datagrams"]["dropped"]["stale"], dropped
    assert answers(s, 11, within=0.5) is None  # nothing was answered
    assert s.mount.proc is not None and s.mount.proc.poll() is None, s.mount.log()


def test_authentic_datagram_is_heard_and_its_replay_changes_nothing(setup: Setup) -> None:
    s = setup
    before = s.membership()
    inc = time.time_ns() // 10**6
    suspect_you = [pb.MemberUpdate(node=s.addr, state=swim.SUSPECT,
                                   incarnation=before["swim"]["incarnation"])]
    good = Codec(s.fake, s.token)
    data = good.seal(message(s, swim.PING, inc, seq=21, updates=suspect_you), s.addr)
    s.send(data)
    ack = answers(s, 21)
    assert ack is not None, "the daemon did not answer an authentic ping"
    assert ack.node_id == "node-a" and ack.from_node == s.addr
    # That was the quick ack of the datagram thread: no news, and the suspicion it
    # carried refuted already (a higher incarnation). The event loop's own ack follows
    # with its news (the fake peer alive).
    assert ack.incarnation > before["swim"]["incarnation"] and not ack.updates, ack
    loops = answers(s, 21)
    assert loops is not None and loops.incarnation == ack.incarnation, loops
    # It refuted the suspicion, and the fake peer is alive in its view.
    refuted = s.membership()["swim"]
    assert refuted["incarnation"] > before["swim"]["incarnation"], refuted
    assert refuted["refutations"] == before["swim"]["refutations"] + 1, refuted
    assert s.peer()["alive"] and s.peer()["node_id"] == FAKE_NODE, s.peer()
    # The same datagram again (a recorded one replayed): dropped, nothing changes.
    replayed_before = s.membership()["datagrams"]["dropped"]["replayed"]
    for _ in range(3):
        s.send(data)
    assert answers(s, 21, within=0.5) is None
    after = s.membership()
    assert after["swim"]["incarnation"] == refuted["incarnation"], after
    assert after["swim"]["refutations"] == refuted["refutations"], after
    assert after["datagrams"]["dropped"]["replayed"] == replayed_before + 3, after
    # The fake peer does not answer the daemon's probes: it is found dead in time.
    deadline = time.monotonic() + 10
    while s.peer()["alive"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not s.peer()["alive"], s.peer()
