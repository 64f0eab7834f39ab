"""The metadata database: namespace, attributes and per-file state.

It lives in the RAM dir beside the data, so a daemon killed with -9 and
started again re-adopts both. SQLite with `synchronous=OFF`: a committed
transaction has reached the page cache (tmpfs), which survives the death of
the process; fsync would only protect against losing the machine, and then
the RAM tier is gone anyway.

Only namespace changes and seals are written: write() never touches the
database, so metadata cost does not grow with the bytes written.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice

SCHEMA_VERSION = 6
# An inode row's columns (_INODE_COLS' order), as Inode.params makes them.
Params = tuple[object, ...]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS inodes (
    ino INTEGER PRIMARY KEY,
    mode INTEGER NOT NULL,
    uid INTEGER NOT NULL,
    gid INTEGER NOT NULL,
    size INTEGER NOT NULL,
    atime_ns INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    ctime_ns INTEGER NOT NULL,
    rdev INTEGER NOT NULL DEFAULT 0,
    target BLOB,
    state TEXT NOT NULL,
    crc32c INTEGER,
    version INTEGER NOT NULL DEFAULT 0,
    persisted_version INTEGER NOT NULL DEFAULT 0,
    generation INTEGER NOT NULL DEFAULT 0,
    has_data INTEGER NOT NULL DEFAULT 1,
    guid TEXT NOT NULL DEFAULT '',
    lamport INTEGER NOT NULL DEFAULT 0,
    writer TEXT NOT NULL DEFAULT '',
    holders TEXT NOT NULL DEFAULT '',
    block_crcs BLOB,
    author TEXT NOT NULL DEFAULT '',
    parent INTEGER NOT NULL DEFAULT 0,
    name BLOB NOT NULL DEFAULT x''
);
-- Hard links' further names (alias 1); until schema 6 every name (own: alias 0).
CREATE TABLE IF NOT EXISTS dentries (
    parent INTEGER NOT NULL,
    name BLOB NOT NULL,
    ino INTEGER NOT NULL,
    alias INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (parent, name)
);
CREATE TABLE IF NOT EXISTS pending_deletes (
    key TEXT PRIMARY KEY,
    generation INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS tombstones (
    guid TEXT PRIMARY KEY,
    lamport INTEGER NOT NULL,
    writer TEXT NOT NULL,
    removed_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS xattrs (
    ino INTEGER NOT NULL,
    name BLOB NOT NULL,
    value BLOB NOT NULL,
    PRIMARY KEY (ino, name)
);
"""

_INODE_COLS = (
    "ino, mode, uid, gid, size, atime_ns, mtime_ns, ctime_ns, rdev, target, state, crc32c, version,"
    " persisted_version, generation, has_data, guid, lamport, writer, holders, block_crcs,"
    " author, parent, name"
)
_INODE_PARAMS = ",".join("?" * len(_INODE_COLS.split(",")))
# Columns added after schema 1, for databases written by older versions.
_MIGRATIONS = {
    1: [
        "ALTER TABLE inodes ADD COLUMN persisted_version INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE inodes ADD COLUMN generation INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE inodes ADD COLUMN has_data INTEGER NOT NULL DEFAULT 1",
    ],
    2: [
        "ALTER TABLE inodes ADD COLUMN guid TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE inodes ADD COLUMN lamport INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE inodes ADD COLUMN writer TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE inodes ADD COLUMN holders TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE inodes ADD COLUMN block_crcs BLOB",
    ],
    3: [
        # 1 for a hard link's further names; 0 for the name an inode is known by.
        "ALTER TABLE dentries ADD COLUMN alias INTEGER NOT NULL DEFAULT 0",
    ],
    4: [
        # The node that sealed an inode's data version (until schema 4 the writer of
        # its last change stood for it).
        "ALTER TABLE inodes ADD COLUMN author TEXT NOT NULL DEFAULT ''",
        "UPDATE inodes SET author = writer",
    ],
    5: [
        # Nothing looked names up by inode: the index only cost every write.
        "DROP INDEX IF EXISTS dentries_ino",
        # An inode's own name moves into its row (parent 0: it has none), so that
        # making a file writes one row (a joining host makes hundreds of thousands);
        # dentries keep only hard links' further names.
        "ALTER TABLE inodes ADD COLUMN parent INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE inodes ADD COLUMN name BLOB NOT NULL DEFAULT x''",
        "UPDATE inodes SET"
        " parent = COALESCE((SELECT d.parent FROM dentries d"
        "                    WHERE d.ino = inodes.ino AND d.alias = 0), 0),"
        " name = COALESCE((SELECT d.name FROM dentries d"
        "                  WHERE d.ino = inodes.ino AND d.alias = 0), x'')",
        "DELETE FROM dentries WHERE alias = 0",
    ],
}


