"""mtcfs on Kubernetes: the CheckpointConfiguration controller (`mtcfs controller`),
its leader election, and peer discovery for the node daemon (`mtcfs discover`).

See docs/gke.md for the operator's view and crd/ for the resource's schema.
"""

from __future__ import annotations

GROUP = "mtcfs.dev"
VERSION = "v1"
CPC_PLURAL = "checkpointconfigurations"
CPC_KIND = "CheckpointConfiguration"

# Shared with the CLI, which must not import the kubernetes client just to print --help.
DEFAULT_NAMESPACE = "mtcfs-system"
DAEMON_APP = "mtcfsd"
PEER_PORT = 7466
