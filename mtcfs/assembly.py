"""One mount's parts, built in dependency order, each given its collaborators.

The daemon (mtcfs.daemon) builds a `Mount` from the mount options and serves it
through FUSE; the in-process tests (tests/nofuse) build the same `Mount` and
drive its filesystem directly. Nothing is wired after construction except the
event listeners, registered here, in one place, in the order they hear events:

    filesystem   other hosts' removals make its nodes stale
    lags         close -> replicas / persisted, measured first
    uploader     seals, renames, removals -> objects in the durable tier
    peers        changes -> index broadcasts; seals -> replicas
    fetcher      copies the uploader wants here
    space        copies that became evictable -> waiting writers
    durability   copies and persists -> waiting fsyncs
    retention    --keep-steps passes
    withdrawal   committed steps that lost a file's last copy

Parts only for features that are configured are None: `uploader` and `listing`
without --bucket, `peers` without --listen, `retention` without --keep-steps,
`withdrawal` without peers.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from mtcfs import __version__
from mtcfs.config import MountOptions, read_token
from mtcfs.events import Events
from mtcfs.fetch import Fetcher
from mtcfs.fs.filesystem import Filesystem
from mtcfs.fs.kernel import KernelCache
from mtcfs.fs.namespace import Namespace
from mtcfs.fs.passthrough import Passthrough
from mtcfs.fs.recovery import recover
from mtcfs.fs.writeclock import WriteClock
from mtcfs.lifecycle.copies import Copies
from mtcfs.lifecycle.durability import Durability
from mtcfs.lifecycle.lags import Lags
from mtcfs.lifecycle.retention import Retention
from mtcfs.lifecycle.retired import RetiredSteps
from mtcfs.lifecycle.space import SpaceManager
from mtcfs.lifecycle.withdrawal import Withdrawal
from mtcfs.meta.store import MetaStore
from mtcfs.persist.steps import DEFAULT_MARKERS, DEFAULT_TMP_PATTERNS, StepRules
from mtcfs.tiers.ram import RamTier

if TYPE_CHECKING:
    from mtcfs.peer.tier import PeerTier
    from mtcfs.persist.listing import BucketListing
    from mtcfs.persist.uploader import Uploader
    from mtcfs.tiers.durable import DurableTier

log = logging.getLogger(__name__)


class AssemblyError(Exception):
    """A part could not be set up (bad bucket, bad peer address): the mount fails
    with this message."""


@dataclass(eq=False)
class Mount:
    opts: MountOptions
    store: MetaStore
    ns: Namespace
    ram: RamTier
    events: Events
    kernel: KernelCache
    copies: Copies
    fs: Filesystem
    fetcher: Fetcher
    space: SpaceManager
    durability: Durability
    lags: Lags
    passthrough: Passthrough
    uploader: Uploader | None = None
    listing: BucketListing | None = None
    peers: PeerTier | None = None
    retention: Retention | None = None
    withdrawal: Withdrawal | None = None
    started: float = field(default_factory=time.time)
    metrics_url: str | None = None

    # -- running ---------------------------------------------------------------------

    async def start_peers(self, nursery: trio.Nursery) -> None:
        """Before the mount is live: listen, be heard by every peer, pull one caught-up
        peer's snapshot (a new host sees the whole tree at once)."""
        if self.peers is not None:
            await self.peers.start(nursery)

    def run_background(self, nursery: trio.Nursery) -> None:
        """The parts' own tasks: fetches, uploads, listing refreshes, retention,
        withdrawal, room kept ahead of passthrough writers, the trash."""
        nursery.start_soon(self.ram.empty_trash)
        nursery.start_soon(self.fetcher.run)
        if self.uploader is not None and self.listing is not None:
            nursery.start_soon(self.uploader.run)
            nursery.start_soon(self.listing.refresh_loop, self.uploader.deletes)
        if self.retention is not None:
            nursery.start_soon(self.retention.run)
        if self.withdrawal is not None:
            nursery.start_soon(self.withdrawal.run)
        if self.ram.own_tmpfs:
            nursery.start_soon(self.space.keep_room, self.fs.write_headroom)

    def stop(self) -> None:
        """Stop talking to peers and to the kernel (before the unmount)."""
        if self.peers is not None:
            self.peers.stop()
        self.kernel.stop()

    def close(self) -> None:
        """Release the RAM tier and the metadata store (after the unmount)."""
        self.ram.close()
        self.store.close()

    # -- status ----------------------------------------------------------------------

    def lifecycle_status(self) -> dict[str, object]:
        r, w = self.retention, self.withdrawal
        return {
            **self.space.status(),
            "fsync": self.durability.status(),
            "incomplete_grace": r.grace if r is not None else None,
            "removed_incomplete_steps": r.removed_steps[-20:] if r is not None else [],
            **self.lags.status(),
            **(w.status() if w is not None else {}),
        }

    def status(self) -> dict[str, Any]:
        """What `mtcfs status --json` shows (and the metrics are made of)."""
        fs, opts = self.fs, self.opts
        st: dict[str, Any] = fs.status()
        st.update(
            mountpoint=opts.mountpoint,
            pid=os.getpid(),
            version=__version__,
            uptime=round(time.time() - self.started, 1),
            health="ok",
            node=fs.node_id,
            data_path=fs.data_path,
            passthrough=self.passthrough.status(),
            lifecycle=self.lifecycle_status(),
            fetch=self.fetcher.status(),
            metrics_url=self.metrics_url,
        )
        up, listing = self.uploader, self.listing
        if up is not None and listing is not None:
            st["durable"] = {**up.status(),
                             "readthrough": {**self.fetcher.status(), **listing.status()}}
            # Failing now: backing off, or a tier call retrying through an outage.
            recent = time.time() - up.stats.last_error_time < 30
            if up.stats.last_error and not up.idle() and (up.status()["retrying_in"] or recent):
                st["health"] = "degraded"
        else:
            st["durable"] = None
        lc = st["lifecycle"]
        if lc["writers_waiting"] or (lc["last_full_age"] is not None
                                     and lc["last_full_age"] < 60):
            st["health"] = "degraded"  # writers blocked on, or refused by, a full RAM tier
        peers = self.peers
        st["peers"] = peers.status() if peers is not None else None
        st["visibility"] = {
            "mode": fs.visibility_mode,
            **(peers.broadcaster.status() if peers is not None else {
                "commit_timeout": opts.commit_timeout, "waits": 0, "wait_seconds": 0.0,
                "max_wait_seconds": 0.0, "timeouts": 0, "last_timeout": None,
                "broadcast_queue": 0}),
        }
        if st["visibility"]["timeouts"] and peers is not None and not peers.broadcaster.quiet():
            st["health"] = "degraded"  # commits returned before every peer had them
        if peers is not None:
            st["peers"]["bytes_fetched_by_source"] = self.fetcher.status()["bytes_by_source"]
        return st


