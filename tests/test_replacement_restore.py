"""A replacement host restored before it is asked (mtcfs.lifecycle.replacement).

Real daemons on loopback: a host writes two committed steps, its files are
replicated to both peers (K=2), it is killed -9, and a replacement starts under
its node id with an EMPTY RAM dir. Without any read, it pulls the files the job
listed it as holding into its RAM tier, newest step first, striped over the
holders, while one holder is frozen (SIGSTOP); a trainer reading a file the
restore has not reached yet gets the right bytes; `mtcfs prefetch --restore`
waits for it, as an init container would.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from support.mounts import MtcfsMount, blob, crc_of, data_files, file_crc, wait_until, write

MiB = 1 << 20
STEPS = ("step_1", "step_2")
SHARDS = 4


def replicated(m: MtcfsMount, rel: str, k: int) -> None:
    wait_until(lambda: m.state(rel)["replicas"] >= k, 60, interval=0.1,
               what=f"{rel} in {k} peer copies")


def saved_then_lost(c, k: int) -> dict[str, int]:
    """Host a saves two steps, each file reaches k peers, then a is killed -9."""
    crcs = save_steps(c["a"])
    for rel in crcs:
        replicated(c["a"], rel, k)
    c.kill9("a")
    return crcs


def save_steps(m: MtcfsMount) -> dict[str, int]:
    """Two committed torch-DCP-like steps on host m: shards, then the marker."""
    crcs = {}
    for s, step in enumerate(STEPS):
        for i in range(SHARDS):
            rel = f"{step}/__{i}_0.distcp"
            crcs[rel] = crc_of(write(m, rel, blob(100 * s + i, 24 * MiB + i)))
        rel = f"{step}/.metadata"
        crcs[rel] = crc_of(write(m, rel, blob(100 * s + 99, 4096)))
    return crcs


@pytest.mark.slow
def test_a_replacement_restores_what_it_held_while_a_holder_is_frozen(make_cluster):
    c = make_cluster(3, replicas=2)
    crcs = saved_then_lost(c, 2)
    frozen = c["b"].proc
    assert frozen is not None
    frozen.send_signal(signal.SIGSTOP)
    try:
        new = c.replace("a")  # the same node id and address, an EMPTY RAM dir
        assert new.node_id == "node-a"
        got: list[int] = []
        # A trainer reads the step the restore reaches last, at once.
        last = f"{STEPS[0]}/__{SHARDS - 1}_0.distcp"
        reader = threading.Thread(target=lambda: got.append(file_crc(new.path / last)))
        reader.start()
        st = wait_until(lambda: (r := new.status()["restore"])["state"] == "done" and r, 120,
                        interval=0.2, what="the background restore done")
        reader.join(60)
    finally:
        frozen.send_signal(signal.SIGCONT)
    assert got == [crcs[last]], "the trainer's read got other bytes"
    assert st["files_total"] == len(crcs) and st["files_done"] == len(crcs), st
    assert st["failed"] == 0 and st["bytes_done"] == st["bytes_total"], st
    # Every file is in the new host's RAM tier, verified, byte for byte.
    held = {file_crc(p) for p in data_files(new.ram_dir)}
    assert set(crcs.values()) <= held
    for rel, crc in crcs.items():
        s = new.state(rel)
        assert "node-a" in s["holders"] and s["crc32c"] == f"{crc:08x}", (rel, s)
    # Newest step first: the first file the restore fetched is one of step_2's.
    fetched = [line for line in new.log().splitlines() if " fetched " in line]
    assert fetched and f"{STEPS[1]}/" in fetched[0], fetched[:3]
    by_source = new.status()["peers"]["bytes_fetched_by_source"]
    assert set(by_source) <= {"node-b", "node-c"} and by_source.get("node-c"), by_source


def test_prefetch_restore_waits_for_the_background_restore(make_cluster):
    c = make_cluster(2, replicas=1)
    crcs = saved_then_lost(c, 1)
    new = c.replace("a")
    r = subprocess.run([sys.executable, "-m", "mtcfs", "prefetch", str(new.path), "--restore",
                        "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["files"] == len(crcs) and out["failed"] == {}, out
    st = new.status()["restore"]
    assert st["files_done"] == len(crcs), st
    assert {file_crc(p) for p in data_files(new.ram_dir)} >= set(crcs.values())
    # Nothing to restore on a host that lost nothing; PATHS and --restore exclude each other.
    assert c["b"].status()["restore"]["files_total"] == 0
    bad = subprocess.run([sys.executable, "-m", "mtcfs", "prefetch", str(new.path), "--restore",
                          "step_1"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "not both" in bad.stderr, bad.stderr


def test_a_restored_copy_counts_again_and_is_restored_after_a_second_loss(make_cluster):
    """What the restore brings back is the copy the job counted on this node id for,
    not a cache copy: the other hosts list the replacement as a holder of each file
    again (by the time the restore says it is done), and when the replacement is lost
    too, the next one restores it all again."""
    c = make_cluster(2, replicas=1)
    crcs = saved_then_lost(c, 1)
    for generation in (1, 2):
        new = c.replace("a")
        st = wait_until(lambda m=new: (r := m.status()["restore"])["state"] == "done" and r,
                        120, interval=0.2, what=f"restore {generation} done")
        assert st["files_done"] == len(crcs) and st["failed"] == 0, (generation, st)
        assert {file_crc(p) for p in data_files(new.ram_dir)} >= set(crcs.values())
        # Done means counted: b has applied the replacement's word that it holds them.
        for rel in crcs:
            assert "node-a" in c["b"].state(rel)["holders"], (generation, rel, c["b"].state(rel))
        # Once both have sent what they had to say (the replacement's word that it
        # lacked the files, then that it holds them again), and a moment for it to land:
        for m in (new, c["b"]):
            wait_until(lambda m=m: m.status()["peers"]["broadcast_queue"] == 0, 30,
                       interval=0.1, what="nothing left to broadcast")
        time.sleep(2)
        for rel in crcs:
            assert "node-a" in c["b"].state(rel)["holders"], (generation, rel, c["b"].state(rel))
        c.kill9("a")


def test_a_restore_is_done_once_the_other_hosts_count_its_copies(make_cluster):
    """The restore says it is done only once every live peer has applied its word that
    it holds the files again: a replacement lost right after that leaves them listed
    as its, for the next one to restore. (Over gRPC, the slower path, and large
    enough that the restore outlasts the second its start's "I lack them" may wait.)"""
    c = make_cluster(2, replicas=1, extra=("--data-connections", "0"))
    a = c["a"]
    rels = [f"step_5/__{i}_0.distcp" for i in range(10)]  # 1.2-1.4 s to restore here
    for i, rel in enumerate(rels):
        write(a, rel, blob(500 + i, 128 * MiB))
    write(a, "step_5/.metadata", b"meta")
    for rel in rels:
        replicated(a, rel, 1)
    c.kill9("a")
    new = c.replace("a")
    st = wait_until(lambda: (r := new.status()["restore"])["state"] == "done" and r, 120,
                    interval=0.02, what="the background restore done")
    holders = {rel: c["b"].state(rel)["holders"] for rel in rels}  # at once
    assert st["files_done"] == len(rels) + 1 and st["failed"] == 0, st
    assert all("node-a" in h for h in holders.values()), holders
