"""Smoke tests of the container image built from deploy/Dockerfile.

`make image` builds the image (scripts/build_image.sh) and then runs this file;
`make test` leaves it out (marker `image`). Skipped where buildah is not
installed or the image ($MTCFS_IMAGE, default mtcfs:<version>) is not built.

There is no container engine here: the image runs under `buildah run
--isolation chroot`. That is the image's own root filesystem, user space
(Python 3.13, the patched pyfuse3, libfuse 3.17, util-linux) and environment,
in a mount and UTS namespace of its own, with the host's network, PID
namespace and /dev (so /dev/fuse is there), as root with buildah's default
capabilities plus those asked for (CAP_SYS_ADMIN for mount(2)); no cgroup
limits and no seccomp filter. buildah's chroot isolation makes every bind
private (`-v ...:rshared` is not honoured), so a mount made inside never
reaches the host and vanishes with the container's last process: the
DaemonSets' Bidirectional propagation cannot be reproduced here. The host
reaches a mount inside through /proc/<pid>/root of a process in the
container (the kernel resolves that path in the process's mount namespace),
and the CSI plugin runs in the same container as the daemon, so that its bind
mounts land where the daemon's mount is.

Every container is removed and every process ended at teardown, also when a
test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from mtcfs import __version__
from mtcfs.csi import DRIVER_NAME
from mtcfs.csi.v1 import csi_pb2 as pb
from mtcfs.csi.v1 import csi_pb2_grpc as rpc

from support.mounts import wait_until

BUILDAH = shutil.which("buildah")
IMAGE = os.environ.get("MTCFS_IMAGE", f"mtcfs:{__version__}")

pytestmark = [
    pytest.mark.image,
    pytest.mark.skipif(BUILDAH is None, reason="buildah is not installed "
                       "(`make image` installs it, builds the image and runs these tests)"),
]


def buildah(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    assert BUILDAH is not None
    r = subprocess.run([BUILDAH, *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"buildah {' '.join(args)} exited {r.returncode}:\n"
                             f"{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    return r


@pytest.fixture(scope="module")
def image() -> dict:
    """The image's `buildah inspect` (skips the module if it is not built)."""
    r = buildah("inspect", "--type", "image", IMAGE, check=False)
    if r.returncode != 0:
        pytest.skip(f"image {IMAGE} is not built (`make image` builds it and runs these tests)")
    return json.loads(r.stdout)


