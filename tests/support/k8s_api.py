"""An in-memory Kubernetes API server for the controller tests and benchmark.

NO REAL API SERVER RUNS HERE. This is a small HTTP server on 127.0.0.1 that
speaks enough of the Kubernetes REST API for the official Python client:
get/list (labelSelector, fieldSelector spec.nodeName/metadata.name), create
(generateName, 409 on a duplicate), replace (PUT, 409 on a stale
metadata.resourceVersion), JSON merge patch (RFC 7386, conditional on a
resourceVersion in the patch), the status subresource (the main resource
ignores status changes, /status only changes status), metadata.generation
(bumped when anything but metadata/status changes), deletion with finalizers
(deletionTimestamp first, removal when the last finalizer goes), and watch
(newline-delimited events after a resourceVersion, closed after
timeoutSeconds), and the immutability of the CSIDriver fields that are
immutable in Kubernetes (422). There is no admission, no defaulting, no garbage collector
and no workload controllers: a test that wants a DaemonSet's status sets it.

Authorization is off unless a test sets `authorize` (Rbac below evaluates
Roles/ClusterRoles the way the RBAC authorizer does: verb, apiGroup,
resource[/subresource], resourceNames, namespace); every request's
(verb, group, resource, namespace, name) is recorded in `calls`.

Why not kmock (PyPI): its emulator merges PUT bodies instead of replacing,
ignores label selectors and resourceVersions (so no optimistic concurrency
for the Lease), and its pytest plugin needs pytest-asyncio.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import json
import re
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

Obj = dict[str, Any]
# (verb, api group, resource or resource/subresource, namespace, name)
Call = tuple[str, str, str, str, str]

# Spec fields the real API server refuses to change (422 Invalid on update).
IMMUTABLE: dict[tuple[str, str], tuple[str, ...]] = {
    ("storage.k8s.io", "csidrivers"): ("attachRequired", "volumeLifecycleModes",
                                       "fsGroupPolicy"),
}

# (group, plural) -> (kind, namespaced, has a status subresource)
RESOURCES: dict[tuple[str, str], tuple[str, bool, bool]] = {
    ("", "pods"): ("Pod", True, True),
    ("", "nodes"): ("Node", False, True),
    ("", "namespaces"): ("Namespace", False, True),
    ("", "secrets"): ("Secret", True, False),
    ("", "serviceaccounts"): ("ServiceAccount", True, False),
    ("", "configmaps"): ("ConfigMap", True, False),
    ("", "events"): ("Event", True, False),
    ("apps", "daemonsets"): ("DaemonSet", True, True),
    ("apps", "deployments"): ("Deployment", True, True),
    ("storage.k8s.io", "csidrivers"): ("CSIDriver", False, False),
    ("rbac.authorization.k8s.io", "clusterroles"): ("ClusterRole", False, False),
    ("rbac.authorization.k8s.io", "clusterrolebindings"): ("ClusterRoleBinding", False, False),
    ("coordination.k8s.io", "leases"): ("Lease", True, False),
    ("mtcfs.dev", "checkpointconfigurations"): ("CheckpointConfiguration", False, True),
}

_PATH = re.compile(
    r"^/(?:api/(?P<cv>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
    r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$"
)


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def _label_match(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _field_match(obj: Obj, selector: str) -> bool:
    for term in filter(None, selector.split(",")):
        k, v = term.split("=", 1)
        cur: Any = obj
        for part in k.split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        if str(cur) != v:
            return False
    return True


class FakeApiServer:
    """The store and the HTTP front end; `url` is what the client's host is set to."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str, str], Obj] = {}  # (group, plural, ns, name)
        self.log: list[tuple[int, str, str, Obj]] = []  # (rv, type, group/plural, object)
        self.requests = 0
        self.calls: list[Call] = []
        self.denied: list[Call] = []
        self.authorize: Any = None  # Callable[[Call], bool] | None
        self._rv = itertools.count(1)
        self._cond = threading.Condition()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def start(self) -> FakeApiServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    # -- direct access for tests (what a kubelet or a workload controller would do) --

    def put(self, group: str, plural: str, obj: Obj) -> Obj:
        """Create or overwrite an object as the system would (no checks)."""
        with self._cond:
            meta = obj.setdefault("metadata", {})
            key = (group, plural, meta.get("namespace", ""), meta["name"])
            old = self.objects.get(key)
            meta.setdefault("uid", (old or {}).get("metadata", {}).get("uid", str(uuid.uuid4())))
            meta.setdefault("creationTimestamp", _now())
            meta.setdefault("generation", 1)
            self._store(key, obj, "MODIFIED" if old else "ADDED")
            return copy.deepcopy(obj)

    def get(self, group: str, plural: str, name: str, ns: str = "") -> Obj | None:
        with self._cond:
            obj = self.objects.get((group, plural, ns, name))
            return copy.deepcopy(obj) if obj else None

    def list(self, group: str, plural: str) -> list[Obj]:
        with self._cond:
            return [copy.deepcopy(o) for (g, p, _, _), o in sorted(self.objects.items())
                    if (g, p) == (group, plural)]

    def remove(self, group: str, plural: str, name: str, ns: str = "") -> None:
        """Delete an object as the system would (the kubelet, the node controller):
        no checks, finalizers honoured as a DELETE would."""
        with self._cond:
            key = (group, plural, ns, name)
            self._delete(key, self.objects[key])

    def set_status(self, group: str, plural: str, name: str, ns: str, status: Obj) -> None:
        with self._cond:
            obj = self.objects[(group, plural, ns, name)]
            obj["status"] = status
            self._store((group, plural, ns, name), obj, "MODIFIED")

    # -- the store -------------------------------------------------------------------

    def _store(self, key: tuple[str, str, str, str], obj: Obj, event: str) -> None:
        rv = next(self._rv)
        obj["metadata"]["resourceVersion"] = str(rv)
        if event == "DELETED":
            self.objects.pop(key, None)
        else:
            self.objects[key] = obj
        self.log.append((rv, event, f"{key[0]}/{key[1]}", copy.deepcopy(obj)))
        self._cond.notify_all()

    def handle(self, method: str, path: str, query: dict[str, str], body: Any,
               content_type: str) -> tuple[int, Obj] | Iterator[Obj]:
        m = _PATH.match(path)
        if not m:
            raise ApiError(404, "NotFound", f"no such path {path}")
        group = m.group("group") or ""
        plural, ns, name, sub = m.group("plural"), m.group("ns") or "", m.group("name"), m.group(
            "sub") or ""
        if (group, plural) not in RESOURCES:
            raise ApiError(404, "NotFound", f"the server could not find resource {plural}")
        kind, namespaced, has_status = RESOURCES[(group, plural)]
        if not namespaced:
            ns = ""
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch",
                "DELETE": "delete"}.get(method, "get")
        if method == "GET" and name is None:
            verb = "watch" if query.get("watch") in ("true", "1") else "list"
        call = (verb, group, f"{plural}/{sub}" if sub else plural, ns, name or "")
        with self._cond:
            self.calls.append(call)
            if self.authorize is not None and not self.authorize(call):
                self.denied.append(call)
                raise ApiError(403, "Forbidden", f"{verb} {plural} {name or ''} in "
                               f"namespace {ns!r} is forbidden")
        with self._cond:
            self.requests += 1
            if method == "GET" and name is None:
                if query.get("watch") in ("true", "1"):
                    return self._watch(group, plural, ns, query)
                items = [copy.deepcopy(o) for (g, p, n, _), o in sorted(self.objects.items())
                         if (g, p) == (group, plural) and (not ns or n == ns)
                         and _label_match(o["metadata"].get("labels") or {},
                                          query.get("labelSelector", ""))
                         and _field_match(o, query.get("fieldSelector", ""))]
                rv = str(self.log[-1][0]) if self.log else "0"
                return 200, {"kind": f"{kind}List", "apiVersion": "v1",
                             "metadata": {"resourceVersion": rv}, "items": items}
            if method == "POST" and name is None:
                return 201, self._create(group, plural, ns, kind, body)
            key = (group, plural, ns, name or "")
            cur = self.objects.get(key)
            if cur is None:
                raise ApiError(404, "NotFound", f'{plural} "{name}" not found')
            if method == "GET":
                return 200, copy.deepcopy(cur)
            if method == "DELETE":
                return 200, self._delete(key, cur)
            if method == "PUT":
                new = copy.deepcopy(body)
            elif method == "PATCH":
                if "json-patch" in content_type:
                    raise ApiError(415, "UnsupportedMediaType", "only merge patches here")
                new = merge_patch(cur, body)
            else:
                raise ApiError(405, "MethodNotAllowed", method)
            want_rv = (new.get("metadata") or {}).get("resourceVersion")
            if method == "PATCH":
                want_rv = ((body or {}).get("metadata") or {}).get("resourceVersion")
            if want_rv and want_rv != cur["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {plural} '
                               f'"{name}": the object has been modified')
            return 200, self._update(key, cur, new, sub, has_status)

    def _create(self, group: str, plural: str, ns: str, kind: str, body: Obj) -> Obj:
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, "Invalid", "metadata.name is required")
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if ns:
            meta["namespace"] = ns
        key = (group, plural, ns, meta["name"])
        if key in self.objects:
            raise ApiError(409, "AlreadyExists", f'{plural} "{meta["name"]}" already exists')
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        obj.setdefault("kind", kind)
        self._store(key, obj, "ADDED")
        return copy.deepcopy(obj)

    def _update(self, key: tuple[str, str, str, str], cur: Obj, new: Obj, sub: str,
                has_status: bool) -> Obj:
        if sub == "status":
            obj = copy.deepcopy(cur)
            obj["status"] = new.get("status")
        else:
            obj = new
            for f in IMMUTABLE.get(key[:2], ()):
                if (new.get("spec") or {}).get(f) != (cur.get("spec") or {}).get(f):
                    raise ApiError(422, "Invalid", f"spec.{f}: field is immutable")
            if has_status:
                obj["status"] = copy.deepcopy(cur.get("status"))
            meta = obj.setdefault("metadata", {})
            for k in ("uid", "creationTimestamp", "deletionTimestamp", "generation"):
                if k in cur["metadata"]:
                    meta[k] = cur["metadata"][k]
            if meta.get("deletionTimestamp") and not cur["metadata"].get("deletionTimestamp"):
                meta.pop("deletionTimestamp")
            body_new = {k: v for k, v in obj.items() if k not in ("metadata", "status")}
            body_old = {k: v for k, v in cur.items() if k not in ("metadata", "status")}
            if body_new != body_old:
                meta["generation"] = cur["metadata"].get("generation", 1) + 1
        if obj.get("status") is None:
            obj.pop("status", None)
        if obj["metadata"].get("deletionTimestamp") and not obj["metadata"].get("finalizers"):
            self._store(key, obj, "DELETED")
        else:
            self._store(key, obj, "MODIFIED")
        return copy.deepcopy(obj)

    def _delete(self, key: tuple[str, str, str, str], cur: Obj) -> Obj:
        if cur["metadata"].get("finalizers"):
            if not cur["metadata"].get("deletionTimestamp"):
                obj = copy.deepcopy(cur)
                obj["metadata"]["deletionTimestamp"] = _now()
                self._store(key, obj, "MODIFIED")
                return copy.deepcopy(obj)
            return copy.deepcopy(cur)
        self._store(key, copy.deepcopy(cur), "DELETED")
        return copy.deepcopy(cur)

    def _watch(self, group: str, plural: str, ns: str, query: dict[str, str]) -> Iterator[Obj]:
        since = int(query.get("resourceVersion") or 0)
        deadline = time.monotonic() + min(float(query.get("timeoutSeconds") or 5), 5.0)
        gp = f"{group}/{plural}"

        def events() -> Iterator[Obj]:
            pos = since
            while time.monotonic() < deadline:
                with self._cond:
                    new = [(rv, t, o) for rv, t, g, o in self.log
                           if rv > pos and g == gp and (not ns or o["metadata"].get(
                               "namespace") == ns)]
                    if not new:
                        self._cond.wait(max(0.0, deadline - time.monotonic()))
                        continue
                for rv, t, o in new:
                    pos = rv
                    yield {"type": t, "object": o}

        return events()

    # -- HTTP --------------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # else 40 ms delayed ACKs per request

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _serve(self) -> None:
                url = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw else None
                try:
                    out = server.handle(self.command, url.path, query, body,
                                        self.headers.get("Content-Type", ""))
                except ApiError as e:
                    self._send(e.code, {"kind": "Status", "apiVersion": "v1", "metadata": {},
                                        "status": "Failure", "message": e.message,
                                        "reason": e.reason, "code": e.code})
                    return
                if isinstance(out, tuple):
                    self._send(*out)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    for ev in out:
                        line = json.dumps(ev).encode() + b"\n"
                        self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except OSError:  # the watcher hung up (it had seen what it wanted)
                    self.close_connection = True

            def _send(self, code: int, obj: Obj) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

        return Handler


