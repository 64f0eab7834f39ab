"""Objects to delete from the durable tier, kept in the metadata store until done:
commit markers first, and nothing else while one is being deleted (a step that
loses its objects stops looking committed before it is partial). A marker that is
being moved (a server-side copy to its new name, then its old object goes) holds
back the deletes of the other objects under its directory until its old object is
gone: else a withdrawal or a renamed step showed, for a moment, its marker beside
files already deleted."""

from __future__ import annotations

import logging
from functools import partial

import trio

from mtcfs.core.namespace import Namespace
from mtcfs.core.steps import StepRules
from mtcfs.persist.attempts import Backoff
from mtcfs.tiers.durable import DurableError, DurableTier, PreconditionFailed, Unavailable

log = logging.getLogger("mtcfs.persist.uploader")


class Deletes:
    """`pending`: key -> the generation to delete (a generation precondition: a newer
    object under the key stays). `wake` is unparked when a delete is added or ends."""

    def __init__(self, ns: Namespace, tier: DurableTier, rules: StepRules, backoff: Backoff,
                 limiter: trio.CapacityLimiter, wake: trio.lowlevel.ParkingLot) -> None:
        self.ns = ns
        self.tier = tier
        self.rules = rules
        self.backoff = backoff
        self.limiter = limiter
        self.wake = wake
        self.pending: dict[str, int] = dict(ns.store.load_pending_deletes())
        self.running: set[str] = set()
        self._markers = {k for k in self.pending if self.is_marker_key(k)}
        self.moving: set[str] = set()  # markers whose old object goes once copied

    def hold(self, marker_key: str) -> None:
        """This marker's object is being copied to a new name and will be deleted then
        (later()): until it is, nothing else under its directory is deleted."""
        self.moving.add(marker_key)

    def release(self, marker_key: str) -> None:
        """That marker will not be deleted after all (its object was gone, or another's)."""
        self.moving.discard(marker_key)
        self.wake.unpark_all()

    def later(self, key: str, generation: int) -> None:
        """Delete this object (recorded now, in the caller's transaction if any)."""
        self.moving.discard(key)
        self.pending[key] = generation
        if self.is_marker_key(key):
            self._markers.add(key)
        self.ns.store.add_pending_delete(key, generation)
        self.wake.unpark_all()

    def is_marker_key(self, key: str) -> bool:
        return self.rules.is_marker_name(key.rpartition("/")[2].encode("utf-8", "surrogateescape"))

    def blocks(self, key: str) -> bool:
        """An old object at this key is still to go (an upload to it waits)."""
        return key in self.pending or key in self.running

    def busy(self) -> bool:
        return bool(self.pending or self.running)

    def next(self) -> tuple[str, int] | None:
        """The next delete to run: commit markers first, and nothing else while one
        is being deleted."""
        key = next(iter(self._markers), None)
        if key is not None:
            self._markers.discard(key)
            if key in self.pending:
                return key, self.pending.pop(key)
            return self.next()
        if not self.pending or any(self.is_marker_key(k) for k in self.running):
            return None
        held = [k.rpartition("/")[0] + "/" for k in self.moving]
        key = next((k for k in self.pending if not any(k.startswith(d) for d in held)), None)
        if key is None:
            return None
        return key, self.pending.pop(key)

    async def run(self, key: str, gen: int) -> bool:
        """Delete one object (taken from next()); False when the tier failed (it is
        pending again, after the backoff)."""
        self.running.add(key)
        try:
            await trio.to_thread.run_sync(partial(self.tier.delete, key, if_generation_match=gen),
                                          limiter=self.limiter, abandon_on_cancel=True)
        except PreconditionFailed:
            log.warning("not deleting object %s: it was replaced by someone else", key)
        except (Unavailable, DurableError, OSError) as e:
            self.pending.setdefault(key, gen)
            if self.is_marker_key(key):
                self._markers.add(key)
            self.backoff.failed(f"delete {key}: {e}")
            return False
        finally:
            self.running.discard(key)
            self.wake.unpark_all()  # an upload to the same key may go now
        self.backoff.stats.deletes += 1
        self.backoff.succeeded()
        if key not in self.pending:  # not removed again meanwhile (a newer generation)
            with self.ns.store.transaction():
                self.ns.store.remove_pending_delete(key)
        return True
