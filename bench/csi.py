"""The CSI node plugin (`mtcfs csi`) on a real mtcfs mount, driven over its unix
socket like kubelet does.

1. NodePublishVolume to a usable target: the request, then stat of the target
   and a small file created, written and closed in it; vs the same directory
   bound with `mount --bind` (util-linux) and used the same way.
2. node-daemon restart to re-bound targets: with 8 published targets, the
   daemon is killed (-9) and started again on the same RAM dir; timed from the
   restart until every target answers again (statfs, read a file), beside the
   time until the daemon's own mount is live (shown, not compared: the plugin
   re-binds when the mount table changes, so the two are close).

The plugin, its targets and its bind mounts are removed by the group itself
and, after an error or Ctrl-C, by Scratch.defer (before its mounts go).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
from common import MTCFS, BenchError, Context, Mount, Row, alternating_pair, err, run

from mtcfs.config import process_alive
from mtcfs.csi import mounts
from mtcfs.csi.v1 import csi_pb2 as pb
from mtcfs.csi.v1 import csi_pb2_grpc as rpc

POLL = 0.005
TARGETS = 8  # published targets re-bound after a restart
NS, JOB = "bench", "job"


class Plugin:
    """`mtcfs csi` as a subprocess and a client on its socket."""

    def __init__(self, root: Path, mount_root: Path) -> None:
        self.sock = root / "csi.sock"
        self.targets = root / "pods"
        self.targets.mkdir(parents=True, exist_ok=True)
        self.log = root / "plugin.log"
        self.n = 0
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    *MTCFS,
                    "csi",
                    "--endpoint",
                    f"unix://{self.sock}",
                    "--node-id",
                    "bench",
                    "--mount-root",
                    str(mount_root),
                    "--targets-root",
                    str(self.targets),
                    "--log-level",
                    "warning",
                ],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
            )
        self.channel = grpc.insecure_channel(
            f"unix://{self.sock}",
            options=[
                ("grpc.initial_reconnect_backoff_ms", 50),
                ("grpc.min_reconnect_backoff_ms", 50),
                ("grpc.max_reconnect_backoff_ms", 200),
            ],
        )
        self.node = rpc.NodeStub(self.channel)
        identity = rpc.IdentityStub(self.channel)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"mtcfs csi exited ({self.proc.returncode}), see {self.log}")
            try:
                if identity.Probe(pb.ProbeRequest(), timeout=2).ready.value:
                    break
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"mtcfs csi did not get ready, see {self.log}")
            time.sleep(0.05)

    def target(self) -> str:
        self.n += 1
        parent = self.targets / f"uid-{self.n}" / "volumes" / "kubernetes.io~csi" / "ckpt"
        parent.mkdir(parents=True)
        return str(parent / "mount")

    def publish(self, target: str) -> None:
        cap = pb.VolumeCapability(
            mount=pb.VolumeCapability.MountVolume(),
            access_mode=pb.VolumeCapability.AccessMode(mode=1),
        )
        self.node.NodePublishVolume(
            pb.NodePublishVolumeRequest(
                volume_id=f"v{self.n}",
                target_path=target,
                volume_capability=cap,
                volume_context={
                    "csi.storage.k8s.io/pod.namespace": NS,
                    "csi.storage.k8s.io/pod.name": "pod",
                    "csi.storage.k8s.io/ephemeral": "true",
                    "job": JOB,
                },
            ),
            timeout=30,
        )

    def unpublish(self, target: str) -> None:
        self.node.NodeUnpublishVolume(
            pb.NodeUnpublishVolumeRequest(volume_id="v", target_path=target), timeout=30
        )

    def close(self) -> None:
        """Stop the plugin and detach every bind it made (idempotent)."""
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        prefix = f"{self.targets}/"
        for e in reversed(mounts.mountinfo()):
            if e.mount_point.startswith(prefix):
                subprocess.run(["umount", "-l", e.mount_point], capture_output=True)


def use(target: str) -> None:
    """What a pod does first with its volume."""
    os.stat(target)
    fd = os.open(os.path.join(target, f"probe-{time.monotonic_ns()}"), os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"x" * 4096)
    finally:
        os.close(fd)


def publish_time(ctx: Context, plugin: Plugin, m: Mount) -> Row:
    source = m.path / NS / JOB
    source.mkdir(parents=True, exist_ok=True)

    def ours() -> float:
        target = plugin.target()
        t0 = time.perf_counter()
        plugin.publish(target)
        use(target)
        took = time.perf_counter() - t0
        plugin.unpublish(target)
        return took * 1000

    def bind() -> float:
        target = plugin.target()
        os.makedirs(target)
        t0 = time.perf_counter()
        run(["mount", "--bind", str(source), target])
        use(target)
        took = time.perf_counter() - t0
        run(["umount", target])
        os.rmdir(target)
        return took * 1000

    reps = max(50, ctx.reps * 10)  # milliseconds each: more reps for a steadier median
    pair = alternating_pair(ours, bind)
    pair()  # warm-up (imports, dentries)
    xs, ys = [], []
    for _ in range(reps):
        x, y = pair()
        xs.append(x)
        ys.append(y)
    return Row(
        "csi",
        "NodePublishVolume to a usable target",
        "ms",
        xs,
        ys,
        ref_label="mount --bind",
        higher_is_better=False,
        note=f"median of {reps}; request + stat + 4 KiB file written in the target; "
        "reference: the same bind made with mount(8)",
    )


def _usable(target: str) -> bool:
    try:
        os.statvfs(target)
        return bool(os.listdir(target))
    except OSError:
        return False


def rebind_time(ctx: Context, plugin: Plugin, m: Mount) -> list[Row]:
    targets = [plugin.target() for _ in range(TARGETS)]
    for t in targets:
        plugin.publish(t)
    Path(targets[0], "ckpt").write_bytes(b"step")
    xs, ys = [], []
    for i in range(ctx.reps):
        assert m.pid is not None
        os.kill(m.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while process_alive(m.pid) and time.monotonic() < deadline:
            time.sleep(POLL)
        if any(_usable(t) for t in targets):
            raise BenchError("targets still answer after the daemon was killed")
        t0 = time.perf_counter()
        m.start()  # `mtcfs mount --daemon`: returns once the new mount is live
        live = time.perf_counter() - t0
        deadline = time.monotonic() + 30
        while not all(_usable(t) for t in targets):
            if time.monotonic() > deadline:
                raise BenchError(f"targets not re-bound within 30 s, see {plugin.log}")
            time.sleep(POLL)
        xs.append(time.perf_counter() - t0)
        ys.append(live)
        err.print(
            f"  restart {i + 1}/{ctx.reps}: mount live after {live:.2f} s, "
            f"{TARGETS} targets re-bound after {xs[-1]:.2f} s",
            style="dim",
        )
    for t in targets:
        plugin.unpublish(t)
    return [
        Row(
            "csi",
            f"node-daemon restart (kill -9) to {TARGETS} targets re-bound",
            "s",
            xs,
            ys,
            ref_label="daemon mount live",
            higher_is_better=False,
            compare=False,
            note="timed from `mtcfs mount --daemon` on the dead mountpoint; the plugin "
            "wakes on the mount-table change (poll on mountinfo)",
        ),
        Row(
            "csi",
            f"{TARGETS} targets re-bound after the restarted daemon's mount is live",
            "ms",
            [(x - y) * 1000 for x, y in zip(xs, ys, strict=True)],
            higher_is_better=False,
            note="the plugin's share of the restart: the difference of the two times above",
        ),
    ]


def group(ctx: Context) -> list[Row]:
    sc = ctx.scratch
    m = sc.mount("csi", "1GiB")
    root = sc.tmp / "csi"
    root.mkdir()
    plugin = Plugin(root, m.path)
    # Scratch unmounts mtcfs first, then runs deferred clean-ups: detach the binds
    # before that, or the daemon would wait for them (the group's finally does).
    sc.defer(plugin.close)
    try:
        err.print(f"  plugin pid {plugin.proc.pid} on {plugin.sock}", style="dim")
        rows = [publish_time(ctx, plugin, m)]
        rows += rebind_time(ctx, plugin, m)
    finally:
        plugin.close()
    return rows