class Container:
    """A buildah working container of the image, as privileged as the node pods
    need: /dev/fuse and CAP_SYS_ADMIN. `scratch` is a host directory for the
    commands it starts in the background (logs, pid files)."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.name = f"mtcfs-image-test-{uuid.uuid4().hex[:10]}"
        buildah("from", "--pull=never", "--quiet", "--name", self.name,
                "--device", "/dev/fuse", "--cap-add", "CAP_SYS_ADMIN", IMAGE)
        self.background: list[Background] = []

    def argv(self, cmd: tuple[str, ...], volumes: tuple[str, ...]) -> list[str]:
        assert BUILDAH is not None
        vols = [a for v in volumes for a in ("-v", f"{v}:{v}")]  # same path on both sides
        return [BUILDAH, "run", "--isolation", "chroot", *vols, self.name, "--", *cmd]

    def run(self, *cmd: str, volumes: tuple[str, ...] = (),
            timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(cmd, volumes), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def sh(self, script: str, volumes: tuple[str, ...] = ()) -> str:
        """Run a shell script inside; its stdout (fails on a non-zero exit)."""
        r = self.run("sh", "-ec", script, volumes=volumes)
        assert r.returncode == 0, f"exit {r.returncode}:\n{r.stdout}\n{r.stderr}"
        return r.stdout

    def start(self, script: str) -> Background:
        """Run a shell script inside in the background, with the scratch directory
        bound at its own path; the script writes the pids of what it starts to
        scratch/<name>.pid."""
        b = Background(self.argv(("sh", "-ec", script), (str(self.scratch),)), self.scratch)
        self.background.append(b)
        return b

    def remove(self) -> None:
        try:
            for b in self.background:
                b.stop()
        finally:
            buildah("rm", self.name, check=False)


class Background:
    """One `buildah run` in the background, in a session of its own: the processes
    inside are in its process group (chroot isolation has no PID namespace)."""

    def __init__(self, argv: list[str], scratch: Path) -> None:
        self.scratch = scratch
        self.log_path = scratch / "buildah-run.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def log(self, name: str = "buildah-run") -> str:
        """All of scratch/<name>.log so far."""
        path = self.scratch / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        """The end of every log, for failure messages."""
        return "\n".join(f"--- {p.name}\n{self.log(p.stem)[-4000:]}"
                         for p in sorted(self.scratch.glob("*.log")))

    def wait_for_log(self, name: str, text: str, timeout: float = 20) -> None:
        try:
            wait_until(lambda: text in self.log(name), timeout=timeout, interval=0.05,
                       what=f"{text!r} in {name}.log")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.logs()}") from None

    def pid(self, name: str, timeout: float = 30) -> int:
        """The host pid of process `name` inside (from scratch/<name>.pid)."""
        path = self.scratch / f"{name}.pid"

        def read() -> int | None:
            if self.proc.poll() is not None:
                raise AssertionError(f"buildah run exited ({self.proc.returncode}):\n"
                                     f"{self.logs()}")
            with contextlib.suppress(FileNotFoundError, ValueError):
                return int(path.read_text())
            return None

        return wait_until(read, timeout=timeout, interval=0.05, what=f"{path}")

    def inside(self) -> list[int]:
        """Live pids named in the pid files that still run mtcfs."""
        pids = []
        for f in self.scratch.glob("*.pid"):
            with contextlib.suppress(ValueError, OSError):
                pid = int(f.read_text())
                if b"mtcfs" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    pids.append(pid)
        return pids

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM the processes inside (each shuts down cleanly), then wait for
        buildah run; then SIGKILL whatever is left in its process group (buildah
        run, killed or not, leaves the grandchildren of its command running)."""
        if self.proc.poll() is None:
            for pid in self.inside():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        for pid in self.inside():  # in case one left the group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A short host directory (unix socket paths are limited to 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="mtcfs-img-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def container(image: dict, scratch: Path) -> Iterator[Container]:
    """Removed, and what it started stopped, before `scratch` goes."""
    c = Container(scratch)
    try:
        yield c
    finally:
        c.remove()


def csi_client(socket: Path) -> tuple[grpc.Channel, rpc.IdentityStub, rpc.NodeStub]:
    channel = grpc.insecure_channel(
        f"unix://{socket}", options=[("grpc.initial_reconnect_backoff_ms", 50),
                                     ("grpc.min_reconnect_backoff_ms", 50),
                                     ("grpc.max_reconnect_backoff_ms", 200)])
    return channel, rpc.IdentityStub(channel), rpc.NodeStub(channel)


def serving(identity: rpc.IdentityStub, bg: Background) -> pb.GetPluginInfoResponse:
    def info() -> pb.GetPluginInfoResponse | None:
        if bg.proc.poll() is not None:
            raise AssertionError(f"buildah run exited ({bg.proc.returncode}):\n{bg.logs()}")
        try:
            return identity.GetPluginInfo(pb.GetPluginInfoRequest(), timeout=1)
        except grpc.RpcError:
            return None

    return wait_until(info, timeout=60, interval=0.1, what="the plugin in the image to serve")


def mount_points(pid: int) -> dict[str, tuple[str, str]]:
    """The mount table of process `pid`'s mount namespace: mount point -> (fstype, root)."""
    table = {}
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        parts = line.split()
        sep = parts.index("-", 6)
        table[parts[4].replace("\\040", " ")] = (parts[sep + 1], parts[3])
    return table


# -- the image -------------------------------------------------------------------------------


def test_image_config(image: dict):
    config = image["OCIv1"]["config"]
    assert config["Entrypoint"] == ["mtcfs"] and config["Cmd"] == ["--help"]
    env = dict(e.split("=", 1) for e in config["Env"])
    assert env["PATH"].split(":")[0] == "/opt/mtcfs/bin"


