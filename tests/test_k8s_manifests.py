"""Offline checks of everything mtcfs asks a cluster to run: crd/, deploy/
(rendered as kustomize would), deploy/examples/, and the objects the controller
generates, against the Kubernetes schemas shipped in kubernetes-validate; example
and broken CheckpointConfigurations against the CRD's openAPIV3Schema
(jsonschema). No cluster and no kubectl/kustomize binary are involved.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from mtcfs.csi import DRIVER_NAME
from mtcfs.k8s import objects as o

ROOT = Path(__file__).resolve().parent.parent
K8S_VERSION = "1.33.0"  # GKE's regular channel; native sidecars are GA since 1.33
NAMESPACED_CLUSTER_KINDS = {"Namespace", "ClusterRole", "ClusterRoleBinding",
                            "CustomResourceDefinition", "CSIDriver", "CheckpointConfiguration"}
Obj = dict[str, Any]


def load_yaml(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def merge(target: Any, patch: Any) -> Any:
    """JSON merge patch: the overlays here only patch maps and scalars, where
    kustomize's strategic merge gives the same result."""
    if not isinstance(patch, dict) or not isinstance(target, dict):
        return copy.deepcopy(patch)
    out = dict(target)
    for k, v in patch.items():
        out[k] = merge(out.get(k), v) if v is not None else None
        if v is None:
            out.pop(k)
    return out


