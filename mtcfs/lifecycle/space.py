"""Space in the RAM tier: evict what is safe elsewhere, in a sensible order,
and make writers wait (bounded) when nothing is.

Victims, first to last (each group oldest first):

  0. copies of files in steps older than the kept ones (--keep-steps, else the
     newest complete step is kept);
  1. cache copies (read through, never announced);
  2. replicas held for other hosts (persisted ones only, see copies.py);
  3. this host's own data outside the kept steps;
  4. anything else that is safe, the kept steps last.

Never a copy that is the only one (copies.py), never an open file, never a
file being uploaded, replicated or fetched.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import trio

from mtcfs.core.copies import CACHE, OWN, REPLICA, Copies
from mtcfs.core.events import Listener
from mtcfs.core.steps import StepRules, all_steps, files_under, step_number
from mtcfs.sizes import format_size

if TYPE_CHECKING:
    from mtcfs.core.events import Peer
    from mtcfs.core.namespace import Inode, Namespace
    from mtcfs.tiers.ram import RamTier

log = logging.getLogger(__name__)

# Evict a little more than asked, so the next writes do not each scan for victims.
HEADROOM_FRACTION = 0.02
HEADROOM_MAX = 256 << 20
# A waiting writer re-checks at least this often (uploads and replicas also wake it).
RECHECK = 0.5
KEEP_ROOM_EVERY = 0.2  # passthrough: how often free room is checked
FULL_BELOW = 1 << 20  # passthrough: the tier counts as full below this


class NoSpace(OSError):
    def __init__(self, msg: str) -> None:
        super().__init__(errno.ENOSPC, msg)


@dataclass
class Stats:
    evictions: dict[str, int] = field(default_factory=dict)  # by reason
    evicted_bytes: dict[str, int] = field(default_factory=dict)
    waits: int = 0
    wait_seconds: float = 0.0
    enospc: int = 0
    last_full: str = ""  # why the last write was refused, for `mtcfs status`
    last_full_time: float = 0.0
    full_passthrough: int = 0  # times the tier filled up under passthrough writers


@dataclass
class StepView:
    """The steps as retention and eviction see them, computed in one pass."""

    kept: set[int]  # inos of the step directories kept in RAM
    order: dict[int, tuple[int, int]]  # file ino -> (step rank, 1 if kept), oldest first
    complete: list[Inode]  # complete steps, oldest first
    oldest_kept_rank: int  # steps ranked below it are older than every kept one


def step_view(ns: Namespace, rules: StepRules, keep: int) -> StepView:
    steps = all_steps(ns, rules)
    complete = sorted((d for d in steps if rules.is_committed_step(ns, d)),
                      key=lambda d: (step_number(d.name) or -1, d.mtime_ns))
    kept = {d.ino for d in complete[-keep:]} if keep else set()
    ranked = sorted(steps, key=lambda d: (step_number(d.name) or -1, d.mtime_ns))
    order: dict[int, tuple[int, int]] = {}
    for rank, d in enumerate(ranked):
        for f in files_under(ns, d):
            order.setdefault(f.ino, (rank, 1 if d.ino in kept else 0))
    kept_ranks = [rank for rank, is_kept in order.values() if is_kept]
    return StepView(kept, order, complete, min(kept_ranks) if kept_ranks else 1 << 30)


class Activity(Protocol):
    """A tier's work on files (uploads, pushes, fetches)."""

    def busy(self, node: Inode) -> bool:
        """This file's copy is being read or written by the tier right now."""
        ...

    def settling(self) -> bool:
        """Work is pending that can make data safe elsewhere (uploads, replication)."""
        ...


