"""The CheckpointConfiguration controller, leader election and peer discovery.

No real Kubernetes API server runs here: every test talks, through the official
client over HTTP, to the in-memory API server of tests/support/k8s_api.py (objects,
resourceVersions, finalizers, status subresource, watch; no workload
controllers, so tests set a DaemonSet's status themselves, as the DaemonSet
controller would). Each test's API server holds what deploy/base installs
besides the controller (the peer-token Secret); with `Rbac` it also refuses
what the shipped Roles do not allow, as a real API server would.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mtcfs.config import load_toml, parse_size, read_peers_file
from mtcfs.csi import DRIVER_NAME
from mtcfs.k8s import discovery
from mtcfs.k8s import objects as o
from mtcfs.k8s.controller import CPCS, Controller
from mtcfs.k8s.kube import Kube, api_client_for
from mtcfs.k8s.leader import LeaderElector

from support.k8s_api import FakeApiServer, Rbac, fake_api, shipped

NS = "mtcfs-system"
G = "mtcfs.dev"
P = "checkpointconfigurations"



@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with fake_api() as srv:
        for secret in shipped("Secret"):
            srv.put("", "secrets", secret)
        yield srv


def tokens(api: FakeApiServer) -> dict[str, str]:
    secret = api.get("", "secrets", o.TOKENS_SECRET, NS)
    assert secret is not None
    return secret.get("data") or {}


@pytest.fixture
def kube(api: FakeApiServer) -> Kube:
    return Kube(api_client_for(api.url), timeout=10)


@pytest.fixture
def ctl(kube: Kube) -> Controller:
    return Controller(kube, NS, default_image="mtcfs:test", identity="test")


def spec(**over: Any) -> dict[str, Any]:
    s: dict[str, Any] = {
        "cloudStorageBucketName": "ckpt-bucket",
        "inMemoryVolumeSize": "64Gi",
        "nodeSelector": {"cloud.google.com/gke-nodepool": "pool-a"},
        "tolerations": [{"key": "google.com/tpu", "operator": "Exists",
                         "effect": "NoSchedule"}],
    }
    s.update(over)
    return s


def create_cpc(kube: Kube, name: str, **over: Any) -> dict[str, Any]:
    return kube.create(CPCS, {"apiVersion": f"{G}/v1", "kind": "CheckpointConfiguration",
                              "metadata": {"name": name}, "spec": spec(**over)})


def cpc(api: FakeApiServer, name: str) -> dict[str, Any] | None:
    return api.get(G, P, name)


def cond(obj: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in obj["status"]["conditions"] if c["type"] == ctype)


def ds(api: FakeApiServer, name: str) -> dict[str, Any] | None:
    return api.get("apps", "daemonsets", name, NS)


def container(obj: dict[str, Any], name: str) -> dict[str, Any]:
    spec_ = obj["spec"]["template"]["spec"]
    return next(c for c in spec_["containers"] + spec_.get("initContainers", [])
                if c["name"] == name)


def arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def ds_ready(api: FakeApiServer, name: str, nodes: int, updated: int | None = None) -> None:
    obj = ds(api, name)
    assert obj is not None
    api.set_status("apps", "daemonsets", name, NS, {
        "observedGeneration": obj["metadata"]["generation"],
        "desiredNumberScheduled": nodes, "numberReady": nodes,
        "updatedNumberScheduled": nodes if updated is None else updated,
    })


# -- create ---------------------------------------------------------------------------


def test_cpc_becomes_daemonsets_driver_token(api: FakeApiServer, kube: Kube,
                                             ctl: Controller) -> None:
    created = create_cpc(kube, "pool-a", replicas=2, keepSteps=3, fsync="replicas",
                         dataPath="fuse", peerEncryption=True,
                         persistPolicy="interval:300")
    uid = created["metadata"]["uid"]
    ctl.reconcile_all()

    d = ds(api, "mtcfsd-pool-a")
    assert d is not None
    pod = d["spec"]["template"]["spec"]
    assert d["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert pod["hostNetwork"] is True
    assert pod["nodeSelector"] == {"cloud.google.com/gke-nodepool": "pool-a"}
    assert pod["tolerations"][0]["key"] == "google.com/tpu"
    daemon = container(d, "mtcfsd")
    assert daemon["securityContext"]["privileged"] is True
    assert daemon["image"] == "mtcfs:test"
    a = daemon["args"]
    assert a[:2] == ["mount", o.HOST_MOUNT]
    assert arg(a, "--ram-size") == "64GiB"
    assert parse_size(arg(a, "--ram-size")) == 64 << 30
    assert arg(a, "--replicas") == "2"
    assert arg(a, "--keep-steps") == "3"
    assert arg(a, "--fsync") == "replicas"
    assert arg(a, "--data-path") == "fuse"
    assert "--peer-encryption" in a
    assert arg(a, "--persist") == "interval:300"
    assert arg(a, "--bucket") == "gs://ckpt-bucket"
    assert arg(a, "--peers-file") == o.PEERS_FILE
    assert arg(a, "--listen") == f"$(HOST_IP):{o.PEER_PORT}"
    assert arg(a, "--log-format") == "json"
    assert int(arg(a, "--metrics-port")) in [p["containerPort"] for p in daemon["ports"]]
    assert arg(a, "--metrics-address") == "$(HOST_IP)"  # hostNetwork: not 0.0.0.0
    assert pod["serviceAccountName"] == o.NODE_ACCOUNT
    assert daemon["resources"]["requests"]["memory"] == str(64 << 30)
    mounts = {m["name"]: m for m in daemon["volumeMounts"]}
    assert mounts["state"]["mountPropagation"] == "Bidirectional"
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["fuse"]["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}
    # hostPath, not an emptyDir: the RAM tier outlives a daemon pod restart.
    assert vols["ram"]["hostPath"]["path"] == o.HOST_RAM
    assert vols["state"]["hostPath"]["path"] == o.HOST_ROOT
    assert vols["token"]["secret"]["secretName"] == o.TOKENS_SECRET
    assert vols["token"]["secret"]["items"] == [{"key": "pool-a", "path": "pool-a"}]
    assert arg(a, "--token-file") == f"{o.TOKEN_DIR}/pool-a"
    disc = container(d, "discover")
    assert disc["restartPolicy"] == "Always"  # a native sidecar
    assert disc["securityContext"]["runAsNonRoot"] is True
    assert disc["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert arg(disc["args"], "--selector") == o.daemon_selector("pool-a")
    assert arg(disc["args"], "--failure-domain-label") == "topology.kubernetes.io/zone"

    c = ds(api, "mtcfs-csi-pool-a")
    assert c is not None
    plugin, registrar = container(c, "csi-plugin"), container(c, "node-driver-registrar")
    liveness = container(c, "liveness-probe")
    assert c["spec"]["template"]["spec"]["serviceAccountName"] == o.NODE_ACCOUNT
    assert "@sha256:" in registrar["image"] and "@sha256:" in liveness["image"]
    assert registrar["securityContext"]["allowPrivilegeEscalation"] is False
    # The kubelet probes the sidecar, which calls the plugin's Probe RPC.
    assert plugin["livenessProbe"]["httpGet"]["port"] == "healthz"
    assert f"--http-endpoint=:{o.CSI_HEALTH_PORT}" in liveness["args"]
    assert "limits" not in plugin["resources"]  # no csiEphemeralLimit: no limit
    assert plugin["args"][:3] == ["csi", "--endpoint", "unix:///csi/csi.sock"]
    assert arg(plugin["args"], "--mount-root") == o.HOST_MOUNT
    assert f"--kubelet-registration-path=/var/lib/kubelet/plugins/{DRIVER_NAME}/csi.sock" \
        in registrar["args"]
    cvols = {v["name"]: v["hostPath"]["path"] for v in c["spec"]["template"]["spec"]["volumes"]}
    assert cvols["registration-dir"] == "/var/lib/kubelet/plugins_registry"

    drv = api.get("storage.k8s.io", "csidrivers", DRIVER_NAME)
    assert drv is not None
    assert drv["spec"] == {"attachRequired": False, "podInfoOnMount": True,
                           "volumeLifecycleModes": ["Persistent", "Ephemeral"],
                           "fsGroupPolicy": "None"}
    assert len(base64.b64decode(tokens(api)["pool-a"])) >= 32
    # No RBAC objects: the node pods' account is static (deploy/base/rbac.yaml).
    assert api.list("rbac.authorization.k8s.io", "clusterroles") == []
    assert api.list("rbac.authorization.k8s.io", "clusterrolebindings") == []
    assert api.list("", "serviceaccounts") == []
    for obj in (d, c):
        assert obj["metadata"]["ownerReferences"][0]["uid"] == uid

    got = cpc(api, "pool-a")
    assert got is not None
    assert o.FINALIZER in got["metadata"]["finalizers"]
    assert got["status"]["observedGeneration"] == 1
    assert cond(got, "Ready")["status"] == "False"
    assert cond(got, "Degraded")["status"] == "False"

    # The DaemonSet controller reports the pods ready: the CPC becomes Ready.
    ds_ready(api, "mtcfsd-pool-a", 3)
    ds_ready(api, "mtcfs-csi-pool-a", 3)
    ctl.reconcile_all()
    got = cpc(api, "pool-a")
    assert got is not None
    ready = cond(got, "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "AllNodesReady")
    assert "3/3 node daemons ready" in ready["message"]


def test_no_matching_nodes_is_reported(api: FakeApiServer, kube: Kube, ctl: Controller) -> None:
    create_cpc(kube, "empty")
    ctl.reconcile_all()
    ds_ready(api, "mtcfsd-empty", 0)
    ds_ready(api, "mtcfs-csi-empty", 0)
    ctl.reconcile_all()
    got = cpc(api, "empty")
    assert got is not None
    assert cond(got, "Ready")["reason"] == "NoNodesSelected"


# -- update ---------------------------------------------------------------------------


def test_changed_cpc_is_rolled_out(api: FakeApiServer, kube: Kube, ctl: Controller) -> None:
    create_cpc(kube, "pool-a")
    ctl.reconcile_all()
    before = ds(api, "mtcfsd-pool-a")
    token = tokens(api)["pool-a"]
    assert before is not None

    # Nothing changed: a second pass writes nothing at all.
    writes = len(api.log)
    ctl.reconcile_all()
    assert len(api.log) == writes

    kube.merge_patch(CPCS, "pool-a", {"spec": {
        "inMemoryVolumeSize": "128Gi", "replicas": 3, "image": "mtcfs:new",
        "tolerations": None,  # removed: a replace, not a merge, must drop them
    }})
    ctl.reconcile_all()
    after = ds(api, "mtcfsd-pool-a")
    assert after is not None
    daemon = container(after, "mtcfsd")
    assert arg(daemon["args"], "--ram-size") == "128GiB"
    assert arg(daemon["args"], "--replicas") == "3"
    assert daemon["image"] == "mtcfs:new"
    assert container(after, "discover")["image"] == "mtcfs:new"
    assert after["spec"]["template"]["spec"]["tolerations"] == []
    assert after["metadata"]["generation"] == before["metadata"]["generation"] + 1
    assert after["metadata"]["uid"] == before["metadata"]["uid"]  # updated, not recreated
    csi = ds(api, "mtcfs-csi-pool-a")
    assert csi is not None
    assert container(csi, "csi-plugin")["image"] == "mtcfs:new"
    # The peer token is never regenerated (running daemons would lose their peers).
    assert tokens(api)["pool-a"] == token

    got = cpc(api, "pool-a")
    assert got is not None
    assert got["metadata"]["generation"] == 2
    assert got["status"]["observedGeneration"] == 2
    assert all(c["observedGeneration"] == 2 for c in got["status"]["conditions"])

    # OnDelete: the DaemonSet controller reports old pods; the status says what to do.
    ds_ready(api, "mtcfsd-pool-a", 4, updated=1)
    ds_ready(api, "mtcfs-csi-pool-a", 4)
    ctl.reconcile_all()
    got = cpc(api, "pool-a")
    assert got is not None
    assert "3 node daemon(s) run an older spec" in cond(got, "Ready")["message"]


def test_gcsfuse_options_mapped_or_rejected(api: FakeApiServer, kube: Kube,
                                           ctl: Controller) -> None:
    create_cpc(kube, "mapped", gcsFuseMountOptions=[
        "implicit-dirs", "only-dir=runs/llama", "metadata-cache:ttl-secs:60"])
    create_cpc(kube, "rejected", nodeSelector={"pool": "other"},
               gcsFuseMountOptions=["implicit-dirs", "file-cache:max-size-mb:-1", "uid=1000"])
    ctl.reconcile_all()
    d = ds(api, "mtcfsd-mapped")
    assert d is not None
    a = container(d, "mtcfsd")["args"]
    assert arg(a, "--bucket") == "gs://ckpt-bucket/runs/llama"
    assert arg(a, "--list-refresh") == "60"
    assert ds(api, "mtcfsd-rejected") is None  # not rolled out
    got = cpc(api, "rejected")
    assert got is not None
    deg = cond(got, "Degraded")
    assert (deg["status"], deg["reason"]) == ("True", "UnsupportedMountOption")
    assert "file-cache:max-size-mb:-1" in deg["message"] and "uid=1000" in deg["message"]
    assert "implicit-dirs" not in deg["message"].split("(")[0]
    assert cond(got, "Ready")["status"] == "False"


@pytest.mark.parametrize(("q", "n"), [("64Gi", 64 << 30), ("500M", 500 * 10**6),
                                      ("1.5Ti", int(1.5 * (1 << 40))), ("1073741824", 1 << 30)])
def test_quantities(q: str, n: int) -> None:
    assert o.parse_quantity(q) == n


@pytest.mark.parametrize("q", ["64GB", "-1Gi", "1Ki", "lots"])
def test_bad_quantities(q: str) -> None:
    with pytest.raises(o.SpecError):
        o.parse_quantity(q)


def test_peer_token_secret_ref(api: FakeApiServer, kube: Kube, ctl: Controller) -> None:
    create_cpc(kube, "own-token", peerTokenSecretRef={"name": "shared", "key": "tok"})
    ctl.reconcile_all()
    got = cpc(api, "own-token")
    assert got is not None
    assert cond(got, "Degraded")["reason"] == "SecretMissing"
    assert ds(api, "mtcfsd-own-token") is None

    api.put("", "secrets", {"metadata": {"name": "shared", "namespace": NS},
                            "data": {"tok": base64.b64encode(b"x" * 32).decode()}})
    ctl.reconcile_all()
    d = ds(api, "mtcfsd-own-token")
    assert d is not None
    vols = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
    assert vols["token"]["secret"]["secretName"] == "shared"
    assert arg(container(d, "mtcfsd")["args"], "--token-file") == f"{o.TOKEN_DIR}/tok"
    assert "own-token" not in tokens(api)
    got = cpc(api, "own-token")
    assert got is not None
    assert cond(got, "Degraded")["status"] == "False"


# -- delete ---------------------------------------------------------------------------


def test_delete_runs_the_finalizer(api: FakeApiServer, kube: Kube, ctl: Controller) -> None:
    create_cpc(kube, "a")
    create_cpc(kube, "b", nodeSelector={"cloud.google.com/gke-nodepool": "pool-b"})
    ctl.reconcile_all()
    b_uid = cpc(api, "b")["metadata"]["uid"]  # type: ignore[index]
    drv = api.get("storage.k8s.io", "csidrivers", DRIVER_NAME)
    assert drv is not None and len(drv["metadata"]["ownerReferences"]) == 2

    kube.delete(CPCS, "a")
    held = cpc(api, "a")
    assert held is not None and held["metadata"].get("deletionTimestamp")  # the finalizer holds it
    ctl.reconcile_all()
    assert cpc(api, "a") is None
    assert ds(api, "mtcfsd-a") is None and ds(api, "mtcfs-csi-a") is None
    assert "a" not in tokens(api) and "b" in tokens(api)  # a's token key went with it
    assert ds(api, "mtcfsd-b") is not None
    # The shared CSIDriver stays for b, now owned by b alone.
    drv = api.get("storage.k8s.io", "csidrivers", DRIVER_NAME)
    assert drv is not None
    assert [r["uid"] for r in drv["metadata"]["ownerReferences"]] == [b_uid]

    kube.delete(CPCS, "b")
    ctl.reconcile_all()
    assert api.list(G, P) == []
    assert api.get("storage.k8s.io", "csidrivers", DRIVER_NAME) is None
    assert api.list("apps", "daemonsets") == []


# -- conflicts ------------------------------------------------------------------------


def test_overlapping_node_selectors(api: FakeApiServer, kube: Kube, ctl: Controller) -> None:
    for i, labels in enumerate([{"pool": "a", "zone": "z1"}, {"pool": "a", "zone": "z2"},
                                {"pool": "b", "zone": "z1"}]):
        api.put("", "nodes", {"metadata": {"name": f"n{i}", "labels": labels}})
    create_cpc(kube, "first", nodeSelector={"pool": "a"})
    time.sleep(1.1)  # creationTimestamp has one-second resolution: make "first" older
    create_cpc(kube, "second", nodeSelector={"pool": "a", "zone": "z1"})
    create_cpc(kube, "third", nodeSelector={"pool": "b"})
    ctl.reconcile_all()

    assert ds(api, "mtcfsd-first") is not None
    assert ds(api, "mtcfsd-third") is not None
    assert ds(api, "mtcfsd-second") is None  # the younger one is not rolled out
    got = cpc(api, "second")
    assert got is not None
    deg = cond(got, "Degraded")
    assert (deg["status"], deg["reason"]) == ("True", "NodeSelectorConflict")
    assert "first" in deg["message"] and "1 node(s)" in deg["message"]
    first = cpc(api, "first")
    assert first is not None and cond(first, "Degraded")["status"] == "False"
    events = api.list("", "events")
    assert [(e["reason"], e["involvedObject"]["name"], e["type"]) for e in events] == [
        ("NodeSelectorConflict", "second", "Warning")]

    ctl.reconcile_all()  # the condition stands; no second event
    assert len(api.list("", "events")) == 1

    # The older one goes: the younger one takes the nodes.
    kube.delete(CPCS, "first")
    ctl.reconcile_all()
    ctl.reconcile_all()
    assert ds(api, "mtcfsd-second") is not None
    got = cpc(api, "second")
    assert got is not None and cond(got, "Degraded")["status"] == "False"


# -- leader election ------------------------------------------------------------------


def elector(kube: Kube, who: str) -> LeaderElector:
    return LeaderElector(kube, NS, "mtcfs-controller", who,
                         lease_duration=1.0, renew_deadline=0.6, retry_period=0.1)


def test_lease_acquire_renew_expire(api: FakeApiServer, kube: Kube) -> None:
    a, b = elector(kube, "a"), elector(kube, "b")
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    lease = api.get("coordination.k8s.io", "leases", "mtcfs-controller", NS)
    assert lease is not None and lease["spec"]["holderIdentity"] == "a"
    renewed = lease["spec"]["renewTime"]
    time.sleep(0.05)
    assert a.try_acquire_or_renew()  # renew
    lease = api.get("coordination.k8s.io", "leases", "mtcfs-controller", NS)
    assert lease is not None and lease["spec"]["renewTime"] > renewed
    assert not b.try_acquire_or_renew()
    # a stops renewing: b takes over once b has seen the record unchanged for 1 s.
    deadline = time.monotonic() + 5
    while not b.try_acquire_or_renew():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    lease = api.get("coordination.k8s.io", "leases", "mtcfs-controller", NS)
    assert lease is not None
    assert lease["spec"]["holderIdentity"] == "b"
    assert lease["spec"]["leaseTransitions"] == 1
    assert not a.try_acquire_or_renew()  # a is a follower now
    b.release()
    assert a.try_acquire_or_renew()  # released: no need to wait


def test_two_controllers_one_leads(api: FakeApiServer, kube: Kube) -> None:
    """Two controller replicas: one leads and reconciles; when it dies without
    releasing the Lease, the other takes over after the lease duration."""
    stops = {"a": threading.Event(), "b": threading.Event()}
    electors = {k: elector(kube, k) for k in stops}
    threads = []
    for k, el in electors.items():
        c = Controller(Kube(api_client_for(api.url)), NS, "mtcfs:test", k)

        def lead(c: Controller = c, el: LeaderElector = el, stop: threading.Event = stops[k]
                 ) -> None:
            threading.Thread(target=c.run, args=(stop, 5.0, el.is_leader), daemon=True).start()

        t = threading.Thread(target=el.run, args=(stops[k], lead),
                             kwargs={"release_on_stop": False}, daemon=True)
        t.start()
        threads.append(t)
    try:
        deadline = time.monotonic() + 5
        while not any(e.is_leader() for e in electors.values()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)
        leaders = [k for k, e in electors.items() if e.is_leader()]
        assert len(leaders) == 1
        first = leaders[0]
        # The leader's loop reconciles a CPC created now (woken by the watch).
        create_cpc(kube, "watched")
        _wait(lambda: ds(api, "mtcfsd-watched") is not None)

        stops[first].set()  # "crash": no release
        other = next(k for k in electors if k != first)
        _wait(lambda: electors[other].is_leader(), timeout=5)
        lease = api.get("coordination.k8s.io", "leases", "mtcfs-controller", NS)
        assert lease is not None and lease["spec"]["holderIdentity"] == other
        create_cpc(kube, "after", nodeSelector={"cloud.google.com/gke-nodepool": "pool-x"})
        _wait(lambda: ds(api, "mtcfsd-after") is not None)
    finally:
        for s in stops.values():
            s.set()
        for t in threads:
            t.join(timeout=5)


def _wait(pred: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# -- discovery ------------------------------------------------------------------------


def _pods(api: FakeApiServer) -> None:
    zones = {"n1": {"topology.kubernetes.io/zone": "us-a"},
             "n2": {"topology.kubernetes.io/zone": "us-b"},
             "n3": {"cloud.google.com/gke-nodepool": "pool-3"},  # no zone label
             "n4": {"topology.kubernetes.io/zone": "us-a"}}
    for node, labels in zones.items():
        api.put("", "nodes", {"metadata": {"name": node, "labels": labels}})
    for i, node in enumerate(["n1", "n2", "n3", "n4"], start=1):
        api.put("", "pods", {
            "metadata": {"name": f"mtcfsd-x-{node}", "namespace": NS,
                         "labels": {"app.kubernetes.io/name": "mtcfsd", o.LABEL_CPC: "x"}},
            "spec": {"nodeName": node},
            # n4's daemon is not running yet: not a peer.
            "status": {"phase": "Running" if node != "n4" else "Pending",
                       "hostIP": f"10.0.0.{i}"},
        })
    for job_index, completion, node in [(0, 0, "n1"), (0, 1, "n2"), (1, 0, "n2")]:
        api.put("", "pods", {
            "metadata": {
                "name": f"llama-trainer-{job_index}-{completion}-abcde", "namespace": "ml",
                "labels": {discovery.JOBSET_NAME: "llama",
                           discovery.JOB_INDEX: str(job_index)},
                "annotations": {discovery.COMPLETION_INDEX: str(completion)},
            },
            "spec": {"nodeName": node},
            "status": {"phase": "Running", "hostIP": "x"},
        })


def test_discovery_writes_peers_and_failure_domains(api: FakeApiServer, kube: Kube,
                                                   tmp_path: Path) -> None:
    _pods(api)
    d = discovery.Discovery(kube, "n1", NS, o.daemon_selector("x"), o.PEER_PORT)
    view = d.scan()
    assert view.failure_domain == "us-a"
    assert [(p.node, p.address, p.failure_domain) for p in view.peers] == [
        ("n2", "10.0.0.2:7466", "us-b"),
        ("n3", "10.0.0.3:7466", "pool-3"),  # fallback label
    ]
    assert [m.key() for m in view.peers[0].members] == ["ml/llama/0/1", "ml/llama/1/0"]
    assert [m.key() for m in view.members] == ["ml/llama/0/0"]

    peers, node_cfg = tmp_path / "peers", tmp_path / "node.toml"
    assert discovery.write_view(view, str(peers), str(node_cfg))
    # The daemon's own parser reads it: comments are ignored.
    assert read_peers_file(str(peers)) == ["10.0.0.2:7466", "10.0.0.3:7466"]
    assert "members=ml/llama/0/1 ml/llama/1/0" in peers.read_text()
    side = json.loads((tmp_path / "peers.json").read_text())
    assert side["members"] == ["ml/llama/0/0"]
    assert side["peers"][0]["members"] == ["ml/llama/0/1", "ml/llama/1/0"]
    assert load_toml(str(node_cfg)) == {"failure_domain": "us-a"}
    mtime = peers.stat().st_mtime_ns
    assert not discovery.write_view(d.scan(), str(peers), str(node_cfg))  # unchanged: no write
    assert peers.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".peers-")] == []

    # A trainer pod recreated on another node (new UID) is the same member there.
    api.objects.pop(("", "pods", "ml", "llama-trainer-1-0-abcde"))
    api.put("", "pods", {
        "metadata": {"name": "llama-trainer-1-0-fghij", "namespace": "ml",
                     "labels": {discovery.JOBSET_NAME: "llama", discovery.JOB_INDEX: "1"},
                     "annotations": {discovery.COMPLETION_INDEX: "0"}},
        "spec": {"nodeName": "n3"}, "status": {"phase": "Running"}})
    view = d.scan()
    assert {p.node: [m.key() for m in p.members] for p in view.peers} == {
        "n2": ["ml/llama/0/1"], "n3": ["ml/llama/1/0"]}

    # A node gone NotReady: the node lifecycle controller marks its pods not Ready, and
    # the daemon there stops being a peer at the next scan (so does a deleted pod).
    n2 = api.objects[("", "pods", NS, "mtcfsd-x-n2")]
    n2["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    assert [p.node for p in d.scan().peers] == ["n3"]
    n2["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    assert [p.node for p in d.scan().peers] == ["n2", "n3"]
    api.objects[("", "pods", NS, "mtcfsd-x-n3")]["metadata"]["deletionTimestamp"] = "now"
    assert [p.node for p in d.scan().peers] == ["n2"]
    api.objects[("", "pods", NS, "mtcfsd-x-n3")]["metadata"].pop("deletionTimestamp")

    # Narrowed to the JobSet's nodes; zone label per the CPC's failureDomainLabel.
    d = discovery.Discovery(kube, "n1", NS, o.daemon_selector("x"), o.PEER_PORT,
                            "cloud.google.com/gke-nodepool", jobset=("ml", "llama"))
    view = d.scan()
    assert [(p.node, p.failure_domain) for p in view.peers] == [("n2", None), ("n3", "pool-3")]
    assert discovery.render_node_config(view).startswith("#")  # n1 has no such label


def test_discovery_writes_a_deleted_daemon_out_of_the_peers_file_at_once(
        api: FakeApiServer, kube: Kube, tmp_path: Path) -> None:
    """Between passes discovery watches the daemon pods: a deletion starts the next pass
    at once, long before --interval."""
    _pods(api)
    d = discovery.Discovery(kube, "n1", NS, o.daemon_selector("x"), o.PEER_PORT)
    peers = tmp_path / "peers"
    stop = threading.Event()
    t = threading.Thread(target=discovery.run, args=(d, str(peers), None, 60.0, stop),
                         daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 10
        while not peers.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert read_peers_file(str(peers)) == ["10.0.0.2:7466", "10.0.0.3:7466"]
        time.sleep(0.3)  # the loop is watching now
        t0 = time.monotonic()
        api.remove("", "pods", "mtcfsd-x-n3", NS)
        while (read_peers_file(str(peers)) != ["10.0.0.2:7466"]
               and time.monotonic() - t0 < 10):
            time.sleep(0.02)
        assert read_peers_file(str(peers)) == ["10.0.0.2:7466"]
        assert time.monotonic() - t0 < 10  # not the 60 s interval
    finally:
        stop.set()
        t.join(timeout=10)


def _kubeconfig(tmp_path: Path, url: str) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": url}}],
        "users": [{"name": "fake", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
    }))
    return str(path)


def _mtcfs(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KUBERNETES_SERVICE_HOST",)}
    return subprocess.run([sys.executable, "-m", "mtcfs", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def test_cli_discover_and_controller_once(api: FakeApiServer, kube: Kube,
                                          tmp_path: Path) -> None:
    _pods(api)
    cfg = _kubeconfig(tmp_path, api.url)
    peers = tmp_path / "peers"
    r = _mtcfs("discover", "--kubeconfig", cfg, "--peers-file", str(peers),
               "--node-name", "n2", "--namespace", NS, "--selector", o.daemon_selector("x"),
               "--node-config", str(tmp_path / "n.toml"), "--once")
    assert r.returncode == 0, r.stderr
    assert read_peers_file(str(peers)) == ["10.0.0.1:7466", "10.0.0.3:7466"]
    assert load_toml(str(tmp_path / "n.toml")) == {"failure_domain": "us-b"}

    create_cpc(kube, "cli")
    r = _mtcfs("controller", "--kubeconfig", cfg, "--namespace", NS, "--image", "img:1",
               "--once")
    assert r.returncode == 0, r.stderr
    d = ds(api, "mtcfsd-cli")
    assert d is not None and container(d, "mtcfsd")["image"] == "img:1"

    r = _mtcfs("discover", "--peers-file", str(peers))
    assert r.returncode == 2 and "--node-name" in r.stderr


def test_hand_made_csidriver_is_left_alone(api: FakeApiServer, ctl: Controller) -> None:
    """A CSIDriver installed by hand (docs/csi.md) is not the controller's to delete."""
    api.put("storage.k8s.io", "csidrivers", {"metadata": {"name": DRIVER_NAME},
                                             "spec": {"attachRequired": False}})
    ctl.reconcile_all()
    assert api.get("storage.k8s.io", "csidrivers", DRIVER_NAME) is not None


