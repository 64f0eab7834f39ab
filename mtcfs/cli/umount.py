"""`mtcfs umount`: unmount, wait for the daemon to finish, clean dead mounts."""

from __future__ import annotations

import os
import subprocess
import time

import click

from mtcfs import control
from mtcfs.cli.common import fail
from mtcfs.cli.progress import poll_with_progress
from mtcfs.config import mount_entry, process_alive


@click.command("umount")
@click.argument("mountpoint", type=click.Path())
@click.option("--wait", is_flag=True,
              help="finish replication to peers and uploads to the durable tier first "
                   "(progress bars)")
@click.option("--timeout", type=float, default=60.0, show_default=True,
              help="seconds to wait for the daemon to exit")
def umount(mountpoint: str, wait: bool, timeout: float) -> None:
    """Unmount the mtcfs mount at MOUNTPOINT."""
    mountpoint = os.path.abspath(mountpoint)
    entry = mount_entry(mountpoint)
    if entry is None:
        fail(f"{mountpoint} is not mounted")
    if not entry["fstype"].startswith("fuse"):
        fail(f"{mountpoint} is a {entry['fstype']} mount, not mtcfs")
    pid = None
    try:
        pid = control.request(mountpoint, "status", timeout=10)["status"]["pid"]
    except control.ControlError as e:
        if "not an mtcfs mount" in str(e):
            fail(str(e))
        if "dead mount" not in str(e):
            # The daemon does not answer (its RAM dir may be gone): unmount anyway.
            click.echo(f"warning: {e}; unmounting without it", err=True)
            _unmount(mountpoint)
            return
        subprocess.run(["fusermount3", "-uz", mountpoint], capture_output=True)
        if mount_entry(mountpoint) is not None:
            subprocess.run(["umount", "-l", mountpoint], capture_output=True)
        click.echo(f"cleaned up the dead mount at {mountpoint}")
        return
    if wait:
        _wait_for_replication(mountpoint)
        _wait_for_uploads(mountpoint)
    _unmount(mountpoint)
    deadline = time.monotonic() + timeout
    while pid and time.monotonic() < deadline:
        if not process_alive(pid):
            break
        time.sleep(0.05)
    else:
        if pid:
            fail(f"unmounted {mountpoint}, but daemon pid {pid} is still running")


def _unmount(mountpoint: str) -> None:
    r = subprocess.run(["fusermount3", "-u", mountpoint], capture_output=True, text=True)
    if r.returncode != 0:
        why = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "unmount failed"
        fail(f"cannot unmount {mountpoint}: {why}")


def _wait_for_replication(mountpoint: str) -> None:
    """Until every file has its K copies and every change reached the live peers
    (or no peer is alive to take them: said, not waited for)."""
    first = control.request(mountpoint, "status")["status"]["peers"]
    if not first:
        return
    total = first["replication_pending_bytes"]

    def poll() -> dict:
        p = control.request(mountpoint, "status")["status"]["peers"]
        pending = p["replication_pending_bytes"]
        nonlocal total
        total = max(total, pending)
        alone = p["live_peers"] == 0 and not p["quiet"]
        return {"bytes_total": total, "bytes_done": total - pending,
                "finished": p["quiet"] or alone,
                "note": "no live peer: files stay short of K copies" if alone else ""}

    try:
        st = poll_with_progress("replicating before unmount", poll)
    except control.ControlError as e:
        fail(str(e))
    if st.get("note"):
        click.echo(f"warning: {st['note']}", err=True)


def _wait_for_uploads(mountpoint: str) -> None:
    first = control.request(mountpoint, "status")["status"]["durable"]
    if not first:
        return
    start_bytes = first["uploaded_bytes"]

    def poll() -> dict:
        d = control.request(mountpoint, "status")["status"]["durable"]
        idle = (d["queued_files"] == 0 and d["inflight_files"] == 0
                and d["pending_deletes"] == 0)
        done = d["uploaded_bytes"] - start_bytes
        note = f"retrying: {d['last_error'][:60]}" if d["retrying_in"] and d["last_error"] else ""
        return {"bytes_total": done + d["pending_bytes"], "bytes_done": done, "finished": idle,
                "note": note}

    try:
        poll_with_progress("uploading before unmount", poll)
    except control.ControlError as e:
        fail(str(e))
