"""What a CheckpointConfiguration (CPC) becomes: pure functions from the CPC to
the manifests the controller applies. No API calls here, so the tests validate
exactly these dicts offline (kubernetes-validate) and docs/gke.md can describe
them field by field.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import secrets
from dataclasses import dataclass, field

from kubernetes.utils import parse_quantity as _k8s_quantity

from mtcfs import __version__
from mtcfs.csi import DRIVER_NAME
from mtcfs.k8s import CPC_KIND, DAEMON_APP, DEFAULT_NAMESPACE, GROUP, PEER_PORT, VERSION
from mtcfs.k8s.kube import CSI_DRIVERS, DAEMON_SETS, Obj, Resource

# Fully qualified: a bare "mtcfs" resolves to docker.io/library/mtcfs. Used only
# when the controller cannot read its own pod's image (cli/controller.py); the
# kustomizations set the real one (`kustomize edit set image`).
IMAGE_REPOSITORY = "registry.example.com/mtcfs/mtcfs"
DEFAULT_IMAGE = f"{IMAGE_REPOSITORY}:{__version__}"
__all__ = ["DAEMON_APP", "DEFAULT_NAMESPACE", "PEER_PORT"]  # re-exported
# Tag for people, digest for the kubelet (a tag can be moved; the digest cannot).
REGISTRAR_IMAGE = (
    "registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.13.0"
    "@sha256:d7138bcc3aa5f267403d45ad4292c95397e421ea17a0035888850f424c7de25d"
)
LIVENESS_PROBE_IMAGE = (
    "registry.k8s.io/sig-storage/livenessprobe:v2.15.0"
    "@sha256:2c5f9dc4ea5ac5509d93c664ae7982d4ecdec40ca7b0638c24e5b16243b8360f"
)
# The node pods' identity, static in deploy/base/rbac.yaml (the controller makes
# no RBAC objects), and the Secret the generated peer tokens live in, one key per
# CPC (so the controller's Role can name it: resourceNames).
NODE_ACCOUNT = "mtcfs-node"
TOKENS_SECRET = "mtcfs-peer-tokens"

FINALIZER = "mtcfs.dev/cleanup"
LABEL_CPC = "mtcfs.dev/checkpoint-configuration"
HASH_ANNOTATION = "mtcfs.dev/config-hash"
CSI_APP = "mtcfs-csi"
MANAGED_BY = "mtcfs-controller"

# Host paths. The RAM tier is a directory on the host's /dev/shm (tmpfs), not an
# emptyDir: it outlives the daemon pod, so a restarted daemon re-adopts the data.
HOST_ROOT = "/var/lib/mtcfs"
HOST_MOUNT = f"{HOST_ROOT}/mnt"
HOST_RAM = "/dev/shm/mtcfs"
KUBELET = "/var/lib/kubelet"
PLUGIN_DIR = f"{KUBELET}/plugins/{DRIVER_NAME}"
METRICS_PORT = 9466
CSI_HEALTH_PORT = 9808  # the livenessprobe sidecar's, on the CSI pod's own IP
RUN_DIR = "/run/mtcfs"  # the peers file and the node's TOML, written by discovery
PEERS_FILE = f"{RUN_DIR}/peers"
NODE_CONFIG = f"{RUN_DIR}/node.toml"
TOKEN_DIR = "/etc/mtcfs/token"
GOOGLE_DIR = "/etc/mtcfs/google"

PERSIST_RE = re.compile(r"^(on-close|step|manual|interval:[1-9][0-9]*)$")
FSYNC_LEVELS = ("local", "replicas", "gcs")
DATA_PATHS = ("auto", "passthrough", "fuse")


class SpecError(ValueError):
    """A CPC the controller will not roll out; `reason` becomes the condition's reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Settings:
    """A validated CPC spec, defaults filled in."""

    name: str
    uid: str
    bucket: str  # gs://bucket[/prefix]
    ram_bytes: int
    ram_quantity: str
    node_selector: dict[str, str]
    tolerations: list[Obj]
    replicas: int = 1
    persist: str = "step"
    keep_steps: int | None = None
    fsync: str = "local"
    data_path: str = "auto"
    peer_encryption: bool = False
    failure_domain_label: str = "topology.kubernetes.io/zone"
    token_secret: str = ""
    token_key: str = "token"
    token_generated: bool = True
    image: str = DEFAULT_IMAGE
    list_refresh: float | None = None
    csi_ephemeral_limit: str | None = None  # a quantity; None: no limit
    ignored_mount_options: list[str] = field(default_factory=list)
    ignored_fields: list[str] = field(default_factory=list)
    # (Secret, key) of a Google credentials file for the daemons; None: the node's
    # identity (Workload Identity does not reach hostNetwork pods).
    google_credentials: tuple[str, str] | None = None


