"""This host's index changes on their way out: the replicated index puts each
change here, the broadcaster takes them in batches (mtcfs.peer.dissemination).
Built before both, so that neither is wired to the other after construction."""

from __future__ import annotations

import trio

from mtcfs.peer.v1 import peer_pb2 as pb


class Outbox:
    def __init__(self) -> None:
        self.entries: list[pb.Entry] = []
        self._ready = trio.Event()

    def put(self, entries: list[pb.Entry]) -> None:
        """Queue entries for every host: they leave in the broadcaster's next batch."""
        if entries:
            self.entries.extend(entries)
            self._ready.set()

    def take(self, most: int) -> list[pb.Entry]:
        """The oldest `most` entries waiting (removed from the outbox)."""
        part, self.entries = self.entries[:most], self.entries[most:]
        return part

    def count(self) -> int:
        return len(self.entries)

    async def wait(self) -> None:
        """Until entries were put since the last wait."""
        await self._ready.wait()
        self._ready = trio.Event()


class Nowhere(Outbox):
    """An index whose changes go nowhere (tools and tests that drive one index)."""

    def put(self, entries: list[pb.Entry]) -> None:
        pass


NOWHERE = Nowhere()  # (holds nothing: one serves every such index)
