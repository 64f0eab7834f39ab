"""This host's index changes on their way out: the replicated index puts each
change here, the broadcaster takes them in batches (mtcfs.peer.dissemination).
Built before both, so that neither is wired to the other after construction.

Each change says how long it may wait for others to share its batch: a batch
costs every host a tree message, an apply and an ack whatever it carries, so a
save's step directory and the closes of its files leave together (GATHER,
DIRECTORY_GATHER, GATHER_MOST), and the announcement that a
replica landed rides in its file's change when the push beat it (COPY_WAIT_BYTES),
else with the next batch or after ANNOUNCE. A commit takes
everything at once (the broadcaster's wait_applied), so no wait here delays
what the commit rule promises.
"""

from __future__ import annotations

import math
import stat
import time

import trio

from mtcfs.peer.v1 import peer_pb2 as pb

# Seconds a change waits for the next one (a file's close: seen elsewhere within
# milliseconds), a directory's for the changes made in it (a save makes its step
# directory, then closes its files one after the other: one batch, one tree for
# every host, not one for the directory and one for its files), and at most after
# the first change that waits.
GATHER = 0.02
DIRECTORY_GATHER = 0.1
GATHER_MOST = 0.5
# ... and an announcement of where copies are (a replica landed): a commit sends
# it at once, and the holders of a dead writer's replicas announce them again
# (ReplicatedIndex.announce_replicas_of), so a save's pushes share one batch.
ANNOUNCE = 2.0
# ... each one starting that wait again (a save's replicas land over a few seconds
# on a busy job: one batch, not three), at most this long after the first.
ANNOUNCE_MOST = 5.0
# A sealed file this small (one block of the data channel) waits (up to
# COPY_WAIT_MOST after the first change: a push takes a second on a busy job) for
# the push of its copies, whose announcement then rides in its own entry: one entry
# per file for every host to apply instead of two, and one tree a save instead of
# two. Its push takes milliseconds and does not yield to the trainer's writes
# (mtcfs.peer.replicator). A larger file's push takes longer than its change should
# wait: its announcement goes on its own.
COPY_WAIT_BYTES = 4 << 20
COPY_WAIT_MOST = 1.5