def _quantity(what: str, q: str | int) -> int:
    """A Kubernetes quantity in bytes, parsed by the client library."""
    try:
        n = int(_k8s_quantity(str(q).strip()))
    except ValueError:
        raise SpecError("InvalidSpec", f"{what} {q!r} is not a quantity such as 64Gi") from None
    if n < 0:
        raise SpecError("InvalidSpec", f"{what} {q!r} is negative")
    return n


def parse_quantity(q: str | int) -> int:
    """inMemoryVolumeSize ("64Gi", "500M", "1073741824") in bytes."""
    n = _quantity("inMemoryVolumeSize", q)
    if n < 64 << 20:
        raise SpecError("InvalidSpec", f"inMemoryVolumeSize {q!r} is below the 64Mi minimum")
    return n


def ephemeral_limit(q: str | int | None) -> str | None:
    """csiEphemeralLimit as the quantity to set, None for no limit ("0", as the
    managed MTC reads it). An integer is bytes."""
    if q is None or _quantity("csiEphemeralLimit", q) == 0:
        return None
    return str(q).strip()


# gcsFuseMountOptions come from the managed MTC, which mounts the bucket with
# gcsfuse. mtcfs has its own GCS client; the options with an mtcfs meaning are
# mapped, the ones that are moot for mtcfs are accepted and ignored, and any
# other is rejected (the CPC is not rolled out: Degraded, UnsupportedMountOption)
# rather than silently dropped. See docs/gke.md, "gcsFuseMountOptions".
_MOOT_OPTIONS = {
    # mtcfs lists GCS prefixes as directories whatever the flag says.
    "implicit-dirs",
    # Negative lookups are answered from the replicated index, not a cache.
    "metadata-cache:negative-ttl-secs",
    # Directory renames are atomic in mtcfs, with no size limit.
    "rename-dir-limit",
    # Metadata lives in the index; these gcsfuse cache sizes have no counterpart.
    "metadata-cache:stat-cache-max-size-mb",
    "metadata-cache:type-cache-max-size-mb",
}


def map_mount_options(options: list[str]) -> tuple[str | None, float | None, list[str]]:
    """-> (only-dir prefix, list refresh seconds, options ignored as moot)."""
    prefix: str | None = None
    refresh: float | None = None
    ignored: list[str] = []
    rejected: list[str] = []
    for raw in options:
        opt = raw.strip()
        key, sep, value = opt.partition("=")
        if not sep:  # gcsfuse config-file style: "metadata-cache:ttl-secs:60"
            key, _, value = opt.rpartition(":") if opt.count(":") >= 2 else (opt, "", "")
        if key == "only-dir" and value.strip("/"):
            prefix = value.strip("/")
        elif key in ("metadata-cache:ttl-secs", "stat-cache-ttl"):
            try:
                secs = int(value.rstrip("s"))
            except ValueError:
                rejected.append(opt)
                continue
            # -1 is gcsfuse's "never expire": re-list the bucket rarely (hourly).
            refresh = 3600.0 if secs < 0 else float(max(1, secs))
        elif key in _MOOT_OPTIONS or opt in _MOOT_OPTIONS:
            ignored.append(opt)
        else:
            rejected.append(opt)
    if rejected:
        raise SpecError(
            "UnsupportedMountOption",
            f"gcsFuseMountOptions not supported by mtcfs: {', '.join(rejected)} "
            "(supported: only-dir, metadata-cache:ttl-secs, stat-cache-ttl; accepted and "
            f"ignored: {', '.join(sorted(_MOOT_OPTIONS))})",
        )
    return prefix, refresh, ignored


