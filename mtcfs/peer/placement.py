"""Where a file's replicas go.

Rendezvous hashing of (writer, peer) node ids: every file a host writes goes to
the same K peers while they live, so a replacement host with the same node id
knows where its data is, and the choice needs no coordination. With failure
domains, peers in other domains come first (a zone loss keeps a copy), each
group in hash order. A dead or full peer is skipped for the next in rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol, TypeVar


class Candidate(Protocol):
    node_id: str
    domain: str


C = TypeVar("C", bound="Candidate")


def score(writer: str, peer: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{writer}\0{peer}".encode()).digest()[:8], "big")


def rank(writer: str, domain: str, peers: Sequence[C]) -> list[C]:
    """Peers in the order replicas of `writer`'s files should go to."""
    known = [p for p in peers if p.node_id and p.node_id != writer]
    return sorted(known, key=lambda p: (bool(domain) and p.domain == domain,
                                        -score(writer, p.node_id)))
