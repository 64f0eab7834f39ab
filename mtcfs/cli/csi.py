"""`mtcfs csi`: the CSI node plugin (Kubernetes); see docs/csi.md."""

from __future__ import annotations

import logging
import os
import sys

import click

from mtcfs.cli.common import fail


def _socket_path(endpoint: str) -> str:
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme != "unix" or not rest.startswith("/"):
        raise click.BadParameter(
            f"{endpoint!r}: must be unix:///absolute/path.sock (kubelet talks to CSI "
            f"plugins over a unix socket)", param_hint="--endpoint")
    return os.path.normpath(rest)


@click.command("csi")
@click.option("--endpoint", required=True, metavar="unix:///PATH",
              help="unix socket to serve CSI on, e.g. unix:///csi/csi.sock")
@click.option("--node-id", required=True, metavar="NAME",
              help="this node's name (NodeGetInfo), usually spec.nodeName")
@click.option("--mount-root", required=True, metavar="PATH",
              help="the node daemon's mtcfs mount; pods get PATH/<namespace>/<job>")
@click.option("--targets-root", default="/var/lib/kubelet/pods", show_default=True,
              metavar="DIR", help="where kubelet's volume targets are: binds under it are "
                                  "re-bound after a node daemon restart")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(("debug", "info", "warning", "error"), case_sensitive=False))
@click.option("--pod-labels-file", metavar="FILE", hidden=True,
              help="read pod labels from this JSON file {\"ns/pod\": {labels}} instead of the "
                   "Kubernetes API (tests; clusters where the plugin may not read pods)")
def csi(endpoint: str, node_id: str, mount_root: str, targets_root: str, log_level: str,
        pod_labels_file: str | None) -> None:
    """The CSI node plugin: bind-mounts MOUNT-ROOT/<namespace>/<job> into pods."""
    socket_path = _socket_path(endpoint)
    if not node_id.strip():
        raise click.BadParameter("must not be empty", param_hint="--node-id")
    if not os.path.isabs(mount_root):
        raise click.BadParameter(f"{mount_root!r}: must be an absolute path",
                                 param_hint="--mount-root")
    # A dead FUSE mount fails stat() with ENOTCONN yet is there (it comes back).
    try:
        os.stat(mount_root)
    except FileNotFoundError:
        raise click.BadParameter(f"{mount_root} does not exist",
                                 param_hint="--mount-root") from None
    except OSError:
        pass
    if pod_labels_file and not os.path.isfile(pod_labels_file):
        raise click.BadParameter(f"{pod_labels_file} does not exist",
                                 param_hint="--pod-labels-file")

    # Imported here: grpc and the generated code are not needed by the other commands.
    from mtcfs.csi.pods import FilePodLabels, KubernetesPodLabels
    from mtcfs.csi.server import PluginOptions, ServeError, serve

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(log_level.upper())
    pod_labels = FilePodLabels(pod_labels_file) if pod_labels_file else KubernetesPodLabels()
    try:
        serve(PluginOptions(socket_path=socket_path, node_id=node_id,
                            mount_root=os.path.normpath(mount_root),
                            targets_root=os.path.abspath(targets_root),
                            pod_labels=pod_labels))
    except ServeError as e:
        fail(str(e))