def settings_from(cpc: Obj, default_image: str) -> Settings:
    """Validate a CPC's spec beyond what the CRD schema checks; SpecError if unusable."""
    meta, spec = cpc["metadata"], cpc.get("spec") or {}
    bucket = spec.get("cloudStorageBucketName")
    if not bucket:
        raise SpecError("InvalidSpec", "spec.cloudStorageBucketName is required")
    size = spec.get("inMemoryVolumeSize")
    if size is None:
        raise SpecError("InvalidSpec", "spec.inMemoryVolumeSize is required")
    prefix, refresh, ignored = map_mount_options(list(spec.get("gcsFuseMountOptions") or []))
    persist = str(spec.get("persistPolicy", "step"))
    if not PERSIST_RE.match(persist):
        raise SpecError("InvalidSpec", f"spec.persistPolicy {persist!r} is not valid")
    fsync = str(spec.get("fsync", "local"))
    if fsync not in FSYNC_LEVELS:
        raise SpecError("InvalidSpec", f"spec.fsync {fsync!r} is not one of {FSYNC_LEVELS}")
    data_path = str(spec.get("dataPath", "auto"))
    if data_path not in DATA_PATHS:
        raise SpecError("InvalidSpec", f"spec.dataPath {data_path!r} is not one of {DATA_PATHS}")
    ref = spec.get("peerTokenSecretRef") or {}
    name = meta["name"]
    ignored_fields = ["enableExternalJaxProcessIds"] if spec.get(
        "enableExternalJaxProcessIds") else []
    gref = spec.get("googleCredentialsSecretRef") or {}
    return Settings(
        name=name,
        uid=meta.get("uid", ""),
        bucket=f"gs://{bucket}" + (f"/{prefix}" if prefix else ""),
        ram_bytes=parse_quantity(size),
        ram_quantity=str(size),
        node_selector=dict(spec.get("nodeSelector") or {}),
        tolerations=list(spec.get("tolerations") or []),
        replicas=int(spec.get("replicas", 1)),
        persist=persist,
        keep_steps=spec.get("keepSteps"),
        fsync=fsync,
        data_path=data_path,
        peer_encryption=spec.get("peerEncryption") is True,
        failure_domain_label=spec.get("failureDomainLabel", "topology.kubernetes.io/zone"),
        token_secret=ref.get("name") or TOKENS_SECRET,
        token_key=(ref.get("key") or "token") if ref else name,
        token_generated=not ref,
        image=spec.get("image") or default_image,
        list_refresh=refresh,
        csi_ephemeral_limit=ephemeral_limit(spec.get("csiEphemeralLimit")),
        ignored_mount_options=ignored,
        ignored_fields=ignored_fields,
        google_credentials=(gref["name"], gref.get("key") or "credentials.json")
        if gref.get("name") else None,
    )


def owner_ref(cpc: Obj, controller: bool = True) -> Obj:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": CPC_KIND,
        "name": cpc["metadata"]["name"],
        "uid": cpc["metadata"]["uid"],
        "controller": controller,
        "blockOwnerDeletion": True,
    }


def config_hash(obj: Obj) -> str:
    """Hash of the desired object: the controller replaces an object only when this
    changes, since the API server adds defaults that make a field-by-field diff
    of desired vs. live always differ."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _labels(s: Settings, app: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": app,
        "app.kubernetes.io/instance": s.name,
        "app.kubernetes.io/part-of": "mtcfs",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        LABEL_CPC: s.name,
    }


def _meta(s: Settings, name: str, app: str, owners: list[Obj], ns: str | None = None) -> Obj:
    meta: Obj = {"name": name, "labels": _labels(s, app), "ownerReferences": owners}
    if ns:
        meta["namespace"] = ns
    return meta


def names(cpc_name: str) -> dict[str, str]:
    return {
        "daemon": f"{DAEMON_APP}-{cpc_name}",
        "csi": f"{CSI_APP}-{cpc_name}",
    }


def daemon_selector(cpc_name: str) -> str:
    """Label selector of one CPC's node-daemon pods (discovery lists them)."""
    return f"app.kubernetes.io/name={DAEMON_APP},{LABEL_CPC}={cpc_name}"