@dataclass
class InodeRow:
    ino: int
    mode: int
    uid: int
    gid: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    rdev: int
    target: bytes | None
    state: str
    crc32c: int | None
    version: int
    persisted_version: int = 0  # the version last confirmed by the durable tier
    generation: int = 0  # that object's generation in the durable tier (0: none)
    has_data: bool = True  # the whole content is in the RAM tier
    guid: str = ""  # global id in the job's replicated index (stable across renames)
    lamport: int = 0  # (lamport, writer): the last change's stamp, last writer wins
    writer: str = ""
    holders: str = ""  # comma-separated node ids with a verified copy of this version
    block_crcs: bytes | None = None  # crc32c per 4 MiB block (mtcfs.core.checksums.BLOCK)
    author: str = ""  # the node that sealed this data version (it uploads, pushes it)
    parent: int = 0  # the directory of the name it is known by (0: none, unlinked)
    name: bytes = b""


class MetaStore:
    """Write-through persistence for the in-memory namespace (mtcfs.core.namespace)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=OFF")
        row = self._schema_version()
        if row is not None and int(row) < SCHEMA_VERSION:
            for version in range(int(row), SCHEMA_VERSION):
                for stmt in _MIGRATIONS.get(version, []):
                    self.db.execute(stmt)
            self.db.execute("UPDATE meta SET value=? WHERE key='schema'", (str(SCHEMA_VERSION),))
            row = str(SCHEMA_VERSION)
        self.db.executescript(_SCHEMA)
        if row is None:
            self.db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
        elif int(row) != SCHEMA_VERSION:
            raise RuntimeError(
                f"metadata database {path} has schema {row}, this mtcfs needs {SCHEMA_VERSION}"
            )
        self._depth = 0
        # A coalescing transaction's inode and link writes (None: written at once).
        self._inodes: dict[int, Callable[[], Params] | None] | None = None
        self._links: dict[tuple[int, bytes], int | None] = {}
        # Rows left for later by write_behind (None: delete it), oldest first; each is
        # written with its inode's state when it is written.
        self._later: dict[int, Callable[[], Params] | None] = {}
        self._later_links: dict[tuple[int, bytes], int | None] = {}
        self._now: set[int] = set()  # a coalescing transaction's rows never left for later
        self._behind = 0  # write_behind contexts open (nested)

    def _schema_version(self) -> str | None:
        try:
            row = self.db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
        except sqlite3.OperationalError:
            return None  # a new database
        return None if row is None else str(row[0])

    @contextmanager
    def transaction(self, coalesce: bool = False) -> Iterator[None]:
        """Group several changes so that a crash leaves all or none of them.
        coalesce (outermost only): an inode or a name written several times in the
        transaction is written once, at its end, its last state (the rows go in one
        executemany each: a snapshot of thousands of entries is applied in a few
        statements instead of four per entry)."""
        if self._depth == 0:
            self.db.execute("BEGIN")
            if coalesce:
                self._inodes, self._links, self._now = {}, {}, set()
        self._depth += 1
        try:
            yield
            if self._depth == 1:
                self._flush()
        except BaseException:
            self._depth -= 1
            if self._depth == 0:
                self._inodes = None
                self.db.execute("ROLLBACK")
            raise
        self._depth -= 1
        if self._depth == 0:
            self.db.execute("COMMIT")

    @contextmanager
    def write_behind(self) -> Iterator[None]:
        """Within it, coalesced transactions leave their inode and link rows for later
        (write_later) instead of writing them: a host pulling a snapshot has its index
        in memory sooner, and a third of applying one is these rows. A crash before
        they are written loses nothing that matters: a starting host pulls a whole
        snapshot again (mtcfs.peer.join)."""
        self._behind += 1
        try:
            yield
        finally:
            self._behind -= 1

    @property
    def deferring(self) -> bool:
        """A write_behind is open."""
        return self._behind > 0

    @property
    def rows_later(self) -> int:
        """Rows left for later by write_behind, not written yet."""
        return len(self._later) + len(self._later_links)

    def write_later(self, limit: int) -> int:
        """Write up to `limit` of the rows left for later (the oldest first, each with
        its inode's state now), in one transaction. Returns how many are left."""
        inodes = {ino: self._later.pop(ino) for ino in list(islice(self._later, limit))}
        room = max(0, limit - len(inodes))
        links = {k: self._later_links.pop(k) for k in list(islice(self._later_links, room))}
        if inodes or links:
            with self.transaction():
                self._write_rows(inodes, links)
        return self.rows_later

    def _flush(self) -> None:
        inodes, links = self._inodes, self._links
        if inodes is None:
            return
        self._inodes, self._links = None, {}
        if self._behind:
            now = {ino: inodes.pop(ino) for ino in self._now if ino in inodes}
            self._later.update(inodes)
            self._later_links.update(links)
            self._write_rows(now, {})
            return
        if self._later:  # written now with their state now: none is needed later
            for ino in inodes:
                self._later.pop(ino, None)
            for ino in links.values():  # a name needs its inode's row
                if ino is not None and ino in self._later:
                    inodes[ino] = self._later.pop(ino)
        if self._later_links:
            for key in links:
                self._later_links.pop(key, None)
        self._write_rows(inodes, links)

    def _write_rows(self, inodes: dict[int, Callable[[], Params] | None],
                    links: dict[tuple[int, bytes], int | None]) -> None:
        gone = [(ino,) for ino, r in inodes.items() if r is None]
        if gone:
            self.db.executemany("DELETE FROM inodes WHERE ino=?", gone)
            self.db.executemany("DELETE FROM xattrs WHERE ino=?", gone)
        rows = [params() for params in inodes.values() if params is not None]
        if rows:
            self.db.executemany(
                f"INSERT OR REPLACE INTO inodes ({_INODE_COLS}) VALUES ({_INODE_PARAMS})",
                rows)
        gone_names = [k for k, v in links.items() if v is None]
        if gone_names:
            self.db.executemany("DELETE FROM dentries WHERE parent=? AND name=?", gone_names)
        names = [(*k, v) for k, v in links.items() if v is not None]
        if names:
            self.db.executemany("INSERT OR REPLACE INTO dentries VALUES (?,?,?,1)", names)

    def close(self) -> None:
        """Every row left for later is written first."""
        while self._later or self._later_links:
            self.write_later(10_000)
        self.db.close()

    # -- reads (startup only) ------------------------------------------------

    def load_inodes(self) -> Iterator[InodeRow]:
        """Every inode's row, by inode number (Namespace._load: the older of two rows
        naming one entry keeps it)."""
        for row in self.db.execute(f"SELECT {_INODE_COLS} FROM inodes ORDER BY ino"):
            r = InodeRow(*row)
            r.has_data = bool(r.has_data)
            yield r

    def load_links(self) -> Iterator[tuple[int, bytes, int]]:
        """Hard links' further names (an inode's own name is in its row)."""
        yield from self.db.execute("SELECT parent, name, ino FROM dentries ORDER BY parent, name")

    def load_xattrs(self) -> Iterator[tuple[int, bytes, bytes]]:
        yield from self.db.execute("SELECT ino, name, value FROM xattrs")

    # -- writes ----------------------------------------------------------------

    def put_node(self, ino: int, params: Callable[[], Params], named: bool = False) -> None:
        """Write the inode's row, params() its columns in _INODE_COLS' order; in a
        coalescing transaction params() is called at its end (once, however often the
        inode changed). named: other rows name it (a directory, their parent): never
        left for later, else a crash would leave them orphans."""
        if self._inodes is not None:
            self._inodes[ino] = params
            if named:
                self._now.add(ino)
            return
        if self._later:
            self._later.pop(ino, None)
        self.db.execute(
            f"INSERT OR REPLACE INTO inodes ({_INODE_COLS}) VALUES ({_INODE_PARAMS})",
            params())

    @property
    def depth(self) -> int:
        """Transactions open (nested)."""
        return self._depth

    def delete_inode(self, ino: int) -> None:
        if self._inodes is not None:
            self._inodes[ino] = None
            return
        if self._later:
            self._later.pop(ino, None)
        with self.transaction():
            self.db.execute("DELETE FROM inodes WHERE ino=?", (ino,))
            self.db.execute("DELETE FROM xattrs WHERE ino=?", (ino,))

    def put_link(self, parent: int, name: bytes, ino: int) -> None:
        """A further name of a hard-linked inode."""
        if self._inodes is not None:
            self._links[(parent, name)] = ino
            return
        if self._later_links:
            self._later_links.pop((parent, name), None)
        if (later := self._later.pop(ino, None)) is not None:  # a name needs its row
            self.put_node(ino, later)
        self.db.execute("INSERT OR REPLACE INTO dentries VALUES (?,?,?,1)", (parent, name, ino))

    def delete_link(self, parent: int, name: bytes) -> None:
        if self._inodes is not None:
            self._links[(parent, name)] = None
            return
        if self._later_links:
            self._later_links.pop((parent, name), None)
        self.db.execute("DELETE FROM dentries WHERE parent=? AND name=?", (parent, name))

    def put_xattr(self, ino: int, name: bytes, value: bytes) -> None:
        self.db.execute("INSERT OR REPLACE INTO xattrs VALUES (?,?,?)", (ino, name, value))

    def delete_xattr(self, ino: int, name: bytes) -> None:
        self.db.execute("DELETE FROM xattrs WHERE ino=? AND name=?", (ino, name))

    # -- durable-tier deletions still to do (survive restarts) ----------------------

    def add_pending_delete(self, key: str, generation: int) -> None:
        self.db.execute("INSERT OR REPLACE INTO pending_deletes VALUES (?,?)", (key, generation))

    def remove_pending_delete(self, key: str) -> None:
        self.db.execute("DELETE FROM pending_deletes WHERE key=?", (key,))

    def load_pending_deletes(self) -> list[tuple[str, int]]:
        return list(self.db.execute("SELECT key, generation FROM pending_deletes"))

    # -- tombstones of the replicated index (removed entries, by global id) --------

    def put_tombstone(self, guid: str, lamport: int, writer: str, removed_at: float) -> None:
        self.db.execute("INSERT OR REPLACE INTO tombstones VALUES (?,?,?,?)",
                        (guid, lamport, writer, removed_at))

    def delete_tombstone(self, guid: str) -> None:
        self.db.execute("DELETE FROM tombstones WHERE guid=?", (guid,))

    def load_tombstones(self) -> list[tuple[str, int, str, float]]:
        return list(self.db.execute("SELECT guid, lamport, writer, removed_at FROM tombstones"))

    def get_meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta VALUES (?,?)", (key, value))
