"""The mount daemon: assembles the tiers and the filesystem, serves FUSE and
the control socket, and unmounts cleanly on SIGTERM/SIGINT."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pyfuse3
import trio

from mtcfs import control
from mtcfs.absent import NoMetrics
from mtcfs.assembly import AssemblyError, KernelCalls, Mount, assemble
from mtcfs.config import OWN_MOUNT_OPTIONS, MountOptions
from mtcfs.control.handlers import ControlHandler
from mtcfs.fs.fuse_ops import FuseOperations, mount_options, raise_read_ahead
from mtcfs.probes import is_dead_mount, mount_entry, record_listener
from mtcfs.sizes import format_size
from mtcfs.tiers.ram import unmount_tmpfs

if TYPE_CHECKING:
    from mtcfs.metrics import Metrics

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
    # gRPC's C core writes its own lines to stderr (a bind it could not make, with a
    # hint to set GRPC_VERBOSITY): not one of ours, and not JSON. Errors reach us as
    # exceptions; --log-level debug lets its lines through.
    if opts.log_level != "debug":
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
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


class Failure:
    """Why the mount failed before it was live. The waiting `mount --daemon` is told
    once everything is cleaned up, so that it returns to a machine with nothing of
    this mount left on it."""

    def __init__(self) -> None:
        self.message = ""

    def __call__(self, msg: str) -> None:
        log.error("%s", msg)
        self.message = self.message or msg


def _fail_early(msg: str, ready_fd: int | None, discard: Callable[[], None]) -> int:
    """Mounting failed: say why (log, and the waiting `mount --daemon`), after
    `discard()` took back what the attempt made."""
    log.error("%s", msg)
    discard()
    _notify(ready_fd, msg)
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


def _discard_leftovers(opts: MountOptions, mounted_tmpfs: bool, fresh: bool) -> None:
    """A mount that failed before it was live takes back what it made: the RAM tier's
    tmpfs it mounted and the RAM dir it created, if nothing was in them before."""
    if not fresh or os.path.exists(os.path.join(opts.ram_dir, "daemon.json")):
        return  # a RAM dir with data (re-adopted), or one that was live
    if mounted_tmpfs:
        unmount_tmpfs(os.path.join(opts.ram_dir, "data"))
    if opts.ram_dir_created and mount_entry(os.path.join(opts.ram_dir, "data")) is None:
        shutil.rmtree(opts.ram_dir, ignore_errors=True)


# What the mount asks of the kernel: pyfuse3's calls.
PYFUSE3 = KernelCalls(
    invalidate_entry=lambda parent, name: pyfuse3.invalidate_entry(parent, name),
    invalidate_inode=lambda ino: pyfuse3.invalidate_inode(ino, attr_only=True),
    backing_open=lambda fd: pyfuse3.backing_open(fd),
    backing_close=lambda backing: pyfuse3.backing_close(backing))


def _serve_foreground(opts: MountOptions, ready_fd: int | None) -> int:
    try:
        lock_fd = _lock_ram_dir(opts.ram_dir)
    except MountFailed as e:
        log.error("%s", e)
        _notify(ready_fd, str(e))
        return 1
    if opts.listen and not opts.token_file:
        log.warning("--insecure: peer RPCs and the data channel are not authenticated; any "
                    "host that reaches %s can read and change this job's files", opts.listen)
    # Nothing of ours in the RAM dir yet: a failed mount leaves none of it behind.
    fresh = not os.path.exists(os.path.join(opts.ram_dir, "meta.db"))
    if cleanup_dead_mount(opts.mountpoint):
        log.warning("cleaned up a dead mount left at %s by a previous daemon", opts.mountpoint)
    try:
        mount = assemble(opts, PYFUSE3)
    except AssemblyError as e:
        os.close(lock_fd)
        mounted = e.mounted_tmpfs
        return _fail_early(str(e), ready_fd, lambda: _discard_leftovers(opts, mounted, fresh))

    def give_up(msg: str, metrics: Metrics | NoMetrics) -> int:
        """Before the mount was live: undo it all, say why."""
        mount.stop()
        metrics.close()
        mount.close()
        os.close(lock_fd)
        return _fail_early(msg, ready_fd,
                           lambda: _discard_leftovers(opts, mount.ram.mounted_tmpfs, fresh))

    try:
        metrics = _serve_metrics(opts, mount)
    except OSError as e:
        return give_up(f"metrics server on {opts.metrics_address}:{opts.metrics_port}: "
                       f"{e.strerror}", NoMetrics())
    ops = FuseOperations(mount.fs, mount.view, passthrough=mount.passthrough_asked)
    kernel_options = [o for o in opts.fuse_options if o not in OWN_MOUNT_OPTIONS]
    try:
        pyfuse3.init(ops, opts.mountpoint, mount_options(f"mtcfs:{opts.node_id}",
                                                         kernel_options))
    except Exception as e:
        return give_up(f"cannot mount {opts.mountpoint}: {e}", metrics)
    code = 0
    failure = Failure()
    try:
        code = trio.run(_main, mount, ready_fd, failure, metrics, ops.enable_passthrough)
    except Exception:
        log.exception("daemon failed")
        code = 1
    finally:
        mount.stop()
        metrics.close()
        pyfuse3.close(unmount=True)
        mount.close()  # after the unmount: the RAM tier's own tmpfs goes last
        os.close(lock_fd)
        if code != 0:
            _discard_leftovers(opts, mount.ram.mounted_tmpfs, fresh)
        if failure.message:
            _notify(ready_fd, failure.message)
    log.info("unmounted %s", opts.mountpoint)
    return code


def _serve_metrics(opts: MountOptions, mount: Mount) -> Metrics | NoMetrics:
    """The metrics server (--metrics-port); raises OSError when it cannot listen."""
    if opts.metrics_port is None:
        return NoMetrics()
    from mtcfs.metrics import Metrics

    metrics = Metrics(mount, opts.node_id)
    metrics.serve(opts.metrics_address, opts.metrics_port)
    log.info("metrics on %s (health: /healthz)", metrics.url)
    return metrics


def _passthrough_unavailable() -> str | None:
    from mtcfs.fs.passthrough import unavailable

    return unavailable()


def _start_passthrough(mount: Mount) -> str | None:
    """After INIT: did the kernel agree, and does registering a backing file work?
    Returns why not (None: passthrough is on)."""
    if not pyfuse3.passthrough_enabled():
        return "the kernel did not agree to FUSE passthrough at INIT"
    probe = os.path.join(mount.ram.data_dir, ".passthrough-probe")
    fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        backing = pyfuse3.backing_open(fd)
        pyfuse3.backing_close(backing)
    except OSError as e:
        return f"registering a backing file failed: {e.strerror or e}"
    finally:
        os.close(fd)
        os.unlink(probe)
    mount.passthrough.enable()
    return None


async def _main(mount: Mount, ready_fd: int | None, failure: Failure,
                metrics: Metrics | NoMetrics, passthrough_asked: bool = False) -> int:
    opts = mount.opts
    on_control = ControlHandler(mount, lambda: nursery.cancel_scope.cancel(), metrics.url)

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
        # Before the mount is live: a new host sees the whole tree at once.
        try:
            await mount.start_peers(nursery)
        except (OSError, RuntimeError) as e:
            failure(f"peer tier: {e}")
            nursery.cancel_scope.cancel()
            return 1
        # Listen before serving FUSE: the socket path is published through an xattr
        # of the mount, and a client that reads it must find a listener.
        await nursery.start(control.serve, opts.control_socket, on_control)
        nursery.start_soon(serve_fuse)
        nursery.start_soon(watch_signals)
        mount.run_background(nursery)
        nursery.start_soon(metrics.refresh_loop)
        # The first call on the mount waits for the kernel's INIT to be served.
        await trio.to_thread.run_sync(raise_read_ahead, opts.mountpoint)
        mount.kernel.start()
        why = _start_passthrough(mount) if passthrough_asked else (
            "the daemon was told --data-path fuse" if opts.data_path == "fuse"
            else _passthrough_unavailable())
        if why is not None and opts.data_path == "passthrough":
            failure(f"--data-path passthrough: {why}")
            nursery.cancel_scope.cancel()
            return 1
        if why is None:
            log.info("data path: passthrough (reads and writes of files in this host's RAM "
                     "tier bypass the daemon)")
        else:
            log.info("data path: fuse (%s)", why)
        log.info(
            "mounted %s: node %s, RAM dir %s, RAM size %s, huge pages %s, "
            "%d files re-adopted", opts.mountpoint, opts.node_id, opts.ram_dir,
            format_size(opts.ram_size), mount.ram.huge_pages.describe(), len(mount.ns.files()),
        )
        with open(os.path.join(opts.ram_dir, "daemon.json"), "w") as f:
            json.dump({"pid": os.getpid(), "mountpoint": opts.mountpoint,
                       "node_id": opts.node_id}, f)
        if opts.listen:
            record_listener(opts.listen, os.getpid(), opts.mountpoint)
        _notify(ready_fd, "OK")
    return 0
