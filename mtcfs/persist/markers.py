"""Commit ordering: a step's commit marker goes to the durable tier only after every
other file of its step directory is persisted (its hard links' further names too),
and while every host is alive and caught up with, or gone for good (a host cut off
for a moment may hold files of the step nobody here has seen), so the bucket never
shows a marker for a partial step."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from mtcfs.core.namespace import ROOT, Inode, Namespace
from mtcfs.core.steps import StepRules, files_under

log = logging.getLogger("mtcfs.persist.uploader")

HELD_LOG = 30.0  # a commit marker held this long is logged, with why
LINKS_KEY = "link_objects"  # metadata store: objects of hard links' further names


class Links:
    """The objects of hard-linked files' further names: ino -> {key: [generation,
    version]}, kept in the metadata store."""

    def __init__(self, ns: Namespace) -> None:
        self.ns = ns
        self.objects: dict[int, dict[str, list[int]]] = {
            int(ino): objs for ino, objs in
            json.loads(ns.store.get_meta(LINKS_KEY) or "{}").items()}

    def save(self) -> None:
        self.ns.store.set_meta(LINKS_KEY,
                               json.dumps({str(k): v for k, v in self.objects.items()}))

    def in_step(self, node: Inode) -> bool:
        """Every further name of the file has its object at the file's version."""
        objs = self.objects.get(node.ino, {})
        return all(objs.get(k, (0, -1))[1] == node.version for k in self.ns.link_paths(node))


def temporary_below(ns: Namespace, rules: StepRules, f: Inode, d: Inode) -> bool:
    """True if `f` or a directory between it and `d` has a temporary name."""
    node = f
    while node.ino != d.ino and node.ino != ROOT:
        if rules.is_temporary_name(node.name):
            return True
        node = ns.inodes[node.parent]
    return False


class Markers:
    """Which commit markers may go now, and why the others wait (`held`, for the
    status and the log). `hosts_accounted()`: every host of the job is alive or gone
    for good."""

    def __init__(self, ns: Namespace, rules: StepRules, links: Links,
                 hosts_accounted: Callable[[], bool] = lambda: True) -> None:
        self.ns = ns
        self.rules = rules
        self.links = links
        self.hosts_accounted = hosts_accounted
        self.waiting_for_hosts = False  # a marker waits for a host to come back or be gone
        # Commit markers waiting to go: ino -> (since, why, last logged).
        self.held: dict[int, tuple[float, str, float]] = {}

    def may_go(self, marker: Inode) -> bool:
        """The marker's step is persisted and every host accounted for; otherwise it is
        held (with why)."""
        waiting = self.unpersisted_in_step(marker)
        if waiting is not None:
            self._hold(marker, f"waits for {self.ns.path_of(waiting)} (written by "
                       f"{waiting.author or 'this host'}) to be persisted")
            return False
        if not self.hosts_accounted():
            # A host cut off for a moment may have written files of this step that no
            # host here has seen: they would be missing beside the marker.
            self.waiting_for_hosts = True
            self._hold(marker, "waits for every host to be alive and caught up with "
                       "(or gone for good)")
            return False
        self.held.pop(marker.ino, None)
        return True

    def step_ready(self, marker: Inode) -> bool:
        """Every non-marker file in the marker's directory tree is persisted."""
        return self.unpersisted_in_step(marker) is None

    def unpersisted_in_step(self, marker: Inode) -> Inode | None:
        """A file the marker waits for (the first found): one in its directory tree not
        persisted yet; None when there is none."""
        d = self.ns.inodes[marker.parent]
        # Files under temporary names are no part of the step (and are never uploaded
        # by the on-close and step policies): they must not hold the marker back.
        return next((f for f in files_under(self.ns, d)
                     if f.linked and not ((f.persisted and self.links.in_step(f))
                                          or self.rules.is_marker_name(f.name)
                                          or temporary_below(self.ns, self.rules, f, d))),
                    None)

    def looking_again(self) -> None:
        """The workers look at the queue afresh: a marker still held for a host says so
        again when it is looked at."""
        self.waiting_for_hosts = False

    def forget_unqueued(self, queue: Mapping[int, Inode]) -> None:
        for ino in [i for i in self.held if i not in queue]:
            del self.held[ino]

    def park_for(self) -> float:
        """How long idle workers wait before looking again: a marker held for a host,
        each second (a host's grace ends); one waiting for files, every HELD_LOG
        seconds (said in the log if it still waits)."""
        return 1.0 if self.waiting_for_hosts else HELD_LOG if self.held else math.inf

    def status(self, queue: Mapping[int, Inode]) -> list[dict[str, Any]]:
        return [{"path": self.ns.path_of(n), "seconds": round(time.monotonic() - since, 1),
                 "why": why}
                for ino, (since, why, _) in self.held.items()
                if (n := queue.get(ino)) is not None and n.linked]

    def _hold(self, marker: Inode, why: str) -> None:
        """Said in `status`, and in the log once it has waited HELD_LOG seconds (then at
        most every HELD_LOG seconds)."""
        now = time.monotonic()
        since, _, logged = self.held.get(marker.ino, (now, "", -math.inf))
        if now - since >= HELD_LOG and now - logged >= HELD_LOG:
            log.warning("commit marker %s %s (for %.0f s)", self.ns.path_of(marker), why,
                        now - since)
            logged = now
        self.held[marker.ino] = (since, why, logged)
