"""`mtcfs discover`: keep a node daemon's --peers-file current from the
Kubernetes API (the node-daemon DaemonSet runs it as a sidecar)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import FrameType

import click

from mtcfs import k8s
from mtcfs.cli.common import fail


@click.command("discover")
@click.option("--peers-file", required=True, type=click.Path(dir_okay=False),
              help="file to write: one peer host:port per line")
@click.option("--node-name", default=lambda: os.environ.get("NODE_NAME", ""),
              show_default="$NODE_NAME", help="this node (left out of the peers)")
@click.option("--namespace", default=lambda: os.environ.get("POD_NAMESPACE",
                                                            k8s.DEFAULT_NAMESPACE),
              show_default="$POD_NAMESPACE", help="namespace of the node-daemon pods")
@click.option("--selector", default=f"app.kubernetes.io/name={k8s.DAEMON_APP}",
              show_default=True, help="label selector of the node-daemon pods")
@click.option("--port", type=click.IntRange(1, 65535), default=k8s.PEER_PORT,
              show_default=True, help="the daemons' peer port (--listen)")
@click.option("--jobset", metavar="[NAMESPACE/]NAME",
              help="only peers on nodes that run this JobSet's pods")
@click.option("--failure-domain-label", default="topology.kubernetes.io/zone",
              show_default=True, help="node label naming a failure domain")
@click.option("--node-config", type=click.Path(dir_okay=False),
              help="also write this node's failure domain as TOML for `mtcfs mount --config`")
@click.option("--interval", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              metavar="SECONDS")
@click.option("--once", is_flag=True, help="one pass, then exit")
@click.option("--kubeconfig", type=click.Path(dir_okay=False),
              help="kubeconfig file [default: in-cluster, else ~/.kube/config]")
def discover(peers_file: str, node_name: str, namespace: str, selector: str, port: int,
             jobset: str | None, failure_domain_label: str, node_config: str | None,
             interval: float, once: bool, kubeconfig: str | None) -> None:
    """Write the peers file from the node-daemon pods' host addresses."""
    if not node_name:
        raise click.UsageError("--node-name is required (or set $NODE_NAME)")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kubernetes.config import ConfigException

    from mtcfs.k8s import discovery
    from mtcfs.k8s.kube import Kube, load_config

    target = None
    if jobset:
        ns, _, name = jobset.rpartition("/")
        target = (ns or "default", name)
    try:
        kube = Kube(load_config(kubeconfig))
    except (ConfigException, OSError) as e:
        fail(f"no Kubernetes API configuration: {e}")
    d = discovery.Discovery(kube, node_name, namespace, selector, port,
                            failure_domain_label, target)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        discovery.run(d, peers_file, node_config, interval, stop, once=once)
    except Exception as e:
        fail(f"discovery failed: {e}")
