"""The CSI Node service: publish a job's directory of the node daemon's mtcfs
mount into a pod's volume directory (a bind mount), unpublish it, and re-bind
published targets after the node daemon restarted.

Volumes are inline (ephemeral) CSI volumes or static PersistentVolumes, both
with podInfoOnMount: kubelet passes the pod's name and namespace in the volume
context. A pod of namespace NS in job JOB gets `<mount root>/NS/JOB`, created on
first use; JOB is the volume attribute `job`, else the pod's JobSet label. Any
other volume attribute is refused (INVALID_ARGUMENT), which kubelet shows as a
FailedMount event on the pod.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import re
import select
import threading

import grpc

from mtcfs.csi import mounts
from mtcfs.csi.mounts import MountEntry, MountError
from mtcfs.csi.pods import JOBSET_LABEL, PodLabels, PodLookupError
from mtcfs.csi.rpc import POD_NAME, POD_NAMESPACE, RpcError, handler
from mtcfs.csi.v1 import csi_pb2, csi_pb2_grpc

log = logging.getLogger("mtcfs.csi")

JOB_ATTRIBUTE = "job"
VOLUME_ATTRIBUTES = (JOB_ATTRIBUTE,)
# Keys kubelet adds itself (pod info, ephemeral, service account tokens).
KUBELET_PREFIX = "csi.storage.k8s.io/"
# Kubernetes names (namespaces, JobSets) are DNS labels/subdomains: this also
# rules out "/", ".", ".." and anything else that could leave the mount root.
_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?")
_Mode = csi_pb2.VolumeCapability.AccessMode.Mode
_READER_ONLY = (_Mode.SINGLE_NODE_READER_ONLY, _Mode.MULTI_NODE_READER_ONLY)


def check_name(what: str, value: str) -> str:
    if not _NAME.fullmatch(value):
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                       f"invalid {what} {value!r}: must be a Kubernetes name (letters, digits, "
                       f"'-', '_', '.'; no '/')")
    return value


class Publisher:
    """Bind mounts of `<mount root>/<namespace>/<job>`, read back from mountinfo.

    One lock serialises publish, unpublish and re-bind: each is a few syscalls,
    and kubelet retries a target's requests, which must not interleave.
    """

    def __init__(self, mount_root: str, targets_root: str, timeout: float = 2.0) -> None:
        self.mount_root = os.path.abspath(mount_root)
        self.targets_root = os.path.abspath(targets_root)
        self.timeout = timeout  # for calls into the FUSE mount that may hang
        self.lock = threading.Lock()

    def live(self) -> tuple[bool, str]:
        return mounts.mount_root_live(self.mount_root, self.timeout)

    def _root_entry(self, table: list[MountEntry]) -> MountEntry:
        live, why = self.live()
        entry = mounts.entry_at(self.mount_root, table)
        if not live or entry is None:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, f"the node daemon is not ready: {why}")
        return entry

    def publish(self, target: str, namespace: str, job: str, readonly: bool) -> str:
        """Bind NAMESPACE/JOB onto `target`; returns what was done (for the log)."""
        with self.lock:
            table = mounts.mountinfo()
            root = self._root_entry(table)
            want = posixpath.join(root.root, namespace, job)
            existing = mounts.entry_at(target, table)
            if existing is not None:
                if not (existing.is_mtcfs and existing.root == want):
                    raise RpcError(grpc.StatusCode.ALREADY_EXISTS,
                                   f"{target} already has another mount ({existing.fstype} "
                                   f"{existing.source}, {existing.root})")
                if existing.readonly != readonly:
                    mode = "read-only" if existing.readonly else "read-write"
                    raise RpcError(grpc.StatusCode.ALREADY_EXISTS,
                                   f"{target} is already published {mode}")
                if existing.dev == root.dev:
                    return "already published"
                if not mounts.is_dead(target, self.timeout):
                    raise RpcError(grpc.StatusCode.ALREADY_EXISTS,
                                   f"{target} has a bind of another, live mtcfs mount "
                                   f"({existing.source})")
                # A bind of a previous daemon's mount (dead): bind on top of it,
                # as the re-bind loop does.
            try:
                self._bind(target, [namespace, job], readonly, mounted=existing is not None)
            except OSError as e:
                raise RpcError(grpc.StatusCode.INTERNAL, str(e)) from None
            return "published"

    def _bind(self, target: str, parts: list[str], readonly: bool, mounted: bool) -> str:
        """Bind <mount root>/<parts> onto `target` (on top of a mount there, if
        `mounted`); creates both directories. Returns the source."""
        source = os.path.join(self.mount_root, *parts)
        try:
            os.makedirs(source, exist_ok=True)  # through the mount: the daemon records it
            if not mounted:  # a dead mount there fails stat: leave it alone
                os.makedirs(target, mode=0o750, exist_ok=True)
        except OSError as e:
            raise MountError(e.errno, f"creating {e.filename}: {e.strerror}") from None
        mounts.bind(source, target, readonly)
        return source

    def unpublish(self, target: str) -> str:
        with self.lock:
            detached = 0
            # Stacked mounts (re-binds on top of dead ones) all go, topmost first.
            while mounts.entries_at(target):
                if detached >= 64:
                    raise RpcError(grpc.StatusCode.INTERNAL, f"{target} stays mounted")
                try:
                    if not mounts.unmount(target):
                        break  # mountinfo and the kernel disagree on the path: leave it
                except MountError as e:
                    raise RpcError(grpc.StatusCode.INTERNAL, str(e)) from None
                detached += 1
            try:
                os.rmdir(target)
            except FileNotFoundError:
                return "unmounted" if detached else "not published"
            except OSError as e:
                if e.errno == errno.ENOTDIR:
                    os.unlink(target)
                else:
                    raise RpcError(grpc.StatusCode.INTERNAL,
                                   f"removing {target}: {e.strerror}") from None
            return "unmounted and removed" if detached else "removed"

    def rebind_stale(self) -> tuple[list[str], int]:
        """Re-bind targets under the targets root whose bind belongs to a dead
        mtcfs mount, once the daemon at the mount root is live again (it restarted).
        Everything comes from mountinfo: the subdirectory is the bind's `root`,
        read-only-ness its options. Returns (targets re-bound, dead binds left:
        the daemon is not live yet, or a re-bind failed)."""
        with self.lock:
            table = mounts.mountinfo()
            root = mounts.entry_at(self.mount_root, table)
            if root is None or not root.is_mtcfs:
                return [], 0
            prefix = self.targets_root.rstrip("/") + "/"
            # The topmost mount per target, from another (older) mtcfs superblock.
            top: dict[str, MountEntry] = {}
            for e in table:
                if e.mount_point.startswith(prefix) and e.mount_point != self.mount_root:
                    top[e.mount_point] = e
            stale = [e for e in top.values() if e.is_mtcfs and e.dev != root.dev]
            if not stale or not self.live()[0]:
                return [], len(stale)
            done, others = [], 0
            for e in stale:
                # Another mtcfs mount that is alive (not ours to touch), or one that hangs.
                if not mounts.is_dead(e.mount_point, self.timeout):
                    others += 1
                    continue
                rel = posixpath.relpath(e.root, root.root)
                if rel == ".." or rel.startswith("../"):
                    log.warning("not re-binding %s: its directory %s is outside %s's",
                                e.mount_point, e.root, self.mount_root)
                    continue
                parts = [] if rel == "." else rel.split("/")
                # On top of the dead bind, not in its place: the pod's container
                # holds a copy of the dead bind, and only mounts made *on* it reach
                # that copy (HostToContainer propagation). Unpublish removes both.
                try:
                    source = self._bind(e.mount_point, parts, e.readonly, mounted=True)
                except OSError as err:
                    log.error("re-binding %s to %s failed: %s", e.mount_point, e.root, err)
                    continue
                log.info("re-bound %s to %s%s after a node daemon restart", e.mount_point,
                         source, " (read-only)" if e.readonly else "")
                done.append(e.mount_point)
            return done, len(stale) - len(done) - others


class RebindLoop:
    """Runs Publisher.rebind_stale in a daemon thread: when the mount table
    changes (a restarted daemon mounting again; poll(2) on mountinfo reports it),
    every `interval` seconds anyway, and every `retry` seconds while binds of
    another superblock are left (the new daemon may answer a moment after its
    mount appears)."""

    def __init__(self, publisher: Publisher, interval: float = 1.0, retry: float = 0.1) -> None:
        self.publisher = publisher
        self.interval = interval
        self.retry = retry
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()  # stop() interrupts the poll
        self._thread = threading.Thread(target=self._run, name="csi-rebind", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stopping = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _run(self) -> None:
        with open(mounts.MOUNTINFO, "rb") as table:
            changes = select.poll()
            changes.register(table, select.POLLPRI | select.POLLERR)
            changes.register(self._wake_r, select.POLLIN)
            while not self._stopping:
                left = 0
                try:
                    left = self.publisher.rebind_stale()[1]
                except Exception:  # keep scanning: the next round may succeed
                    log.exception("re-bind scan failed")
                changes.poll((self.retry if left else self.interval) * 1000)


def check_attributes(volume_context: dict[str, str]) -> None:
    unknown = sorted(k for k in volume_context
                     if k not in VOLUME_ATTRIBUTES and not k.startswith(KUBELET_PREFIX))
    if unknown:
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                       f"unknown volume attribute(s) {', '.join(map(repr, unknown))}: the "
                       f"mtcfs CSI driver knows only {', '.join(VOLUME_ATTRIBUTES)} "
                       f"(docs/csi.md)")


class NodeService(csi_pb2_grpc.NodeServicer):
    def __init__(self, node_id: str, publisher: Publisher, pod_labels: PodLabels) -> None:
        self.node_id = node_id
        self.publisher = publisher
        self.pod_labels = pod_labels

    def _job(self, context: dict[str, str], namespace: str) -> str:
        job = context.get(JOB_ATTRIBUTE)
        if job:
            return check_name("job attribute", job)
        pod = context.get(POD_NAME)
        if not pod:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"no pod name in the volume context ({POD_NAME}) and no "
                           f"'{JOB_ATTRIBUTE}' attribute")
        try:
            labels = self.pod_labels(namespace, pod)
        except PodLookupError as e:
            raise RpcError(e.code, str(e)) from None
        job = labels.get(JOBSET_LABEL)
        if not job:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"pod {namespace}/{pod} has no {JOBSET_LABEL} label; give the "
                           f"volume a '{JOB_ATTRIBUTE}' attribute")
        return check_name(f"{JOBSET_LABEL} label", job)

    @handler()
    def NodePublishVolume(self, request: csi_pb2.NodePublishVolumeRequest,
                          context: grpc.ServicerContext) -> csi_pb2.NodePublishVolumeResponse:
        for field in ("volume_id", "target_path"):
            if not getattr(request, field):
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"{field} is required")
        if not request.HasField("volume_capability"):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "volume_capability is required")
        cap = request.volume_capability
        access = cap.WhichOneof("access_type")
        if access == "block":
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           "block volumes are not supported: mtcfs is a filesystem")
        if access != "mount":
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           "volume_capability needs an access type (mount)")
        target = request.target_path
        if not os.path.isabs(target):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"target_path must be absolute: {target!r}")
        volume_context = dict(request.volume_context)
        check_attributes(volume_context)
        namespace = volume_context.get(POD_NAMESPACE)
        if not namespace:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"no pod namespace in the volume context ({POD_NAMESPACE}): the "
                           f"CSIDriver object needs podInfoOnMount: true")
        check_name("pod namespace", namespace)
        job = self._job(volume_context, namespace)
        readonly = request.readonly or cap.access_mode.mode in _READER_ONLY
        self.publisher.publish(os.path.normpath(target), namespace, job, readonly)
        return csi_pb2.NodePublishVolumeResponse()

    @handler()
    def NodeUnpublishVolume(self, request: csi_pb2.NodeUnpublishVolumeRequest,
                            context: grpc.ServicerContext
                            ) -> csi_pb2.NodeUnpublishVolumeResponse:
        for field in ("volume_id", "target_path"):
            if not getattr(request, field):
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"{field} is required")
        if not os.path.isabs(request.target_path):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"target_path must be absolute: {request.target_path!r}")
        self.publisher.unpublish(os.path.normpath(request.target_path))
        return csi_pb2.NodeUnpublishVolumeResponse()

    @handler()
    def NodeGetCapabilities(self, request: csi_pb2.NodeGetCapabilitiesRequest,
                            context: grpc.ServicerContext
                            ) -> csi_pb2.NodeGetCapabilitiesResponse:
        # No STAGE_UNSTAGE_VOLUME: a bind mount needs no per-node staging step.
        return csi_pb2.NodeGetCapabilitiesResponse()

    @handler()
    def NodeGetInfo(self, request: csi_pb2.NodeGetInfoRequest,
                    context: grpc.ServicerContext) -> csi_pb2.NodeGetInfoResponse:
        # 0: one mount serves any number of volumes on a node.
        return csi_pb2.NodeGetInfoResponse(node_id=self.node_id, max_volumes_per_node=0)
