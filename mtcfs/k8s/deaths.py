"""Node daemons Kubernetes took away, told to the others at once (`mtcfs controller`).

Kubernetes knows that a node daemon's pod is gone (deleted, evicted, its node
drained or lost and its pods deleted by the node controller) seconds before
SWIM's probes and suspicion period find it dead. The controller's leader
watches the node-daemon pods of every CheckpointConfiguration in its namespace;
when one goes (a DELETED event, a deletionTimestamp, phase Failed or
Succeeded), it calls `Gone` on every other running daemon of the same CPC, with
that CPC's peer token. Each receiver probes the host at once and declares it
dead only if it does not answer (mtcfs.peer.swim.Swim.gone): the word is
evidence, never the only source; a daemon still answering (a pod deleted with
its process still in its grace period, or a stale event) stays alive, and
membership works as before without the controller.

A replacement pod for that node id (JobSet recreates the member elsewhere)
then finds the old address already dead everywhere: nothing waits out the
old host's suspicion period.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from kubernetes.client.exceptions import ApiException

from mtcfs.k8s import DAEMON_APP, PEER_PORT
from mtcfs.k8s import objects as o
from mtcfs.k8s.controller import CPCS
from mtcfs.k8s.kube import PODS, SECRETS, Kube, Obj
from mtcfs.peer import security
from mtcfs.peer.v1 import peer_pb2 as pb
from mtcfs.peer.v1 import peer_pb2_grpc as pb_grpc

log = logging.getLogger("mtcfs.controller.deaths")

CALL_TIMEOUT = 2.0  # seconds per Gone call
TOKEN_TTL = 60.0  # seconds a CPC's token is cached
SENDERS = 32  # Gone calls in flight at once


@dataclass(frozen=True)
class Daemon:
    uid: str
    name: str
    cpc: str
    address: str  # host:port, its --listen
    running: bool  # not going away


def daemon_of(pod: Obj) -> Daemon | None:
    """A node-daemon pod as a peer (None: another pod, or not on a node yet). Its
    address: the node's IP (host network) and its container port named "peer"."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    labels = meta.get("labels") or {}
    ip = status.get("hostIP")
    cpc = labels.get(o.LABEL_CPC)
    if not ip or not cpc or labels.get("app.kubernetes.io/name") != DAEMON_APP:
        return None
    port = next((p.get("containerPort") for c in (pod.get("spec") or {}).get("containers") or []
                 for p in c.get("ports") or [] if p.get("name") == "peer"), PEER_PORT)
    going = bool(meta.get("deletionTimestamp")) or status.get("phase") in ("Failed",
                                                                            "Succeeded")
    host = f"[{ip}]" if ":" in ip else ip
    return Daemon(meta.get("uid") or meta.get("name", ""), meta.get("name", ""), cpc,
                  f"{host}:{port}", not going)


def send_gone(targets: list[str], gone: list[str], reason: str, token: bytes) -> int:
    """Tell each target these addresses are gone; returns how many answered."""
    request = pb.GoneRequest(addresses=gone, reason=reason)
    metadata = security.call_metadata(token)

    def one(target: str) -> bool:
        with grpc.insecure_channel(target) as ch:
            try:
                pb_grpc.PeerStub(ch).Gone(request, timeout=CALL_TIMEOUT, metadata=metadata)
                return True
            except grpc.RpcError as e:
                log.info("telling %s that %s is gone: %s", target, ", ".join(gone),
                         e.code().name if hasattr(e, "code") else e)
                return False

    with ThreadPoolExecutor(min(SENDERS, max(1, len(targets)))) as pool:
        return sum(pool.map(one, targets))