def test_help_versions_and_tools(container: Container):
    r = container.run("mtcfs", "--help")
    assert r.returncode == 0, r.stderr
    for command in ("mount", "csi", "discover", "controller", "status", "umount"):
        assert f"  {command} " in r.stdout, r.stdout
    for command in ("mount", "csi", "discover", "controller"):
        r = container.run("mtcfs", command, "--help")
        assert r.returncode == 0 and "Usage: mtcfs" in r.stdout, r.stderr
    assert container.sh("mtcfs --version").strip() == f"mtcfs, version {__version__}"
    # What the image is made of: trixie, its Python and libfuse, the patched pyfuse3.
    versions = json.loads(container.sh("""python3 -c '
import json, platform, importlib.metadata as md, pyfuse3
print(json.dumps({"python": platform.python_version(), "pyfuse3": md.version("pyfuse3"),
                  "passthrough": all(hasattr(pyfuse3, n) for n in ("backing_open",
                      "backing_close", "passthrough_enabled")),
                  "pyfuse3_so": pyfuse3.__file__}))'"""))
    assert versions["python"].startswith("3.13.") and versions["pyfuse3"] == "3.5.0"
    assert versions["passthrough"], versions
    osr = container.sh(". /etc/os-release; echo $VERSION_CODENAME")
    assert osr.strip() == "trixie"
    assert "fusermount3 version: 3.17" in container.sh("fusermount3 --version 2>&1")
    # pyfuse3 is linked against trixie's libfuse (libfuse3.so.4 -> libfuse3.so.3.17.x).
    lib = container.sh(f"readlink -f $(ldd {versions['pyfuse3_so']} "
                       "| sed -n 's/.*libfuse3.so.4 => \\([^ ]*\\) .*/\\1/p')")
    assert "/libfuse3.so.3.17." in lib, lib
    # The tools the Kubernetes manifests call (the init container: sh, grep,
    # fusermount3, mkdir; the plugin: mount, umount; the probe: test).
    container.sh("command -v sh grep fusermount3 mkdir mount umount test >/dev/null")
    container.sh("test ! -e /run/secrets/ca-bundle")  # the build's CA bundle stayed out
    # Every part imports: the daemon, the plugin, discovery, the controller, GCS.
    container.sh("python3 -c 'import mtcfs.daemon, mtcfs.csi.server, mtcfs.k8s.controller, "
                 "mtcfs.k8s.discovery, mtcfs.cli.discover, google.cloud.storage'")


# -- the CSI plugin ---------------------------------------------------------------------------


def test_csi_plugin_answers_over_its_socket(container: Container, scratch: Path):
    """The plugin alone, with a plain directory as --mount-root: Identity and Node
    info over the unix socket (host directory bound at the same path inside)."""
    (scratch / "root").mkdir()
    socket = scratch / "csi.sock"
    bg = container.start(
        f"echo $$ > {scratch}/csi.pid; exec mtcfs csi --endpoint unix://{socket} "
        f"--node-id image-node --mount-root {scratch}/root --targets-root {scratch}/pods "
        f"--log-level debug > {scratch}/csi.log 2>&1")
    channel, identity, node = csi_client(socket)
    with channel:
        info = serving(identity, bg)
        assert (info.name, info.vendor_version) == (DRIVER_NAME, __version__)
        caps = identity.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest(), timeout=10)
        assert list(caps.capabilities) == []
        assert node.NodeGetInfo(pb.NodeGetInfoRequest(), timeout=10).node_id == "image-node"
        # Probe is the plugin's own health (the livenessprobe sidecar's), ready even
        # though the mount root is not an mtcfs mount (docs/csi.md).
        assert identity.Probe(pb.ProbeRequest(), timeout=10).ready.value is True
    bg.stop()
    assert bg.proc.returncode == 0, bg.logs()
    assert "stopping (published mounts stay)" in bg.log("csi")
    assert not socket.exists()  # the plugin removed its socket


# -- the node daemon (and the plugin beside it) -------------------------------------------------