def render(directory: Path) -> list[Obj]:
    """The subset of kustomize this repository uses: resources (files and
    kustomization directories), namespace, labels, images, patches (by path)."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(k) <= {"apiVersion", "kind", "namespace", "labels", "resources", "images",
                      "patches"}, f"{directory}: a kustomize feature this test does not render"
    objs: list[Obj] = []
    for res in k.get("resources", []):
        path = (directory / res).resolve()
        objs += render(path) if path.is_dir() else load_yaml(path)
    for p in k.get("patches", []):
        patch = yaml.safe_load((directory / p["path"]).read_text())
        hits = [i for i, obj in enumerate(objs)
                if (obj["kind"], obj["metadata"]["name"])
                == (patch["kind"], patch["metadata"]["name"])]
        assert len(hits) == 1, f"patch {p['path']} matches {len(hits)} objects"
        objs[hits[0]] = merge(objs[hits[0]], patch)
    for obj in objs:
        if k.get("namespace") and obj["kind"] not in NAMESPACED_CLUSTER_KINDS:
            obj["metadata"]["namespace"] = k["namespace"]
        for entry in k.get("labels", []):
            obj["metadata"].setdefault("labels", {}).update(entry["pairs"])
        for img in k.get("images", []):
            for c in _containers(obj):
                name, _, _tag = c["image"].partition(":")
                if name == img["name"] or name == img.get("newName"):
                    c["image"] = f"{img.get('newName', name)}:{img.get('newTag', _tag)}"
    return objs


def _containers(obj: Obj) -> list[Obj]:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", []) + spec.get("initContainers", [])


def validate(obj: Obj) -> None:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise AssertionError(f"{obj['kind']} {obj['metadata'].get('name')}: {e.message} "
                             f"at {'.'.join(map(str, e.path))}") from None


def crd_schema() -> Obj:
    (crd,) = load_yaml(ROOT / "crd" / "checkpointconfiguration.yaml")
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def cpc_errors(cpc: Obj) -> list[str]:
    v = jsonschema.Draft7Validator(crd_schema())
    return sorted(f"{'.'.join(map(str, e.path))}: {e.message}" for e in v.iter_errors(cpc))


def examples() -> list[Obj]:
    return load_yaml(ROOT / "deploy" / "examples" / "checkpointconfiguration.yaml")


# -- deploy/ ----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["deploy/base", "deploy/overlays/gke"])
def test_kustomizations_render_to_valid_objects(where: str) -> None:
    objs = render(ROOT / where)
    kinds = {(x["kind"], x["metadata"]["name"]) for x in objs}
    assert {("CustomResourceDefinition", "checkpointconfigurations.mtcfs.dev"),
            ("Namespace", "mtcfs-system"), ("Deployment", "mtcfs-controller"),
            ("ClusterRole", "mtcfs-controller"), ("ServiceAccount", "mtcfs-controller"),
            ("Role", "mtcfs-controller")} <= kinds
    for obj in objs:
        validate(obj)
        if obj["kind"] not in NAMESPACED_CLUSTER_KINDS:
            assert obj["metadata"]["namespace"] == "mtcfs-system"
    ctl = next(x for x in objs if x["kind"] == "Deployment")
    image = ctl["spec"]["template"]["spec"]["containers"][0]["image"]
    c = ctl["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "healthz"}
    assert c["args"][c["args"].index("--health-port") + 1] == str(ports["healthz"])
    assert c["args"][c["args"].index("--metrics-port") + 1] == str(ports["metrics"])
    if where.endswith("gke"):
        spec = ctl["spec"]["template"]["spec"]
        assert ctl["spec"]["replicas"] == 2  # HA through the Lease
        assert image == "us-docker.pkg.dev/PROJECT/mtcfs/mtcfs:0.1.0"
        assert any(x["kind"] == "ResourceQuota" for x in objs)
        anti_rules = spec["affinity"]["podAntiAffinity"]
        (anti,) = anti_rules["requiredDuringSchedulingIgnoredDuringExecution"]
        assert anti["topologyKey"] == "kubernetes.io/hostname"
        assert anti["labelSelector"]["matchLabels"] == ctl["spec"]["selector"]["matchLabels"]
        (pdb,) = [x for x in objs if x["kind"] == "PodDisruptionBudget"]
        assert pdb["spec"]["minAvailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"] == ctl["spec"]["selector"]["matchLabels"]
    else:
        assert image == f"{o.IMAGE_REPOSITORY}:0.1.0"
    for x in objs:
        for c in _containers(x):
            assert_qualified(c["image"])


def assert_qualified(image: str) -> None:
    """A registry host first (a bare name means docker.io/library/...), and never
    :latest (a moving tag)."""
    first = image.split("/")[0]
    assert "/" in image and ("." in first or ":" in first or first == "localhost"), image
    assert not image.split("@")[0].endswith(":latest"), image


def test_rbac_is_least_privilege() -> None:
    """No cluster-wide DaemonSets, Secrets or RBAC objects for the controller;
    Secrets, the Lease and the CSIDriver only by name; events only in our namespace.
    (tests/test_k8s_controller.py runs the controller against these rules.)"""
    objs = render(ROOT / "deploy" / "base")
    roles = {(x["kind"], x["metadata"]["name"]): x for x in objs
             if x["kind"] in ("ClusterRole", "Role")}
    assert set(roles) == {("ClusterRole", "mtcfs-controller"), ("Role", "mtcfs-controller"),
                          ("ClusterRole", "mtcfs-node")}
    cluster = [r for r in roles["ClusterRole", "mtcfs-controller"]["rules"]]
    for r in cluster:
        assert not {"daemonsets", "secrets", "events", "clusterroles", "clusterrolebindings",
                    "roles", "rolebindings", "serviceaccounts"} & set(r["resources"]), r
        if set(r["verbs"]) & {"get", "update", "patch", "delete"} and \
                r["resources"] == ["csidrivers"]:
            assert r["resourceNames"] == [DRIVER_NAME]
    role = roles["Role", "mtcfs-controller"]
    assert role["metadata"]["namespace"] == "mtcfs-system"
    for r in role["rules"]:
        if r["resources"] == ["secrets"]:
            assert r["resourceNames"] == [o.TOKENS_SECRET] and "list" not in r["verbs"]
        if r["resources"] == ["leases"] and r["verbs"] != ["create"]:
            assert r["resourceNames"] == ["mtcfs-controller"]
    node = roles["ClusterRole", "mtcfs-node"]["rules"]
    assert all(set(r["verbs"]) <= {"get", "list", "watch"} for r in node)
    # Bindings: each role to its own account only.
    for b in (x for x in objs if x["kind"] in ("ClusterRoleBinding", "RoleBinding")):
        (subject,) = b["subjects"]
        assert subject["name"] == b["roleRef"]["name"] == b["metadata"]["name"]
    assert ("Secret", o.TOKENS_SECRET) in {(x["kind"], x["metadata"]["name"]) for x in objs}
    assert ("ServiceAccount", o.NODE_ACCOUNT) in {(x["kind"], x["metadata"]["name"])
                                                  for x in objs}


def test_dockerfile_copies_what_exists() -> None:
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    for line in text.splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src
    assert "fuse3" in text and 'ENTRYPOINT ["mtcfs"]' in text


# -- what the controller generates ------------------------------------------------------


@pytest.mark.parametrize("cpc", examples(), ids=lambda c: c["metadata"]["name"])
def test_generated_objects_are_valid(cpc: Obj) -> None:
    cpc = copy.deepcopy(cpc)
    cpc["metadata"]["uid"] = "0b9f0a5e-0000-4000-8000-000000000001"
    s = o.settings_from(cpc, "mtcfs:test")
    objs = [obj for _, obj in o.desired(s, "mtcfs-system", cpc, [o.owner_ref(cpc, False)])]
    for obj in objs:
        validate(obj)
        for c in _containers(obj):
            if c["image"] != "mtcfs:test":
                assert_qualified(c["image"])
                assert "@sha256:" in c["image"], c["image"]  # the sidecars: pinned
    kinds = sorted(x["kind"] for x in objs)
    assert kinds == ["CSIDriver", "DaemonSet", "DaemonSet"]  # no RBAC objects
    # The optional fields' objects are valid too.
    cpc["spec"].update(googleCredentialsSecretRef={"name": "gcs-writer"},
                       csiEphemeralLimit="8Gi")
    assert cpc_errors({k: v for k, v in cpc.items() if k != "metadata"} | {
        "metadata": {"name": cpc["metadata"]["name"]}}) == []
    s = o.settings_from(cpc, "mtcfs:test")
    for _, obj in o.desired(s, "mtcfs-system", cpc, [o.owner_ref(cpc, False)]):
        validate(obj)
    assert o.DEFAULT_IMAGE.startswith(o.IMAGE_REPOSITORY)
    assert_qualified(o.DEFAULT_IMAGE)


# -- the CRD and CheckpointConfigurations -----------------------------------------------


def test_crd_is_a_valid_crd() -> None:
    (crd,) = load_yaml(ROOT / "crd" / "checkpointconfiguration.yaml")
    validate(crd)
    jsonschema.Draft7Validator.check_schema(crd_schema())
    v = crd["spec"]["versions"][0]
    assert crd["spec"]["scope"] == "Cluster" and v["subresources"] == {"status": {}}


@pytest.mark.parametrize("cpc", examples(), ids=lambda c: c["metadata"]["name"])
def test_example_cpcs_are_valid(cpc: Obj) -> None:
    assert cpc_errors(cpc) == []
    o.settings_from({**cpc, "metadata": {**cpc["metadata"], "uid": "u"}}, "x")  # no SpecError


MANAGED_MTC_DRIVER = "multitier-checkpoint.csi.storage.gke.io"


def from_managed_mtc(obj: Obj) -> Obj:
    """The two edits docs/gke.md ("Coming from the managed MTC") asks for, done on
    the YAML text as a user would with sed: the CPC's apiVersion, the JobSets'
    CSI driver name."""
    text = yaml.safe_dump(obj)
    text = text.replace("apiVersion: checkpointing.gke.io/v1", "apiVersion: mtcfs.dev/v1")
    text = text.replace(f"driver: {MANAGED_MTC_DRIVER}", f"driver: {DRIVER_NAME}")
    return yaml.safe_load(text)


def test_managed_mtc_cpc_is_accepted() -> None:
    """A CPC written for GKE's managed MTC (checkpointing.gke.io/v1: csiEphemeralLimit
    a string quantity, enableExternalJaxProcessIds), after the apiVersion edit."""
    managed = {
        "apiVersion": "checkpointing.gke.io/v1", "kind": "CheckpointConfiguration",
        "metadata": {"name": "my-checkpointconfiguration"},
        "spec": {
            "cloudStorageBucketName": "my-bucket",
            "nodeSelector": {"node.kubernetes.io/instance-type": "a3-highgpu-8g"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                             "effect": "NoSchedule"}],
            "inMemoryVolumeSize": "50Gi",
            "gcsFuseMountOptions": ["implicit-dirs", "metadata-cache:negative-ttl-secs:0",
                                    "metadata-cache:ttl-secs:-1",
                                    "metadata-cache:stat-cache-max-size-mb:-1",
                                    "metadata-cache:type-cache-max-size-mb:-1"],
            "csiEphemeralLimit": "16Gi",
            "enableExternalJaxProcessIds": True,
        },
    }
    cpc = from_managed_mtc(managed)
    assert cpc["apiVersion"] == "mtcfs.dev/v1"
    assert cpc_errors(cpc) == []
    s = o.settings_from({**cpc, "metadata": {**cpc["metadata"], "uid": "u"}}, "x")
    assert s.list_refresh == 3600.0 and s.bucket == "gs://my-bucket"
    assert s.csi_ephemeral_limit == "16Gi" and s.ignored_fields == ["enableExternalJaxProcessIds"]
    csi = o.csi_daemon_set(s, "mtcfs-system", [])
    validate(csi)
    plugin = csi["spec"]["template"]["spec"]["containers"][0]
    assert plugin["resources"]["limits"] == {"ephemeral-storage": "16Gi"}


def test_managed_mtc_jobset_works_after_the_driver_edit() -> None:
    """A JobSet written for the managed MTC: an inline volume of its driver with no
    attributes. After the edit it is a valid mtcfs volume (the job comes from the
    pod's JobSet label)."""
    (js,) = load_yaml(ROOT / "deploy" / "examples" / "jobset-maxtext-orbax.yaml")
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (vol,) = [v for v in pod["volumes"] if "csi" in v]
    vol["csi"] = {"driver": MANAGED_MTC_DRIVER}
    converted = from_managed_mtc(js)
    pod = converted["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (vol,) = [v for v in pod["volumes"] if "csi" in v]
    assert vol["csi"] == {"driver": DRIVER_NAME}
    gke = (ROOT / "docs" / "gke.md").read_text()
    assert MANAGED_MTC_DRIVER in gke and "checkpointing.gke.io/v1" in gke


def test_monitoring_examples_select_what_serves_metrics() -> None:
    """PodMonitoring (GMP) and ServiceMonitor (Prometheus Operator) have no schema
    here: check that they select the pods and name the ports that serve /metrics."""
    cpc = copy.deepcopy(examples()[0])
    cpc["metadata"]["uid"] = "u"
    s = o.settings_from(cpc, "x")
    daemon_pod = o.daemon_set(s, "mtcfs-system", [])["spec"]["template"]
    ctl = next(x for x in render(ROOT / "deploy" / "base") if x["kind"] == "Deployment")
    serving = {}
    for pod in (daemon_pod, ctl["spec"]["template"]):
        ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        serving[pod["metadata"]["labels"]["app.kubernetes.io/name"]] = ports
    gmp = load_yaml(ROOT / "deploy" / "examples" / "monitoring-gmp.yaml")
    sm = load_yaml(ROOT / "deploy" / "examples" / "monitoring-servicemonitor.yaml")
    monitors = [x for x in gmp + sm if x["kind"] in ("PodMonitoring", "ServiceMonitor")]
    assert {x["kind"] for x in monitors} == {"PodMonitoring", "ServiceMonitor"}
    services = {x["metadata"]["labels"]["app.kubernetes.io/name"]: x for x in sm
                if x["kind"] == "Service"}
    for m in monitors:
        app = m["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
        (ep,) = m["spec"]["endpoints"]
        if m["kind"] == "PodMonitoring":
            assert ep["port"] in serving[app], (app, ep)
        else:
            svc = services[app]
            validate(svc)
            assert svc["spec"]["selector"] == {"app.kubernetes.io/name": app}
            (port,) = svc["spec"]["ports"]
            assert port["name"] == ep["port"] and port["targetPort"] in serving[app]


def _broken(**change: Any) -> Obj:
    cpc = copy.deepcopy(examples()[0])
    for key, value in change.items():
        if value is None:
            cpc["spec"].pop(key)
        else:
            cpc["spec"][key] = value
    return cpc


@pytest.mark.parametrize(("cpc", "error"), [
    (_broken(cloudStorageBucketName=None), "'cloudStorageBucketName' is a required property"),
    (_broken(cloudStorageBucketName="gs://bucket"), "does not match"),
    (_broken(inMemoryVolumeSize="64GB"), "does not match"),
    (_broken(nodeSelector={}), "should be non-empty"),
    (_broken(replicas=-1), "less than the minimum"),
    (_broken(replicas="2"), "is not of type 'integer'"),
    (_broken(persistPolicy="sometimes"), "does not match"),
    (_broken(persistPolicy="interval:0"), "does not match"),
    (_broken(fsync="never"), "is not one of"),
    (_broken(dataPath="direct"), "is not one of"),
    (_broken(keepSteps=0), "less than the minimum"),
    (_broken(tolerations=[{"operator": "Maybe"}]), "is not one of"),
    (_broken(peerTokenSecretRef={"key": "t"}), "'name' is a required property"),
    (_broken(csiEphemeralLimit=-1), "is not valid under any of the given schemas"),
    (_broken(csiEphemeralLimit="16GB"), "is not valid under any of the given schemas"),
    (_broken(replica=2), "Additional properties are not allowed ('replica'"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_broken_cpcs_are_rejected(cpc: Obj, error: str) -> None:
    errors = cpc_errors(cpc)
    assert any(error in e for e in errors), errors


# -- the example JobSets ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["jobset-pytorch-dcp.yaml", "jobset-maxtext-orbax.yaml"])
def test_example_jobsets(name: str) -> None:
    (js,) = load_yaml(ROOT / "deploy" / "examples" / name)
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    for rj in js["spec"]["replicatedJobs"]:
        # JobSet has no schema here; its Job template is a batch/v1 Job spec.
        validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": rj["name"]},
                  "spec": rj["template"]["spec"]})
        pod = rj["template"]["spec"]["template"]["spec"]
        (vol,) = [v for v in pod["volumes"] if "csi" in v]
        assert vol["csi"]["driver"] == DRIVER_NAME
        assert vol["csi"]["volumeAttributes"]["job"] == js["metadata"]["name"]
        mounts = [m for c in pod["containers"] for m in c["volumeMounts"]
                  if m["name"] == vol["name"]]
        assert mounts and all(m["mountPropagation"] == "HostToContainer" for m in mounts)
        # Its nodes are those of an example CPC.
        pools = {c["spec"]["nodeSelector"]["cloud.google.com/gke-nodepool"] for c in examples()}
        assert pod["nodeSelector"]["cloud.google.com/gke-nodepool"] in pools