_DOWNWARD_ENV = [
    {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
    {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
]


_UNPRIVILEGED: Obj = {
    "runAsNonRoot": True,
    "runAsUser": 65532,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
# The CSI sidecars: root, for the root-owned kubelet directories and socket, but
# with no capabilities beyond a file owner's.
_SIDECAR: Obj = {
    "runAsUser": 0,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _host_path(name: str, path: str, kind: str = "DirectoryOrCreate") -> Obj:
    return {"name": name, "hostPath": {"path": path, "type": kind}}


def daemon_args(s: Settings) -> list[str]:
    """`mtcfs mount` for one node; $(VAR)s are expanded by the kubelet."""
    # "64Gi" reads better as "64GiB" than as bytes; anything else goes as bytes.
    ram = f"{s.ram_quantity}B" if re.fullmatch(r"[0-9]+[KMGTP]i", s.ram_quantity) \
        else str(s.ram_bytes)
    args = [
        "mount", HOST_MOUNT,
        "--config", NODE_CONFIG,  # this node's failure domain, written by discovery
        "--ram-dir", HOST_RAM,
        "--ram-size", ram,
        "--node-id", "$(NODE_NAME)",
        "--listen", f"$(HOST_IP):{PEER_PORT}",
        "--peers-file", PEERS_FILE,
        "--replicas", str(s.replicas),
        "--token-file", f"{TOKEN_DIR}/{s.token_key}",
        "--bucket", s.bucket,
        "--persist", s.persist,
        "--fsync", s.fsync,
        "--data-path", s.data_path,
        "--metrics-port", str(METRICS_PORT),
        # hostNetwork: the node's IP, not 0.0.0.0 (docs/gke.md, "Metrics").
        "--metrics-address", "$(HOST_IP)",
        "--log-format", "json",
        "-o", "allow_other",  # training containers do not run as the daemon's user
    ]
    if s.keep_steps is not None:
        args += ["--keep-steps", str(s.keep_steps)]
    if s.peer_encryption:
        args.append("--peer-encryption")
    if s.list_refresh is not None:
        args += ["--list-refresh", f"{s.list_refresh:g}"]
    return args


def daemon_set(s: Settings, ns: str, owners: list[Obj]) -> Obj:
    n = names(s.name)
    labels = _labels(s, DAEMON_APP)
    selector = {"app.kubernetes.io/name": DAEMON_APP, LABEL_CPC: s.name}
    state_mount = {"name": "state", "mountPath": HOST_ROOT, "mountPropagation": "Bidirectional"}
    discover = {
        # A native sidecar (an init container that keeps running): its startup
        # probe holds the daemon back until the first peers file is written.
        "name": "discover",
        "image": s.image,
        "restartPolicy": "Always",
        "command": ["mtcfs"],
        "args": [
            "discover",
            "--peers-file", PEERS_FILE,
            "--node-config", NODE_CONFIG,
            "--node-name", "$(NODE_NAME)",
            "--namespace", "$(POD_NAMESPACE)",
            "--selector", daemon_selector(s.name),
            "--port", str(PEER_PORT),
            "--failure-domain-label", s.failure_domain_label,
            "--interval", "10",
        ],
        "env": _DOWNWARD_ENV,
        "startupProbe": {
            "exec": {"command": ["test", "-f", NODE_CONFIG]},
            "periodSeconds": 1,
            "failureThreshold": 120,
        },
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}},
        # Reads the API and writes two files into an emptyDir: no privileges.
        "securityContext": _UNPRIVILEGED,
        "volumeMounts": [{"name": "run", "mountPath": RUN_DIR}],
    }
    unmount_stale = {
        # A daemon that died leaves a dead FUSE mount ("transport endpoint is not
        # connected") at the host path; the new daemon refuses a mountpoint in use.
        "name": "unmount-stale",
        "image": s.image,
        "command": ["sh", "-c",
                    f"if grep -qs ' {HOST_MOUNT} ' /proc/self/mountinfo; then "
                    f"fusermount3 -u -z {HOST_MOUNT}; fi; mkdir -p {HOST_MOUNT}"],
        "securityContext": {"privileged": True},
        "volumeMounts": [state_mount],
    }
    daemon = {
        "name": "mtcfsd",
        "image": s.image,
        "command": ["mtcfs"],
        "args": daemon_args(s),
        "env": _DOWNWARD_ENV,
        "securityContext": {"privileged": True},
        "ports": [
            {"name": "peer", "containerPort": PEER_PORT, "protocol": "TCP"},
            # Membership (SWIM) datagrams: the --listen port, on UDP.
            {"name": "gossip", "containerPort": PEER_PORT, "protocol": "UDP"},
            # The bulk data channel (--data-listen defaults to the --listen port + 1).
            {"name": "data", "containerPort": PEER_PORT + 1, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        # No liveness probe: restarting a slow daemon would cost every pod on the
        # node its /ckpt until the re-bind, which is worse than waiting.
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": METRICS_PORT},
                           "periodSeconds": 5},
        # tmpfs pages are charged to this container's memory cgroup: request the
        # RAM tier so the scheduler counts it, and set no limit (an OOM kill would
        # take the node's checkpoints' only fast copy with it).
        "resources": {"requests": {"cpu": "500m", "memory": str(s.ram_bytes)}},
        "volumeMounts": [
            {"name": "fuse", "mountPath": "/dev/fuse"},
            # Bidirectional: the RAM tier's own tmpfs (passthrough) is mounted by the
            # daemon inside this path; it must outlive the container, so that a
            # restarted daemon finds its files (as it does on the host's /dev/shm).
            {"name": "ram", "mountPath": HOST_RAM, "mountPropagation": "Bidirectional"},
            state_mount,
            {"name": "run", "mountPath": RUN_DIR},
            {"name": "token", "mountPath": TOKEN_DIR, "readOnly": True},
        ],
    }
    if s.google_credentials:
        secret, key = s.google_credentials
        daemon["env"] = [*_DOWNWARD_ENV, {"name": "GOOGLE_APPLICATION_CREDENTIALS",
                                          "value": f"{GOOGLE_DIR}/{key}"}]
        daemon["volumeMounts"].append({"name": "google", "mountPath": GOOGLE_DIR,
                                       "readOnly": True})
    pod_spec: Obj = {
        "serviceAccountName": NODE_ACCOUNT,
        "hostNetwork": True,  # a stable peer address: the node's IP
        "dnsPolicy": "ClusterFirstWithHostNet",
        "priorityClassName": "system-node-critical",
        "terminationGracePeriodSeconds": 30,
        "nodeSelector": s.node_selector,
        "tolerations": s.tolerations,
        "initContainers": [unmount_stale, discover],
        "containers": [daemon],
        "volumes": [
            _host_path("fuse", "/dev/fuse", "CharDevice"),
            _host_path("ram", HOST_RAM),
            _host_path("state", HOST_ROOT),
            {"name": "run", "emptyDir": {}},
            {"name": "token", "secret": {
                "secretName": s.token_secret,
                "items": [{"key": s.token_key, "path": s.token_key}],
                "defaultMode": 0o400,
            }},
        ],
    }
    if s.google_credentials:
        secret, key = s.google_credentials
        pod_spec["volumes"].append({"name": "google", "secret": {
            "secretName": secret, "items": [{"key": key, "path": key}], "defaultMode": 0o400}})
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _meta(s, n["daemon"], DAEMON_APP, owners, ns),
        "spec": {
            "selector": {"matchLabels": selector},
            # A daemon restart drops every pod's view of /ckpt until the CSI plugin
            # re-binds it: the operator picks the moment (delete the pod) per node.
            "updateStrategy": {"type": "OnDelete"},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def csi_daemon_set(s: Settings, ns: str, owners: list[Obj]) -> Obj:
    n = names(s.name)
    labels = _labels(s, CSI_APP)
    plugin = {
        "name": "csi-plugin",
        "image": s.image,
        "command": ["mtcfs"],
        "args": [
            "csi",
            "--endpoint", "unix:///csi/csi.sock",
            "--node-id", "$(NODE_NAME)",
            "--mount-root", HOST_MOUNT,
            "--targets-root", f"{KUBELET}/pods",
        ],
        "env": _DOWNWARD_ENV[:1],
        "securityContext": {"privileged": True},
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}},
        "volumeMounts": [
            {"name": "plugin-dir", "mountPath": "/csi"},
            # Bind mounts made into pod targets must reach the host: Bidirectional.
            {"name": "pods-dir", "mountPath": f"{KUBELET}/pods",
             "mountPropagation": "Bidirectional"},
            # The daemon's mount (and its re-mount after a restart) must be seen here.
            {"name": "state", "mountPath": HOST_ROOT, "mountPropagation": "HostToContainer"},
        ],
        "ports": [{"name": "healthz", "containerPort": CSI_HEALTH_PORT, "protocol": "TCP"}],
        # The livenessprobe sidecar answers /healthz by calling the plugin's Probe
        # RPC: a plugin that no longer serves gRPC is restarted.
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "healthz"},
            "initialDelaySeconds": 10,
            "periodSeconds": 10,
            "timeoutSeconds": 3,
            "failureThreshold": 5,
        },
    }
    if s.csi_ephemeral_limit:
        # csiEphemeralLimit, applied as the managed MTC does: a cap on the CSI
        # pod's local ephemeral storage (logs, writable layer); over it, the
        # kubelet evicts the pod (mounts stay: the plugin is stateless).
        plugin["resources"]["limits"] = {"ephemeral-storage": s.csi_ephemeral_limit}
    registrar = {
        "name": "node-driver-registrar",
        "image": REGISTRAR_IMAGE,
        "args": [
            "--csi-address=/csi/csi.sock",
            f"--kubelet-registration-path={PLUGIN_DIR}/csi.sock",
        ],
        "securityContext": _SIDECAR,
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"},
                      "limits": {"memory": "64Mi"}},
        "volumeMounts": [
            {"name": "plugin-dir", "mountPath": "/csi"},
            {"name": "registration-dir", "mountPath": "/registration"},
        ],
    }
    liveness = {
        "name": "liveness-probe",
        "image": LIVENESS_PROBE_IMAGE,
        "args": [
            "--csi-address=/csi/csi.sock",
            # The pod IP (not hostNetwork): the kubelet probes it there.
            f"--http-endpoint=:{CSI_HEALTH_PORT}",
            "--probe-timeout=3s",
        ],
        "securityContext": _SIDECAR,
        "resources": {"requests": {"cpu": "5m", "memory": "16Mi"},
                      "limits": {"memory": "64Mi"}},
        "volumeMounts": [{"name": "plugin-dir", "mountPath": "/csi"}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _meta(s, n["csi"], CSI_APP, owners, ns),
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": CSI_APP, LABEL_CPC: s.name}},
            # The plugin is stateless and never touches mounts when it restarts.
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "serviceAccountName": NODE_ACCOUNT,
                    "priorityClassName": "system-node-critical",
                    "nodeSelector": s.node_selector,
                    "tolerations": s.tolerations,
                    "containers": [plugin, registrar, liveness],
                    "volumes": [
                        _host_path("plugin-dir", PLUGIN_DIR),
                        _host_path("registration-dir", f"{KUBELET}/plugins_registry", "Directory"),
                        _host_path("pods-dir", f"{KUBELET}/pods", "Directory"),
                        _host_path("state", HOST_ROOT),
                    ],
                },
            },
        },
    }


