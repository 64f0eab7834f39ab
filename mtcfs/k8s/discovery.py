"""Peer discovery in Kubernetes (`mtcfs discover`): keep the node daemon's
--peers-file current from the API.

Peers are the node-daemon pods of the same DaemonSet (host network: a pod's
hostIP is its node's address), optionally narrowed to the nodes that run one
JobSet's pods. Each peer's failure domain comes from its node's labels
(topology.kubernetes.io/zone, or cloud.google.com/gke-nodepool, per the CPC's
failureDomainLabel); this node's own goes into a small TOML file the daemon
reads with --config.

A training member is identified by (namespace, JobSet, job index, completion
index), never by pod UID: a pod that JobSet recreates on another node after a
failure is the same member, and the replacement node must find the replicas
of that member's shards. The peers file carries this as comments; a JSON file
beside it (`<peers-file>.json`) carries it for tools and `mtcfs status`.

Files are written atomically (temporary file, fsync, rename) and only when
their content changes, so the daemon, which re-reads the file on change, never
sees half a list.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from mtcfs.k8s.kube import NODES, PODS, Kube, Obj

log = logging.getLogger("mtcfs.discover")

JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
JOB_INDEX = "jobset.sigs.k8s.io/job-index"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
DEFAULT_DOMAIN_LABEL = "topology.kubernetes.io/zone"
FALLBACK_DOMAIN_LABEL = "cloud.google.com/gke-nodepool"


@dataclass(frozen=True, order=True)
class Member:
    """One rank-holder of a training job, stable across pod re-creation."""

    namespace: str
    jobset: str
    job_index: int
    completion_index: int

    def key(self) -> str:
        return f"{self.namespace}/{self.jobset}/{self.job_index}/{self.completion_index}"


@dataclass
class Peer:
    node: str
    address: str
    failure_domain: str | None
    members: list[Member] = field(default_factory=list)


def member_of(pod: Obj) -> Member | None:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    notes = meta.get("annotations") or {}
    jobset = labels.get(JOBSET_NAME)
    # The completion index is an annotation (and, since 1.28, also a label).
    completion = notes.get(COMPLETION_INDEX, labels.get(COMPLETION_INDEX))
    job_index = labels.get(JOB_INDEX, notes.get(JOB_INDEX))
    if not jobset or completion is None or job_index is None:
        return None
    try:
        return Member(meta.get("namespace") or "default", jobset, int(job_index), int(completion))
    except ValueError:
        return None


def failure_domain(node: Obj | None, label: str) -> str | None:
    labels = ((node or {}).get("metadata") or {}).get("labels") or {}
    if labels.get(label):
        return str(labels[label])
    if label == DEFAULT_DOMAIN_LABEL and labels.get(FALLBACK_DOMAIN_LABEL):
        return str(labels[FALLBACK_DOMAIN_LABEL])
    return None


def _running(pod: Obj) -> bool:
    """A peer: running, not being deleted, and Ready. A deleted pod leaves the peers
    file at the next scan, and so does one on a node gone NotReady: the node
    lifecycle controller marks that node's pods not Ready when it marks the node
    (node-monitor-grace-period, 40 s by default), so no node list is needed. The
    daemon takes a host that leaves the file as gone at once."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    return (not meta.get("deletionTimestamp") and status.get("phase") == "Running"
            and bool(status.get("hostIP")) and bool((pod.get("spec") or {}).get("nodeName"))
            and _ready(status))


def _ready(status: dict[str, Any]) -> bool:
    for c in status.get("conditions") or []:
        if c.get("type") == "Ready":
            return c.get("status") == "True"
    return True  # no conditions reported (yet): running is all we know


def _host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


@dataclass
class View:
    """What one discovery pass found."""

    node: str
    failure_domain: str | None
    peers: list[Peer]
    members: list[Member]  # this node's training members

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "failureDomain": self.failure_domain,
            "members": [m.key() for m in self.members],
            "peers": [
                {**{k: v for k, v in asdict(p).items() if k != "members"},
                 "members": [m.key() for m in p.members]}
                for p in self.peers
            ],
        }


