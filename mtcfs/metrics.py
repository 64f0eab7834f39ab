"""Prometheus metrics and /healthz (--metrics-port).

The daemon's state belongs to its trio thread, so the HTTP server (threads of its
own) never reads it directly: the trio side takes a snapshot every second and the
collector turns the newest one into metric families. Lags are histograms observed
as events happen (prometheus-client objects are thread-safe). The metrics are
prometheus_client's default registry (so its process_* and python_* collectors come
with them) plus mtcfs's own, served by prometheus_client's WSGI app in its threaded
WSGI server; /healthz answers 200 while snapshots keep coming (the event loop that
serves FUSE is alive) and 503 when they stop.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import trio
from prometheus_client import REGISTRY, CollectorRegistry, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from mtcfs import __version__
from mtcfs.status import mount_status

if TYPE_CHECKING:
    from mtcfs.assembly import Mount

log = logging.getLogger(__name__)

SNAPSHOT_EVERY = 1.0
STALE_AFTER = 10.0  # /healthz fails when the newest snapshot is older than this
COMMIT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)
# A local fsync takes about 1 ms; one that waits for peers or the bucket, seconds.
FSYNC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30,
                 60, 120, 300)
LAG_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
HEALTH_STATES = ("ok", "degraded")


class Metrics(Collector):
    """The metrics of `mount`: its status (read on the trio thread, see refresh_loop),
    its lags and waits observed as they happen. `registry`: where the metrics are
    registered (one daemon, one mount: the default registry, with the process and
    Python collectors)."""

    def __init__(self, mount: Mount, node_id: str,
                 registry: CollectorRegistry = REGISTRY) -> None:
        self.mount = mount
        self.node_id = node_id
        self.registry = registry
        self.replication_lag = Histogram(
            "mtcfs_replication_lag_seconds",
            "Seconds from a file's close (seal) to K verified peer copies",
            buckets=LAG_BUCKETS, registry=registry)
        self.persist_lag = Histogram(
            "mtcfs_persist_lag_seconds",
            "Seconds from a file's close (seal) to persisted in the durable tier",
            buckets=LAG_BUCKETS, registry=registry)
        self.fsync_seconds = Histogram(
            "mtcfs_fsync_wait_seconds", "Seconds fsync()/close() waited for its durability level",
            ["level"], buckets=FSYNC_BUCKETS, registry=registry)
        self.commit_seconds = Histogram(
            "mtcfs_commit_wait_seconds",
            "Seconds fsync, a directory fsync or a commit waited for every live peer to "
            "apply it", buckets=COMMIT_BUCKETS, registry=registry)
        self.snap: dict[str, Any] = {}
        self.taken = 0.0  # time.monotonic() of the newest snapshot
        registry.register(self)
        self.server: ThreadingWSGIServer | None = None
        self.port = 0
        self.url: str | None = None  # once served
        # The lags and waits, as they happen.
        mount.lags.replication_observers.append(self.replication_lag.observe)
        mount.lags.persist_observers.append(self.persist_lag.observe)
        mount.durability.observers.append(
            lambda level, s: self.fsync_seconds.labels(level).observe(s))
        mount.peers.broadcaster.observers.append(self.commit_seconds.observe)

    def status(self) -> dict[str, Any]:
        return mount_status(self.mount, self.url)

    # -- the trio side -----------------------------------------------------------------

    async def refresh_loop(self) -> None:
        while True:
            try:
                self.snap = self.status()
                self.taken = time.monotonic()
            except Exception:  # a broken metric must not take the mount down
                log.exception("metrics snapshot failed")
            await trio.sleep(SNAPSHOT_EVERY)

    def healthy(self) -> tuple[bool, str]:
        age = time.monotonic() - self.taken if self.taken else None
        if age is None:
            return False, "starting"
        if age > STALE_AFTER:
            return False, f"event loop stalled: no snapshot for {age:.0f} s"
        return True, "ok"

    # -- the HTTP side -----------------------------------------------------------------

    def serve(self, address: str, port: int) -> int:
        """Start the HTTP server (a thread per request) in a daemon thread; returns the
        bound port."""
        metrics_app = make_wsgi_app(self.registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
            if environ.get("PATH_INFO", "") == "/healthz":
                ok, why = self.healthy()
                body = json.dumps({"ok": ok, "status": why,
                                   "node_id": self.node_id}).encode() + b"\n"
                start_response("200 OK" if ok else "503 Service Unavailable",
                               [("Content-Type", "application/json"),
                                ("Content-Length", str(len(body)))])
                return [body]
            return metrics_app(environ, start_response)  # /metrics, and any other path

        class Quiet(WSGIRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass  # scrapes every few seconds would drown the log

        self.server = make_server(address, port, app, ThreadingWSGIServer, Quiet)
        self.port = self.server.server_port
        self.url = f"http://{address}:{self.port}/metrics"
        threading.Thread(target=self.server.serve_forever, name="metrics", daemon=True).start()
        return self.port

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def collect(self) -> Iterator[Metric]:
        s = self.snap
        if not s:
            return
        info = GaugeMetricFamily("mtcfs_build_info", "mtcfs version and node",
                                 labels=["version", "node"])
        info.add_metric([__version__, s["node_id"]], 1)
        yield info
        health = GaugeMetricFamily("mtcfs_health", "1 for the mount's health now (ok or "
                                   "degraded, as in mtcfs status), 0 for the other",
                                   labels=["state"])
        for state in HEALTH_STATES:
            health.add_metric([state], 1 if s["health"] == state else 0)
        yield health
        safe = s.get("newest_safe_step")
        if safe is not None and safe["step"] is not None:
            yield _gauge("mtcfs_newest_safe_step",
                         "Number of the newest complete step that is safe (persisted or in "
                         "K peer copies)", safe["step"])
        ram = s["ram"]
        yield _gauge("mtcfs_ram_capacity_bytes", "RAM tier budget (--ram-size)", ram["capacity"])
        yield _gauge("mtcfs_ram_used_bytes", "Bytes charged to the RAM tier", ram["used"])
        files = GaugeMetricFamily("mtcfs_files", "Files by lifecycle state", labels=["state"])
        for state, n in sorted(s["states"].items()):
            files.add_metric([state], n)
        yield files
        yield _gauge("mtcfs_open_handles", "Open file handles", s["open_handles"])
        yield from self._traffic(s)
        rt = s.get("fetch")
        d = s.get("durable")
        p = s.get("peers")
        if rt is not None:
            pf = rt["prefetch"]
            yield _gauge("mtcfs_prefetch_wanted_bytes",
                         "Bytes of the files of the prefetches under way (or last finished)",
                         pf["bytes_total"])
            yield _gauge("mtcfs_prefetch_done_bytes",
                         "Of those, bytes in this host's RAM tier", pf["bytes_done"])
            yield _gauge("mtcfs_fetching_files",
                         "Files being fetched into this host's RAM tier now (read-through, "
                         "prefetch, restore)", rt["fetching"])
        rs = s.get("restore")
        if rs is not None:
            yield _gauge("mtcfs_restore_wanted_bytes",
                         "Bytes a replacement host's background restore pulls (the copies "
                         "the job listed it as holding)", rs["bytes_total"])
            yield _gauge("mtcfs_restore_done_bytes",
                         "Of those, bytes in this host's RAM tier", rs["bytes_done"])
        if d is not None and d.get("last_upload_age") is not None:
            yield _gauge("mtcfs_seconds_since_last_persist",
                         "Seconds since an upload to the durable tier last succeeded",
                         d["last_upload_age"])

        lc = s.get("lifecycle") or {}
        ev = CounterMetricFamily("mtcfs_evictions", "Copies evicted from the RAM tier, by reason",
                                 labels=["reason"])
        evb = CounterMetricFamily("mtcfs_evicted_bytes", "Bytes evicted from the RAM tier",
                                  labels=["reason"])
        for reason, n in sorted(lc.get("evictions", {}).items()):
            ev.add_metric([reason], n)
            evb.add_metric([reason], lc["evicted_bytes"].get(reason, 0))
        yield ev
        yield evb
        yield _counter("mtcfs_enospc", "Writes refused with ENOSPC (RAM tier full)",
                       ram["enospc"])
        yield _gauge("mtcfs_writers_waiting", "Writers waiting for RAM tier space",
                     lc.get("writers_waiting", 0))
        yield _counter("mtcfs_space_wait_seconds", "Seconds writers waited for space",
                       lc.get("wait_seconds", 0.0))
        if "withdrawn_steps" in lc:
            yield _counter("mtcfs_steps_withdrawn",
                           "Committed steps withdrawn because a file lost its last copy",
                           lc["withdrawn_steps"])
            yield _gauge("mtcfs_steps_withdrawn_now", "Withdrawn steps in the namespace now",
                         lc["withdrawn_now"])
            yield _counter("mtcfs_lost_files_found_in_bucket",
                           "Files with no copy on any host found in the bucket (an upload "
                           "whose record died with its uploader)",
                           lc["lost_files_found_in_bucket"])
        yield _counter("mtcfs_replicas_refused",
                       "Replicas from peers refused for lack of space", ram.get("refused", 0))

        errors = CounterMetricFamily("mtcfs_errors", "Errors by kind", labels=["kind"])
        fs_ = lc.get("fsync") or {}
        errors.add_metric(["fsync_level_not_reached"], fs_.get("failures", 0))
        if d is not None:
            errors.add_metric(["upload"], d["errors"])
            yield _gauge("mtcfs_upload_queue_files", "Files waiting for or in upload",
                         d["queued_files"] + d["inflight_files"])
            yield _gauge("mtcfs_upload_pending_bytes", "Bytes still to upload",
                         d["pending_bytes"])
            yield _gauge("mtcfs_upload_conflicts", "Files not persisted (changed elsewhere)",
                         d["conflicts"])
            yield _gauge("mtcfs_upload_lost_files",
                         "Files to upload that no host has a copy of", d["lost_files"])
        if rt is not None:
            errors.add_metric(["fetch"], rt["errors"])
            errors.add_metric(["integrity"], rt["integrity_errors"]
                              + (p["integrity_errors"] if p else 0))
        if p is not None:
            errors.add_metric(["replication"], p["replica_failures"])
            yield _gauge("mtcfs_replication_queue_files", "Files waiting for K peer copies",
                         p["replication_queue"])
            yield _gauge("mtcfs_replication_pending_bytes", "Bytes of files waiting for copies",
                         p["replication_pending_bytes"])
            yield _gauge("mtcfs_broadcast_queue_entries",
                         "This host's index changes not yet applied by every live host",
                         p["broadcast_queue"])
            yield _counter("mtcfs_replicas_sent", "Replicas pushed to peers", p["replicas_sent"])
            yield _counter("mtcfs_replicas_received", "Replicas received from peers",
                           p["replicas_received"])
            up = GaugeMetricFamily("mtcfs_peer_up",
                                   "1 while a peer is alive in this host's membership view",
                                   labels=["peer", "node"])
            for peer in p["peers"]:
                up.add_metric([peer["address"], peer["node_id"] or ""], 1 if peer["alive"] else 0)
            yield up
            yield _gauge("mtcfs_peers_live", "Peers alive", p["live_peers"])
            vis = s.get("visibility") or {}
            yield _counter("mtcfs_commit_timeouts",
                           "fsyncs and commits that returned after --commit-timeout before "
                           "every live peer had applied them", vis.get("timeouts", 0))
        yield errors

    def _traffic(self, s: dict[str, Any]) -> Iterator[Metric]:
        """Bytes moved, one metric per source: their sums mean something."""
        app = CounterMetricFamily(
            "mtcfs_application_written_bytes",
            "Bytes applications wrote into this mount; through passthrough (which the daemon "
            "does not see) counted at each seal that makes a new version, as its size",
            labels=["data_path"])
        app.add_metric(["fuse"], s["bytes_written"])
        app.add_metric(["passthrough"], s.get("bytes_written_passthrough", 0))
        yield app
        yield _counter("mtcfs_application_read_bytes",
                       "Bytes applications read through the daemon (passthrough reads, "
                       "served by the kernel, are not counted)", s["bytes_read"])
        rt, d, p = s.get("fetch"), s.get("durable"), s.get("peers")
        durable_tier = ("gcs" if d["url"].startswith("gs:") else "file") if d else "durable"
        if rt is not None:
            fetched = CounterMetricFamily(
                "mtcfs_fetched_bytes",
                "Bytes fetched into this host's RAM tier (read-through, prefetch, restore), "
                "by the tier they came from", labels=["tier"])
            by_tier: dict[str, int] = {}
            for source, n in rt["bytes_by_source"].items():
                tier = durable_tier if "://" in source else "peers"
                by_tier[tier] = by_tier.get(tier, 0) + n
            for tier, n in sorted(by_tier.items()):
                fetched.add_metric([tier], n)
            yield fetched
        if d is not None:
            up = CounterMetricFamily("mtcfs_uploaded_bytes",
                                     "Bytes uploaded to the durable tier", labels=["tier"])
            up.add_metric([durable_tier], d["uploaded_bytes"])
            yield up
        if p is not None:
            yield _counter("mtcfs_replica_sent_bytes", "Bytes of replicas pushed to peers",
                           p["replica_bytes_sent"])
            yield _counter("mtcfs_replica_received_bytes",
                           "Bytes of replicas received from peers", p["replica_bytes_received"])


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
