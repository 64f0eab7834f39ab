"""The files `mtcfs persist` asked for and not yet persisted: kept in the metadata
store, so that a request survives a daemon crash or restart."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

from mtcfs.core.store import MetaStore

REQUESTED_KEY = "persist_requested"  # metadata store: inos `mtcfs persist` asked for


class Requested:
    def __init__(self, store: MetaStore) -> None:
        self.store = store
        self._inos: set[int] = set(json.loads(store.get_meta(REQUESTED_KEY) or "[]"))

    def __contains__(self, ino: object) -> bool:
        return ino in self._inos

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._inos))

    def add(self, inos: Iterable[int]) -> None:
        new = set(inos) - self._inos
        if new:
            self._inos |= new
            self._save()

    def discard(self, ino: int) -> None:
        if ino in self._inos:
            self._inos.discard(ino)
            self._save()

    def _save(self) -> None:
        with self.store.transaction():
            self.store.set_meta(REQUESTED_KEY, json.dumps(sorted(self._inos)))
