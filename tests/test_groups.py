"""Dissemination groups (--peer-group, mtcfs.peer.grouped) on real daemons: four
FUSE mounts peered over gRPC on loopback, one group of four whose leader does not
turn (--peer-group-turn 0), so three hosts hand their index batches to the fourth
(the first by address), which carries them
down its tree. A file fsynced on a member is listed on every host when fsync
returns; with the leader killed (-9), a member's fsync still returns and its
file reaches every live host, down the member's own tree."""

from __future__ import annotations

import os
import time

from support.mounts import wait_until


def fsync_write(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def test_members_commit_through_their_leader_and_without_it(make_cluster) -> None:
    c = make_cluster(4, replicas=1, extra=("--peer-group", "4", "--peer-group-turn", "0"))
    names = "abcd"
    hosts = [c[n] for n in names]
    leaders = {h.status()["peers"]["tree"]["leader"] for h in hosts}
    assert len(leaders) == 1, leaders
    (leader_name,) = [n for n in names if c.addr(n) in leaders]
    assert leaders == {min(c.addr(n) for n in names)}
    leader = c[leader_name]
    members = [h for h in hosts if h is not leader]
    (members[0].path / "step_1").mkdir()
    for i, m in enumerate(members):
        fsync_write(m.path / "step_1" / f"shard-{i}", bytes([i]) * 4096)
        # fsync returned: every host lists it (with its size) at once.
        for h in hosts:
            assert os.path.getsize(h.path / "step_1" / f"shard-{i}") == 4096, h.path
    for m in members:
        tree = m.status()["peers"]["tree"]
        assert tree["handed"] >= 1 and tree["own_trees"] == 0, tree
    assert leader.status()["peers"]["tree"]["carried_for_others"] >= 3

    c.kill9(leader_name)
    writer, others = members[0], members[1:]
    t0 = time.monotonic()
    fsync_write(writer.path / "step_1" / "after", b"after the leader")
    took = time.monotonic() - t0
    assert took < 15, took  # not stuck on the dead leader (--commit-timeout: 10 s)
    for h in others:
        assert (h.path / "step_1" / "after").read_bytes() == b"after the leader", h.path
    wait_until(lambda: writer.status()["peers"]["tree"]["own_trees"] >= 1, 10,
               what="the hand-over went down the writer's own tree")
    for i in range(3):  # and every member's shard is still readable on every live host
        for h in members:
            assert (h.path / "step_1" / f"shard-{i}").read_bytes() == bytes([i]) * 4096
