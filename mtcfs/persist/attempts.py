"""What the uploader's parts share about their attempts on the durable tier: the
counters the status shows, and one backoff (the tier is down for all of them)."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

log = logging.getLogger("mtcfs.persist.uploader")

MAX_BACKOFF = 30.0


@dataclass
class Stats:
    files_uploaded: int = 0
    bytes_uploaded: int = 0
    inflight_bytes_done: int = 0
    deletes: int = 0
    errors: int = 0
    last_error: str = ""
    last_error_time: float = 0.0
    last_upload_time: float = 0.0  # time.time() of the newest upload that succeeded
    conflicts: int = 0
    copies: int = 0

    def record_error(self, msg: str) -> None:
        """An error the status shows at once. Also the durable tier's `on_retry`: called
        from worker threads while the tier retries a transient error (a GCS outage)."""
        self.errors += 1
        self.last_error = msg
        self.last_error_time = time.time()


class Backoff:
    """One delay for every worker: a failed call to the tier slows them all, a
    success resets it."""

    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self.delay = 0.0

    def failed(self, msg: str) -> None:
        self.delay = min(MAX_BACKOFF, max(0.5, self.delay * 2)) * random.uniform(0.8, 1.2)
        self.stats.record_error(msg)
        log.warning("%s; retrying in %.1f s", msg, self.delay)

    def succeeded(self) -> None:
        self.delay = 0.0
