"""Where a file's replicas go.

A ring of the live hosts, the same on every host: each failure domain's hosts
in the order of a hash of their node ids, the domains interleaved (one host of
each in turn). A writer's replicas go to the next hosts after it on the ring,
other failure domains first. So, with every host alive, each host holds the
replicas of exactly K writers (rendezvous hashing, used before, left some
hosts holding five writers' replicas and others none, at N=64, K=1: a RAM
tier sized for shard x (1 + K) overflowed), a zone loss keeps a copy, a
replacement host with the same node id knows where its data is, and the
choice needs no coordination. A dead or full peer is skipped for the next.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from itertools import zip_longest
from typing import Protocol, TypeVar


class Candidate(Protocol):
    node_id: str
    domain: str


C = TypeVar("C", bound="Candidate")


def _hash(node_id: str) -> int:
    return int.from_bytes(hashlib.sha256(node_id.encode()).digest()[:8], "big")


def ring(members: Sequence[tuple[str, str]]) -> list[str]:
    """Node ids in ring order, from (node id, failure domain) pairs."""
    by_domain: dict[str, list[str]] = {}
    for node_id, domain in members:
        by_domain.setdefault(domain, []).append(node_id)
    columns = [sorted(set(ids), key=lambda n: (_hash(n), n))
               for _, ids in sorted(by_domain.items())]
    return [n for row in zip_longest(*columns) for n in row if n is not None]


def rank(writer: str, domain: str, peers: Sequence[C]) -> list[C]:
    """Peers in the order replicas of `writer`'s files should go to."""
    known = {p.node_id: p for p in peers if p.node_id and p.node_id != writer}
    order = ring([(writer, domain), *((p.node_id, p.domain) for p in known.values())])
    i = order.index(writer)
    after = [known[n] for n in order[i + 1:] + order[:i]]
    # Other failure domains first; the ring order within each group.
    return sorted(after, key=lambda p: bool(domain) and p.domain == domain)


def partners(order: Sequence[str], me: str, k: int, is_live: Callable[[str], bool],
             at: int | None = None) -> list[str]:
    """On a ring (`ring()`), the hosts `me` replicates to (its k live successors) and
    those that replicate to it (its k live predecessors): the hosts membership probes
    most often, as they are the first to need to know of a death. `at`: me's index
    in `order`, if known."""
    if at is None:
        if me not in order:
            return []
        at = order.index(me)
    if k < 1:
        return []
    i, n = at, len(order)
    out: list[str] = []
    for step in (1, -1):
        found, j = 0, i
        for _ in range(n - 1):
            j = (j + step) % n
            if is_live(order[j]):
                if order[j] not in out:
                    out.append(order[j])
                found += 1
                if found == k:
                    break
    return out
