"""The CSI node plugin (`mtcfs csi`), CSI-sanity style, over its real unix socket.

Real parts: an mtcfs daemon mount as the plugin's --mount-root (conftest's
`mnt`), the plugin as a subprocess, real bind mounts under a kubelet-like
targets directory, and a gRPC client built from the generated CSI stubs.

No Kubernetes API server runs here: where a test needs the pod's JobSet label,
the plugin reads labels from a JSON file (the hidden --pod-labels-file option)
that stands in for the API server.

Every bind mount under the targets directory is detached at teardown (before
the mtcfs mount is stopped), also when a test fails.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from mtcfs.csi import DRIVER_NAME, mounts
from mtcfs.csi.pods import JOBSET_LABEL
from mtcfs.csi.v1 import csi_pb2 as pb
from mtcfs.csi.v1 import csi_pb2_grpc as rpc

from support.mounts import MTCFS, MtcfsMount, mtcfs, wait_until

NS = "csi.storage.k8s.io/pod.namespace"
POD = "csi.storage.k8s.io/pod.name"
Mode = pb.VolumeCapability.AccessMode.Mode
Code = grpc.StatusCode


def mount_capability(mode: int = Mode.SINGLE_NODE_WRITER) -> pb.VolumeCapability:
    return pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(),
                               access_mode=pb.VolumeCapability.AccessMode(mode=mode))


class Plugin:
    """One `mtcfs csi` subprocess and a client for it."""

    def __init__(self, tmp_path: Path, mount_root: Path) -> None:
        self.socket = tmp_path / "plugin" / "csi.sock"
        self.targets = tmp_path / "pods"
        self.targets.mkdir(exist_ok=True)
        self.containers = tmp_path / "containers"  # stand-ins for pods' mount namespaces
        self.labels_file = tmp_path / "pod-labels.json"  # stands in for the API server
        self.labels_file.write_text("{}")
        self.mount_root = mount_root
        self.log_path = tmp_path / "plugin.log"
        self.proc: subprocess.Popen | None = None
        self.channel: grpc.Channel | None = None
        self.uid = 0

    def start(self) -> Plugin:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*MTCFS, "csi", "--endpoint", f"unix://{self.socket}", "--node-id", "node-a",
                 "--mount-root", str(self.mount_root), "--targets-root", str(self.targets),
                 "--pod-labels-file", str(self.labels_file), "--log-level", "debug"],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        # Short reconnect back-off: the first attempts may come before the server listens.
        self.channel = grpc.insecure_channel(
            f"unix://{self.socket}", options=[("grpc.initial_reconnect_backoff_ms", 50),
                                              ("grpc.min_reconnect_backoff_ms", 50),
                                              ("grpc.max_reconnect_backoff_ms", 200)])
        self.identity = rpc.IdentityStub(self.channel)
        self.node = rpc.NodeStub(self.channel)

        def up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"the plugin exited ({self.proc.returncode}):\n{self.log()}")
            try:
                self.identity.GetPluginInfo(pb.GetPluginInfoRequest(), timeout=1)
                return True
            except grpc.RpcError:
                return False

        wait_until(up, timeout=20, interval=0.05, what="the plugin to serve")
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-8000:] if self.log_path.exists() else ""

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def detach_targets(self) -> None:
        """Lazily unmount every mount under (and at) the targets and containers
        directories, topmost first."""
        roots = (str(self.targets), str(self.containers))
        for e in reversed(mounts.mountinfo()):
            if any(e.mount_point == r or e.mount_point.startswith(r + "/") for r in roots):
                subprocess.run(["umount", "-l", e.mount_point], capture_output=True)

    def container_view(self, target: str, name: str, propagation: str) -> Path:
        """What a container runtime does with a volume: an rbind of the target, made
        rslave (volumeMount mountPropagation: HostToContainer) or rprivate (None)."""
        view = self.containers / name
        view.mkdir(parents=True)
        subprocess.run(["mount", "--rbind", target, str(view)], check=True)
        subprocess.run(["mount", f"--make-{propagation}", str(view)], check=True)
        return view

    # -- requests --------------------------------------------------------------------------

    def target(self, name: str = "vol") -> str:
        """A fresh kubelet-style target path (kubelet creates the parent, not the leaf)."""
        self.uid += 1
        parent = self.targets / f"uid-{self.uid}" / "volumes" / "kubernetes.io~csi" / name
        parent.mkdir(parents=True)
        return str(parent / "mount")

    def publish(self, target: str, ns: str = "team", job: str | None = "job1",
                pod: str = "pod-0", readonly: bool = False,
                capability: pb.VolumeCapability | None = None, ephemeral: bool = True,
                attributes: dict[str, str] | None = None, **fields) -> None:
        context = {NS: ns, POD: pod, "csi.storage.k8s.io/pod.uid": "u-1",
                   "csi.storage.k8s.io/ephemeral": str(ephemeral).lower(),
                   **(attributes or {})}
        if job is not None:
            context["job"] = job
        req = pb.NodePublishVolumeRequest(
            volume_id=f"csi-{os.path.basename(os.path.dirname(target))}", target_path=target,
            volume_capability=capability or mount_capability(), readonly=readonly,
            volume_context=context)
        for k, v in fields.items():
            if k == "volume_capability" and v is None:
                req.ClearField("volume_capability")
            else:
                setattr(req, k, v)
        self.node.NodePublishVolume(req, timeout=15)

    def unpublish(self, target: str, volume_id: str = "vol") -> None:
        self.node.NodeUnpublishVolume(
            pb.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=target), timeout=15)

    def ready(self) -> bool:
        return self.identity.Probe(pb.ProbeRequest(), timeout=10).ready.value


@pytest.fixture
def make_plugin(tmp_path: Path) -> Iterator:
    """make_plugin(mount_root) -> a started Plugin; stopped, and its targets detached,
    at teardown (before the mounts of fixtures it was given, set up earlier)."""
    plugins: list[Plugin] = []

    def make(mount_root: Path, start: bool = True) -> Plugin:
        p = Plugin(tmp_path, mount_root)
        plugins.append(p)
        return p.start() if start else p

    yield make
    for p in plugins:
        try:
            p.stop()
        finally:
            p.detach_targets()


@pytest.fixture
def plugin(mnt: MtcfsMount, make_plugin) -> Plugin:
    return make_plugin(mnt.path)


def rpc_error(fn, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)
    return info.value


def binds_at(target: str) -> list[mounts.MountEntry]:
    return mounts.entries_at(target)


# -- identity and node info ----------------------------------------------------------------


def test_identity_and_node_info(plugin: Plugin):
    info = plugin.identity.GetPluginInfo(pb.GetPluginInfoRequest())
    from mtcfs import __version__
    assert (info.name, info.vendor_version) == (DRIVER_NAME, __version__)
    caps = plugin.identity.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest())
    assert list(caps.capabilities) == []
    probe = plugin.identity.Probe(pb.ProbeRequest())
    assert probe.HasField("ready") and probe.ready.value is True
    node = plugin.node.NodeGetInfo(pb.NodeGetInfoRequest())
    assert (node.node_id, node.max_volumes_per_node) == ("node-a", 0)
    ncaps = plugin.node.NodeGetCapabilities(pb.NodeGetCapabilitiesRequest())
    assert list(ncaps.capabilities) == []  # no STAGE_UNSTAGE_VOLUME: kubelet skips staging


def test_probe_is_the_plugins_health_not_the_daemons(tmp_path: Path, make_plugin):
    """Probe feeds the livenessprobe sidecar, which restarts the plugin on false:
    a node daemon that is not there must not make it false (a restart cannot help,
    and the back-off would delay re-binds); publishing answers UNAVAILABLE."""
    plain = tmp_path / "not-a-mount"
    plain.mkdir()
    p = make_plugin(plain)
    assert p.ready() is True
    e = rpc_error(p.publish, p.target())
    assert e.code() == Code.UNAVAILABLE and "not an mtcfs mount" in e.details()


def test_probe_does_not_hang_on_a_stuck_daemon(mnt: MtcfsMount, plugin: Plugin):
    assert plugin.ready()
    assert mnt.proc is not None
    mnt.proc.send_signal(signal.SIGSTOP)  # alive, but answers no FUSE request
    try:
        started = time.monotonic()
        assert plugin.ready() is True
        assert time.monotonic() - started < 1
        e = rpc_error(plugin.publish, plugin.target())
        assert e.code() == Code.UNAVAILABLE and "does not answer" in e.details()
    finally:
        mnt.proc.send_signal(signal.SIGCONT)

    def answers_again() -> bool:  # once the call left hanging on the stuck daemon returned
        try:
            plugin.publish(plugin.target())
            return True
        except grpc.RpcError as e:
            assert e.code() == Code.UNAVAILABLE, e
            return False

    wait_until(answers_again, 10, interval=0.1, what="the plugin publishing again")


# -- publish ---------------------------------------------------------------------------------


def test_publish_binds_the_jobs_directory(mnt: MtcfsMount, plugin: Plugin):
    target = plugin.target()
    plugin.publish(target, ns="team", job="llama")
    assert (mnt.path / "team" / "llama").is_dir()  # created through the mount
    (entry,) = binds_at(target)
    assert entry.is_mtcfs and entry.root == "/team/llama" and not entry.readonly
    # The same files both ways.
    Path(target, "from-pod").write_bytes(b"written in the pod")
    assert (mnt.path / "team/llama/from-pod").read_bytes() == b"written in the pod"
    (mnt.path / "team/llama/step-1").mkdir()
    (mnt.path / "team/llama/step-1/shard").write_bytes(b"x" * 4096)
    assert Path(target, "step-1/shard").read_bytes() == b"x" * 4096
    assert sorted(os.listdir(target)) == ["from-pod", "step-1"]
    # Unpublish: unmounted and removed; the data stays on the mount.
    plugin.unpublish(target)
    assert not os.path.lexists(target) and binds_at(target) == []
    assert (mnt.path / "team/llama/from-pod").read_bytes() == b"written in the pod"


def test_job_from_the_pods_jobset_label(mnt: MtcfsMount, plugin: Plugin):
    plugin.labels_file.write_text(json.dumps({
        "ml/trainer-0": {JOBSET_LABEL: "gpt-run", "app": "x"},
        "ml/lonely": {"app": "x"},
    }))
    target = plugin.target()
    plugin.publish(target, ns="ml", pod="trainer-0", job=None)
    assert binds_at(target)[0].root == "/ml/gpt-run"
    assert (mnt.path / "ml" / "gpt-run").is_dir()
    # A job attribute wins over the label.
    t2 = plugin.target()
    plugin.publish(t2, ns="ml", pod="trainer-0", job="explicit")
    assert binds_at(t2)[0].root == "/ml/explicit"
    e = rpc_error(plugin.publish, plugin.target(), ns="ml", pod="lonely", job=None)
    assert e.code() == Code.INVALID_ARGUMENT and JOBSET_LABEL in e.details()
    e = rpc_error(plugin.publish, plugin.target(), ns="ml", pod="ghost", job=None)
    assert e.code() == Code.NOT_FOUND


def test_publish_is_idempotent_and_refuses_incompatible(plugin: Plugin, tmp_path: Path):
    target = plugin.target()
    plugin.publish(target)
    plugin.publish(target)
    assert len(binds_at(target)) == 1
    e = rpc_error(plugin.publish, target, readonly=True)
    assert e.code() == Code.ALREADY_EXISTS and "read-write" in e.details()
    e = rpc_error(plugin.publish, target, job="another-job")
    assert e.code() == Code.ALREADY_EXISTS
    assert len(binds_at(target)) == 1
    # A target that holds a mount that is not ours.
    other = plugin.target()
    os.makedirs(other)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", other], check=True)
    e = rpc_error(plugin.publish, other)
    assert e.code() == Code.ALREADY_EXISTS and "tmpfs" in e.details()


def test_persistent_volume_form(mnt: MtcfsMount, plugin: Plugin):
    """A static PV (csi.volumeHandle, csi.volumeAttributes) bound by a PVC that two
    pods use: kubelet publishes it per pod, with ephemeral=false and the PV's
    handle as volume_id; each pod gets the job's directory."""
    a, b = plugin.target("ckpt-pv"), plugin.target("ckpt-pv")
    rwx = mount_capability(Mode.MULTI_NODE_MULTI_WRITER)
    plugin.publish(a, ephemeral=False, capability=rwx, volume_id="mtcfs-llama", job="llama")
    plugin.publish(b, ephemeral=False, capability=rwx, volume_id="mtcfs-llama", job="llama",
                   pod="pod-1")
    assert [binds_at(t)[0].root for t in (a, b)] == ["/team/llama", "/team/llama"]
    Path(a, "shard-0").write_bytes(b"from pod 0")
    assert Path(b, "shard-0").read_bytes() == b"from pod 0"
    assert (mnt.path / "team/llama/shard-0").read_bytes() == b"from pod 0"
    # A read-only claim (ReadOnlyMany) of the same PV.
    ro = plugin.target("ckpt-pv")
    plugin.publish(ro, ephemeral=False, volume_id="mtcfs-llama", job="llama",
                   capability=mount_capability(Mode.MULTI_NODE_READER_ONLY))
    assert binds_at(ro)[0].readonly
    for t in (a, b, ro):
        plugin.unpublish(t, volume_id="mtcfs-llama")
        assert binds_at(t) == []