def test_daemon_mounts_in_the_image(container: Container, scratch: Path):
    """`mtcfs mount` on /dev/fuse inside the image, with the CSI plugin in the same
    container publishing a job directory of it; the host writes and reads through
    /proc/<daemon pid>/root."""
    mnt, pods, socket = scratch / "mnt", scratch / "pods", scratch / "csi.sock"
    mnt.mkdir()
    pods.mkdir()
    bg = container.start(f"""
mtcfs mount {mnt} --ram-dir {scratch}/ram --ram-size 256MiB --node-id image-node \\
    --log-level debug > {scratch}/daemon.log 2>&1 &
echo $! > {scratch}/daemon.pid
mtcfs csi --endpoint unix://{socket} --node-id image-node --mount-root {mnt} \\
    --targets-root {pods} --log-level debug > {scratch}/csi.log 2>&1 &
echo $! > {scratch}/csi.pid
wait
""")
    daemon = bg.pid("daemon")
    inside = Path(f"/proc/{daemon}/root")  # the container's root, its mounts included

    def mounted() -> bool:
        if bg.proc.poll() is not None:
            raise AssertionError(f"buildah run exited ({bg.proc.returncode}):\n{bg.logs()}")
        try:
            os.getxattr(inside / str(mnt).lstrip("/"), "user.mtcfs.control")
            return True
        except OSError:
            return False

    wait_until(mounted, timeout=60, interval=0.1, what="the daemon in the image to mount")
    table = mount_points(daemon)
    assert table[str(mnt)][0] == "fuse.mtcfs"
    assert table[f"{scratch}/ram/data"][0] == "tmpfs"  # the RAM tier's own tmpfs
    assert str(mnt) not in mount_points(os.getpid())  # nothing reached the host
    # Logged just after the mount is live: libfuse 3.17 + the patch, kernel 6.9+.
    bg.wait_for_log("daemon", "data path: passthrough")

    # Files through the mount, from the host.
    m = inside / str(mnt).lstrip("/")
    (m / "team/llama/step-1").mkdir(parents=True)
    data = os.urandom(3 << 20)
    (m / "team/llama/step-1/shard-0").write_bytes(data)
    assert (m / "team/llama/step-1/shard-0").read_bytes() == data
    state = json.loads(os.getxattr(m / "team/llama/step-1/shard-0", "user.mtcfs.state"))
    assert state["size"] == len(data) and state["tiers"] == ["ram"]
    # `mtcfs status` in the daemon's container (what `kubectl exec` would do): the
    # image's mtcfs, entered into the daemon's mount namespace and root.
    r = subprocess.run(["nsenter", f"--target={daemon}", "--mount", "--root", "--wd",
                        "/opt/mtcfs/bin/mtcfs", "status", str(mnt), "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["node_id"] == "image-node", r.stdout

    # The plugin beside it: ready, and a job directory published into a pod target.
    channel, identity, node = csi_client(socket)
    with channel:
        serving(identity, bg)
        wait_until(lambda: identity.Probe(pb.ProbeRequest(), timeout=10).ready.value,
                   timeout=30, what="Probe to say ready")
        target = pods / "uid-1/volumes/kubernetes.io~csi/ckpt/mount"
        target.parent.mkdir(parents=True)
        cap = pb.VolumeCapability(
            mount=pb.VolumeCapability.MountVolume(),
            access_mode=pb.VolumeCapability.AccessMode(
                mode=pb.VolumeCapability.AccessMode.Mode.SINGLE_NODE_WRITER))
        node.NodePublishVolume(pb.NodePublishVolumeRequest(
            volume_id="csi-ckpt", target_path=str(target), volume_capability=cap,
            volume_context={"csi.storage.k8s.io/pod.namespace": "team",
                            "csi.storage.k8s.io/pod.name": "trainer-0", "job": "llama"}),
            timeout=30)
        fstype, root = mount_points(daemon)[str(target)]
        assert (fstype, root) == ("fuse.mtcfs", "/team/llama")
        t = inside / str(target).lstrip("/")
        assert (t / "step-1/shard-0").read_bytes() == data
        (t / "from-pod").write_bytes(b"written in the pod")
        assert (m / "team/llama/from-pod").read_bytes() == b"written in the pod"
        node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
            volume_id="csi-ckpt", target_path=str(target)), timeout=30)
        assert str(target) not in mount_points(daemon)

    # SIGTERM: the daemon unmounts cleanly, the plugin stops; buildah run ends.
    bg.stop()
    assert bg.proc.returncode == 0, bg.logs()
    assert f"unmounted {mnt}" in bg.log("daemon"), bg.logs()
    assert "stopping (published mounts stay)" in bg.log("csi")
    assert not os.listdir(mnt)  # nothing was written below the mount point
    deadline = time.monotonic() + 10
    while Path(f"/proc/{daemon}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{daemon}").exists()
