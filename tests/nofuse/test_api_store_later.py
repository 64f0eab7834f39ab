"""Rows left for later (MetaStore.write_behind): a host applying a pulled snapshot
keeps its files' rows in memory and writes them once it is live (LaterRows). Each
is written with its inode's state when it is written; directories are written at
once, so a crash before the rest are written leaves no row naming a parent the
store lacks; a row written or deleted meanwhile is not written again; a hard link
to such a file writes the file's row first; closing the store writes them all.
A crash is the database closed with rows still left for later, then reopened as a
restarted daemon opens it."""

from __future__ import annotations

import logging
import sqlite3
import stat
from pathlib import Path

import pytest
import trio

from mtcfs.core.namespace import ROOT, Inode, Namespace
from mtcfs.core.store import MetaStore

from support.inprocess import Host, until
from support.ports import free_port

pytestmark = pytest.mark.nofuse

FILE, DIR = stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755


def stored(db: Path) -> dict[bytes, tuple[int, int]]:
    """name -> (size, parent) of every inode row, read by a connection of its own."""
    con = sqlite3.connect(str(db))
    try:
        return {name: (size, parent)
                for name, size, parent in con.execute("SELECT name, size, parent FROM inodes")}
    finally:
        con.close()


def at(ns: Namespace, path: str) -> Inode | None:
    node: Inode | None = ns.inodes[ROOT]
    for name in path.split("/"):
        node = None if node is None else ns.child(node, name.encode())
    return node


def crashed(db: Path, ns: Namespace) -> Namespace:
    """The daemon killed: what was committed stays, what was left for later is gone."""
    ns.store.db.close()
    return Namespace(MetaStore(str(db)))


def pulled(ns: Namespace, files: int) -> Inode:
    """A snapshot's piece applied within write_behind: a directory and its files."""
    root = ns.inodes[ROOT]
    with ns.store.write_behind(), ns.store.transaction(coalesce=True):
        d = ns.new_inode(root, b"step_1", DIR, 0, 0)
        for i in range(files):
            f = ns.new_inode(d, f"shard{i}".encode(), FILE, 0, 0)
            f.size = 100 + i
            ns.persist(f)
    return d


def test_files_rows_wait_directories_do_not(tmp_path: Path) -> None:
    db = tmp_path / "meta.db"
    ns = Namespace(MetaStore(str(db)))
    pulled(ns, 5)
    assert ns.store.rows_later == 5
    rows = stored(db)
    assert b"step_1" in rows and not any(n.startswith(b"shard") for n in rows)
    # The oldest first, with the state they have when written.
    shard0 = at(ns, "step_1/shard0")
    shard0.size = 7_000
    assert ns.store.write_later(2) == 3
    rows = stored(db)
    assert rows[b"shard0"][0] == 7_000 and rows[b"shard1"][0] == 101
    assert b"shard2" not in rows
    assert ns.store.write_later(100) == 0
    assert {n for n in stored(db) if n.startswith(b"shard")} == {
        f"shard{i}".encode() for i in range(5)}


def test_a_crash_before_they_are_written_leaves_no_orphan(tmp_path: Path) -> None:
    """A file made here in a pulled directory, then a crash: the directory's row is
    there, so the file keeps its name; the pulled files are gone (the next start
    pulls them again)."""
    db = tmp_path / "meta.db"
    ns = Namespace(MetaStore(str(db)))
    d = pulled(ns, 3)
    mine = ns.new_inode(d, b"mine", FILE, 0, 0)
    mine.size = 42
    ns.persist(mine)
    again = crashed(db, ns)
    assert sorted(at(again, "step_1").children or {}) == [b"mine"]
    assert at(again, "step_1/mine").size == 42


def test_a_row_written_or_removed_meanwhile_is_not_written_again(tmp_path: Path) -> None:
    db = tmp_path / "meta.db"
    ns = Namespace(MetaStore(str(db)))
    d = pulled(ns, 3)
    s0 = at(ns, "step_1/shard0")
    s0.size = 1
    ns.persist(s0)  # written now: not later
    s1 = ns.unlink(d, b"shard1")
    ns.drop(s1)  # removed: never written
    assert ns.store.rows_later == 1
    assert stored(db)[b"shard0"][0] == 1
    assert ns.store.write_later(10) == 0
    assert sorted(n for n in stored(db) if n.startswith(b"shard")) == [b"shard0", b"shard2"]