def step_rules(opts: MountOptions) -> StepRules:
    """What commits a step (markers) and what is temporary (never uploaded)."""
    return StepRules(
        markers=_names(opts.commit_markers) or DEFAULT_MARKERS,
        tmp_patterns=_names(opts.tmp_patterns) or DEFAULT_TMP_PATTERNS,
    )


def _names(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip()) if value else ()


def open_ram(opts: MountOptions, own_tmpfs: bool) -> RamTier:
    """The RAM tier; with own_tmpfs (passthrough) on a tmpfs of its own, sized
    --ram-size (raises OSError if that cannot be mounted)."""
    return RamTier(opts.ram_dir, opts.ram_size, own_tmpfs=own_tmpfs)


def build(opts: MountOptions, store: MetaStore, ram: RamTier, kernel: KernelCache,
          passthrough: Passthrough) -> Mount:
    """Every part of one mount, in dependency order. The durable tier is opened,
    checked and listed here (before the kernel sees anything); the peer tier starts
    listening in Mount.start_peers. Raises AssemblyError."""
    ns = Namespace(store)
    rules = step_rules(opts)
    events = Events()
    clock = WriteClock(ram.stat)
    retired = RetiredSteps(ns)
    with_peers = bool(opts.listen)
    replicas = (opts.replicas or 0) if with_peers else 0

    members = None
    if with_peers:
        members = _membership(opts, events)
    copies = Copies(opts.node_id, replicas,
                    members.is_live if members is not None else (lambda n: False),
                    durable=bool(opts.bucket), ns=ns, events=events)
    recover(ns, ram, copies)  # what a previous daemon left, before anything reads it

    tier = _open_durable(opts) if opts.bucket else None
    listing = None
    if tier is not None:
        from mtcfs.persist.listing import BucketListing

        listing = BucketListing(ns, tier, copies, events, kernel, refresh=opts.list_refresh)
        # Objects this host is deleting (its pending deletes) are not merged back.
        _merge_bucket(listing, {k for k, _ in store.load_pending_deletes()})

    peers = None
    if members is not None:
        from mtcfs.peer.tier import PeerTier

        bulk, bulk_server = _data_channel(opts)
        peers = PeerTier(ns, ram, copies, events, kernel, members, clock, retired,
                         node_id=opts.node_id, listen=opts.listen or "", replicas=replicas,
                         secret=_secret(opts), tls=_tls(opts),
                         failure_domain=opts.failure_domain or "",
                         commit_timeout=opts.commit_timeout, bulk=bulk, bulk_server=bulk_server)
    uploader = None
    if tier is not None:
        from mtcfs.persist.policy import PersistPolicy
        from mtcfs.persist.uploader import Uploader

        uploader = Uploader(ns, ram, tier, PersistPolicy.parse(opts.persist or "step"), rules,
                            copies, events, node_id=opts.node_id if with_peers else "",
                            hosts_accounted=(peers.hosts_accounted if peers is not None
                                             else lambda: True))

    # What may not be evicted now (being uploaded, pushed) and what may make room.
    activity = [a for a in (uploader, peers) if a is not None]
    space = SpaceManager(ns, ram, copies, rules, activity, opts.keep_steps, opts.full_timeout)
    fetcher = Fetcher(ns, ram, copies, events, space, tier, peers)
    durability = Durability(ns, copies, events, rules, opts.fsync, opts.fsync_timeout,
                            uploader, with_peers)
    lags = Lags(copies, durable=tier is not None)
    fs = Filesystem(ns, ram, copies, events, kernel, clock, fetcher, space, durability,
                    passthrough, node_id=opts.node_id, control_socket=opts.control_socket,
                    rules=rules, visibility=peers, visibility_mode=opts.visibility,
                    durable_name=_durable_name(tier))
    retention = (Retention(fs, space, rules, retired, opts.keep_steps, opts.incomplete_grace)
                 if opts.keep_steps else None)
    # With peers, a committed step whose file lost its last copy is withdrawn.
    withdrawal = None
    if members is not None:
        from mtcfs.peer.membership import GONE_AFTER

        withdrawal = Withdrawal(fs, copies, rules, members.live_nodes, members.job_size,
                                members.down_for, GONE_AFTER)

    events.register(*[x for x in (fs, lags, uploader, peers, fetcher, space, durability,
                                  retention, withdrawal) if x is not None])
    return Mount(opts, store, ns, ram, events, kernel, copies, fs, fetcher, space, durability,
                 lags, passthrough, uploader, listing, peers, retention, withdrawal)