def test_unknown_volume_attributes_are_refused(plugin: Plugin):
    target = plugin.target()
    e = rpc_error(plugin.publish, target, attributes={"bucketName": "b", "jobName": "x"})
    assert e.code() == Code.INVALID_ARGUMENT
    assert "unknown volume attribute(s) 'bucketName', 'jobName'" in e.details()
    assert "knows only job" in e.details()
    assert binds_at(target) == [] and not os.path.lexists(target)
    # kubelet's own keys are not attributes.
    plugin.publish(target, attributes={"csi.storage.k8s.io/serviceAccount.name": "default"})
    assert len(binds_at(target)) == 1


def test_readonly_is_honoured(mnt: MtcfsMount, plugin: Plugin):
    (mnt.path / "team" / "job1").mkdir(parents=True)
    (mnt.path / "team/job1/ckpt").write_bytes(b"weights")
    for kw in ({"readonly": True},
               {"capability": mount_capability(Mode.MULTI_NODE_READER_ONLY)}):
        target = plugin.target()
        plugin.publish(target, **kw)
        assert binds_at(target)[0].readonly
        assert Path(target, "ckpt").read_bytes() == b"weights"
        with pytest.raises(OSError) as info:
            Path(target, "new").write_bytes(b"no")
        assert info.value.errno == errno.EROFS
        plugin.publish(target, **kw)  # idempotent in read-only too
    # The node daemon's mount itself stays writable.
    (mnt.path / "team/job1/new").write_bytes(b"yes")


