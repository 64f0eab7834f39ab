"""The peer tier's counters, shared by its parts (each counts what it does; the
tier's status shows them together), and its last error."""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("mtcfs.peer.tier")


class PeerFetchError(OSError):
    pass


@dataclass
class Stats:
    replicas_sent: int = 0
    replica_bytes_sent: int = 0
    replicas_received: int = 0
    replica_bytes_received: int = 0
    replica_failures: int = 0
    fetched_files: int = 0
    fetched_bytes: int = 0
    fetch_failures: int = 0
    bulk_replicas_sent: int = 0  # of replicas_sent, over the data channel
    bulk_fetched_bytes: int = 0  # of fetched_bytes, over the data channel
    integrity_errors: int = 0
    restores: int = 0  # persisted files read through together with other sources
    restore_bucket_bytes: int = 0  # of those, read from the durable tier by this host
    restore_peer_bytes: int = 0  # of those, taken from other sources
    restore_sources_dropped: int = 0
    restore_refusals: int = 0  # chunks an owner said it would not have (views differed)
    restore_forced_chunks: int = 0  # of those, read from the bucket here after all
    restore_from_earlier: int = 0  # chunks of this host's share an earlier source had
    batches_received: int = 0
    snapshots_pulled: int = 0
    delta_snapshots_pulled: int = 0  # of those: only what changed while it was away
    snapshots_served: int = 0
    delta_snapshots_served: int = 0  # of those: only what changed here lately
    snapshot_entries_served: int = 0
    last_error: str = ""

    def error(self, msg: str) -> None:
        """Logged, and shown as the tier's last error."""
        self.last_error = msg
        log.error("%s", msg)

    def counters(self) -> dict[str, int]:
        return {k: v for k, v in vars(self).items() if k != "last_error"}
