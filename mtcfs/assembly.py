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

Parts for features that are not configured are null objects (mtcfs.absent): no
`uploader` or `listing` without --bucket, no `peers` without --listen, no
`retention` without --keep-steps, no `withdrawal` without peers; no part asks
whether another one is there.

`assemble` makes the whole mount the daemon serves (metadata store, RAM tier,
kernel side, every part); `build` makes the parts over a given store, RAM tier and
kernel side (what tests/nofuse and the benchmarks call).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import trio

from mtcfs.absent import (
    NoDurable,
    NoListing,
    NoPeers,
    NoRetention,
    NoUploader,
    NoWithdrawal,
)
from mtcfs.config import MountOptions, read_token
from mtcfs.core.copies import Copies
from mtcfs.core.events import Events
from mtcfs.core.namespace import Namespace
from mtcfs.core.retired import RetiredSteps
from mtcfs.core.steps import DEFAULT_MARKERS, DEFAULT_TMP_PATTERNS, StepRules
from mtcfs.core.store import MetaStore
from mtcfs.core.versions import Versions
from mtcfs.fetch import Fetcher
from mtcfs.fs.filesystem import Filesystem
from mtcfs.fs.kernel import KernelCache
from mtcfs.fs.names import Names
from mtcfs.fs.passthrough import Passthrough
from mtcfs.fs.recovery import recover
from mtcfs.fs.sealer import Sealer
from mtcfs.fs.state_view import FileStateView
from mtcfs.fs.writeclock import WriteClock
from mtcfs.fs.xattrs import Xattrs
from mtcfs.lifecycle.durability import Durability
from mtcfs.lifecycle.lags import Lags
from mtcfs.lifecycle.replacement import ReplacementRestore
from mtcfs.lifecycle.retention import Retention
from mtcfs.lifecycle.space import SpaceManager
from mtcfs.lifecycle.withdrawal import Withdrawal
from mtcfs.persist.attempts import Stats as UploadStats
from mtcfs.persist.step_report import StepReport
from mtcfs.tiers.huge_pages import HugePages
from mtcfs.tiers.ram import RamTier

if TYPE_CHECKING:
    from mtcfs.peer.tier import PeerTier
    from mtcfs.persist.listing import BucketListing
    from mtcfs.persist.uploader import Uploader
    from mtcfs.tiers.durable import DurableTier

log = logging.getLogger(__name__)