class DeathWatch:
    """Watches node-daemon pods; a daemon going is told to the others of its CPC."""

    def __init__(self, kube: Kube, namespace: str,
                 send: Callable[[list[str], list[str], str, bytes], int] = send_gone) -> None:
        self.kube = kube
        self.namespace = namespace
        self.send = send
        self.selector = f"app.kubernetes.io/name={DAEMON_APP}"
        self.daemons: dict[str, Daemon] = {}  # uid -> what we last saw
        self.told: set[str] = set()  # uids whose going was told
        self._tokens: dict[str, tuple[float, bytes]] = {}  # cpc -> (read at, token)
        self.announced = 0  # daemons told gone (for tests and the log)

    # -- the loop ----------------------------------------------------------------

    def run(self, stop: threading.Event, leading: Callable[[], bool] = lambda: True,
            timeout: int = 30) -> None:
        while not stop.is_set() and leading():
            try:
                rv = self.resync()
                while not stop.is_set() and leading():
                    for kind, pod in self.kube.watch(PODS, rv, timeout, self.namespace,
                                                     self.selector):
                        rv = (pod.get("metadata") or {}).get("resourceVersion") or rv
                        if kind != "BOOKMARK":
                            self.seen(kind, pod)
                        if stop.is_set():
                            return
            except ApiException as e:
                if e.status != 410:  # 410: our resourceVersion is too old; list again
                    log.warning("pod watch failed: %s %s; retrying", e.status, e.reason)
                    stop.wait(2.0)
            except Exception as e:  # connection errors and the like: keep watching
                log.warning("pod watch failed: %s; retrying", e)
                stop.wait(2.0)

    def resync(self) -> str:
        """List the daemons (their going while we did not watch is told now);
        returns the list's resourceVersion to watch from."""
        listing = self.kube.request("GET", PODS.path(self.namespace),
                                    {"labelSelector": self.selector})
        seen = set()
        for pod in listing.get("items") or []:
            self.seen("LISTED", pod)
            seen.add((pod.get("metadata") or {}).get("uid"))
        for uid in [u for u in self.daemons if u not in seen]:
            self._gone(self.daemons.pop(uid), "pod deleted")
        return str((listing.get("metadata") or {}).get("resourceVersion") or "")

    # -- one event ---------------------------------------------------------------

    def seen(self, kind: str, pod: Obj) -> None:
        d = daemon_of(pod)
        if d is None:
            return
        if kind == "DELETED":
            self.daemons.pop(d.uid, None)
            self._gone(d, f"pod {d.name} deleted")
            return
        self.daemons[d.uid] = d
        if not d.running:
            why = ("deleted" if (pod.get("metadata") or {}).get("deletionTimestamp")
                   else f"phase {(pod.get('status') or {}).get('phase')}")
            self._gone(d, f"pod {d.name} {why}")

    def _gone(self, d: Daemon, reason: str) -> None:
        if d.uid in self.told:
            return
        self.told.add(d.uid)
        others = sorted({x.address for x in self.daemons.values()
                         if x.cpc == d.cpc and x.running and x.address != d.address})
        if not others:
            return
        token = self._token(d.cpc)
        if token is None:
            return
        t0 = time.monotonic()
        answered = self.send(others, [d.address], reason, token)
        self.announced += 1
        log.info("%s (%s, %s): told %d of %d daemons in %.2f s", d.address, reason, d.cpc,
                 answered, len(others), time.monotonic() - t0)

    def _token(self, cpc_name: str) -> bytes | None:
        now = time.monotonic()
        cached = self._tokens.get(cpc_name)
        if cached is not None and now - cached[0] < TOKEN_TTL:
            return cached[1]
        try:
            cpc = self.kube.get(CPCS, cpc_name)
            if cpc is None:
                return None
            s = o.settings_from(cpc, o.DEFAULT_IMAGE)
            secret = self.kube.get(SECRETS, s.token_secret, self.namespace) or {}
        except (ApiException, o.SpecError) as e:
            log.warning("CheckpointConfiguration %s: its peer token: %s", cpc_name, e)
            return None
        raw = ((secret.get("data") or {}).get(s.token_key)) or ""
        token = base64.b64decode(raw).strip() if raw else b""
        if not token:
            log.warning("CheckpointConfiguration %s: no peer token in Secret %s key %s",
                        cpc_name, s.token_secret, s.token_key)
            return None
        self._tokens[cpc_name] = (now, token)
        return token