def test_a_hard_link_to_a_file_left_for_later_writes_its_row(tmp_path: Path) -> None:
    db = tmp_path / "meta.db"
    ns = Namespace(MetaStore(str(db)))
    pulled(ns, 2)
    s1 = at(ns, "step_1/shard1")
    ns.link(s1, ns.inodes[ROOT], b"latest")
    again = crashed(db, ns)
    node = at(again, "latest")
    assert node.size == 101 and again.path_of(node) == "step_1/shard1"
    assert at(again, "step_1/shard0") is None  # left for later: gone


def test_a_second_pull_leaves_the_same_rows_later_once(tmp_path: Path) -> None:
    db = tmp_path / "meta.db"
    ns = Namespace(MetaStore(str(db)))
    pulled(ns, 3)
    with ns.store.write_behind(), ns.store.transaction(coalesce=True):
        f = at(ns, "step_1/shard2")
        f.size = 9
        ns.persist(f)
    assert ns.store.rows_later == 3
    ns.store.close()  # a clean stop writes them all
    again = Namespace(MetaStore(str(db)))
    assert at(again, "step_1/shard2").size == 9
    assert sorted(at(again, "step_1").children or {}) == [
        b"shard0", b"shard1", b"shard2"]


@pytest.mark.trio
async def test_a_joining_host_is_live_then_its_store_has_every_row(make_host, caplog) -> None:
    """A third host joins a job whose index has 1,200 files: its snapshot pull
    leaves their rows for later, and LaterRows writes them once it is live."""
    pa, pc = free_port(), free_port()
    common = {"insecure": True, "replicas": 1, "commit_timeout": 10,
              "data_listen": "127.0.0.1:0"}
    a: Host = await make_host("a", start=False, listen=f"127.0.0.1:{pa}", **common)
    await make_host.start(a)
    for step in range(3):
        a.makedirs(f"step_{step}")
        for i in range(400):
            await a.write_file(f"step_{step}/shard{i}", b"x" * (i + 1))
    caplog.set_level(logging.INFO, logger="mtcfs.peer.join")
    c: Host = await make_host("c", start=False, listen=f"127.0.0.1:{pc}",
                              peers=f"127.0.0.1:{pa}", **common)
    await make_host.start(c)
    assert sorted(c.listdir("step_2")) == sorted(f"shard{i}" for i in range(400))
    store = c.mount.ns.store

    def said() -> list[int]:  # LaterRows' line, once it has written them all
        return [r.args[0] for r in caplog.records
                if isinstance(r.msg, str) and r.msg.startswith("stored the")]

    await until(lambda: said(), what="c's rows written")
    assert store.rows_later == 0
    con = sqlite3.connect(store.path)
    try:
        sizes = sorted(size for name, size in con.execute("SELECT name, size FROM inodes")
                       if name.startswith(b"shard"))
    finally:
        con.close()
    assert sizes == sorted(list(range(1, 401)) * 3)
    assert said()[0] >= 1_200, said()  # they were left for later, then written


@pytest.mark.trio
async def test_rows_the_store_cannot_take_wait_and_go_later(tmp_path: Path, monkeypatch,
                                                            caplog) -> None:
    """The RAM dir full when LaterRows writes: it says so and tries again; the daemon
    goes on (the rows are written once there is room)."""
    from mtcfs.peer import join

    db = tmp_path / "meta.db"
    ns = Namespace(MetaStore(str(db)))
    pulled(ns, 3)
    monkeypatch.setattr(join, "LATER_RETRY", 0.01)
    real, fails = ns.store.write_later, [2]

    def full_twice(limit: int) -> int:
        if fails[0]:
            fails[0] -= 1
            raise sqlite3.OperationalError("database or disk is full")
        return real(limit)

    monkeypatch.setattr(ns.store, "write_later", full_twice)
    later = join.LaterRows(ns.store)
    async with trio.open_nursery() as n:
        n.start_soon(later.run)
        later.poke()
        await until(lambda: ns.store.rows_later == 0, what="the rows written")
        n.cancel_scope.cancel()
    assert caplog.text.count("database or disk is full") == 2
    assert {n for n in stored(db) if n.startswith(b"shard")} == {b"shard0", b"shard1", b"shard2"}
