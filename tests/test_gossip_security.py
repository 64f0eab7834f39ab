"""Membership datagrams (mtcfs.peer.gossip) against a real daemon: forged,
unauthenticated, misdirected, stale and replayed datagrams change nothing; an
authentic one is heard.

The daemon has one configured peer: a UDP socket of this test, which speaks
SWIM's messages sealed with the job's key (or not).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mtcfs import control
from mtcfs.peer import swim
from mtcfs.peer.gossip import MAC_LEN, MAGIC, Codec
from mtcfs.peer.v1 import peer_pb2 as pb

from support.gcs_server import free_port
from support.mounts import MtcfsMount, dispose

FAKE_NODE = "node-fake"


@dataclass
class Setup:
    mount: MtcfsMount
    addr: str  # the daemon's --listen
    fake: str  # the fake peer's address (configured in the daemon's --peers)
    sock: socket.socket
    token: bytes

    def membership(self) -> dict[str, Any]:
        return control.request(str(self.mount.path), "status")["status"]["peers"]["membership"]

    def peer(self) -> dict[str, Any]:
        peers = control.request(str(self.mount.path), "status")["status"]["peers"]["peers"]
        return next(p for p in peers if p["address"] == self.fake)

    def send(self, data: bytes) -> None:
        host, port = self.addr.rsplit(":", 1)
        self.sock.sendto(data, (host, int(port)))


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("gossip-security")
    ram_root = Path("/dev/shm") / f"mtcfs-test-{uuid.uuid4().hex[:10]}"
    ram_root.mkdir()
    token = os.urandom(16).hex().encode()
    (tmp / "token").write_bytes(token + b"\n")
    mp = tmp / "mnt"
    mp.mkdir()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.2)
    fake = f"127.0.0.1:{sock.getsockname()[1]}"
    addr = f"127.0.0.1:{free_port()}"
    m = MtcfsMount(mp, ram_root / "ram-a", "64MiB", "node-a",
                   ("--listen", addr, "--peers", fake, "--token-file", str(tmp / "token"),
                    "--commit-timeout", "3"))
    try:
        m.start(timeout=30)
        yield Setup(m, addr, fake, sock, token)
    finally:
        sock.close()
        dispose(m, ram_root)


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
