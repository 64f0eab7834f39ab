"""Snapshots of the replicated index, whole or delta, in pieces made as the stream
asks for them (mtcfs.peer.index holds the entries; this makes what a host that
joins or comes back pulls)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Protocol

from mtcfs.core.namespace import ROOT, Inode, Namespace
from mtcfs.peer.v1 import peer_pb2 as pb

TOMBSTONE_TTL = 24 * 3600.0  # a host away longer than this may bring back removed entries
# Ids whose last change time is kept for delta snapshots. One per entry or tombstone,
# so the index's own size bounds it; past this the oldest are forgotten.
RECENT_MAX = 1_000_000


class RecentChanges:
    """Global ids by the time (now()) of their last change here, made here or applied,
    oldest first: what changed in the last s seconds, for a host that was away that
    long. Changes before `floor` are not in it (this process started then, or the
    oldest were forgotten); an index that starts empty has every change in it."""

    def __init__(self, now: Callable[[], float], starts_empty: bool) -> None:
        self.now = now
        self.times: dict[str, float] = {}
        self.floor = float("-inf") if starts_empty else now()

    def __len__(self) -> int:
        return len(self.times)

    def note(self, gid: str) -> None:
        """`gid` changed here now: it goes to the end."""
        times = self.times
        times.pop(gid, None)
        times[gid] = self.now()
        while len(times) > RECENT_MAX:
            self.floor = times.pop(next(iter(times)))


class Index(Protocol):
    """What a snapshot reads of the replicated index (mtcfs.peer.index)."""

    ns: Namespace
    tombstones: dict[str, tuple[int, str, float]]  # id -> (lamport, writer, when)
    recent: RecentChanges
    now: Callable[[], float]

    def visible(self, node: Inode) -> bool: ...

    def entry_of(self, node: Inode) -> pb.Entry: ...


class Snapshots:
    """The pieces of one index's snapshots (read in the thread that owns it)."""

    def __init__(self, index: Index) -> None:
        self.index = index

    def whole(self) -> Iterator[pb.Entry]:
        """Every visible entry, parents before children, then the tombstones."""
        for piece in self.pieces(1 << 62):
            yield from piece

    def pieces(self, size: int) -> Iterator[list[pb.Entry]]:
        """The snapshot in pieces of at most `size` entries, each made when it is asked
        for: a source serves its first piece at once and the requester applies it
        while the next is made. Only the order (inode numbers) is taken up front.
        Advance it in the thread that owns the namespace; other changes may run
        between pieces: a piece shows entries as they are then (a node gone by then
        is left out), and the requester, counted for commits before the first piece,
        gets those changes by broadcast too: merged by stamp, either order is sound."""
        index = self.index
        ns = index.ns
        order: list[int] = []
        todo = [ROOT]
        seen: set[int] = set()  # a hard-linked file is under several directories
        while todo:
            d = ns.inodes[todo.pop()]
            assert d.children is not None
            for ino in d.children.values():
                node = ns.inodes[ino]
                if node.links:
                    if ino in seen:
                        continue
                    seen.add(ino)
                order.append(ino)
                if node.is_dir:
                    todo.append(ino)
        tombs = list(index.tombstones)
        inodes, visible = ns.inodes, index.visible
        entry_of = index.entry_of

        def entries() -> Iterator[pb.Entry]:
            for ino in order:
                node = inodes.get(ino)
                if node is not None and visible(node):
                    yield entry_of(node)
            now = time.time()
            for g in tombs:
                tomb = index.tombstones.get(g)
                if tomb is not None and now - tomb[2] < TOMBSTONE_TTL:
                    yield removal(g, tomb)

        yield from in_pieces(entries(), size)

    def delta(self, since_s: float, size: int) -> Iterator[list[pb.Entry]] | None:
        """What changed here in the last `since_s` seconds, oldest change first, in
        pieces made as `pieces` makes them: for a host that was away (seen dead) that
        long, instead of the whole snapshot. None when this index cannot tell: this
        process started, or forgot the oldest changes, after that."""
        index = self.index
        cutoff = index.now() - since_s
        if cutoff < index.recent.floor:
            return None
        ids: list[str] = []
        times = index.recent.times
        for g in reversed(times):
            if times[g] < cutoff:
                break
            ids.append(g)
        ids.reverse()
        return self._pieces_of(ids, size)

    def _pieces_of(self, ids: list[str], size: int) -> Iterator[list[pb.Entry]]:
        index = self.index

        def entries() -> Iterator[pb.Entry]:
            for g in ids:
                node = index.ns.by_global_id(g)
                if node is not None and index.visible(node):
                    yield index.entry_of(node)
                elif (tomb := index.tombstones.get(g)) is not None:
                    yield removal(g, tomb)

        return in_pieces(entries(), size)


def removal(gid: str, tomb: tuple[int, str, float]) -> pb.Entry:
    """The entry that says `gid` was removed (its tombstone: lamport, writer, when)."""
    return pb.Entry(id=gid, lamport=tomb[0], writer=tomb[1], removed=True)


def in_pieces(entries: Iterator[pb.Entry], size: int) -> Iterator[list[pb.Entry]]:
    """Entries in lists of at most `size`, each made only when it is asked for."""
    piece: list[pb.Entry] = []
    for e in entries:
        piece.append(e)
        if len(piece) >= size:
            yield piece
            piece = []
    if piece:
        yield piece