def test_invalid_arguments(plugin: Plugin):
    target = plugin.target()
    block = pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume(),
                                access_mode=pb.VolumeCapability.AccessMode(mode=1))
    cases = [
        ({"volume_id": ""}, "volume_id"),
        ({"target_path": ""}, "target_path"),
        ({"volume_capability": None}, "volume_capability"),
        ({"capability": block}, "block"),
        ({"target_path": "relative/mount"}, "absolute"),
        ({"job": "../escape"}, "invalid job"),
        ({"job": "a/b"}, "invalid job"),
        ({"job": ".."}, "invalid job"),
        ({"ns": ""}, "podInfoOnMount"),
        ({"ns": "../etc"}, "invalid pod namespace"),
    ]
    for kw, why in cases:
        e = rpc_error(plugin.publish, target, **kw)
        assert e.code() == Code.INVALID_ARGUMENT, (kw, e.code(), e.details())
        assert why in e.details(), (kw, e.details())
    assert binds_at(target) == []
    for req in (pb.NodeUnpublishVolumeRequest(volume_id="v"),
                pb.NodeUnpublishVolumeRequest(target_path=target)):
        e = rpc_error(plugin.node.NodeUnpublishVolume, req)
        assert e.code() == Code.INVALID_ARGUMENT


def test_unpublish_unknown_and_busy_targets(mnt: MtcfsMount, plugin: Plugin):
    plugin.unpublish(str(plugin.targets / "never" / "published"))  # OK: nothing to do
    empty = plugin.target()
    os.makedirs(empty)
    plugin.unpublish(empty)  # an unmounted leftover directory: removed
    assert not os.path.lexists(empty)
    # A file still open in the pod: the unmount is lazy, the target goes anyway.
    busy = plugin.target()
    plugin.publish(busy)
    with open(Path(busy, "open-file"), "wb") as f:
        plugin.unpublish(busy)
        f.write(b"still writable")
    assert not os.path.lexists(busy) and binds_at(busy) == []
    assert (mnt.path / "team/job1/open-file").read_bytes() == b"still writable"
    plugin.unpublish(busy)  # twice: OK