def _membership(opts: MountOptions, events: Events) -> Any:
    from mtcfs.peer.membership import Membership

    static = [a.strip() for a in (opts.peers or "").split(",") if a.strip()]
    try:
        return Membership(opts.listen or "", opts.node_id, static, opts.peers_file,
                          _secret(opts), _tls(opts), events,
                          domain=opts.failure_domain or "", replicas=opts.replicas or 0)
    except (OSError, ValueError) as e:
        raise AssemblyError(f"peer tier: {e}") from None


def _data_channel(opts: MountOptions) -> tuple[Any, Any]:
    """The bulk data channel's client pool, and how to make its server once the peer
    tier runs (it calls into the trio thread); (None, None) with --data-connections 0."""
    if not opts.data_connections:
        return None, None
    from mtcfs.config import data_listen_address
    from mtcfs.peer.bulk import (
        VERIFIERS,
        BlockHashes,
        BulkPool,
        BulkServer,
        Keys,
        in_trio,
        tls_contexts,
    )

    keys = Keys(_secret(opts))
    hashes = BlockHashes()  # digests learned sending or receiving, used by both sides
    # Threads that check landed blocks, for both sides (they share the 2 cores anyway).
    verifier = ThreadPoolExecutor(VERIFIERS, "bulk-verify")
    try:
        server_tls, client_tls = tls_contexts(_tls(opts))
    except (OSError, ValueError) as e:
        raise AssemblyError(f"data channel TLS: {e}") from None
    listen = data_listen_address(opts)

    def server(handler: Any, token: trio.lowlevel.TrioToken) -> BulkServer:
        return BulkServer(handler, in_trio(token), keys, listen, server_tls, hashes=hashes,
                          verifier=verifier)

    return BulkPool(keys, client_tls, opts.data_connections, hashes, verifier), server


def _secret(opts: MountOptions) -> bytes | None:
    return read_token(opts.token_file) if opts.token_file else None


def _tls(opts: MountOptions) -> tuple[bytes, bytes, bytes | None] | None:
    if not (opts.tls_cert and opts.tls_key):
        return None

    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    return read(opts.tls_cert), read(opts.tls_key), read(opts.tls_ca) if opts.tls_ca else None


def _open_durable(opts: MountOptions) -> DurableTier:
    # Imported here: google-cloud-storage is slow to import and unused without --bucket.
    from mtcfs.tiers.durable import DurableError, open_durable

    try:
        tier = open_durable(opts.bucket or "", opts.gcs_endpoint)
        tier.check()
    except DurableError as e:
        raise AssemblyError(f"durable tier {opts.bucket}: {e}") from None
    return tier


def _merge_bucket(listing: BucketListing, pending_deletes: set[str]) -> None:
    """The bucket's tree into the namespace, before the kernel sees anything."""
    from mtcfs.tiers.durable import DurableError

    t0 = time.monotonic()
    try:
        objects = listing.listing()
    except DurableError as e:
        raise AssemblyError(f"durable tier {listing.tier.url}: {e}") from None
    merged = listing.merge(objects, pending_deletes, full=True)
    log.info("durable tier %s: %d objects listed, %d files merged in %.2f s", listing.tier.url,
             len(objects), merged, time.monotonic() - t0)


def _durable_name(tier: DurableTier | None) -> str:
    """The durable tier's name in `tiers`: "gcs" for gs://, "file" for file://."""
    if tier is None:
        return "durable"
    return "gcs" if tier.url.startswith("gs:") else "file"