def csi_driver(owners: list[Obj]) -> Obj:
    """One per cluster, shared by every CPC (each owns it): deleted with the last."""
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "CSIDriver",
        "metadata": {
            "name": DRIVER_NAME,
            "labels": {"app.kubernetes.io/part-of": "mtcfs",
                       "app.kubernetes.io/managed-by": MANAGED_BY},
            "ownerReferences": owners,
        },
        "spec": {
            "attachRequired": False,
            "podInfoOnMount": True,  # the plugin needs the pod's namespace and name
            # Inline volumes, and static PersistentVolumes (docs/csi.md).
            "volumeLifecycleModes": ["Persistent", "Ephemeral"],
            "fsGroupPolicy": "None",  # a chown walk over a checkpoint tree would be ruinous
        },
    }


def new_token() -> str:
    """A generated peer token, base64 as Secret data holds it."""
    return base64.b64encode(secrets.token_urlsafe(32).encode()).decode()


def desired(s: Settings, ns: str, cpc: Obj, driver_owners: list[Obj]) -> list[tuple[Resource, Obj]]:
    """Everything one CPC owns except its generated token (written once into the
    shared Secret, never replaced: a new token would cut every running daemon off
    its peers). No RBAC objects: the node pods' account is static."""
    owners = [owner_ref(cpc)]
    return [
        (CSI_DRIVERS, csi_driver(driver_owners)),
        (DAEMON_SETS, daemon_set(s, ns, owners)),
        (DAEMON_SETS, csi_daemon_set(s, ns, owners)),
    ]


def selectors_overlap(a: dict[str, str], b: dict[str, str]) -> bool:
    """Whether some node could match both nodeSelectors: no key with two values."""
    return all(a[k] == b[k] for k in a.keys() & b.keys())


def selects(selector: dict[str, str], node: Obj) -> bool:
    labels = node.get("metadata", {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())