class Discovery:
    def __init__(
        self,
        kube: Kube,
        node_name: str,
        daemon_namespace: str,
        daemon_selector: str,
        port: int,
        failure_domain_label: str = DEFAULT_DOMAIN_LABEL,
        jobset: tuple[str, str] | None = None,  # (namespace, name)
    ) -> None:
        self.kube = kube
        self.node_name = node_name
        self.daemon_namespace = daemon_namespace
        self.daemon_selector = daemon_selector
        self.port = port
        self.label = failure_domain_label
        self.jobset = jobset
        self._nodes: dict[str, Obj] = {}  # node labels change rarely: fetched once each
        self._daemons_version: str | None = None  # of the last scan's list: watched from

    def _node(self, name: str) -> Obj | None:
        if name not in self._nodes:
            node = self.kube.get(NODES, name)
            if node is None:
                return None
            self._nodes[name] = node
        return self._nodes[name]

    def wait_for_change(self, interval: float, stop: threading.Event) -> bool:
        """Until a node-daemon pod changes (a watch from the last scan's list: a pod
        deleted, evicted or new reaches the peers file in about a second, not at the
        next pass), `interval` passes, or `stop`; True when stopped."""
        deadline = time.monotonic() + interval
        try:
            while not stop.is_set() and time.monotonic() < deadline:
                timeout = max(1, min(30, int(deadline - time.monotonic())))
                for kind, _ in self.kube.watch(PODS, self._daemons_version, timeout,
                                               self.daemon_namespace, self.daemon_selector):
                    if kind != "BOOKMARK":
                        return stop.is_set()
        except Exception as e:  # no watch (an API hiccup, RBAC): the pass comes anyway
            log.debug("watching the daemon pods: %s", e)
            return stop.wait(max(0.0, deadline - time.monotonic()))
        return stop.is_set()

    def scan(self) -> View:
        # Every node polls: list from the API server's cache (resourceVersion 0).
        listing = self.kube.request("GET", PODS.path(self.daemon_namespace),
                                    {"labelSelector": self.daemon_selector,
                                     "resourceVersion": "0"})
        self._daemons_version = str((listing.get("metadata") or {}).get("resourceVersion")
                                    or "") or None
        daemons = [p for p in listing.get("items") or [] if _running(p)]
        if self.jobset:
            ns, name = self.jobset
            trainers = self.kube.list(PODS, ns, label_selector=f"{JOBSET_NAME}={name}",
                                      cached=True)
        else:
            trainers = self.kube.list(PODS, label_selector=JOBSET_NAME, cached=True)
        by_node: dict[str, set[Member]] = {}
        for pod in trainers:
            node = (pod.get("spec") or {}).get("nodeName")
            m = member_of(pod)
            if node and m and not (pod.get("metadata") or {}).get("deletionTimestamp"):
                by_node.setdefault(node, set()).add(m)
        peers: dict[str, Peer] = {}
        for pod in daemons:
            node = pod["spec"]["nodeName"]
            if node == self.node_name or node in peers:
                continue
            if self.jobset and node not in by_node:
                continue  # narrowed to the JobSet's nodes
            peers[node] = Peer(node, _host_port(pod["status"]["hostIP"], self.port),
                               failure_domain(self._node(node), self.label),
                               sorted(by_node.get(node, ())))
        return View(
            node=self.node_name,
            failure_domain=failure_domain(self._node(self.node_name), self.label),
            peers=sorted(peers.values(), key=lambda p: p.node),
            members=sorted(by_node.get(self.node_name, ())),
        )


def render_peers(view: View) -> str:
    """The --peers-file: one host:port per line; '#' comments say who is where."""
    lines = [f"# written by mtcfs discover for node {view.node} "
             f"(failure domain {view.failure_domain or '-'})"]
    for p in view.peers:
        who = " ".join(m.key() for m in p.members) or "-"
        lines.append(f"{p.address}  # node={p.node} domain={p.failure_domain or '-'} "
                     f"members={who}")
    return "\n".join(lines) + "\n"


def render_node_config(view: View) -> str:
    """TOML for `mtcfs mount --config`: this node's failure domain."""
    if not view.failure_domain:
        return "# no failure domain label on this node\n"
    return f"failure-domain = {json.dumps(view.failure_domain)}\n"


def write_atomic(path: str, text: str) -> bool:
    """Replace `path` with `text` in one rename; False (no write) if unchanged."""
    try:
        with open(path) as f:
            if f.read() == text:
                return False
    except FileNotFoundError:
        pass
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".peers-", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return True


def write_view(view: View, peers_file: str, node_config: str | None) -> bool:
    """Write the peers file, its JSON twin and the node's TOML; True if peers changed."""
    changed = write_atomic(peers_file, render_peers(view))
    write_atomic(peers_file + ".json", json.dumps(view.to_json(), indent=2) + "\n")
    if node_config:
        write_atomic(node_config, render_node_config(view))
    return changed


def run(
    discovery: Discovery,
    peers_file: str,
    node_config: str | None,
    interval: float,
    stop: threading.Event,
    once: bool = False,
) -> None:
    while True:
        try:
            view = discovery.scan()
            if write_view(view, peers_file, node_config):
                log.info("peers: %s", ", ".join(f"{p.node}={p.address}" for p in view.peers)
                         or "none")
        except Exception as e:  # API hiccup: keep the last good file, try again
            if once:
                raise
            log.warning("discovery pass failed: %s", e)
        if once or discovery.wait_for_change(interval, stop):
            return
