"""A dict-in, dict-out layer over the official client's ApiClient.

The controller builds whole manifests as plain dicts (the same dicts the tests
validate offline with kubernetes-validate), so it talks to the API with dicts
too: the generated typed methods would round-trip every object through their
models. Authentication, TLS and the server address stay the client's
(`kubernetes.config`), and errors are its `ApiException`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

Obj = dict[str, Any]


@dataclass(frozen=True)
class Resource:
    group: str  # "" for the core API
    version: str
    plural: str
    kind: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str | None = None, sub: str = "") -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
            if sub:
                base += f"/{sub}"
        return base


PODS = Resource("", "v1", "pods", "Pod", True)
NODES = Resource("", "v1", "nodes", "Node", False)
SECRETS = Resource("", "v1", "secrets", "Secret", True)
SERVICE_ACCOUNTS = Resource("", "v1", "serviceaccounts", "ServiceAccount", True)
EVENTS = Resource("", "v1", "events", "Event", True)
DAEMON_SETS = Resource("apps", "v1", "daemonsets", "DaemonSet", True)
CSI_DRIVERS = Resource("storage.k8s.io", "v1", "csidrivers", "CSIDriver", False)
CLUSTER_ROLES = Resource("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", False)
CLUSTER_ROLE_BINDINGS = Resource(
    "rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", False
)
LEASES = Resource("coordination.k8s.io", "v1", "leases", "Lease", True)


def is_status(e: BaseException, *codes: int) -> bool:
    return isinstance(e, ApiException) and e.status in codes


def load_config(kubeconfig: str | None = None) -> client.ApiClient:
    """In a pod: the service account; elsewhere: ~/.kube/config (or KUBECONFIG)."""
    cfg = client.Configuration()
    if kubeconfig is None:
        try:
            config.load_incluster_config(client_configuration=cfg)
            return client.ApiClient(cfg)
        except config.ConfigException:
            pass
    config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    return client.ApiClient(cfg)


def api_client_for(host: str) -> client.ApiClient:
    """An unauthenticated client for `host` (tests, benchmarks: an in-memory API)."""
    cfg = client.Configuration()
    cfg.host = host
    return client.ApiClient(cfg)


class Kube:
    """get/list/create/replace/merge-patch/delete/watch on any resource, with dicts."""

    def __init__(self, api: client.ApiClient, timeout: float = 30.0) -> None:
        self.api = api
        self.timeout = timeout

    def request(
        self,
        method: str,
        path: str,
        query: dict[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Obj:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        params = [(k, v) for k, v in (query or {}).items() if v is not None]
        req = self.api.param_serialize(
            method, path, query_params=params, header_params=headers, body=body,
            auth_settings=["BearerToken"],
        )
        resp = self.api.call_api(*req, _request_timeout=self.timeout)
        data = resp.read()
        if not 200 <= resp.status <= 299:
            raise ApiException.from_response(http_resp=resp, body=data.decode(errors="replace"),
                                             data=None)
        return json.loads(data) if data else {}

    def get(self, res: Resource, name: str, namespace: str | None = None) -> Obj | None:
        try:
            return self.request("GET", res.path(namespace, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def list(
        self,
        res: Resource,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        cached: bool = False,
    ) -> list[Obj]:
        """`cached`: resourceVersion=0, served from the API server's watch cache
        (cheap, possibly a little stale): for pollers on every node."""
        out = self.request(
            "GET", res.path(namespace),
            {"labelSelector": label_selector, "fieldSelector": field_selector,
             "resourceVersion": "0" if cached else None},
        )
        return list(out.get("items") or [])

    def create(self, res: Resource, obj: Obj) -> Obj:
        return self.request("POST", res.path(obj["metadata"].get("namespace")), body=obj)

    def replace(self, res: Resource, obj: Obj, sub: str = "") -> Obj:
        """PUT; carries metadata.resourceVersion, so a concurrent change is a 409."""
        meta = obj["metadata"]
        return self.request("PUT", res.path(meta.get("namespace"), meta["name"], sub), body=obj)

    def merge_patch(
        self, res: Resource, name: str, patch: Obj, namespace: str | None = None, sub: str = ""
    ) -> Obj:
        return self.request(
            "PATCH", res.path(namespace, name, sub), body=patch,
            content_type="application/merge-patch+json",
        )

    def delete(self, res: Resource, name: str, namespace: str | None = None) -> bool:
        """False when it was already gone."""
        try:
            self.request("DELETE", res.path(namespace, name),
                         body={"propagationPolicy": "Background"})
            return True
        except ApiException as e:
            if e.status == 404:
                return False
            raise

    def watch(
        self, res: Resource, resource_version: str | None, timeout: int,
        namespace: str | None = None, label_selector: str | None = None,
    ) -> Iterator[tuple[str, Obj]]:
        """One watch request: (type, object) until the server closes it after `timeout` s."""
        from urllib.parse import quote

        from kubernetes import watch  # the client's own stream decoder

        path = res.path(namespace) + "?" + "&".join(
            f"{k}={quote(str(v), safe='')}" for k, v in {
                "watch": "true", "timeoutSeconds": timeout,
                "resourceVersion": resource_version, "allowWatchBookmarks": "true",
                "labelSelector": label_selector,
            }.items() if v is not None
        )
        headers = {"Accept": "application/json"}
        req = self.api.param_serialize("GET", path, header_params=headers,
                                       auth_settings=["BearerToken"])
        resp = self.api.call_api(*req, _request_timeout=(self.timeout, timeout + 5))
        try:
            if resp.status != 200:
                data = resp.read()
                raise ApiException.from_response(http_resp=resp, body=data.decode(), data=None)
            for line in watch.watch.iter_resp_lines(resp.response):
                if not line:
                    continue
                ev = json.loads(line)
                yield ev["type"], ev["object"]
        finally:
            resp.response.release_conn()
