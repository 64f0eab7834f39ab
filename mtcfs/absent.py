"""The parts a mount has for features that are not configured (null objects): they
answer like the real part with nothing to do, so no other part asks whether one is
there. The assembly chooses between the real part and these, nothing else does.

    NoDurable, NoUploader, NoListing   without --bucket
    NoPeers (NoBroadcaster)            without --listen
    NoRetention                        without --keep-steps
    NoWithdrawal                       without peers
    NoMetrics                          without --metrics-port
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import trio

from mtcfs.core.events import Listener
from mtcfs.core.namespace import Inode
from mtcfs.fs.filesystem import LocalOnly
from mtcfs.persist.attempts import Stats
from mtcfs.tiers.durable import DurableError, DurableTier, ObjectInfo


class NoDurable(DurableTier):
    """No durable tier: it holds nothing, and every call says so."""

    url = ""

    def may_hold(self, generation: int) -> bool:
        return False

    def _absent(self, *args: Any, **kwargs: Any) -> Any:
        raise DurableError("this mount has no durable tier (mount with --bucket)")

    check = put_file = copy = read_range = download = delete = _absent

    def stat(self, key: str) -> ObjectInfo | None:
        return None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return iter(())


class NoUploader(Listener):
    """Nothing is uploaded: no file is ever persisted by this host."""

    url: str | None = None  # the steps' "durable"
    pending_deletes: Mapping[str, int] = {}

    def __init__(self) -> None:
        self.failed: dict[int, str] = {}
        self.stats = Stats()

    async def run(self) -> None:
        return

    def persists(self, node: Inode) -> bool:
        return False

    def request(self, nodes: list[Inode]) -> tuple[int, int]:
        return 0, 0

    def idle(self) -> bool:
        return True

    def busy(self, node: Inode) -> bool:
        return False

    def settling(self) -> bool:
        return False

    def status(self) -> dict[str, Any] | None:
        return None


class NoListing:
    """No bucket to list."""

    def __init__(self) -> None:
        self.old_objects: list[Callable[[Inode, ObjectInfo], None]] = []  # never told

    async def refresh_loop(self, pending_deletes: Mapping[str, int]) -> None:
        return

    def status(self) -> dict[str, object]:
        return {}


class NoBroadcaster:
    """Without peers a commit waits for nobody."""

    def __init__(self, commit_timeout: float) -> None:
        self.commit_timeout = commit_timeout
        self.observers: list[Callable[[float], None]] = []

    def quiet(self) -> bool:
        return True

    def status(self) -> dict[str, object]:
        return {"commit_timeout": self.commit_timeout, "waits": 0, "wait_seconds": 0.0,
                "max_wait_seconds": 0.0, "timeouts": 0, "last_timeout": None,
                "broadcast_queue": 0}


class NoPeers(LocalOnly, Listener):
    """No peer tier: no copy is elsewhere, every change is visible at once (LocalOnly),
    every host of the job (this one) is accounted for."""

    node_id = ""

    def __init__(self, commit_timeout: float) -> None:
        self.broadcaster = NoBroadcaster(commit_timeout)

    async def start(self, nursery: trio.Nursery) -> None:
        return

    def stop(self) -> None:
        pass

    def hosts_accounted(self) -> bool:
        return True

    def missing_copies(self) -> list[Inode]:
        return []

    def busy(self, node: Inode) -> bool:
        return False

    def settling(self) -> bool:
        return False

    async def download(self, node: Inode, fd: int, on_verified: Callable[[int, int], None],
                       focus: Callable[[], int | None] = lambda: None) -> dict[str, int]:
        return {}  # no holder reachable: the fetcher reads the bucket, or fails

    async def restore(self, node: Inode, fd: int, tier: DurableTier, key: str, generation: int,
                      parallel: int, on_verified: Callable[[int, int], None]
                      ) -> dict[str, int] | None:
        return None  # the fetcher reads the whole file from the bucket itself

    def status(self) -> dict[str, object] | None:
        return None


class NoRetention(Listener):
    """Every step is kept."""

    keep: int | None = None
    grace: float | None = None

    def __init__(self) -> None:
        self.removed_steps: list[str] = []

    async def run(self) -> None:
        return

    def kept(self) -> set[int]:
        return set()


class NoWithdrawal(Listener):
    """Without peers no other host's copy can be lost."""

    async def run(self) -> None:
        return

    def lost(self, f: Inode) -> bool:
        return False

    def is_withdrawn(self, d: Inode) -> bool:
        return False

    def status(self) -> dict[str, object]:
        return {}


class NoMetrics:
    """No metrics server."""

    url: str | None = None

    async def refresh_loop(self) -> None:
        return

    def close(self) -> None:
        pass