class Rbac:
    """Allows a call when one rule of the given Roles (in their namespace) or
    ClusterRoles (anywhere) matches it. As in Kubernetes, a rule with
    resourceNames never matches create, list or watch (they name no object)."""

    def __init__(self, roles: list[Obj]) -> None:
        self.roles = roles

    def __call__(self, call: Call) -> bool:
        verb, group, resource, ns, name = call
        for role in self.roles:
            if role["kind"] == "Role" and role["metadata"].get("namespace") != ns:
                continue
            for rule in role.get("rules") or []:
                names = rule.get("resourceNames")
                if (group in rule.get("apiGroups", []) and resource in rule.get("resources", [])
                        and (verb in rule.get("verbs", []) or "*" in rule.get("verbs", []))
                        and (not names or (name and name in names))):
                    return True
        return False


@contextmanager
def fake_api() -> Iterator[FakeApiServer]:
    srv = FakeApiServer().start()
    try:
        yield srv
    finally:
        srv.stop()


RBAC_YAML = Path(__file__).resolve().parents[2] / "deploy" / "base" / "rbac.yaml"


def shipped(kind: str, name: str | None = None) -> list[dict[str, Any]]:
    """Objects of deploy/base/rbac.yaml (namespaced ones are in mtcfs-system there)."""
    return [d for d in yaml.safe_load_all(RBAC_YAML.read_text())
            if d and d["kind"] == kind and name in (None, d["metadata"]["name"])]
