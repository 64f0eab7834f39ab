"""The `k8s` group: how long the controller takes to roll out a changed
CheckpointConfiguration, against the in-memory API server of tests/support/k8s_api.py
(no real API server: the figures are the controller's own cost plus loopback
HTTP, not a cluster's latency).

- one reconcile pass after a CPC change (its DaemonSets replaced), beside a
  pass with nothing to change;
- the same with 16 CPCs in the cluster (a pass reads and checks them all);
- from the CPC patch to the DaemonSet updated with the controller running its
  loop (woken by its watch), i.e. what an operator waits for.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from common import Context, Row, err

from mtcfs.k8s import objects as o
from mtcfs.k8s.controller import CPCS, Controller
from mtcfs.k8s.kube import Kube, api_client_for

from support.k8s_api import FakeApiServer, fake_api

NS = "mtcfs-system"


def _cpc(kube: Kube, name: str) -> None:
    kube.create(CPCS, {
        "apiVersion": "mtcfs.dev/v1", "kind": "CheckpointConfiguration",
        "metadata": {"name": name},
        "spec": {"cloudStorageBucketName": "bench", "inMemoryVolumeSize": "64Gi",
                 "nodeSelector": {"cloud.google.com/gke-nodepool": name}},
    })


def _ram(api: FakeApiServer, name: str) -> str:
    ds = api.get("apps", "daemonsets", f"mtcfsd-{name}", NS) or {}
    args: list[str] = ds["spec"]["template"]["spec"]["containers"][0]["args"]
    return args[args.index("--ram-size") + 1]


def _sizes(i: int) -> tuple[str, str]:
    return ("128Gi", "128GiB") if i % 2 == 0 else ("64Gi", "64GiB")


def _passes(reps: int, cpcs: int) -> tuple[list[float], list[float]]:
    change: list[float] = []
    noop: list[float] = []
    with fake_api() as api:
        # What deploy/base installs: the Secret the generated peer tokens go in.
        api.put("", "secrets", {"metadata": {"name": o.TOKENS_SECRET, "namespace": NS}})
        kube = Kube(api_client_for(api.url))
        ctl = Controller(kube, NS, "mtcfs:bench")
        for i in range(cpcs):
            _cpc(kube, f"pool-{i}")
        ctl.reconcile_all()
        for i in range(reps):
            size, want = _sizes(i)
            kube.merge_patch(CPCS, "pool-0", {"spec": {"inMemoryVolumeSize": size}})
            t = time.perf_counter()
            ctl.reconcile_all()
            change.append((time.perf_counter() - t) * 1e3)
            assert _ram(api, "pool-0") == want
            t = time.perf_counter()
            ctl.reconcile_all()
            noop.append((time.perf_counter() - t) * 1e3)
    return change, noop


def _through_watch(reps: int) -> list[float]:
    out: list[float] = []
    with fake_api() as api:
        # What deploy/base installs: the Secret the generated peer tokens go in.
        api.put("", "secrets", {"metadata": {"name": o.TOKENS_SECRET, "namespace": NS}})
        kube = Kube(api_client_for(api.url))
        ctl = Controller(Kube(api_client_for(api.url)), NS, "mtcfs:bench")
        _cpc(kube, "pool-0")
        stop = threading.Event()
        loop = threading.Thread(target=ctl.run, args=(stop, 60.0), daemon=True)
        loop.start()
        try:
            _wait(lambda: api.get("apps", "daemonsets", "mtcfsd-pool-0", NS) is not None)
            time.sleep(0.2)  # let the loop settle into its watch
            for i in range(reps):
                size, want = _sizes(i)
                t = time.perf_counter()
                kube.merge_patch(CPCS, "pool-0", {"spec": {"inMemoryVolumeSize": size}})
                _wait(lambda want=want: _ram(api, "pool-0") == want)
                out.append((time.perf_counter() - t) * 1e3)
                time.sleep(0.1)  # the status write's own wake-up passes
        finally:
            stop.set()
            loop.join(timeout=10)
    return out


def _wait(pred: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("the controller did not roll out the change")
        time.sleep(0.001)


def group(ctx: Context) -> list[Row]:
    reps = max(ctx.reps, 21)  # a pass takes milliseconds: more reps, steadier medians
    rows = []
    for cpcs in (1, 16):
        change, noop = _passes(reps, cpcs)
        err.print(f"  {cpcs} CPC(s): change {statistics.median(change):.1f} ms, "
                  f"no-op {statistics.median(noop):.1f} ms")
        rows.append(Row("k8s", f"reconcile a CPC change, {cpcs} CPC(s)", "ms", change, noop,
                        ref_label="no-op pass", higher_is_better=False, compare=False,
                        note="in-memory API; 2 DaemonSets replaced"))
    watch = _through_watch(reps)
    err.print(f"  CPC patch -> DaemonSet updated: {statistics.median(watch):.1f} ms")
    rows.append(Row("k8s", "CPC patch -> DaemonSet updated (watch)", "ms", watch,
                    higher_is_better=False, max_value=1000.0,
                    note="controller loop woken by its CPC watch"))
    return rows
