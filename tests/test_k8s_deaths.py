"""Deaths from Kubernetes: the controller's pod watch (mtcfs/k8s/deaths.py) tells the
node daemons at once that a host's pod is gone, and they probe it before believing.

Real daemons (three, peered on loopback, with the peer token) and a real pod watch
over HTTP; the Kubernetes API server is the suite's in-memory stand-in
(tests/support/k8s_api.py: no real API server can run here), enforcing the
controller's shipped Role. A pod here is what the node-daemon DaemonSet makes: the
daemon's host IP and its "peer" container port."""

from __future__ import annotations

import base64
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from mtcfs.k8s import DAEMON_APP
from mtcfs.k8s import objects as o
from mtcfs.k8s.deaths import DeathWatch, daemon_of
from mtcfs.k8s.kube import Kube, api_client_for

from support.k8s_api import FakeApiServer, Rbac, fake_api, shipped

NS = "mtcfs-system"
CPC = "job-1"



def _pod(name: str, port: int, phase: str = "Running") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}",
                         "labels": {"app.kubernetes.io/name": DAEMON_APP, o.LABEL_CPC: CPC}},
            "spec": {"containers": [{"name": "daemon", "ports": [
                {"name": "peer", "containerPort": port, "protocol": "TCP"}]}]},
            "status": {"hostIP": "127.0.0.1", "phase": phase}}


@pytest.fixture
def api(make_cluster) -> Iterator[tuple[FakeApiServer, Any]]:
    c = make_cluster(3, replicas=0)
    with fake_api() as srv:
        secret = shipped("Secret")[0]
        token = c.token_file.read_bytes().strip()
        secret.setdefault("data", {})[CPC] = base64.b64encode(token).decode()
        srv.put("", "secrets", secret)
        srv.put("mtcfs.dev", "checkpointconfigurations", {
            "apiVersion": "mtcfs.dev/v1", "kind": "CheckpointConfiguration",
            "metadata": {"name": CPC},
            "spec": {"cloudStorageBucketName": "b", "inMemoryVolumeSize": "1Gi"}})
        for name in "abc":
            srv.put("", "pods", _pod(f"mtcfs-node-{name}", c.ports[name]))
        srv.authorize = Rbac([*shipped("ClusterRole", "mtcfs-controller"),
                              *shipped("Role", "mtcfs-controller")])
        yield srv, c


@pytest.fixture
def watch(api) -> Iterator[DeathWatch]:
    srv, _ = api
    w = DeathWatch(Kube(api_client_for(srv.url), timeout=10), NS)
    stop = threading.Event()
    t = threading.Thread(target=w.run, args=(stop, lambda: True, 2), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while len(w.daemons) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(w.daemons) == 3
    yield w
    stop.set()
    t.join(timeout=10)


def _alive(m: Any, addr: str) -> bool:
    peers = m.status(settle=False)["peers"]["peers"]
    return next(p["alive"] for p in peers if p["address"] == addr)


def test_a_daemon_whose_pod_is_deleted_is_dead_everywhere_at_once(api, watch) -> None:
    srv, c = api
    c_addr = c.addr("c")
    c["c"].proc.send_signal(signal.SIGSTOP)  # it stops answering; SWIM has not noticed
    try:
        t0 = time.monotonic()
        srv.remove("", "pods", "mtcfs-node-c", NS)
        took = {}
        while len(took) < 2 and time.monotonic() - t0 < 20:
            for h in "ab":
                if h not in took and not _alive(c[h], c_addr):
                    took[h] = time.monotonic() - t0
            time.sleep(0.02)
        assert set(took) == {"a", "b"}, took
        assert watch.announced == 1
        for h in "ab":
            assert "gone by word from outside (pod mtcfs-node-c deleted)" in c[h].log()
        # Within the evidence probe's deadline (0.5 s here) and the calls, not the
        # suspicion period after a missed probe (seconds); said for the record.
        print(f"dead on a and b after {took['a']:.2f} s and {took['b']:.2f} s")
    finally:
        c["c"].proc.send_signal(signal.SIGCONT)


def test_a_daemon_that_still_answers_stays_alive_on_the_word(api, watch) -> None:
    """Never the only source: the pod of a daemon that answers is deleted (its process in
    its grace period, or a stale view): the others probe it and keep it."""
    srv, c = api
    srv.remove("", "pods", "mtcfs-node-b", NS)
    deadline = time.monotonic() + 10
    while watch.announced < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert watch.announced == 1
    time.sleep(2.0)  # the probes' deadlines passed
    assert _alive(c["a"], c.addr("b")) and _alive(c["c"], c.addr("b"))


def test_an_evicted_pod_is_gone_and_other_pods_are_not_daemons() -> None:
    failed = _pod("mtcfs-node-x", 7000, phase="Failed")
    d = daemon_of(failed)
    assert d is not None and not d.running and d.address == "127.0.0.1:7000"
    csi = _pod("mtcfs-csi-x", 7000)
    csi["metadata"]["labels"]["app.kubernetes.io/name"] = "mtcfs-csi"
    assert daemon_of(csi) is None
    unscheduled = _pod("mtcfs-node-y", 7000)
    del unscheduled["status"]["hostIP"]
    assert daemon_of(unscheduled) is None
