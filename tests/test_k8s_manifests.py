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
    if where.endswith("gke"):
        assert ctl["spec"]["replicas"] == 2  # HA through the Lease
        assert image == "us-docker.pkg.dev/PROJECT/mtcfs/mtcfs:0.1.0"
        assert any(x["kind"] == "ResourceQuota" for x in objs)
    else:
        assert image == "mtcfs:0.1.0"


def test_controller_rbac_covers_what_it_does() -> None:
    rules = [r for x in render(ROOT / "deploy" / "base") if x["kind"] in ("ClusterRole", "Role")
             for r in x["rules"]]

    def allowed(group: str, resource: str, verb: str) -> bool:
        return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]
                   for r in rules)

    for group, resource, verbs in [
        ("mtcfs.dev", "checkpointconfigurations", ["list", "watch", "patch"]),
        ("mtcfs.dev", "checkpointconfigurations/status", ["patch"]),
        ("mtcfs.dev", "checkpointconfigurations/finalizers", ["update"]),
        ("apps", "daemonsets", ["get", "create", "update", "delete"]),
        ("storage.k8s.io", "csidrivers", ["get", "create", "update", "delete"]),
        ("rbac.authorization.k8s.io", "clusterroles", ["create", "update", "delete"]),
        ("rbac.authorization.k8s.io", "clusterrolebindings", ["create", "update", "delete"]),
        ("", "secrets", ["get", "create", "delete"]),
        ("", "serviceaccounts", ["get", "create", "update", "delete"]),
        ("coordination.k8s.io", "leases", ["get", "create", "update"]),
        ("", "events", ["create"]),
        # Granted on to the node pods, so held by the controller too.
        ("", "pods", ["get", "list", "watch"]),
        ("", "nodes", ["get", "list", "watch"]),
    ]:
        for verb in verbs:
            assert allowed(group, resource, verb), (group, resource, verb)


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
    objs.append(o.token_secret(s, "mtcfs-system", [o.owner_ref(cpc)]))
    for obj in objs:
        validate(obj)
    kinds = sorted(x["kind"] for x in objs)
    assert kinds == ["CSIDriver", "ClusterRole", "ClusterRoleBinding", "DaemonSet",
                     "DaemonSet", "Secret", "ServiceAccount"]


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


def test_managed_mtc_cpc_is_accepted() -> None:
    """A CPC written for GKE's managed MTC, only the apiVersion changed."""
    cpc = {
        "apiVersion": "mtcfs.dev/v1", "kind": "CheckpointConfiguration",
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
            "csiEphemeralLimit": 16,
        },
    }
    assert cpc_errors(cpc) == []
    s = o.settings_from({**cpc, "metadata": {**cpc["metadata"], "uid": "u"}}, "x")
    assert s.list_refresh == 3600.0 and s.bucket == "gs://my-bucket"


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
    (_broken(csiEphemeralLimit=-1), "less than the minimum"),
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
