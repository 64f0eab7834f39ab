"""The CheckpointConfiguration controller (`mtcfs controller`).

One pass (`reconcile_all`) reads every CPC and makes the cluster match it:
the CSIDriver, the node-daemon and CSI DaemonSets, the CPC's key in the
peer-token Secret; then writes the CPC's status (conditions Ready and Degraded,
observedGeneration). Unlike the managed MTC, a changed CPC is rolled out: an
object is replaced (with its resourceVersion, so a concurrent writer is a 409
and a retry) when the hash of what we want differs from the one recorded on
it. The node daemon's DaemonSet is OnDelete, so a new template reaches a node
when its daemon pod is deleted (docs/gke.md, "Upgrades").

The loop (`run`) does a pass, then watches CPCs until one changes or the
resync period ends, and again; only the leader (leader.py) runs it.

Least privilege (deploy/base/rbac.yaml): every call here is one the shipped
Roles allow, and tests/test_k8s_controller.py checks each call the controller
makes against them. Namespaced objects are only touched in `namespace`; the
Secrets only by name; no RBAC objects are made (the node pods' ServiceAccount
and ClusterRole are static).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable

from kubernetes.client.exceptions import ApiException

from mtcfs.csi import DRIVER_NAME
from mtcfs.k8s import CPC_KIND, CPC_PLURAL, GROUP, VERSION
from mtcfs.k8s import objects as o
from mtcfs.k8s.health import NO_MONITOR, PassMonitor
from mtcfs.k8s.kube import CSI_DRIVERS, DAEMON_SETS, EVENTS, NODES, SECRETS, Kube, Obj, Resource

log = logging.getLogger("mtcfs.controller")

CPCS = Resource(GROUP, VERSION, CPC_PLURAL, CPC_KIND, False)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _created(cpc: Obj) -> tuple[str, str]:
    meta = cpc["metadata"]
    return meta.get("creationTimestamp") or "", meta["name"]


def _selector(cpc: Obj) -> dict[str, str]:
    return (cpc.get("spec") or {}).get("nodeSelector") or {}


class Controller:
    def __init__(
        self,
        kube: Kube,
        namespace: str = o.DEFAULT_NAMESPACE,
        default_image: str = o.DEFAULT_IMAGE,
        identity: str = "mtcfs-controller",
        monitor: PassMonitor = NO_MONITOR,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.default_image = default_image
        self.identity = identity
        self.monitor = monitor

    # -- one pass ------------------------------------------------------------

    def reconcile_all(self) -> str:
        """Reconcile every CPC; returns the list's resourceVersion (to watch from)."""
        listing = self.kube.request("GET", CPCS.path())
        cpcs = list(listing.get("items") or [])
        nodes = self.kube.list(NODES)
        live = [c for c in cpcs if not c["metadata"].get("deletionTimestamp")]
        for cpc in sorted(cpcs, key=_created):
            try:
                self.reconcile(cpc, live, nodes)
            except ApiException as e:
                # One broken CPC must not starve the others; the next pass retries.
                log.warning("reconcile %s: %s %s", cpc["metadata"]["name"], e.status, e.reason)
        if not live:
            self._delete_driver()
        return str((listing.get("metadata") or {}).get("resourceVersion") or "")

    def reconcile(self, cpc: Obj, live: list[Obj], nodes: list[Obj]) -> None:
        meta = cpc["metadata"]
        name = meta["name"]
        if meta.get("deletionTimestamp"):
            if o.FINALIZER in (meta.get("finalizers") or []):
                self.cleanup(cpc, live)
                self._set_finalizers(cpc, [f for f in meta["finalizers"] if f != o.FINALIZER])
            return
        if o.FINALIZER not in (meta.get("finalizers") or []):
            cpc = self._set_finalizers(cpc, [*(meta.get("finalizers") or []), o.FINALIZER])

        try:
            s = o.settings_from(cpc, self.default_image)
        except o.SpecError as e:
            self._refuse(cpc, e)
            return

        rivals = [
            c for c in live
            if c["metadata"]["uid"] != meta.get("uid")
            and _created(c) < _created(cpc)
            and o.selectors_overlap(s.node_selector, _selector(c))
        ]
        if rivals:
            # Two daemons cannot share a node (host port, host mount path): the
            # older CPC keeps its nodes; this one is not rolled out.
            shared = [n["metadata"]["name"] for n in nodes
                      if o.selects(s.node_selector, n)
                      and any(o.selects(_selector(r), n)
                              for r in rivals)]
            msg = (f"nodeSelector overlaps CheckpointConfiguration "
                   f"{', '.join(r['metadata']['name'] for r in rivals)} "
                   f"({len(shared)} node(s) selected by both now); not rolled out")
            if self._condition(cpc, "Degraded").get("reason") != "NodeSelectorConflict":
                self.event(cpc, "Warning", "NodeSelectorConflict", msg)
            self._status(cpc, ready=("False", "NodeSelectorConflict", msg),
                         degraded=("True", "NodeSelectorConflict", msg))
            return

        try:
            self._ensure_secret(cpc, s)
        except o.SpecError as e:
            self._refuse(cpc, e)
            return
        driver_owners = [o.owner_ref(c, controller=False) for c in sorted(live, key=_created)]
        changed = [obj["metadata"]["name"] for res, obj in o.desired(s, self.namespace, cpc,
                                                                     driver_owners)
                   if self.apply(res, obj) != "unchanged"]
        if changed:
            log.info("%s: applied %s", name, ", ".join(changed))
        self._status(cpc, *self._readiness(s))

    def apply(self, res: Resource, obj: Obj) -> str:
        """Create, or replace when the desired object changed: 'created'|'updated'|'unchanged'."""
        meta = obj["metadata"]
        digest = o.config_hash(obj)
        meta.setdefault("annotations", {})[o.HASH_ANNOTATION] = digest
        for _ in range(5):
            cur = self.kube.get(res, meta["name"], meta.get("namespace"))
            if cur is None:
                try:
                    self.kube.create(res, obj)
                    return "created"
                except ApiException as e:
                    if e.status == 409:  # created meanwhile: compare again
                        continue
                    raise
            if (cur["metadata"].get("annotations") or {}).get(o.HASH_ANNOTATION) == digest:
                return "unchanged"
            meta["resourceVersion"] = cur["metadata"]["resourceVersion"]
            try:
                self.kube.replace(res, obj)
                return "updated"
            except ApiException as e:
                if e.status == 422 and res == CSI_DRIVERS:
                    # Most of a CSIDriver's spec is immutable (e.g. its lifecycle
                    # modes, changed by an upgrade): replace it. Published volumes
                    # are unaffected; a mount asked for in the gap is retried.
                    log.info("CSIDriver %s: immutable fields changed; recreating it",
                             meta["name"])
                    self.kube.delete(res, meta["name"])
                    meta.pop("resourceVersion", None)
                    continue
                if e.status not in (404, 409):
                    raise
        raise RuntimeError(f"{res.kind} {meta['name']}: kept conflicting with other writers")

    def cleanup(self, cpc: Obj, live: list[Obj]) -> None:
        """The finalizer's work: remove what this CPC made (the garbage collector
        would too, eventually; this makes deletion complete before the CPC goes)."""
        s_name = cpc["metadata"]["name"]
        n = o.names(s_name)
        ns = self.namespace
        self.kube.delete(DAEMON_SETS, n["daemon"], ns)
        self.kube.delete(DAEMON_SETS, n["csi"], ns)
        spec = cpc.get("spec") or {}
        if not spec.get("peerTokenSecretRef"):
            self._drop_token(s_name)
        if not [c for c in live if c["metadata"]["uid"] != cpc["metadata"]["uid"]]:
            self._delete_driver()
        log.info("%s: cleaned up", s_name)

    # -- pieces ----------------------------------------------------------------

    def _delete_driver(self) -> None:
        """The shared CSIDriver goes with the last CPC, but only if we made it (a
        plugin installed by hand, docs/csi.md, keeps its own)."""
        drv = self.kube.get(CSI_DRIVERS, DRIVER_NAME)
        labels = ((drv or {}).get("metadata") or {}).get("labels") or {}
        if labels.get("app.kubernetes.io/managed-by") == o.MANAGED_BY:
            self.kube.delete(CSI_DRIVERS, DRIVER_NAME)

    def _refuse(self, cpc: Obj, e: o.SpecError) -> None:
        self._status(cpc, ready=("False", e.reason, str(e)), degraded=("True", e.reason, str(e)))

    def _set_finalizers(self, cpc: Obj, finalizers: list[str]) -> Obj:
        meta = cpc["metadata"]
        # resourceVersion in a merge patch makes it conditional: no lost update.
        patch = {"metadata": {"finalizers": finalizers,
                              "resourceVersion": meta.get("resourceVersion")}}
        return self.kube.merge_patch(CPCS, meta["name"], patch)

    def _read_secret(self, name: str) -> Obj | None:
        try:
            return self.kube.get(SECRETS, name, self.namespace)
        except ApiException as e:
            if e.status != 403:
                raise
            raise o.SpecError(
                "SecretForbidden",
                f"Secret {self.namespace}/{name}: the controller may not read it; add its "
                f"name to the resourceNames of Role {self.namespace}/mtcfs-controller "
                f"(docs/gke.md, \"RBAC\")") from None

    def _ensure_secret(self, cpc: Obj, s: o.Settings) -> None:
        """A referenced Secret must hold its key; a generated token is a key (the
        CPC's name) of the shared Secret, added once with a conditional patch."""
        for _ in range(5):
            cur = self._read_secret(s.token_secret)
            data = (cur or {}).get("data") or {}
            if cur is None or (not s.token_generated and s.token_key not in data):
                how = ("it is part of deploy/base" if s.token_generated
                       else f"with key {s.token_key!r}")
                raise o.SpecError("SecretMissing",
                                  f"Secret {self.namespace}/{s.token_secret} not found ({how})")
            if s.token_key in data:
                return
            patch = {"metadata": {"resourceVersion": cur["metadata"]["resourceVersion"]},
                     "data": {s.token_key: o.new_token()}}
            try:
                self.kube.merge_patch(SECRETS, s.token_secret, patch, self.namespace)
                return
            except ApiException as e:
                if e.status != 409:  # another writer: read again
                    raise
        raise RuntimeError(f"Secret {s.token_secret}: kept conflicting with other writers")

    def _drop_token(self, cpc_name: str) -> None:
        try:
            self.kube.merge_patch(SECRETS, o.TOKENS_SECRET, {"data": {cpc_name: None}},
                                  self.namespace)
        except ApiException as e:
            if e.status != 404:
                raise

    def _readiness(self, s: o.Settings) -> tuple[tuple[str, str, str], tuple[str, str, str]]:
        n = o.names(s.name)
        msgs: list[str] = []
        ready = True
        no_nodes = False
        for key, what in (("daemon", "node daemons"), ("csi", "CSI plugins")):
            ds = self.kube.get(DAEMON_SETS, n[key], self.namespace) or {}
            st = ds.get("status") or {}
            want, up = st.get("desiredNumberScheduled", 0), st.get("numberReady", 0)
            updated = st.get("updatedNumberScheduled", 0)
            if st.get("observedGeneration", 0) < (ds.get("metadata") or {}).get("generation", 1):
                ready = False
                msgs.append(f"{what}: rollout not observed yet")
                continue
            no_nodes |= want == 0
            ready &= want > 0 and up >= want
            msgs.append(f"{up}/{want} {what} ready")
            if key == "daemon" and updated < want:
                msgs.append(f"{want - updated} node daemon(s) run an older spec: delete those "
                            "pods to upgrade them (updateStrategy OnDelete)")
        msg = "; ".join(msgs)
        if s.ignored_mount_options:
            msg += f"; gcsFuseMountOptions ignored: {', '.join(s.ignored_mount_options)}"
        if s.ignored_fields:
            msg += f"; ignored (no meaning for mtcfs): {', '.join(s.ignored_fields)}"
        if no_nodes:
            rd = ("False", "NoNodesSelected", f"no node matches nodeSelector; {msg}")
        elif ready:
            rd = ("True", "AllNodesReady", msg)
        else:
            rd = ("False", "NodesNotReady", msg)
        return rd, ("False", "AsExpected", "")

    @staticmethod
    def _condition(cpc: Obj, ctype: str) -> Obj:
        for c in (cpc.get("status") or {}).get("conditions") or []:
            if c.get("type") == ctype:
                return c
        return {}

    def _status(
        self, cpc: Obj, ready: tuple[str, str, str], degraded: tuple[str, str, str]
    ) -> None:
        gen = cpc["metadata"].get("generation", 1)
        conds = []
        for ctype, (status, reason, message) in (("Ready", ready), ("Degraded", degraded)):
            old = self._condition(cpc, ctype)
            conds.append({
                "type": ctype,
                "status": status,
                "reason": reason,
                "message": message,
                "observedGeneration": gen,
                # Only a change of status moves the transition time.
                "lastTransitionTime": old.get("lastTransitionTime")
                if old.get("status") == status else _now(),
            })
        status = {"observedGeneration": gen, "conditions": conds}
        if (cpc.get("status") or {}) == status:
            return
        self.kube.merge_patch(CPCS, cpc["metadata"]["name"], {"status": status}, sub="status")

    def event(self, cpc: Obj, etype: str, reason: str, message: str) -> None:
        meta = cpc["metadata"]
        now = _now()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            # Our own namespace: the Role allows events there only.
            "metadata": {"generateName": f"{meta['name']}.", "namespace": self.namespace},
            "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": CPC_KIND,
                               "name": meta["name"], "uid": meta.get("uid")},
            "type": etype,
            "reason": reason,
            "message": message,
            "count": 1,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "source": {"component": "mtcfs-controller"},
            "reportingComponent": "mtcfs.dev/controller",
            "reportingInstance": self.identity,
        }
        try:
            self.kube.create(EVENTS, body)
        except ApiException as e:  # an event is a courtesy; never fail a pass on it
            log.warning("event %s for %s: %s", reason, meta["name"], e.reason)

    # -- the loop --------------------------------------------------------------

    def run(
        self,
        stop: threading.Event,
        resync: float = 30.0,
        leading: Callable[[], bool] = lambda: True,
    ) -> None:
        """Reconcile until `stop` (or until `leading()` turns false)."""
        while not stop.is_set() and leading():
            try:
                started = time.monotonic()
                try:
                    rv = self.reconcile_all()
                except Exception:
                    self.monitor.pass_done(False, time.monotonic() - started)
                    raise
                self.monitor.pass_done(True, time.monotonic() - started)
                deadline = time.monotonic() + resync
                # Any CPC change ends the wait early; DaemonSet status is picked
                # up by the periodic pass.
                while not stop.is_set() and leading() and time.monotonic() < deadline:
                    timeout = max(1, min(5, int(deadline - time.monotonic())))
                    events = self.kube.watch(CPCS, rv, timeout)
                    if any(kind != "BOOKMARK" for kind, _ in events):
                        break
            except ApiException as e:
                if e.status != 410:  # 410: our resourceVersion is too old; list again
                    log.warning("pass failed: %s %s; retrying", e.status, e.reason)
                    stop.wait(2.0)
            except Exception:  # connection errors and the like: keep the loop alive
                log.exception("pass failed; retrying")
                stop.wait(2.0)
