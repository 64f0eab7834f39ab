"""The mount daemon: assembles the tiers and the filesystem, serves FUSE and
the control socket, and unmounts cleanly on SIGTERM/SIGINT."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pyfuse3
import trio

from mtcfs import control
from mtcfs.config import MountOptions, is_dead_mount, mount_entry
from mtcfs.control.handlers import ControlHandler
from mtcfs.fs.filesystem import Filesystem
from mtcfs.fs.fuse_ops import FuseOperations, mount_options, raise_read_ahead
from mtcfs.fs.kernel import KernelCache
from mtcfs.fs.namespace import Inode, Namespace
from mtcfs.fs.passthrough import Passthrough
from mtcfs.meta.store import MetaStore
from mtcfs.persist.steps import DEFAULT_MARKERS, DEFAULT_TMP_PATTERNS, StepRules
from mtcfs.sizes import format_size
from mtcfs.tiers.ram import RamTier

log = logging.getLogger("mtcfs")


class MountFailed(RuntimeError):
    pass


# With --daemon the log lives in the RAM dir (tmpfs, outside the budget): rotated.
LOG_ROTATE_BYTES = 16 << 20
LOG_KEEP = 3


def setup_logging(level: str, stream: Any = None, fmt: str = "text",
                  path: str | None = None) -> None:
    """One line per event; with fmt "json", one JSON object per line with the
    field names Cloud Logging reads (severity, message, time)."""
    handler: logging.Handler
    if path is not None:
        from logging.handlers import RotatingFileHandler

        handler = RotatingFileHandler(path, maxBytes=LOG_ROTATE_BYTES, backupCount=LOG_KEEP)
    else:
        handler = logging.StreamHandler(stream or sys.stderr)
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(JsonFormatter(
            "%(levelname)s %(name)s %(message)s", timestamp="time",
            rename_fields={"levelname": "severity", "name": "logger"}))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def run(opts: MountOptions) -> int:
    """Mount and serve until unmounted. With --daemon, the calling process
    returns 0 as soon as the mount is live (or 1 with the reason)."""
    if not opts.daemon:
        setup_logging(opts.log_level, fmt=opts.log_format)
        return _serve_foreground(opts, ready_fd=None)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as r:
            msg = r.read().decode(errors="replace").strip()
        if msg == "OK":
            return 0
        if not msg:
            os.waitpid(pid, 0)
            msg = f"the daemon exited before the mount was live (see {opts.ram_dir}/mtcfs.log)"
        print(f"mtcfs: error: {msg}", file=sys.stderr)
        return 1
    # Child: detach from the terminal, log to the RAM dir.
    os.close(read_fd)
    os.setsid()
    log_path = os.path.join(opts.ram_dir, "mtcfs.log")
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    setup_logging(opts.log_level, fmt=opts.log_format, path=log_path)
    code = _serve_foreground(opts, ready_fd=write_fd)
    os._exit(code)


def _notify(ready_fd: int | None, msg: str) -> None:
    if ready_fd is None:
        return
    try:
        os.write(ready_fd, msg.encode() + b"\n")
        os.close(ready_fd)
    except OSError:
        pass


def _fail_early(msg: str, ready_fd: int | None, store: MetaStore) -> int:
    """Mounting failed: say why (log, and the waiting `mount --daemon`)."""
    log.error("%s", msg)
    _notify(ready_fd, msg)
    store.close()
    return 1


def _lock_ram_dir(ram_dir: str) -> int:
    fd = os.open(os.path.join(ram_dir, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.lseek(fd, 0, 0)
        owner = os.read(fd, 64).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise MountFailed(
            f"RAM dir {ram_dir} is in use by another mtcfs daemon (pid {owner})"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def cleanup_dead_mount(mountpoint: str) -> bool:
    """A daemon killed with -9 leaves a mount whose every call fails with
    ENOTCONN; detach it so the mountpoint can be used again."""
    entry = mount_entry(mountpoint)
    if entry is None:
        return False
    if not is_dead_mount(mountpoint):
        return False
    subprocess.run(["fusermount3", "-uz", mountpoint], check=False, capture_output=True)
    if mount_entry(mountpoint) is not None:
        subprocess.run(["umount", "-l", mountpoint], check=False, capture_output=True)
    return True


def _serve_foreground(opts: MountOptions, ready_fd: int | None) -> int:
    try:
        lock_fd = _lock_ram_dir(opts.ram_dir)
    except MountFailed as e:
        log.error("%s", e)
        _notify(ready_fd, str(e))
        return 1
    if cleanup_dead_mount(opts.mountpoint):
        log.warning("cleaned up a dead mount left at %s by a previous daemon", opts.mountpoint)
    try:
        store = MetaStore(os.path.join(opts.ram_dir, "meta.db"))
        ns = Namespace(store)
        want_passthrough = _want_passthrough(opts)
        try:
            ram = RamTier(opts.ram_dir, opts.ram_size, own_tmpfs=want_passthrough)
        except OSError as e:
            if opts.data_path == "passthrough":
                raise
            log.warning("data path: fuse (the RAM tier's own tmpfs could not be mounted: %s)",
                        e.strerror or e)
            want_passthrough = False
            ram = RamTier(opts.ram_dir, opts.ram_size)
        fs = Filesystem(ns, ram, opts.node_id, opts.control_socket, step_rules(opts),
                        opts.visibility)
        kernel = KernelCache(
            lambda parent, name: pyfuse3.invalidate_entry(parent, name),
            lambda ino: pyfuse3.invalidate_inode(ino, attr_only=True))
        fs.kernel = kernel
        fs.invalidate_entry = lambda parent, name: kernel.entry(parent.ino, name)
    except Exception as e:
        log.exception("cannot open the RAM dir")
        _notify(ready_fd, f"cannot open RAM dir {opts.ram_dir}: {e}")
        return 1
    if opts.bucket:
        from mtcfs.tiers.durable import DurableError

        try:
            _attach_durable(opts, fs)
        except DurableError as e:
            return _fail_early(f"durable tier {opts.bucket}: {e}", ready_fd, store)
    if opts.listen:
        try:
            _attach_peers(opts, fs)
        except (OSError, ValueError) as e:
            return _fail_early(f"peer tier: {e}", ready_fd, store)
    _attach_lifecycle(opts, fs)
    metrics = None
    if opts.metrics_port is not None:
        from mtcfs.metrics import Metrics

        metrics = Metrics(fs)
        try:
            port = metrics.serve(opts.metrics_address, opts.metrics_port)
        except OSError as e:
            return _fail_early(f"metrics server on {opts.metrics_address}:{opts.metrics_port}: "
                               f"{e.strerror}", ready_fd, store)
        assert fs.lifecycle is not None
        fs.lifecycle.on_replication_lag = metrics.replication_lag.observe
        fs.lifecycle.on_persist_lag = metrics.persist_lag.observe
        fs.lifecycle.durability.on_waited = (
            lambda level, s: metrics.fsync_seconds.labels(level).observe(s))
        if fs.peers is not None:
            fs.peers.broadcaster.on_waited = metrics.commit_seconds.observe
        fs.metrics_url = f"http://{opts.metrics_address}:{port}/metrics"
        log.info("metrics on %s (health: /healthz)", fs.metrics_url)
    ops = FuseOperations(fs, passthrough=want_passthrough)
    fs.passthrough = Passthrough(pyfuse3.backing_open, pyfuse3.backing_close) \
        if want_passthrough else fs.passthrough
    try:
        pyfuse3.init(ops, opts.mountpoint, mount_options(f"mtcfs:{opts.node_id}",
                                                         opts.fuse_options))
    except Exception as e:
        return _fail_early(f"cannot mount {opts.mountpoint}: {e}", ready_fd, store)
    code = 0
    try:
        code = trio.run(_main, opts, fs, ready_fd, metrics, ops.enable_passthrough)
    except Exception:
        log.exception("daemon failed")
        code = 1
    finally:
        if fs.peers is not None:
            fs.peers.stop()
        fs.kernel.stop()
        if metrics is not None:
            metrics.close()
        pyfuse3.close(unmount=True)
        ram.close()
        store.close()
        os.close(lock_fd)
    log.info("unmounted %s", opts.mountpoint)
    return code


def _attach_durable(opts: MountOptions, fs: Filesystem) -> None:
    """Open and check the durable tier, merge its tree into the namespace
    (before the kernel sees anything), and hook up uploads and read-through."""
    # Imported here: google-cloud-storage is slow to import and unused without --bucket.
    from mtcfs.persist.policy import PersistPolicy
    from mtcfs.persist.uploader import Uploader
    from mtcfs.readthrough import ReadThrough
    from mtcfs.tiers.durable import open_durable

    tier = open_durable(opts.bucket or "", opts.gcs_endpoint)
    tier.check()
    uploader = Uploader(fs.ns, fs.ram.path, tier, PersistPolicy.parse(opts.persist or "step"),
                        fs.rules)
    readthrough = ReadThrough(fs.ns, fs.ram, tier, refresh=opts.list_refresh)
    t0 = time.monotonic()
    objects = readthrough.listing()
    merged = readthrough.merge(objects, set(uploader.deletes), full=True)
    log.info("durable tier %s: %d objects listed, %d files merged in %.2f s", tier.url,
             len(objects), merged, time.monotonic() - t0)
    fs.uploader, fs.readthrough = uploader, readthrough


def _attach_peers(opts: MountOptions, fs: Filesystem) -> None:
    """Set up the peer tier (it starts listening in _main, before the mount is live)."""
    from mtcfs.config import read_token
    from mtcfs.peer.tier import PeerTier
    from mtcfs.readthrough import ReadThrough

    secret = read_token(opts.token_file) if opts.token_file else None
    tls = None
    if opts.tls_cert and opts.tls_key:
        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()

        tls = (read(opts.tls_cert), read(opts.tls_key), read(opts.tls_ca) if opts.tls_ca else None)
    peers = PeerTier(
        fs.ns, fs.ram, opts.node_id, opts.listen or "",
        [a.strip() for a in (opts.peers or "").split(",") if a.strip()], opts.peers_file,
        opts.replicas if opts.replicas is not None else 1, secret, tls,
        opts.failure_domain or "", opts.commit_timeout,
    )

    peers.invalidate_hook = lambda parent, name, node: fs.invalidate_entry(parent, name)
    peers.removed_hook = fs.drop_if_unused
    peers.attrs_hook = fs.kernel.attrs
    peers.kernel_settle = fs.kernel.settle
    peers.last_write = lambda: fs.last_write
    fs.peers = peers
    fs.visibility = peers
    if fs.uploader is not None:
        fs.uploader.node_id = opts.node_id
        fs.uploader.on_persisted = peers.index.holders_changed
        peers.on_remote = fs.uploader.on_remote
        peers.on_moved = fs.uploader.on_remote_moved
    if fs.readthrough is None:
        fs.readthrough = ReadThrough(fs.ns, fs.ram, None, peers=peers)
    else:
        fs.readthrough.peers = peers
    if fs.uploader is not None:
        uploader, readthrough = fs.uploader, fs.readthrough

        def fetch_for_upload(node: Inode) -> None:
            async def fetch() -> None:
                try:
                    await readthrough.wait_complete(node)
                except OSError as e:
                    log.error("cannot persist %s: no copy could be fetched: %s",
                              fs.ns.path_of(node) if node.linked else node.guid, e.strerror)
                uploader.wake()

            if node.ino not in readthrough.fetches:
                readthrough.spawn(fetch)

        uploader.fetch = fetch_for_upload


def _attach_lifecycle(opts: MountOptions, fs: Filesystem) -> None:
    """Eviction, retention and fsync levels, hooked to the tiers' events."""
    from mtcfs.lifecycle import Lifecycle

    lc = fs.lifecycle = Lifecycle(fs, opts, fs.rules)
    if fs.uploader is not None:
        announce = fs.uploader.on_persisted

        def persisted(node: Inode) -> None:
            announce(node)
            lc.on_persisted(node)

        fs.uploader.on_persisted = persisted
    if fs.peers is not None:
        peers = fs.peers
        membership_changed = peers.members.on_change
        remote_changed = peers.on_remote

        def on_change(p: Any) -> None:
            membership_changed(p)
            lc.on_peers_changed()

        def on_remote(nodes: list[Inode]) -> None:
            remote_changed(nodes)
            lc.on_peers_changed()

        peers.members.on_change = on_change
        peers.on_remote = on_remote
        fs.peers.on_copies = lc.on_copies
        fs.peers.urgent = lambda node: node.ino in lc.durability.waiting
        fs.peers.make_room = lambda need: lc.space.make_room_now(need, persisted_only=True)
        if lc.retention is not None:
            fs.peers.retired = lc.retention.retired
    if fs.readthrough is not None:
        fs.readthrough.make_room = lc.space.make_room_now


