"""The controller's probes and metrics (`mtcfs controller --health-port/--metrics-port`).

/healthz (liveness): the leader-election loop still turns (it tries at least
every retry period; a wedged process stops doing so). /readyz (readiness): the
API server answered within two lease durations, and, on the leader, the last
reconcile pass did not fail. Metrics come from prometheus_client's own server,
with its default process and Python collectors.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import Counter, Gauge, Histogram, start_http_server

PASSES = Counter("mtcfs_controller_reconcile_passes", "reconcile passes, by result",
                 ["result"])
PASS_SECONDS = Histogram("mtcfs_controller_reconcile_seconds", "duration of a reconcile pass",
                         buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
LEADER = Gauge("mtcfs_controller_leader", "1 while this replica holds the leader Lease")


class PassMonitor:
    """What the reconcile loop reports; the null object records nothing."""

    def pass_done(self, ok: bool, seconds: float) -> None:
        pass


NO_MONITOR = PassMonitor()


class ControllerHealth(PassMonitor):
    """Counts passes into the metrics and keeps what the probes answer from."""

    def __init__(self, attempted_at: Callable[[], float], answered_at: Callable[[], float | None],
                 leading: Callable[[], bool], lease_duration: float) -> None:
        self.attempted_at = attempted_at
        self.answered_at = answered_at
        self.leading = leading
        self.lease_duration = lease_duration
        self.last_pass_ok = True
        LEADER.set_function(lambda: 1.0 if leading() else 0.0)

    def pass_done(self, ok: bool, seconds: float) -> None:
        self.last_pass_ok = ok
        PASSES.labels("ok" if ok else "error").inc()
        PASS_SECONDS.observe(seconds)

    def live(self) -> tuple[bool, str]:
        idle = time.monotonic() - self.attempted_at()
        if idle > 3 * self.lease_duration:
            return False, f"leader election has not run for {idle:.0f}s"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        answered = self.answered_at()
        if answered is None:
            return False, "the API server has not answered yet"
        quiet = time.monotonic() - answered
        if quiet > 2 * self.lease_duration:
            return False, f"no answer from the API server for {quiet:.0f}s"
        if self.leading() and not self.last_pass_ok:
            return False, "the last reconcile pass failed"
        return True, "ok"


def serve_probes(health: ControllerHealth, address: str, port: int) -> int:
    """/healthz and /readyz on a daemon thread; returns the bound port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            check = {"/healthz": health.live, "/readyz": health.ready}.get(self.path)
            if check is None:
                self.send_error(404)
                return
            ok, why = check()
            body = (why + "\n").encode()
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # probes every few seconds: not worth a log line

    server = ThreadingHTTPServer((address, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="probes", daemon=True).start()
    return int(server.server_address[1])


def serve_metrics(address: str, port: int) -> int:
    server, _ = start_http_server(port, addr=address)
    return int(server.server_address[1])
