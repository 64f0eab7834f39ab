"""Probes of the machine's state: what is mounted where (and whether its daemon
died), and whether a process runs. Read by config's checks, the daemon, `mtcfs
umount` and the tests."""

from __future__ import annotations

import json
import os
import subprocess

from mtcfs.mountinfo import entry_at, mountinfo


def mount_entry(mountpoint: str) -> dict[str, str] | None:
    """The /proc/self/mountinfo entry at `mountpoint` (the topmost one), if any."""
    try:
        e = entry_at(mountpoint)
    except OSError:
        return None
    return None if e is None else {"fstype": e.fstype, "source": e.source}


def is_mounted(mountpoint: str) -> bool:
    return mount_entry(mountpoint) is not None


def process_alive(pid: int) -> bool:
    """True while the process runs (a zombie awaiting its parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def is_dead_mount(mountpoint: str) -> bool:
    """True for a FUSE mount whose daemon died (every request fails with
    ENOTCONN). statfs always reaches the daemon; stat() of the mount root
    may still be answered from the kernel's attribute cache."""
    try:
        os.statvfs(mountpoint)
    except OSError as e:
        return e.errno == 107  # ENOTCONN
    return False


# -- a killed daemon that cannot finish dying -------------------------------------------
#
# kill -9 of a daemon while a caller's request holds a directory lock (a create, say)
# and the daemon's invalidation thread waits in the kernel for that lock: the thread
# cannot die, so the process never finishes exiting, its /dev/fuse descriptor stays
# open, the caller waits for an answer forever, and the dead daemon's ports stay bound.
# Only aborting the FUSE connection ends it. Each daemon records, per --listen address,
# its pid and its connection; a new one that finds that address busy aborts the
# connection of a recorded daemon that is dead (or a zombie) and takes the port.

LIVE_DIR = "/run/mtcfs/listen"
FUSECTL = "/sys/fs/fuse/connections"


def _record_path(listen: str) -> str:
    return os.path.join(LIVE_DIR, listen.replace("/", "_").replace(":", "_") + ".json")


def record_listener(listen: str, pid: int, mountpoint: str) -> None:
    """This daemon (pid) serves `listen` and the FUSE connection of `mountpoint`."""
    try:
        conn = os.minor(os.stat(mountpoint).st_dev)
        os.makedirs(LIVE_DIR, exist_ok=True)
        tmp = _record_path(listen) + f".{pid}"
        with open(tmp, "w") as f:
            json.dump({"pid": pid, "fuse_connection": conn, "mountpoint": mountpoint}, f)
        os.replace(tmp, _record_path(listen))
    except OSError:
        pass  # best effort: without it, a stuck predecessor is released by hand


def release_dead_listener(listen: str) -> str | None:
    """If the daemon recorded at `listen` is dead or a zombie and its FUSE connection
    is still up, abort that connection (its stuck thread and callers get ENOTCONN, it
    finishes dying, its ports are freed). Returns what was done, or None."""
    try:
        with open(_record_path(listen)) as f:
            rec = json.load(f)
        pid, conn = int(rec["pid"]), int(rec["fuse_connection"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if process_alive(pid):
        return None
    # The connection number is a device minor, used again by later mounts: abort only
    # if no mount but the dead daemon's own (at its mountpoint) has that device now.
    try:
        table = mountinfo()
    except OSError:
        return None
    if any(e.dev == f"0:{conn}" and e.mount_point != rec.get("mountpoint") for e in table):
        return None
    if os.path.isdir(FUSECTL) and not os.listdir(FUSECTL):  # fusectl not mounted yet
        subprocess.run(["mount", "-t", "fusectl", "fusectl", FUSECTL], capture_output=True,
                       check=False)
    abort = os.path.join(FUSECTL, str(conn), "abort")
    try:
        with open(abort, "w") as f:
            f.write("1")
    except OSError:
        return None
    return f"aborted FUSE connection {conn} of dead daemon {pid} ({rec.get('mountpoint')})"