class SpaceManager(Listener):
    def __init__(self, ns: Namespace, ram: RamTier, copies: Copies, rules: StepRules,
                 activity: Sequence[Activity], keep_steps: int | None,
                 full_timeout: float) -> None:
        self.ns = ns
        self.ram = ram
        self.copies = copies
        self.rules = rules
        self.activity = list(activity)
        self.keep = keep_steps or 1
        self.full_timeout = full_timeout
        self.stats = Stats()
        self.waiting = 0  # writers waiting for space now
        self._full = False  # passthrough: the tier is full now (said once per episode)
        self._lot = trio.lowlevel.ParkingLot()
        # path -> when its wait / ENOSPC was last logged: one line per file, not
        # one per concurrent request of the same write.
        self._warned: dict[str, float] = {}
        self._logged: dict[str, float] = {}

    def can_become_safe(self) -> bool:
        """Uploads or replication are pending: a waiting writer may yet get room."""
        return any(a.settling() for a in self.activity)

    # -- events (Listener) ---------------------------------------------------------------

    def room_needed(self, need: int, safe_only: bool) -> None:
        self.make_room_now(need, persisted_only=safe_only)

    # Something may have become evictable (persisted, replicated elsewhere): waiting
    # writers look again.

    def sealed(self, node: Inode) -> None:
        self._lot.unpark_all()

    def persisted(self, node: Inode) -> None:
        self._lot.unpark_all()

    def copies_changed(self, node: Inode, dropped: str = "") -> None:
        self._lot.unpark_all()

    def remote_changed(self, nodes: list[Inode]) -> None:
        self._lot.unpark_all()

    def peer_alive(self, peer: Peer) -> None:
        self._lot.unpark_all()

    # -- choosing ------------------------------------------------------------------------

    def busy(self, node: Inode) -> bool:
        """Copies that are being read or written by someone right now."""
        return bool(node.opens) or any(a.busy(node) for a in self.activity)

    def victims(self, view: StepView | None = None) -> list[tuple[tuple, Inode, str]]:
        """Droppable copies in eviction order: (sort key, node, reason)."""
        view = view or step_view(self.ns, self.rules, self.keep)
        out = []
        for node in self.ns.files():
            if not self.copies.droppable(node) or self.busy(node):
                continue
            kind = self.copies.kind(node)
            age = node.mtime_ns
            in_step = view.order.get(node.ino)
            if (in_step is not None and in_step[1] == 0
                    and in_step[0] < view.oldest_kept_rank):
                key: tuple = (0, in_step[0], age)
                reason = "old-step"
            elif kind == CACHE:
                key, reason = (1, node.last_access, age), "cache"
            elif kind == REPLICA:
                key, reason = (2, age), "replica"
            elif kind == OWN and (in_step is None or in_step[1] == 0):
                key, reason = (3, age), "own"
            else:
                key, reason = (4, in_step[0] if in_step else 0, age), "kept-step"
            out.append((key, node, reason))
        out.sort(key=lambda t: t[0])
        return out

    # -- evicting ------------------------------------------------------------------------

    def evict(self, node: Inode, reason: str) -> int:
        """Drop this host's copy (metadata stays; reads go to a peer or the bucket).
        Returns the bytes given back to the RAM tier."""
        before = self.ram.charged(node.ino)
        path = self.ns.path_of(node) if node.linked else node.guid
        self.ram.remove(node.ino)
        self.copies.evicted(node)  # recorded, and announced if other hosts counted it
        self.stats.evictions[reason] = self.stats.evictions.get(reason, 0) + 1
        self.stats.evicted_bytes[reason] = self.stats.evicted_bytes.get(reason, 0) + before
        log.info("evicted %s from RAM (%s, %s; %s)", path, reason, format_size(before),
                 "persisted" if node.persisted else
                 f"{(n := self.copies.elsewhere(node))} live peer cop{'y' if n == 1 else 'ies'}")
        return before

    def evict_all(self, nodes: Iterable[Inode], reason: str) -> int:
        return sum(self.evict(n, reason) for n in nodes)

    def make_room_now(self, need: int, persisted_only: bool = False) -> bool:
        """Evict until `need` bytes (plus a little headroom) are free. No waiting.
        `persisted_only` (room for a peer's replica): never this host's own data
        that only K replicas keep safe, nor another replica."""
        ram = self.ram
        if ram.capacity - ram.used >= need:
            return True
        goal = need + min(HEADROOM_MAX, int(ram.capacity * HEADROOM_FRACTION))
        for _key, node, reason in self.victims():
            if persisted_only and not (node.persisted or reason == "cache"):
                continue
            self.evict(node, reason)
            if ram.capacity - ram.used >= goal:
                break
        return ram.capacity - ram.used >= need

    async def make_room(self, need: int, what: str) -> None:
        """For a writer: make `need` bytes free, waiting up to --full-timeout for
        data to become safe (uploads, replicas). Raises NoSpace."""
        if self.make_room_now(need):
            return
        ram = self.ram
        t0 = time.monotonic()
        deadline = t0 + self.full_timeout
        self.waiting += 1
        self.stats.waits += 1
        logged = False
        try:
            while True:
                if not self.can_become_safe() or time.monotonic() >= deadline:
                    break
                if not logged and time.monotonic() - self._warned.get(what, -1e9) > 10:
                    self._warned[what] = time.monotonic()
                    log.warning("RAM tier full writing %s: %s needed, %s free, nothing safe to "
                                "evict; waiting up to %.0f s for uploads/replication",
                                what, format_size(need), format_size(ram.capacity - ram.used),
                                self.full_timeout)
                logged = True
                with trio.move_on_after(min(RECHECK, max(0.0, deadline - time.monotonic()))):
                    await self._lot.park()
                if self.make_room_now(need):
                    if logged:
                        log.info("space for %s after waiting %.1f s", what,
                                 time.monotonic() - t0)
                    return
        finally:
            self.waiting -= 1
            self.stats.wait_seconds += time.monotonic() - t0
        self.stats.enospc += 1
        why = self.why_full(need, time.monotonic() - t0)
        self.stats.last_full, self.stats.last_full_time = why, time.time()
        # The kernel sends a large write as several requests that fail together:
        # one line per file, not one per request.
        if time.monotonic() - self._logged.get(what, -1e9) > 10:
            self._logged[what] = time.monotonic()
            log.error("ENOSPC writing %s: %s", what, why)
        raise NoSpace(why)

    async def keep_room(self, headroom: int,
                        writer_open: Callable[[], Awaitable[None]] = trio.lowlevel.checkpoint
                        ) -> None:
        """With passthrough (writes the daemon does not see, bounded by the kernel's
        tmpfs): evict safe copies ahead of need, to keep twice `headroom` free, so that
        writers rarely meet a full tier; say so when it fills up anyway (those writers
        get ENOSPC from the kernel, at once). `writer_open()`: returns once a file is
        open for writing through passthrough; with none (an idle host) nothing is
        looked at (the daemon's own writes make room as they go)."""
        ram = self.ram
        while True:
            await writer_open()
            await trio.sleep(KEEP_ROOM_EVERY)
            if ram.free < 2 * headroom:
                self.make_room_now(2 * headroom)
            self.check_full()

    def check_full(self) -> None:
        """With passthrough: say so (once per episode) when the tier is full."""
        if self.ram.free >= FULL_BELOW:
            self._full = False
            return
        if self._full:
            return
        self._full = True
        self.stats.full_passthrough += 1
        why = self.why_full(FULL_BELOW, 0.0)
        self.stats.last_full, self.stats.last_full_time = why, time.time()
        log.error("the RAM tier is full: writers through passthrough get ENOSPC from the "
                  "kernel until room is made: %s", why)

    def why_full(self, need: int, waited: float) -> str:
        """One line saying what holds the RAM tier and why none of it may go."""
        ram = self.ram
        held: dict[str, list[int]] = {}
        for node in self.ns.files():
            if node.has_data and node.size:
                if node.opens or node.dirty:
                    why = "open"
                elif node.persisted:
                    why = "busy"
                elif self.copies.kind(node) == REPLICA:
                    why = "replicas not yet persisted"
                else:
                    why = "not yet persisted" + (
                        f" nor in {self.copies.replicas} peer "
                        f"cop{'y' if self.copies.replicas == 1 else 'ies'}"
                        if self.copies.replicas and not self.copies.durable else "")
                c = held.setdefault(why, [0, 0])
                c[0] += 1
                c[1] += ram.charged(node.ino)
        parts = [f"{n} file{'' if n == 1 else 's'} / {format_size(b)} {why}"
                 for why, (n, b) in sorted(held.items(), key=lambda kv: -kv[1][1])]
        return (f"RAM tier full ({format_size(ram.used)} of {format_size(ram.capacity)} used, "
                f"{format_size(need)} needed): " + ("; ".join(parts) or "nothing held")
                + (f"; waited {waited:.1f} s" if waited >= 0.05 else
                   "; nothing can become safe (no uploads or replication pending)"))

    def status(self) -> dict[str, object]:
        s = self.stats
        return {
            "keep_steps": self.keep if self.keep else None,
            "full_timeout": self.full_timeout,
            "evictions": dict(s.evictions),
            "evicted_bytes": dict(s.evicted_bytes),
            "writers_waiting": self.waiting,
            "waits": s.waits,
            "wait_seconds": round(s.wait_seconds, 3),
            "enospc": s.enospc,
            "full_under_passthrough": s.full_passthrough,
            "last_full": s.last_full or None,
            "last_full_age": round(time.time() - s.last_full_time, 1) if s.last_full else None,
        }