# -- restarts --------------------------------------------------------------------------------


def test_plugin_restart_leaves_published_mounts_working(mnt: MtcfsMount, plugin: Plugin):
    target = plugin.target()
    plugin.publish(target)
    Path(target, "before").write_bytes(b"1")
    plugin.kill9()  # its socket file stays behind
    assert plugin.socket.exists()
    Path(target, "while-down").write_bytes(b"2")
    assert (mnt.path / "team/job1/while-down").read_bytes() == b"2"
    plugin.start()  # removes the stale socket, finds the mount in mountinfo
    plugin.publish(target)
    assert len(binds_at(target)) == 1
    assert sorted(os.listdir(target)) == ["before", "while-down"]
    plugin.unpublish(target)
    assert not os.path.lexists(target)


def test_node_daemon_restart_rebinds_targets(mnt: MtcfsMount, plugin: Plugin):
    # kubelet's pods directory is a shared mount on a node (systemd makes / rshared).
    subprocess.run(["mount", "--bind", str(plugin.targets), str(plugin.targets)], check=True)
    subprocess.run(["mount", "--make-shared", str(plugin.targets)], check=True)
    rw, ro = plugin.target("rw"), plugin.target("ro")
    plugin.publish(rw)
    plugin.publish(ro, readonly=True)
    Path(rw, "ckpt").write_bytes(b"step 1")
    # The pods' containers: one with HostToContainer, one without, one read-only.
    seen = plugin.container_view(rw, "a", "rslave")
    not_seen = plugin.container_view(rw, "b", "rprivate")
    seen_ro = plugin.container_view(ro, "c", "rslave")
    mnt.kill9()
    with pytest.raises(OSError) as info:
        os.listdir(rw)
    assert info.value.errno == errno.ENOTCONN
    assert plugin.ready()  # the liveness sidecar must not restart the plugin now
    e = rpc_error(plugin.publish, plugin.target())
    assert e.code() == Code.UNAVAILABLE
    # A new daemon on the same mountpoint and RAM dir (it detaches the dead mount itself).
    started = time.monotonic()
    mnt.start()

    def rebound() -> bool:
        try:
            return (Path(rw, "ckpt").read_bytes() == b"step 1" and os.listdir(ro) == ["ckpt"]
                    and os.listdir(seen) == ["ckpt"] and os.listdir(seen_ro) == ["ckpt"])
        except OSError:
            return False

    wait_until(rebound, timeout=10, what=f"the targets to be re-bound\n{plugin.log()}")
    took = time.monotonic() - started
    assert took < 8, took
    assert plugin.ready()
    assert "re-bound" in plugin.log()
    # The new bind is on top of the dead one (which the containers' copies hold).
    top = binds_at(rw)[-1]
    assert top.root == "/team/job1" and not top.readonly and len(binds_at(rw)) == 2
    assert binds_at(ro)[-1].readonly
    Path(rw, "after").write_bytes(b"new")
    assert (mnt.path / "team/job1/after").read_bytes() == b"new"
    assert (seen / "after").read_bytes() == b"new"
    for path in (Path(ro, "x"), seen_ro / "x"):
        with pytest.raises(OSError) as info:
            path.write_bytes(b"no")
        assert info.value.errno == errno.EROFS, path
    # Without HostToContainer the container keeps the dead mount (JobSet recreates the pod).
    with pytest.raises(OSError) as info:
        os.listdir(not_seen)
    assert info.value.errno == errno.ENOTCONN
    plugin.publish(rw)  # idempotent against the new mount
    assert len(binds_at(rw)) == 2
    # Unpublish removes the whole stack, and the containers' copies of the new bind.
    plugin.unpublish(rw)
    assert binds_at(rw) == [] and not os.path.lexists(rw)
    assert [e.mount_point for e in binds_at(str(seen))] == [str(seen)]  # the dead copy


