"""`mtcfs controller`: the CheckpointConfiguration controller (docs/gke.md)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from types import FrameType

import click

from mtcfs import k8s
from mtcfs.cli.common import fail, usage_error


def _default_image(kube: object, namespace: str) -> str:
    """The image CPCs get when they name none: $MTCFS_IMAGE, else our own pod's
    image (so `kustomize edit set image` moves the whole install), else the default."""
    if os.environ.get("MTCFS_IMAGE"):
        return os.environ["MTCFS_IMAGE"]
    from mtcfs.k8s.kube import PODS, Kube

    pod_name = os.environ.get("POD_NAME")
    if pod_name and isinstance(kube, Kube):
        try:
            pod = kube.get(PODS, pod_name, namespace) or {}
            for c in (pod.get("spec") or {}).get("containers") or []:
                if c.get("name") == "controller":
                    return str(c["image"])
        except Exception as e:  # no permission or no API: the default is fine
            logging.getLogger("mtcfs.controller").warning("own image unknown: %s", e)
    from mtcfs.k8s.objects import DEFAULT_IMAGE

    return DEFAULT_IMAGE


@click.command("controller")
@click.option("--namespace", default=lambda: os.environ.get("POD_NAMESPACE",
                                                            k8s.DEFAULT_NAMESPACE),
              show_default=k8s.DEFAULT_NAMESPACE,
              help="namespace of the DaemonSets, Secrets and the Lease")
@click.option("--lease-name", default="mtcfs-controller", show_default=True,
              help="coordination.k8s.io Lease used for leader election")
@click.option("--identity", default=lambda: f"{socket.gethostname()}-{os.getpid()}",
              show_default="HOSTNAME-PID", help="this replica's holderIdentity")
@click.option("--lease-duration", type=click.FloatRange(min=1), default=15.0,
              show_default=True, metavar="SECONDS")
@click.option("--resync", type=click.FloatRange(min=1), default=30.0, show_default=True,
              metavar="SECONDS", help="full reconcile at least this often")
@click.option("--image", help="node image for CPCs without spec.image "
                              "[default: $MTCFS_IMAGE, else this pod's image]")
@click.option("--kubeconfig", type=click.Path(dir_okay=False),
              help="kubeconfig file [default: in-cluster, else ~/.kube/config]")
@click.option("--once", is_flag=True,
              help="one reconcile pass, without leader election, then exit")
@click.option("--health-port", type=click.IntRange(0, 65535), default=8081, show_default=True,
              metavar="PORT", help="serve /healthz (liveness) and /readyz (readiness); 0: off")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=8080, show_default=True,
              metavar="PORT", help="serve Prometheus /metrics; 0: off")
@click.option("--bind-address", default="0.0.0.0", show_default=True, metavar="ADDR",
              help="address of the health and metrics ports")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False))
def controller(namespace: str, lease_name: str, identity: str, lease_duration: float,
               resync: float, image: str | None, kubeconfig: str | None, once: bool,
               health_port: int, metrics_port: int, bind_address: str,
               log_level: str) -> None:
    """Reconcile CheckpointConfigurations into node daemons and the CSI plugin."""
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kubernetes.config import ConfigException

    from mtcfs.k8s.controller import Controller
    from mtcfs.k8s.deaths import DeathWatch
    from mtcfs.k8s.health import ControllerHealth, serve_metrics, serve_probes
    from mtcfs.k8s.kube import Kube, load_config
    from mtcfs.k8s.leader import LeaderElector

    if kubeconfig is not None and not os.path.exists(kubeconfig):
        usage_error(f"--kubeconfig {kubeconfig}: not found")
    try:
        kube = Kube(load_config(kubeconfig))
    except Exception as e:  # the client raises YAML, type and key errors on a bad file
        why = " ".join(str(e).split())  # YAML errors span lines
        if kubeconfig is not None:
            usage_error(f"--kubeconfig {kubeconfig}: not a usable kubeconfig file: {why}")
        if not isinstance(e, ConfigException | OSError):
            raise
        fail(f"no Kubernetes API configuration: {why}")
    if once:
        ctl = Controller(kube, namespace, image or _default_image(kube, namespace), identity)
        try:
            ctl.reconcile_all()
        except Exception as e:
            fail(f"reconcile failed: {e}")
        return

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    elector = LeaderElector(kube, namespace, lease_name, identity,
                            lease_duration=lease_duration,
                            renew_deadline=lease_duration * 2 / 3,
                            retry_period=lease_duration / 7.5)
    health = ControllerHealth(lambda: elector.attempted_at, lambda: elector.answered_at,
                              elector.is_leader, lease_duration)
    for what, port, start in (("--health-port", health_port,
                               lambda: serve_probes(health, bind_address, health_port)),
                              ("--metrics-port", metrics_port,
                               lambda: serve_metrics(bind_address, metrics_port))):
        if port:
            try:
                start()
            except OSError as e:
                usage_error(f"{what} {port} on {bind_address}: {e.strerror or e}")
    ctl = Controller(kube, namespace, image or _default_image(kube, namespace), identity,
                     monitor=health)
    worker: list[threading.Thread] = []

    deaths = DeathWatch(kube, namespace)

    def started() -> None:
        for name, target, args in (("reconcile", ctl.run, (stop, resync, elector.is_leader)),
                                   ("deaths", deaths.run, (stop, elector.is_leader))):
            t = threading.Thread(target=target, args=args, name=name, daemon=True)
            t.start()
            worker.append(t)

    elector.run(stop, on_started=started)
    for t in worker:
        t.join(timeout=10)
    if not stop.is_set():
        # Lost the lease: exit so that the Deployment restarts us as a follower
        # (a deposed leader must not keep writing).
        fail("lost the leader lease")
