"""`mtcfs csi`: the Identity and Node services on kubelet's unix socket, and the
re-bind loop, until SIGTERM/SIGINT. Stopping never touches mounts."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import FrameType

import grpc

from mtcfs import __version__
from mtcfs.csi import DRIVER_NAME
from mtcfs.csi.identity import IdentityService
from mtcfs.csi.node import NodeService, Publisher, RebindLoop
from mtcfs.csi.pods import PodLabels
from mtcfs.csi.v1 import csi_pb2_grpc

log = logging.getLogger("mtcfs.csi")


class ServeError(RuntimeError):
    pass


@dataclass
class PluginOptions:
    socket_path: str  # from --endpoint unix://PATH
    node_id: str
    mount_root: str
    targets_root: str
    pod_labels: PodLabels
    rebind_interval: float = 1.0
    workers: int = 8


def _remove_stale_socket(path: str) -> None:
    """A socket file left by a previous plugin (killed, or upgraded) blocks bind()."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ServeError(f"{path} exists and is not a socket")
    os.unlink(path)


def serve(opts: PluginOptions, stop: threading.Event | None = None) -> None:
    """Serve until `stop` is set or SIGTERM/SIGINT arrives (main thread only)."""
    stop = stop or threading.Event()
    os.makedirs(os.path.dirname(opts.socket_path) or ".", exist_ok=True)
    _remove_stale_socket(opts.socket_path)
    publisher = Publisher(opts.mount_root, opts.targets_root)
    server = grpc.server(ThreadPoolExecutor(max_workers=opts.workers, thread_name_prefix="csi"))
    rebind = RebindLoop(publisher, opts.rebind_interval)
    csi_pb2_grpc.add_IdentityServicer_to_server(IdentityService(rebind), server)
    csi_pb2_grpc.add_NodeServicer_to_server(
        NodeService(opts.node_id, publisher, opts.pod_labels), server)
    try:
        server.add_insecure_port(f"unix://{opts.socket_path}")
    except RuntimeError as e:
        raise ServeError(f"cannot listen on {opts.socket_path}: {e}") from None
    server.start()
    socket_ino = os.stat(opts.socket_path).st_ino
    rebind.start()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
    live, why = publisher.live()
    log.info("%s %s serving on %s: node %s, mount root %s (%s), re-binding targets under %s",
             DRIVER_NAME, __version__, opts.socket_path, opts.node_id, opts.mount_root,
             "live" if live else f"not live yet: {why}", opts.targets_root)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        log.info("stopping (published mounts stay)")
        rebind.stop()
        server.stop(grace=2).wait()
        # Only our own socket: a successor may have started already.
        with contextlib.suppress(OSError):
            if os.stat(opts.socket_path).st_ino == socket_ino:
                os.unlink(opts.socket_path)