class Outbox:
    def __init__(self) -> None:
        self.changes: list[pb.Entry] = []  # (in the order made: parents first)
        self.announcements: list[pb.Entry] = []
        self.due = math.inf  # time.monotonic() by which the waiting entries must leave
        self._changes_first = math.inf  # when the oldest waiting change was put
        self._changes_due = math.inf
        self._announce_first = math.inf
        self._announce_due = math.inf
        self._copying: set[str] = set()  # waiting changes' ids whose copies are being made
        self.folded = 0  # announcements that rode in their file's change
        self._ready = trio.Event()

    def put(self, entries: list[pb.Entry]) -> None:
        """Queue changes for every host: they leave in a batch GATHER after the last
        change (DIRECTORY_GATHER after a directory's), at most GATHER_MOST after the
        first."""
        if entries:
            now = time.monotonic()
            gather = (DIRECTORY_GATHER if any(stat.S_ISDIR(e.mode) for e in entries)
                      else GATHER)
            if self._changes_first == math.inf:
                self._changes_first, self._changes_due = now, now + gather
            self._changes_due = min(self._changes_first + GATHER_MOST,
                                    max(self._changes_due, now + gather))
            self._queue(self.changes, entries)

    def supersede(self, entries: list[pb.Entry]) -> None:
        """This host changed these files since it announced copies of them: a waiting
        announcement leaves after the change, and its persisted state, older, would
        undo the change's (a file renamed within ANNOUNCE of its upload was taken as
        persisted under its new name on every other host). Its holders still merge
        (the same version)."""
        if not self.announcements:
            return  # (the common case: a local change costs nothing more)
        ids = {e.id for e in entries}
        for a in self.announcements:
            if a.id in ids:
                a.persisted_version = a.generation = 0

    def dropped(self, gid: str, holder: str) -> None:
        """`holder` no longer has `gid`'s copy (this host's drop, queued here, or
        another's, heard): the entries still waiting stop saying it does. This host's
        drop is a change when the file is in the bucket, and changes leave first: an
        announcement made just before (an upload landed, then retention evicted the
        file within 0.1 s) would name it a holder again on every other host, for good
        (no host asks it whether it still holds one)."""
        for e in (*self.changes, *self.announcements):
            if e.id == gid:
                if holder in e.holders:
                    e.holders.remove(holder)
                if holder in e.sources:
                    e.sources.remove(holder)

    def copying(self, e_id: str, size: int) -> None:
        """Copies of the file whose change waits here (`e_id`) are being pushed: a small
        one's change waits for them (see COPY_WAIT_BYTES; copied() ends the wait)."""
        if size <= COPY_WAIT_BYTES and any(c.id == e_id for c in self.changes):
            self._copying.add(e_id)
            self._refresh_due()

    def copied(self, e_id: str) -> None:
        """The pushes of `e_id`'s copies are over (made or not)."""
        if e_id in self._copying:
            self._copying.discard(e_id)
            self._refresh_due()
            self._ready.set()  # the sending loop looks at the time again

    def announce(self, entries: list[pb.Entry]) -> None:
        """Queue announcements of copies: they leave with the next batch, or in one of
        their own ANNOUNCE after the last, at most ANNOUNCE_MOST after the first. One
        whose file's change still waits here rides in that change."""
        entries = [e for e in entries if not self._fold(e)]
        if entries:
            now = time.monotonic()
            if not self.announcements:
                self._announce_first = now
            self._announce_due = min(self._announce_first + ANNOUNCE_MOST, now + ANNOUNCE)
            self._queue(self.announcements, entries)

    def _fold(self, e: pb.Entry) -> bool:
        """`e` (an announcement) replaces its file's waiting change of the same stamp:
        the same entry with its copies as they are now. (A drop travels on its own.)"""
        if e.dropped:
            return False
        for c in reversed(self.changes):
            if c.id == e.id:
                if c.lamport != e.lamport or c.writer != e.writer or c.version != e.version:
                    return False
                c.CopyFrom(e)
                self.folded += 1
                return True
        return False

    def _queue(self, into: list[pb.Entry], entries: list[pb.Entry]) -> None:
        for e in entries:
            for h in e.dropped:
                self.dropped(e.id, h)
        into.extend(entries)
        self._refresh_due()
        self._ready.set()

    def _refresh_due(self) -> None:
        changes_due = self._changes_due
        if self._copying:
            changes_due = max(changes_due, self._changes_first + COPY_WAIT_MOST)
        self.due = min(changes_due, self._announce_due)

    def take(self, most: int) -> list[pb.Entry]:
        """The oldest `most` entries waiting, changes first (removed from the outbox):
        an announcement is of a sealed file whose directories went before."""
        part, self.changes = self.changes[:most], self.changes[most:]
        if len(part) < most:
            more = most - len(part)
            part += self.announcements[:more]
            self.announcements = self.announcements[more:]
        if not self.changes:
            self._changes_first = self._changes_due = math.inf
        if self._copying:  # (it holds only the ids of waiting changes)
            self._copying.difference_update(e.id for e in part)
        if not self.announcements:
            self._announce_due = math.inf
        self._refresh_due()
        return part

    def count(self) -> int:
        return len(self.changes) + len(self.announcements)

    def overdue(self) -> float:
        """Seconds past the time the waiting entries were due (0: none waiting)."""
        return max(0.0, time.monotonic() - self.due) if self.count() else 0.0

    def status(self) -> dict[str, object]:
        return {"changes": len(self.changes), "announcements": len(self.announcements),
                "waiting_for_copies": len(self._copying), "folded": self.folded,
                "overdue_seconds": round(self.overdue(), 3)}

    async def wait(self) -> None:
        """Until entries were put since the last wait."""
        await self._ready.wait()
        self._ready = trio.Event()


class Nowhere(Outbox):
    """An index whose changes go nowhere (tools and tests that drive one index)."""

    def _queue(self, into: list[pb.Entry], entries: list[pb.Entry]) -> None:
        pass


NOWHERE = Nowhere()  # (holds nothing: one serves every such index)