# -- command line --------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "why"), [
    (("--endpoint", "tcp://0:1", "--node-id", "n", "--mount-root", "/"), "unix://"),
    (("--endpoint", "unix://rel.sock", "--node-id", "n", "--mount-root", "/"), "unix://"),
    (("--endpoint", "unix:///tmp/x.sock", "--node-id", "n", "--mount-root", "/nonexistent"),
     "does not exist"),
    (("--endpoint", "unix:///tmp/x.sock", "--mount-root", "/"), "--node-id"),
])
def test_usage_errors(args, why):
    r = mtcfs("csi", *args)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("mtcfs csi: error:") and why in lines[0], lines


def test_readonly_bind_without_the_new_mount_api(tmp_path: Path, monkeypatch):
    # Kernels before 5.12 (no mount_setattr): bind, then remount read-only; the
    # source mount's nosuid/nodev stay on the bind.
    monkeypatch.setattr(mounts, "_bind_readonly_detached", lambda source, target: False)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    (src / "f").write_bytes(b"data")
    mounts.bind(str(src), str(dst), readonly=True)
    try:
        entry = mounts.entry_at(str(dst))
        assert entry is not None and entry.readonly
        assert (dst / "f").read_bytes() == b"data"
        with pytest.raises(OSError) as info:
            (dst / "g").write_bytes(b"no")
        assert info.value.errno == errno.EROFS
    finally:
        assert mounts.unmount(str(dst))
    assert mounts.entry_at(str(dst)) is None
