"""The mtcfs CSI node plugin (`mtcfs csi`): mounts a job's directory of the node
daemon's mtcfs mount into pods that declare an inline CSI volume.

Stateless: what is published is read back from /proc/self/mountinfo, so a
restarted or upgraded plugin picks up where the last one stopped and never
touches existing mounts. See docs/csi.md.
"""

from __future__ import annotations

# The CSI driver name: GetPluginInfo returns it, and the CSIDriver object, the
# node-driver-registrar and the pods' `csi.driver` must use the same.
DRIVER_NAME = "mtcfs.csi.dev"