# -- least privilege ------------------------------------------------------------------


def test_every_controller_call_is_allowed_by_the_shipped_rbac(
        api: FakeApiServer, kube: Kube, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole life of CPCs (create, roll out, status, conflict event, a
    referenced Secret, delete) plus leader election and the image lookup, with the
    API server refusing what deploy/base/rbac.yaml does not grant the controller."""
    from mtcfs.cli.controller import _default_image

    roles = shipped("ClusterRole", "mtcfs-controller") + shipped("Role", "mtcfs-controller")
    assert roles and all(r["kind"] != "Role" or r["metadata"]["namespace"] == NS
                         for r in roles)
    api.authorize = Rbac(roles)
    api.put("", "nodes", {"metadata": {"name": "n1",
                                       "labels": {"cloud.google.com/gke-nodepool": "pool-a"}}})
    api.put("", "pods", {"metadata": {"name": "ctl-0", "namespace": NS},
                         "spec": {"containers": [{"name": "controller", "image": "img:9"}]}})
    monkeypatch.delenv("MTCFS_IMAGE", raising=False)
    monkeypatch.setenv("POD_NAME", "ctl-0")
    assert _default_image(kube, NS) == "img:9"

    elector = LeaderElector(kube, NS, "mtcfs-controller", "me", lease_duration=3,
                            renew_deadline=2, retry_period=0.5)
    assert elector.try_acquire_or_renew() and elector.try_acquire_or_renew()
    ctl = Controller(kube, NS, "img:9", "me")

    def as_user(fn: Any, *args: Any, **kw: Any) -> Any:
        """What the operator does (kubectl, with its own rights): not checked."""
        check, api.authorize = api.authorize, None
        try:
            return fn(*args, **kw)
        finally:
            api.authorize = check

    as_user(create_cpc, kube, "a")
    time.sleep(1.1)  # creationTimestamp has one-second resolution: "a" is older
    # Same nodeSelector, younger: an event, not rolled out.
    as_user(create_cpc, kube, "a-rival")
    ctl.reconcile_all()
    ds_ready(api, "mtcfsd-a", 1)
    ds_ready(api, "mtcfs-csi-a", 1)
    as_user(kube.merge_patch, CPCS, "a", {"spec": {"replicas": 2}})
    ctl.reconcile_all()
    ds_ready(api, "mtcfsd-a", 1)
    ds_ready(api, "mtcfs-csi-a", 1)
    ctl.reconcile_all()
    assert cond(cpc(api, "a"), "Ready")["status"] == "True"  # type: ignore[arg-type]
    events = api.list("", "events")
    assert [e["reason"] for e in events] == ["NodeSelectorConflict"]
    assert events[0]["metadata"]["namespace"] == NS  # events only in our namespace
    assert api.denied == []

    # A referenced Secret is readable only once its name is added to the Role.
    as_user(create_cpc, kube, "own", nodeSelector={"cloud.google.com/gke-nodepool": "own"},
            peerTokenSecretRef={"name": "own-token", "key": "t"})
    api.put("", "secrets", {"metadata": {"name": "own-token", "namespace": NS},
                            "data": {"t": base64.b64encode(b"y" * 32).decode()}})
    ctl.reconcile_all()
    deg = cond(cpc(api, "own"), "Degraded")  # type: ignore[arg-type]
    assert deg["reason"] == "SecretForbidden" and "resourceNames" in deg["message"]
    assert api.denied == [("get", "", "secrets", NS, "own-token")]
    api.denied.clear()
    for role in roles:
        for rule in role["rules"]:
            if "secrets" in rule["resources"]:
                rule["resourceNames"].append("own-token")
    ctl.reconcile_all()
    assert cond(cpc(api, "own"), "Ready")["reason"] == "NodesNotReady"  # type: ignore[arg-type]

    for name in ("a", "a-rival", "own"):
        as_user(kube.delete, CPCS, name)
    ctl.reconcile_all()
    assert api.list(G, P) == [] and api.list("apps", "daemonsets") == []
    assert api.get("storage.k8s.io", "csidrivers", DRIVER_NAME) is None
    assert tokens(api) == {}
    elector.release()
    assert api.denied == []

    # What the controller did touch, to show the check is not vacuous: every verb
    # of the Roles was used, and nothing outside our namespace but cluster objects.
    used = {(verb, res) for verb, _, res, _, _ in api.calls}
    for want in [("create", "daemonsets"), ("update", "daemonsets"), ("delete", "daemonsets"),
                 ("get", "secrets"), ("patch", "secrets"), ("create", "leases"),
                 ("update", "leases"), ("create", "events"), ("get", "pods"),
                 ("list", "nodes"), ("create", "csidrivers"), ("delete", "csidrivers"),
                 ("patch", "checkpointconfigurations/status"),
                 ("list", "checkpointconfigurations")]:
        assert want in used, want
    assert {ns for _, _, _, ns, _ in api.calls} == {"", NS}


def test_node_pods_calls_are_allowed_by_the_shipped_rbac(api: FakeApiServer,
                                                         kube: Kube) -> None:
    """Discovery (both scopes) and the CSI plugin's pod read, as the static node
    account: ClusterRole mtcfs-node."""
    api.authorize = Rbac(shipped("ClusterRole", "mtcfs-node"))
    _pods(api)
    for jobset, want in ((None, ["n2", "n3"]), (("ml", "llama"), ["n2"])):
        d = discovery.Discovery(kube, "n1", NS, o.daemon_selector("x"), o.PEER_PORT,
                                jobset=jobset)
        assert [p.node for p in d.scan().peers] == want
    from mtcfs.k8s.kube import PODS
    assert kube.get(PODS, "llama-trainer-0-0-abcde", "ml") is not None  # the CSI lookup
    assert api.denied == []
    # And it is least privilege: no writes at all.
    from kubernetes.client.exceptions import ApiException

    from mtcfs.k8s.kube import SECRETS
    with pytest.raises(ApiException) as info:
        kube.get(SECRETS, o.TOKENS_SECRET, NS)
    assert info.value.status == 403
    assert api.denied == [("get", "", "secrets", NS, o.TOKENS_SECRET)]


# -- csiEphemeralLimit and managed-MTC fields -----------------------------------------


@pytest.mark.parametrize(("limit", "want"), [("16Gi", "16Gi"), (16 << 30, str(16 << 30)),
                                             ("0", None), (None, None)])
def test_csi_ephemeral_limit_is_applied(api: FakeApiServer, kube: Kube, ctl: Controller,
                                        limit: Any, want: str | None) -> None:
    extra = {} if limit is None else {"csiEphemeralLimit": limit}
    create_cpc(kube, "lim", **extra)
    ctl.reconcile_all()
    c = ds(api, "mtcfs-csi-lim")
    assert c is not None
    limits = container(c, "csi-plugin")["resources"].get("limits") or {}
    assert limits.get("ephemeral-storage") == want


def test_bad_csi_ephemeral_limit_is_refused(api: FakeApiServer, kube: Kube,
                                            ctl: Controller) -> None:
    create_cpc(kube, "bad", csiEphemeralLimit="lots")
    ctl.reconcile_all()
    deg = cond(cpc(api, "bad"), "Degraded")  # type: ignore[arg-type]
    assert deg["reason"] == "InvalidSpec" and "csiEphemeralLimit 'lots'" in deg["message"]
    assert ds(api, "mtcfs-csi-bad") is None


def test_enable_external_jax_process_ids_is_reported_ignored(api: FakeApiServer, kube: Kube,
                                                             ctl: Controller) -> None:
    create_cpc(kube, "jax", enableExternalJaxProcessIds=True)
    ctl.reconcile_all()
    ready = cond(cpc(api, "jax"), "Ready")  # type: ignore[arg-type]
    assert "ignored (no meaning for mtcfs): enableExternalJaxProcessIds" in ready["message"]
    assert ds(api, "mtcfsd-jax") is not None


# -- the controller's probes and metrics ----------------------------------------------


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_controller_health_and_metrics_ports(api: FakeApiServer, kube: Kube,
                                             tmp_path: Path) -> None:
    import urllib.error
    import urllib.request

    health, metrics = _free_port(), _free_port()
    create_cpc(kube, "probed")
    cfg = _kubeconfig(tmp_path, api.url)
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    api.authorize = lambda call: False  # the API refuses everything at first
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtcfs", "controller", "--kubeconfig", cfg, "--namespace", NS,
         "--image", "img:1", "--identity", "probe-test", "--lease-duration", "3",
         "--health-port", str(health), "--metrics-port", str(metrics),
         "--bind-address", "127.0.0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    def get(port: int, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError:
            return 0, ""

    try:
        # Alive but not ready while the API server does not answer.
        _wait(lambda: get(health, "/healthz")[0] == 200, timeout=30)
        assert get(health, "/readyz") == (503, "the API server has not answered yet\n")
        # Now as deploy/base/rbac.yaml allows: the real loop (watch included).
        with api._cond:  # what the deny-all phase refused is not counted
            api.authorize = Rbac(shipped("ClusterRole", "mtcfs-controller")
                                 + shipped("Role", "mtcfs-controller"))
            api.denied.clear()
        _wait(lambda: get(health, "/readyz")[0] == 200, timeout=30)
        _wait(lambda: ds(api, "mtcfsd-probed") is not None, timeout=30)
        _wait(lambda: 'mtcfs_controller_reconcile_passes_total{result="ok"}'
              in get(metrics, "/metrics")[1], timeout=30)
        body = get(metrics, "/metrics")[1]
        assert "mtcfs_controller_leader 1.0" in body
        assert "process_resident_memory_bytes" in body  # the default collectors
        assert "mtcfs_controller_reconcile_seconds_bucket" in body
        assert get(health, "/nope")[0] == 404
        assert api.denied == [] and ("watch", "mtcfs.dev", "checkpointconfigurations", "",
                                     "") in api.calls
        # The leader cut off from the API: it cannot renew the Lease and exits (the
        # Deployment restarts it as a follower), with one line.
        api.authorize = lambda call: False
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 1, out
    assert out.strip().splitlines()[-1] == "mtcfs: error: lost the leader lease", out
    assert "Traceback" not in out, out


def test_controller_busy_health_port_is_one_line(api: FakeApiServer, tmp_path: Path) -> None:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _mtcfs("controller", "--kubeconfig", _kubeconfig(tmp_path, api.url),
                   "--health-port", str(port), "--bind-address", "127.0.0.1",
                   "--metrics-port", "0")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"mtcfs: error: --health-port {port} on 127.0.0.1: Address already in use"], r.stderr


def test_google_credentials_secret_for_host_network_daemons(api: FakeApiServer, kube: Kube,
                                                            ctl: Controller) -> None:
    """Workload Identity does not reach hostNetwork pods: a credentials Secret is
    mounted into the daemon and named by GOOGLE_APPLICATION_CREDENTIALS."""
    create_cpc(kube, "wi", googleCredentialsSecretRef={"name": "gcs-writer", "key": "sa.json"})
    create_cpc(kube, "plain", nodeSelector={"cloud.google.com/gke-nodepool": "other"})
    ctl.reconcile_all()
    d = ds(api, "mtcfsd-wi")
    assert d is not None
    daemon = container(d, "mtcfsd")
    env = {e["name"]: e.get("value") for e in daemon["env"]}
    assert env["GOOGLE_APPLICATION_CREDENTIALS"] == f"{o.GOOGLE_DIR}/sa.json"
    assert {"name": "google", "mountPath": o.GOOGLE_DIR, "readOnly": True} \
        in daemon["volumeMounts"]
    vols = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
    assert vols["google"]["secret"]["secretName"] == "gcs-writer"
    assert vols["google"]["secret"]["items"] == [{"key": "sa.json", "path": "sa.json"}]
    plain = ds(api, "mtcfsd-plain")
    assert plain is not None
    assert "GOOGLE_APPLICATION_CREDENTIALS" not in {
        e["name"] for e in container(plain, "mtcfsd")["env"]}
    assert "google" not in {v["name"] for v in plain["spec"]["template"]["spec"]["volumes"]}


def test_csidriver_of_an_older_version_is_recreated(api: FakeApiServer, kube: Kube,
                                                    ctl: Controller) -> None:
    """0.1's controller made the CSIDriver with Ephemeral only; its lifecycle modes
    are immutable (the stand-in refuses the update as the API server does), so the
    controller deletes and creates it, with the rights the shipped Roles give."""
    api.put("storage.k8s.io", "csidrivers", {
        "metadata": {"name": DRIVER_NAME, "labels": {
            "app.kubernetes.io/managed-by": o.MANAGED_BY}},
        "spec": {"attachRequired": False, "podInfoOnMount": True,
                 "volumeLifecycleModes": ["Ephemeral"], "fsGroupPolicy": "None"}})
    old_uid = api.get("storage.k8s.io", "csidrivers", DRIVER_NAME)["metadata"]["uid"]  # type: ignore[index]
    create_cpc(kube, "up")
    api.authorize = Rbac(shipped("ClusterRole", "mtcfs-controller")
                         + shipped("Role", "mtcfs-controller"))
    ctl.reconcile_all()
    drv = api.get("storage.k8s.io", "csidrivers", DRIVER_NAME)
    assert drv is not None and drv["metadata"]["uid"] != old_uid
    assert drv["spec"]["volumeLifecycleModes"] == ["Persistent", "Ephemeral"]
    assert ("update", "storage.k8s.io", "csidrivers", "", DRIVER_NAME) in api.calls
    assert ("delete", "storage.k8s.io", "csidrivers", "", DRIVER_NAME) in api.calls
    assert api.denied == []
    assert ds(api, "mtcfsd-up") is not None
