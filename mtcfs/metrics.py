"""Prometheus metrics and /healthz (--metrics-port).

The daemon's state belongs to its trio thread, so the HTTP server (a thread of
its own) never reads it directly: the trio side takes a snapshot every second
and the collector turns the newest one into metric families. Lags are
histograms observed as events happen (prometheus-client objects are
thread-safe). /healthz answers 200 while snapshots keep coming (the event loop
that serves FUSE is alive) and 503 when they stop.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import trio
from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mtcfs import __version__

if TYPE_CHECKING:
    from mtcfs.assembly import Mount

log = logging.getLogger(__name__)

SNAPSHOT_EVERY = 1.0
STALE_AFTER = 10.0  # /healthz fails when the newest snapshot is older than this
COMMIT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)
LAG_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)


class Metrics(Collector):
    """`status`: the mount's status (read on the trio thread, see refresh_loop)."""

    def __init__(self, status: Callable[[], dict[str, Any]], node_id: str) -> None:
        self.status = status
        self.node_id = node_id
        self.registry = CollectorRegistry(auto_describe=False)
        self.replication_lag = Histogram(
            "mtcfs_replication_lag_seconds",
            "Seconds from a file's close (seal) to K verified peer copies",
            buckets=LAG_BUCKETS, registry=self.registry)
        self.persist_lag = Histogram(
            "mtcfs_persist_lag_seconds",
            "Seconds from a file's close (seal) to persisted in the durable tier",
            buckets=LAG_BUCKETS, registry=self.registry)
        self.fsync_seconds = Histogram(
            "mtcfs_fsync_wait_seconds", "Seconds fsync()/close() waited for its durability level",
            ["level"], buckets=LAG_BUCKETS, registry=self.registry)
        self.commit_seconds = Histogram(
            "mtcfs_commit_wait_seconds",
            "Seconds fsync, a directory fsync or a commit waited for every live peer to "
            "apply it", buckets=COMMIT_BUCKETS, registry=self.registry)
        self.registry.register(self)
        self.snap: dict[str, Any] = {}
        self.taken = 0.0  # time.monotonic() of the newest snapshot
        self.server: WSGIServer | None = None
        self.port = 0

    def observe(self, mount: Mount) -> None:
        """Observe the lags and waits as they happen."""
        mount.lags.replication_observers.append(self.replication_lag.observe)
        mount.lags.persist_observers.append(self.persist_lag.observe)
        mount.durability.observers.append(
            lambda level, s: self.fsync_seconds.labels(level).observe(s))
        if mount.peers is not None:
            mount.peers.broadcaster.observers.append(self.commit_seconds.observe)

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
        """Start the HTTP server in a daemon thread; returns the bound port."""
        metrics_app = make_wsgi_app(self.registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
            path = environ.get("PATH_INFO", "")
            if path == "/healthz":
                ok, why = self.healthy()
                body = json.dumps({"ok": ok, "status": why,
                                   "node_id": self.node_id}).encode() + b"\n"
                start_response("200 OK" if ok else "503 Service Unavailable",
                               [("Content-Type", "application/json"),
                                ("Content-Length", str(len(body)))])
                return [body]
            if path in ("/metrics", "/"):
                return metrics_app(environ, start_response)
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: try /metrics or /healthz\n"]

        class Quiet(WSGIRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass  # scrapes every few seconds would drown the log

        self.server = make_server(address, port, app, handler_class=Quiet)
        self.port = self.server.server_port
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
        info = GaugeMetricFamily("mtcfs_info", "mtcfs version and node", labels=["version", "node"])
        info.add_metric([__version__, s["node_id"]], 1)
        yield info
        ram = s["ram"]
        yield _gauge("mtcfs_ram_capacity_bytes", "RAM tier budget (--ram-size)", ram["capacity"])
        yield _gauge("mtcfs_ram_used_bytes", "Bytes charged to the RAM tier", ram["used"])
        files = GaugeMetricFamily("mtcfs_files", "Files by lifecycle state", labels=["state"])
        for state, n in sorted(s["states"].items()):
            files.add_metric([state], n)
        yield files
        yield _gauge("mtcfs_open_handles", "Open file handles", s["open_handles"])

        written = CounterMetricFamily("mtcfs_written_bytes", "Bytes written, by tier",
                                      labels=["tier"])
        written.add_metric(["ram"], s["bytes_written"])
        read = CounterMetricFamily("mtcfs_read_bytes",
                                   "Bytes read by applications (ram) and fetched into RAM from "
                                   "other tiers (peers, gcs/file)", labels=["tier"])
        read.add_metric(["ram"], s["bytes_read"])
        rt = s.get("fetch")
        d = s.get("durable")
        p = s.get("peers")
        durable_tier = ("gcs" if d["url"].startswith("gs:") else "file") if d else "durable"
        if rt is not None:
            by_tier: dict[str, int] = {}
            for source, n in rt["bytes_by_source"].items():
                tier = durable_tier if "://" in source else "peers"
                by_tier[tier] = by_tier.get(tier, 0) + n
            for tier, n in sorted(by_tier.items()):
                read.add_metric([tier], n)
        if d is not None:
            written.add_metric([durable_tier], d["uploaded_bytes"])
        if p is not None:
            written.add_metric(["peers"], p["replica_bytes_sent"])
        yield written
        yield read

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


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
