"""The namespace written through to its metadata store (SQLite, a real file) and
read back as a restarted daemon reads it: every name, hard link, rename, exchange
and unlink-while-open survives a reopen exactly, in plain and in coalescing
transactions; and a store written by schema 5 (every name a dentry row) opens
under schema 6 (an inode's own name in its row) with the same tree."""

from __future__ import annotations

import random
import sqlite3
import stat
from pathlib import Path

import pytest

from mtcfs.core.namespace import ROOT, Inode, Namespace
from mtcfs.core.store import SCHEMA_VERSION, MetaStore

pytestmark = pytest.mark.nofuse

FILE, DIR = stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755


def tree(ns: Namespace) -> dict[str, tuple[str, int, frozenset[str]]]:
    """path -> (global id, its directory count, the node's other paths): what a
    reopened namespace must give back (inode numbers included, through the ids)."""
    out: dict[str, tuple[str, int, frozenset[str]]] = {}

    def walk(d: Inode) -> None:
        assert d.children is not None
        for name, ino in d.children.items():
            node = ns.inodes[ino]
            path = ns.path_at(d, name)
            names = {ns.path_of(node), *ns.link_paths(node)}
            out[path] = (node.guid, node.subdirs, frozenset(names - {path}))
            if node.is_dir:
                walk(node)

    walk(ns.inodes[ROOT])
    return out


def reopened(path: Path, ns: Namespace) -> Namespace:
    ns.store.close()
    return Namespace(MetaStore(str(path)))


@pytest.mark.parametrize("coalesce", [False, True])
def test_names_links_renames_survive_a_reopen(tmp_path: Path, coalesce: bool) -> None:
    db = tmp_path / "meta.db"
    ns = Namespace(MetaStore(str(db)))
    root = ns.inodes[ROOT]
    with ns.store.transaction(coalesce=coalesce):
        a = ns.new_inode(root, b"a", DIR, 0, 0)
        b = ns.new_inode(root, b"b", DIR, 0, 0)
        f = ns.new_inode(a, b"f", FILE, 0, 0)
        g = ns.new_inode(a, b"g", FILE, 0, 0)
        ns.link(f, b, b"f2")  # a further name
        ns.link(f, root, b"f3")
        ns.rename(a, b"g", b, b"g1")  # an own name moves
        ns.rename(b, b"f2", root, b"f2")  # a further name moves
        ns.rename(root, b"f3", b, b"g1", exchange=True)  # a further name <-> an own name
        h = ns.new_inode(b, b"h", FILE, 0, 0)
        ns.rename(a, b"f", b, b"h")  # an own name replaces another file
        ns.drop(h)
        open_but_gone = ns.new_inode(root, b"tmp", FILE, 0, 0)
        ns.unlink(root, b"tmp")  # unlinked while open: not there after a restart
    assert not open_but_gone.linked
    assert g.linked and f.linked
    before = tree(ns)
    assert set(before) == {"a", "b", "f2", "f3", "b/g1", "b/h"}
    assert before["b/h"][2] == {"f2", "b/g1"}  # f: its own name and two further ones
    assert before["f3"][0] == g.guid
    ns = reopened(db, ns)
    assert tree(ns) == before
    assert open_but_gone.ino not in ns.inodes

    # The own name goes while further names stay: the oldest becomes the own one.
    f = ns.by_global_id(before["b/h"][0])
    assert f is not None
    ns.unlink(ns.inodes[f.parent], f.name)
    after = tree(ns)
    ns = reopened(db, ns)
    assert tree(ns) == after
    assert set(after) == {"a", "b", "f2", "f3", "b/g1"}


def test_random_operations_survive_a_reopen(tmp_path: Path) -> None:
    """Random makes, links, renames (exchanges too) and unlinks, a few per
    coalescing transaction: after each round the reopened tree is the tree."""
    rnd = random.Random(7)
    db = tmp_path / "meta.db"
    ns = Namespace(MetaStore(str(db)))
    for _round in range(12):
        with ns.store.transaction(coalesce=rnd.random() < 0.5):
            for _ in range(25):
                dirs = [n for n in ns.inodes.values() if n.is_dir and n.linked]
                d = rnd.choice(dirs)
                files = [(p, name) for p in dirs for name, ino in (p.children or {}).items()
                         if ns.inodes[ino].is_file]
                op = rnd.random()
                name = f"n{rnd.randrange(30)}".encode()
                assert d.children is not None
                if op < 0.3 and name not in d.children:
                    ns.new_inode(d, name, DIR if rnd.random() < 0.3 else FILE, 0, 0)
                elif op < 0.5 and files and name not in d.children:
                    p, n = rnd.choice(files)
                    ns.link(ns.inodes[p.children[n]], d, name)  # type: ignore[index]
                elif op < 0.75 and files:
                    (p, n), (q, m) = rnd.choice(files), rnd.choice(files)
                    if (p, n) == (q, m) or p.children[n] == q.children[m]:  # type: ignore[index]
                        continue
                    ns.rename(p, n, q, m, exchange=rnd.random() < 0.5)
                elif files:
                    p, n = rnd.choice(files)
                    node = ns.unlink(p, n)
                    if not node.linked:
                        ns.drop(node)
        before = tree(ns)
        ns = reopened(db, ns)
        assert tree(ns) == before


def test_a_schema_5_store_opens_with_the_same_tree(tmp_path: Path) -> None:
    """Until schema 6 every name was a dentry row (alias 0: the own name)."""
    db = tmp_path / "meta.db"
    ns = Namespace(MetaStore(str(db)))
    root = ns.inodes[ROOT]
    d = ns.new_inode(root, b"step_1", DIR, 0, 0)
    f = ns.new_inode(d, b"shard", FILE, 0, 0)
    ns.link(f, root, b"shard.link")
    ns.new_inode(root, b"open-unlinked", FILE, 0, 0)
    ns.unlink(root, b"open-unlinked")
    before = tree(ns)
    ns.store.close()
    # Rewrite it as schema 5 wrote it.
    con = sqlite3.connect(db, isolation_level=None)
    con.execute("ALTER TABLE dentries RENAME TO links")
    con.execute("CREATE TABLE dentries (parent INTEGER NOT NULL, name BLOB NOT NULL,"
                " ino INTEGER NOT NULL, alias INTEGER NOT NULL DEFAULT 0,"
                " PRIMARY KEY (parent, name))")
    con.execute("INSERT INTO dentries SELECT parent, name, ino, 0 FROM inodes WHERE parent != 0")
    con.execute("INSERT INTO dentries SELECT parent, name, ino, 1 FROM links")
    con.execute("DROP TABLE links")
    con.execute("CREATE INDEX dentries_ino ON dentries (ino)")
    con.execute("ALTER TABLE inodes DROP COLUMN parent")
    con.execute("ALTER TABLE inodes DROP COLUMN name")
    con.execute("UPDATE meta SET value='5' WHERE key='schema'")
    con.close()

    ns = Namespace(MetaStore(str(db)))
    assert tree(ns) == before
    assert ns.store.get_meta("schema") == str(SCHEMA_VERSION)
    con = sqlite3.connect(db)
    assert con.execute("SELECT count(*) FROM dentries WHERE alias = 0").fetchone() == (0,)
    assert con.execute("SELECT count(*) FROM dentries").fetchone() == (1,)
    assert con.execute("SELECT name FROM sqlite_master WHERE name='dentries_ino'"
                       ).fetchone() is None
    con.close()