def _want_passthrough(opts: MountOptions) -> bool:
    return opts.data_path == "passthrough" or (
        opts.data_path == "auto" and _passthrough_unavailable() is None)


def _passthrough_unavailable() -> str | None:
    from mtcfs.fs.passthrough import unavailable

    return unavailable()


def _start_passthrough(fs: Filesystem) -> str | None:
    """After INIT: did the kernel agree, and does registering a backing file work?
    Returns why not (None: passthrough is on)."""
    if not pyfuse3.passthrough_enabled():
        return "the kernel did not agree to FUSE passthrough at INIT"
    probe = os.path.join(fs.ram.data_dir, ".passthrough-probe")
    fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        backing = pyfuse3.backing_open(fd)
        pyfuse3.backing_close(backing)
    except OSError as e:
        return f"registering a backing file failed: {e.strerror or e}"
    finally:
        os.close(fd)
        os.unlink(probe)
    fs.passthrough.enabled = True
    fs.data_path = "passthrough"
    return None


def step_rules(opts: MountOptions) -> StepRules:
    """What commits a step (markers) and what is temporary (never uploaded)."""
    return StepRules(
        markers=_names(opts.commit_markers) or DEFAULT_MARKERS,
        tmp_patterns=_names(opts.tmp_patterns) or DEFAULT_TMP_PATTERNS,
    )