class AssemblyError(Exception):
    """A part could not be set up (bad bucket, bad peer address): the mount fails
    with this message. `mounted_tmpfs`: the RAM tier's tmpfs was mounted by the
    attempt (the daemon takes it back)."""

    def __init__(self, msg: str, mounted_tmpfs: bool = False) -> None:
        super().__init__(msg)
        self.mounted_tmpfs = mounted_tmpfs


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
    uploader: Uploader | NoUploader
    listing: BucketListing | NoListing
    peers: PeerTier | NoPeers
    retention: Retention | NoRetention
    withdrawal: Withdrawal | NoWithdrawal
    restore: ReplacementRestore
    started: float = field(default_factory=time.time)

    @cached_property
    def step_report(self) -> StepReport:
        """The steps as `mtcfs steps`, user.mtcfs.state and the status see them."""
        return StepReport(self.ns, self.fs.rules, self.copies, self.uploader.url,
                          self.retention, self.withdrawal)

    @property
    def passthrough_asked(self) -> bool:
        """The kernel is asked for passthrough at INIT: the RAM tier is on a tmpfs of its
        own (the kernel's backing files must be there)."""
        return self.ram.own_tmpfs

    @cached_property
    def view(self) -> FileStateView:
        """user.mtcfs.state and the files' status (a step directory's: the step report)."""
        return FileStateView(self.fs, self.copies, self.space, self.step_report.of,
                             durable_name=_durable_name(self.uploader.url))

    # -- running ---------------------------------------------------------------------

    async def start_peers(self, nursery: trio.Nursery) -> None:
        """Before the mount is live: listen, be heard by every peer, pull one caught-up
        peer's snapshot (a new host sees the whole tree at once)."""
        await self.peers.start(nursery)
        self.restore.plan_now()

    def run_background(self, nursery: trio.Nursery) -> None:
        """The parts' own tasks: fetches, uploads, listing refreshes, retention,
        withdrawal, room kept ahead of passthrough writers, the trash."""
        nursery.start_soon(self.ram.empty_trash)
        nursery.start_soon(self.fetcher.run)
        nursery.start_soon(self.restore.run)
        nursery.start_soon(self.uploader.run)
        nursery.start_soon(self.listing.refresh_loop, self.uploader.pending_deletes)
        nursery.start_soon(self.retention.run)
        nursery.start_soon(self.withdrawal.run)
        if self.ram.own_tmpfs:
            nursery.start_soon(self.space.keep_room, self.fs.write_headroom,
                               self.fs.clock.writer_open)

    def stop(self) -> None:
        """Stop talking to peers and to the kernel (before the unmount)."""
        self.peers.stop()
        self.kernel.stop()

    def close(self) -> None:
        """Release the RAM tier and the metadata store (after the unmount)."""
        self.ram.close()
        self.store.close()


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
    --ram-size, huge pages as --huge-pages says (raises OSError if that cannot be
    mounted)."""
    return RamTier(opts.ram_dir, opts.ram_size, own_tmpfs=own_tmpfs,
                   huge_pages=HugePages(opts.huge_pages))


@dataclass(frozen=True)
class KernelCalls:
    """What a mount asks of the kernel (pyfuse3's calls, in the daemon): drop cached
    names and attributes; register and release passthrough backing files."""

    invalidate_entry: Callable[[int, bytes], None]
    invalidate_inode: Callable[[int], None]
    backing_open: Callable[[int], int]
    backing_close: Callable[[int], None]


def assemble(opts: MountOptions, calls: KernelCalls) -> Mount:
    """The whole mount the daemon serves: the metadata store, the RAM tier (on a tmpfs
    of its own when passthrough can be had, else as --data-path allows), the kernel
    side and every part (build). Raises AssemblyError, having closed what it opened
    (`mounted_tmpfs` says whether it had mounted the RAM tier's tmpfs)."""
    mounted = False  # the RAM tier's tmpfs was mounted here
    with ExitStack() as opened:  # closed again unless the mount is built
        try:
            store = MetaStore(os.path.join(opts.ram_dir, "meta.db"))
            opened.callback(store.close)
            want_passthrough = wants_passthrough(opts)
            try:
                ram = open_ram(opts, own_tmpfs=want_passthrough)
            except OSError as e:
                if opts.data_path == "passthrough":
                    raise
                log.warning("data path: fuse (the RAM tier's own tmpfs could not be mounted: "
                            "%s)", e.strerror or e)
                want_passthrough = False
                ram = open_ram(opts, own_tmpfs=False)
            opened.callback(ram.close)
            mounted = ram.mounted_tmpfs
            kernel = KernelCache(calls.invalidate_entry, calls.invalidate_inode)
            passthrough = (Passthrough(calls.backing_open, calls.backing_close)
                           if want_passthrough else Passthrough.unused())
            mount = build(opts, store, ram, kernel, passthrough)
        except Exception as e:
            if isinstance(e, AssemblyError):
                msg = str(e)
            else:
                log.exception("cannot open the RAM dir")
                msg = f"cannot open RAM dir {opts.ram_dir}: {e}"
            raise AssemblyError(msg, mounted_tmpfs=mounted) from None
        opened.pop_all()
    return mount


def wants_passthrough(opts: MountOptions) -> bool:
    """--data-path passthrough, or auto where this machine can have it."""
    from mtcfs.fs.passthrough import unavailable

    return opts.data_path == "passthrough" or (
        opts.data_path == "auto" and unavailable() is None)


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

    is_live: Callable[[str], bool] = _nobody_live  # no peers: no other host counts
    if with_peers:
        members = _membership(opts, events, ram)
        is_live = members.is_live
    copies = Copies(opts.node_id, replicas, is_live,
                    durable=bool(opts.bucket), ns=ns, events=events)
    versions = Versions(opts.node_id)  # the one writer of a file's state and version
    recover(ns, ram, copies, versions)  # what a previous daemon left, before anything reads it

    # The uploads' counters: the tier tells them of the errors it retries through.
    upload_stats = UploadStats()
    tier: DurableTier = NoDurable()
    listing: BucketListing | NoListing = NoListing()
    if opts.bucket:
        from mtcfs.persist.listing import BucketListing

        tier = _open_durable(opts, upload_stats.record_error)
        listing = BucketListing(ns, tier, copies, versions, events, kernel,
                                refresh=opts.list_refresh)
        # Objects this host is deleting (its pending deletes) are not merged back.
        _merge_bucket(listing, {k for k, _ in store.load_pending_deletes()})

    peers: PeerTier | NoPeers = NoPeers(opts.commit_timeout)
    if with_peers:
        from mtcfs.peer.tier import PeerSettings, build_peer_tier

        peers = build_peer_tier(
            ns, ram, copies, events, kernel, members, clock, retired,
            PeerSettings(opts.node_id, opts.listen or "", replicas, secret=_secret(opts),
                         tls=_tls(opts), failure_domain=opts.failure_domain or "",
                         commit_timeout=opts.commit_timeout, peer_group=opts.peer_group,
                         peer_group_turn=opts.peer_group_turn),
            _data_channel(opts))
    uploader: Uploader | NoUploader = NoUploader()
    if opts.bucket:
        from mtcfs.persist.policy import PersistPolicy
        from mtcfs.persist.uploader import Uploader

        uploader = Uploader(ns, ram, tier, PersistPolicy.parse(opts.persist or "step"), rules,
                            copies, events, node_id=opts.node_id if with_peers else "",
                            hosts_accounted=peers.hosts_accounted, stats=upload_stats)
        listing.old_objects.append(uploader.server_copies.old_object_found)

    # What may not be evicted now (being uploaded, pushed) and what may make room.
    space = SpaceManager(ns, ram, copies, rules, [uploader, peers], opts.keep_steps,
                         opts.full_timeout)
    fetcher = Fetcher(ns, ram, copies, events, space, tier, peers)
    durability = Durability(ns, copies, events, rules, opts.fsync, opts.fsync_timeout,
                            uploader, with_peers)
    lags = Lags(copies, durable=bool(opts.bucket))
    sealer = Sealer(ns, ram, copies, events, versions)
    names = Names(ns, ram, events, sealer, rules=rules, visibility=peers)
    fs = Filesystem(ns, ram, copies, events, kernel, clock, fetcher, space, durability,
                    passthrough, sealer, names, Xattrs(ns, opts.control_socket),
                    node_id=opts.node_id, rules=rules, visibility_mode=opts.visibility,
                    kernel_times=not ram.own_tmpfs,  # the writeback cache's
                    open_wait=opts.open_wait)
    retention: Retention | NoRetention = (
        Retention(fs, space, rules, retired, opts.keep_steps, opts.incomplete_grace)
        if opts.keep_steps else NoRetention())
    # With peers, a committed step whose file lost its last copy is withdrawn.
    withdrawal: Withdrawal | NoWithdrawal = NoWithdrawal()
    if with_peers:
        from mtcfs.peer.membership import GONE_AFTER

        withdrawal = Withdrawal(fs, copies, tier, rules, members.live_nodes,
                                members.job_size, members.down_for, GONE_AFTER)

    # A replacement host pulls the copies the job counts on it for (none without peers).
    restore = ReplacementRestore(ns, rules, fetcher, copies, opts.node_id, opts.keep_steps,
                                 peers.missing_copies, peers.wait_applied)

    events.register(fs, lags, uploader, peers, fetcher, space, durability, retention,
                    withdrawal)
    mount = Mount(opts, store, ns, ram, events, kernel, copies, fs, fetcher, space, durability,
                  lags, passthrough, uploader, listing, peers, retention, withdrawal, restore)
    return mount


def _nobody_live(node_id: str) -> bool:
    return False


def _membership(opts: MountOptions, events: Events, ram: RamTier) -> Any:
    from mtcfs.peer.membership import Membership

    static = [a.strip() for a in (opts.peers or "").split(",") if a.strip()]
    try:
        return Membership(opts.listen or "", opts.node_id, static, opts.peers_file,
                          _secret(opts), _tls(opts), events,
                          domain=opts.failure_domain or "", replicas=opts.replicas or 0,
                          ram=ram)
    except (OSError, ValueError) as e:
        raise AssemblyError(f"peer tier: {e}") from None


def _data_channel(opts: MountOptions) -> Any:
    """The bulk data channel: its client pool, and how to make its server once the
    peer tier runs (it calls into the trio thread); none with --data-connections 0."""
    from mtcfs.peer.datachannel import DataChannel, NoDataChannel

    if not opts.data_connections:
        return NoDataChannel()
    from mtcfs.config import data_listen_address
    from mtcfs.peer.bulk import (
        VERIFIERS,
        BulkPool,
        BulkServer,
        Keys,
        TrioReaders,
        in_trio,
        tls_contexts,
    )

    keys = Keys(_secret(opts), encrypt=opts.peer_encryption)
    # Threads that check landed blocks, for both sides (they share the 2 cores anyway).
    verifier = ThreadPoolExecutor(VERIFIERS, "bulk-verify")
    try:
        server_tls, client_tls = tls_contexts(_tls(opts))
    except (OSError, ValueError) as e:
        raise AssemblyError(f"data channel TLS: {e}") from None
    listen = data_listen_address(opts)

    def server(handler: Any, token: trio.lowlevel.TrioToken) -> BulkServer:
        return BulkServer(handler, in_trio(token), keys, listen, server_tls, verifier=verifier,
                          post=token.run_sync_soon, streams=TrioReaders(token))

    return DataChannel(BulkPool(keys, client_tls, opts.data_connections, verifier), server)


def _secret(opts: MountOptions) -> bytes | None:
    return read_token(opts.token_file) if opts.token_file else None


def _tls(opts: MountOptions) -> tuple[bytes, bytes, bytes | None] | None:
    if not (opts.tls_cert and opts.tls_key):
        return None

    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    return read(opts.tls_cert), read(opts.tls_key), read(opts.tls_ca) if opts.tls_ca else None


def _open_durable(opts: MountOptions, on_retry: Callable[[str], None]) -> DurableTier:
    # Imported here: google-cloud-storage is slow to import and unused without --bucket.
    from mtcfs.tiers.durable import DurableError, open_durable

    try:
        tier = open_durable(opts.bucket or "", opts.gcs_endpoint, on_retry=on_retry)
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


def _durable_name(url: str | None) -> str:
    """The durable tier's name in `tiers`: "gcs" for gs://, "file" for file://."""
    if not url:
        return "durable"
    return "gcs" if url.startswith("gs:") else "file"
