"""What `mtcfs status --json` shows of a mount (and the metrics are made of), and the
health rules: "degraded" while

- uploads fail now (backing off, or a tier call retrying through an outage);
- writers wait for, or were refused by, a full RAM tier (the last minute);
- commits returned before every peer had them, and the broadcast is not quiet yet.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from mtcfs import __version__

if TYPE_CHECKING:
    from mtcfs.assembly import Mount
    from mtcfs.config import MountOptions

OK, DEGRADED = "ok", "degraded"
# An error of the durable tier this recent still counts while uploads are pending.
RECENT_ERROR = 30.0
# A writer refused by a full RAM tier this recently still counts.
RECENT_FULL = 60.0


def mount_status(mount: Mount, metrics_url: str | None = None) -> dict[str, Any]:
    """The whole status; `metrics_url`: where the metrics are served (None: nowhere)."""
    fs, opts = mount.fs, mount.opts
    st: dict[str, Any] = mount.view.status()
    st.update(
        mountpoint=opts.mountpoint,
        pid=os.getpid(),
        version=__version__,
        uptime=round(time.time() - mount.started, 1),
        health=OK,  # (its place in the output) decided last, over the whole status
        node=fs.node_id,
        data_path=fs.data_path,
        passthrough=mount.passthrough.status(),
        lifecycle=lifecycle_status(mount),
        fetch=mount.fetcher.status(),
        restore=mount.restore.progress(),
        metrics_url=metrics_url,
        newest_safe_step=mount.step_report.newest_safe(),
    )
    up = mount.uploader
    durable = up.status()
    st["durable"] = durable and {**durable, "readthrough": {**mount.fetcher.status(),
                                                           **mount.listing.status()}}
    peers = mount.peers
    st["peers"] = peers.status()
    if st["peers"] is not None:
        st["peers"]["bytes_fetched_by_source"] = mount.fetcher.status()["bytes_by_source"]
    st["visibility"] = {"mode": fs.visibility_mode, **peers.broadcaster.status()}
    st["peer_auth"] = peer_auth(opts)
    st["huge_pages"] = mount.ram.huge_pages.status()
    st["ram"].update(tmpfs=mount.ram.own_tmpfs, **only_here(mount))
    st["health"] = health(st, time.time() - up.stats.last_error_time, up.idle(),
                          peers.broadcaster.quiet())
    return st


def health(st: dict[str, Any], error_age: float, uploads_idle: bool,
           broadcast_quiet: bool) -> str:
    """The health rules over a status (see the module's docstring). `error_age`: seconds
    since the durable tier's last error."""
    durable = st.get("durable")
    if durable is not None and durable["last_error"] and not uploads_idle and (
            durable["retrying_in"] or error_age < RECENT_ERROR):
        return DEGRADED  # failing now: backing off, or a tier call retrying
    lc = st["lifecycle"]
    if lc["writers_waiting"] or (lc["last_full_age"] is not None
                                 and lc["last_full_age"] < RECENT_FULL):
        return DEGRADED  # writers blocked on, or refused by, a full RAM tier
    if st["visibility"]["timeouts"] and not broadcast_quiet:
        return DEGRADED  # commits returned before every peer had them
    return OK


def lifecycle_status(mount: Mount) -> dict[str, object]:
    r = mount.retention
    return {
        **mount.space.status(),
        "fsync": mount.durability.status(),
        "incomplete_grace": r.grace,
        "removed_incomplete_steps": r.removed_steps[-20:],
        **mount.lags.status(),
        **mount.withdrawal.status(),
    }


def only_here(mount: Mount) -> dict[str, int]:
    """Files whose only copy is this host's RAM tier: not persisted, no live peer
    holds one (what `mtcfs umount --release` would lose)."""
    files = nbytes = 0
    for node in mount.ns.files():
        if node.has_data and not node.persisted and mount.copies.elsewhere(node) == 0:
            files += 1
            nbytes += node.size
    return {"only_copy_files": files, "only_copy_bytes": nbytes}


def peer_auth(opts: MountOptions) -> dict[str, object]:
    """How peers authenticate each other: "token" (a shared secret on every call),
    or "none" (--insecure, or no peers); TLS and the data channel's encryption beside."""
    peered = bool(opts.listen)
    return {"mode": "token" if peered and opts.token_file else "none",
            "tls": peered and bool(opts.tls_cert and opts.tls_key),
            "encryption": peered and bool(getattr(opts, "peer_encryption", False))}