def _names(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip()) if value else ()


async def _main(opts: MountOptions, fs: Filesystem, ready_fd: int | None,
                metrics: Any = None, passthrough_asked: bool = False) -> int:
    started = time.time()
    on_control = ControlHandler(fs, opts, started, lambda: nursery.cancel_scope.cancel())

    async def watch_signals() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
            async for sig in sigs:
                if sig == signal.SIGHUP:
                    continue
                log.info("received %s: unmounting", signal.Signals(sig).name)
                nursery.cancel_scope.cancel()
                return

    async def serve_fuse() -> None:
        await pyfuse3.main(min_tasks=4, max_tasks=64)
        log.info("%s was unmounted", opts.mountpoint)
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        if fs.peers is not None:
            # Before the mount is live: a new host sees the whole tree at once.
            try:
                await fs.peers.start(nursery)
            except (OSError, RuntimeError) as e:
                log.error("peer tier: %s", e)
                _notify(ready_fd, f"peer tier: {e}")
                nursery.cancel_scope.cancel()
                return 1
        # Listen before serving FUSE: the socket path is published through an xattr
        # of the mount, and a client that reads it must find a listener.
        await nursery.start(control.serve, opts.control_socket, on_control)
        nursery.start_soon(serve_fuse)
        nursery.start_soon(watch_signals)
        nursery.start_soon(fs.ram.empty_trash)
        if fs.lifecycle is not None:
            await fs.lifecycle.run(nursery)
        if metrics is not None:
            nursery.start_soon(metrics.refresh_loop)
        if fs.readthrough is not None:
            nursery.start_soon(fs.readthrough.run)
        if fs.uploader is not None and fs.readthrough is not None:
            nursery.start_soon(fs.uploader.run)
            nursery.start_soon(fs.readthrough.refresh_loop, fs.uploader.deletes)
        # The first call on the mount waits for the kernel's INIT to be served.
        await trio.to_thread.run_sync(raise_read_ahead, opts.mountpoint)
        fs.live = True
        fs.kernel.start()
        why = _start_passthrough(fs) if passthrough_asked else (
            "the daemon was told --data-path fuse" if opts.data_path == "fuse"
            else _passthrough_unavailable())
        if why is not None and opts.data_path == "passthrough":
            log.error("--data-path passthrough: %s", why)
            _notify(ready_fd, f"--data-path passthrough: {why}")
            nursery.cancel_scope.cancel()
            return 1
        if why is None:
            log.info("data path: passthrough (reads and writes of files in this host's RAM "
                     "tier bypass the daemon)")
        else:
            log.info("data path: fuse (%s)", why)
        log.info(
            "mounted %s: node %s, RAM dir %s, RAM size %s, %d files re-adopted",
            opts.mountpoint, opts.node_id, opts.ram_dir, format_size(opts.ram_size),
            len(fs.ns.files()),
        )
        with open(os.path.join(opts.ram_dir, "daemon.json"), "w") as f:
            json.dump({"pid": os.getpid(), "mountpoint": opts.mountpoint}, f)
        _notify(ready_fd, "OK")
    return 0
