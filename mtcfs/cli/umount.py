"""`mtcfs umount`: unmount, wait for the daemon to finish, clean dead mounts; say
what stays (the RAM tier), and with --release give its memory back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from typing import Any

import click

from mtcfs import control
from mtcfs.cli.common import fail, plural
from mtcfs.cli.progress import poll_with_progress
from mtcfs.config import default_ram_dir
from mtcfs.probes import mount_entry, process_alive
from mtcfs.sizes import format_size


@click.command("umount")
@click.argument("mountpoint", type=click.Path())
@click.option("--wait", is_flag=True,
              help="finish replication to peers and uploads to the durable tier first "
                   "(progress bars)")
@click.option("--timeout", type=float, default=60.0, show_default=True,
              help="seconds to wait for the daemon to exit")
@click.option("--release", is_flag=True,
              help="also give the RAM tier's memory back: unmount its tmpfs and remove the "
                   "RAM dir (refused while a file's only copy is there; also once the "
                   "daemon is gone)")
@click.option("--force", is_flag=True,
              help="with --release: release even files whose only copy is in the RAM tier")
@click.option("--ram-dir", metavar="DIR",
              help="with --release and no daemon: the RAM dir the mount used  "
                   "[default: /dev/shm/mtcfs-<hash of MOUNTPOINT>]")
@click.option("--json", "as_json", is_flag=True,
              help="print what was done, and what stays, as JSON on stdout")
def umount(mountpoint: str, wait: bool, timeout: float, release: bool, force: bool,
           ram_dir: str | None, as_json: bool) -> None:
    """Unmount the mtcfs mount at MOUNTPOINT."""
    report = Report(as_json)
    try:
        _umount(os.path.abspath(mountpoint), wait, timeout, release, force, ram_dir, report)
    finally:
        report.done()


class Report:
    """What umount says it did: a line each, or with --json one object at the end."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.fields: dict[str, Any] = {}

    def say(self, line: str, **fields: Any) -> None:
        self.fields.update(fields)
        if not self.as_json:
            click.echo(line)

    def done(self) -> None:
        if self.as_json and self.fields:
            click.echo(json.dumps(self.fields, indent=2))


def _umount(mountpoint: str, wait: bool, timeout: float, release: bool, force: bool,
            ram_dir: str | None, report: Report) -> None:
    entry = mount_entry(mountpoint)
    ram = RamDir(ram_dir or default_ram_dir(mountpoint), report)
    if entry is None:
        if release:
            ram.release(force, checked=False)
            return
        fail(f"{mountpoint} is not mounted")
    if not entry["fstype"].startswith("fuse"):
        fail(f"{mountpoint} is a {entry['fstype']} mount, not mtcfs")
    pid = None
    try:
        st = control.request(mountpoint, "status", timeout=10)["status"]
    except control.ControlError as e:
        if "not an mtcfs mount" in str(e):
            fail(str(e))
        if "dead mount" not in str(e):
            # The daemon does not answer (its RAM dir may be gone): unmount anyway.
            click.echo(f"warning: {e}; unmounting without it", err=True)
            _unmount(mountpoint)
        else:
            subprocess.run(["fusermount3", "-uz", mountpoint], capture_output=True)
            if mount_entry(mountpoint) is not None:
                subprocess.run(["umount", "-l", mountpoint], capture_output=True)
            report.say(f"cleaned up the dead mount at {mountpoint}", unmounted=mountpoint,
                       dead_mount=True)
        if release:
            ram.release(force, checked=False)
        return
    pid = st["pid"]
    ram = RamDir(st["ram"]["dir"], report)
    if wait:
        _wait_for_replication(mountpoint)
        _wait_for_uploads(mountpoint)
    if release and not force:
        # The daemon knows which peers are alive: ask it, not the records.
        _refuse_unsafe(control.request(mountpoint, "status")["status"]["ram"])
    _unmount(mountpoint)
    deadline = time.monotonic() + timeout
    while pid and time.monotonic() < deadline:
        if not process_alive(pid):
            break
        time.sleep(0.05)
    else:
        if pid:
            fail(f"unmounted {mountpoint}, but daemon pid {pid} is still running")
    report.fields.update(unmounted=mountpoint)
    if release:
        ram.release(force, checked=True)
    else:
        ram.say_what_stays(mountpoint, st["ram"])


def _refuse_unsafe(ram: dict[str, Any]) -> None:
    files, nbytes = ram.get("only_copy_files", 0), ram.get("only_copy_bytes", 0)
    if files:
        fail(f"--release: {plural(files, 'file')} ({format_size(nbytes)}) with the only copy "
             "in this RAM tier (not persisted, no live peer holds one): wait for them (--wait), or "
             "give --force to drop them")


class RamDir:
    """A mount's RAM dir once its daemon is gone: what stays, and releasing it."""

    def __init__(self, path: str, report: Report) -> None:
        self.path = path
        self.data = os.path.join(path, "data")
        self.report = report

    def tmpfs_size(self) -> tuple[int, int] | None:
        """(used, size) of the RAM tier's own tmpfs, or None if it has none."""
        e = mount_entry(self.data)
        if e is None or e["fstype"] != "tmpfs":
            return None
        sv = os.statvfs(self.data)
        return (sv.f_blocks - sv.f_bfree) * sv.f_frsize, sv.f_blocks * sv.f_frsize

    def say_what_stays(self, mountpoint: str, ram: dict[str, Any]) -> None:
        tmpfs = self.tmpfs_size()
        where = (f"the RAM tier's tmpfs {self.data} stays mounted ({format_size(tmpfs[0])} "
                 f"used, size {format_size(tmpfs[1])})" if tmpfs is not None else
                 f"the RAM dir {self.path} stays ({format_size(ram.get('used', 0))} in memory)")
        self.report.say(f"unmounted {mountpoint}; {where} so that a restarted daemon "
                        f"re-adopts its files; `mtcfs umount --release {mountpoint}` gives "
                        "the memory back", unmounted=mountpoint,
                        stays={"ram_dir": self.path, "tmpfs": self.data if tmpfs else None,
                               "used_bytes": tmpfs[0] if tmpfs else ram.get("used", 0),
                               "tmpfs_size_bytes": tmpfs[1] if tmpfs else None})

    def release(self, force: bool, checked: bool) -> None:
        """Unmount the tmpfs and remove the RAM dir (no daemon may use it). Unless
        `checked` (the daemon said) or `force`, refuse while the records say a file's
        only copy is here."""
        if not os.path.isdir(self.path):
            fail(f"--release: no RAM dir {self.path} (give --ram-dir if the mount used another)")
        owner = _daemon_holding(self.path)
        if owner is not None:
            fail(f"--release: the RAM dir {self.path} is in use by mtcfs daemon pid {owner}")
        if not (checked or force):
            _refuse_unsafe(only_here_recorded(self.path))
        tmpfs = self.tmpfs_size()
        if tmpfs is not None:
            r = subprocess.run(["umount", self.data], capture_output=True, text=True)
            if r.returncode != 0:
                fail(f"--release: cannot unmount the RAM tier's tmpfs {self.data}: "
                     f"{r.stderr.strip() or 'umount failed'}{_holders_note(self.data)}")
        shutil.rmtree(self.path)
        freed = f"{format_size(tmpfs[0])} in its tmpfs" if tmpfs is not None else "its files"
        self.report.say(f"released the RAM tier: {freed} given back, {self.path} removed",
                        released={"ram_dir": self.path,
                                  "freed_bytes": tmpfs[0] if tmpfs is not None else None})


def _daemon_holding(ram_dir: str) -> int | None:
    """The pid of a daemon that holds the RAM dir's lock, if one does."""
    import fcntl

    try:
        fd = os.open(os.path.join(ram_dir, "lock"), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.read(fd, 64).decode(errors="replace").strip()
        return int(owner) if owner.isdigit() else -1
    finally:
        os.close(fd)
    return None


def only_here_recorded(ram_dir: str) -> dict[str, int]:
    """From the metadata store a stopped daemon left: files with data here that are
    not persisted and have no other holder on record (liveness is unknown now)."""
    import json
    import stat

    from mtcfs.core.namespace import CLOSED
    from mtcfs.core.store import MetaStore

    path = os.path.join(ram_dir, "meta.db")
    if not os.path.exists(path):
        return {"only_copy_files": 0, "only_copy_bytes": 0}
    try:
        with open(os.path.join(ram_dir, "daemon.json")) as f:
            me = json.load(f).get("node_id", "")
    except (OSError, ValueError):
        me = ""
    store = MetaStore(path)
    files = nbytes = 0
    try:
        for r in store.load_inodes():
            if not (stat.S_ISREG(r.mode) and r.has_data):
                continue
            persisted = r.state == CLOSED and r.persisted_version == r.version
            others = [h for h in r.holders.split(",") if h and h != me] if me else []
            if not persisted and not others:
                files += 1
                nbytes += r.size
    finally:
        store.close()
    return {"only_copy_files": files, "only_copy_bytes": nbytes}


def _unmount(mountpoint: str) -> None:
    r = subprocess.run(["fusermount3", "-u", mountpoint], capture_output=True, text=True)
    if r.returncode != 0:
        why = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "unmount failed"
        fail(f"cannot unmount {mountpoint}: {why}{_holders_note(mountpoint)}")


def _holders_note(path: str) -> str:
    holders = processes_using(path)
    if not holders:
        return ""
    shown = ", ".join(f"pid {pid} {name} ({how})" for pid, name, how in holders[:8])
    more = f" and {len(holders) - 8} more" if len(holders) > 8 else ""
    return f" (in use by {shown}{more})"


def processes_using(path: str) -> list[tuple[int, str, str]]:
    """(pid, command name, how) of the processes with a file open below `path`, or
    their working or root directory there (as fuser -m finds them, from /proc)."""
    prefix = path.rstrip("/") + "/"
    out = []
    for pid_s in os.listdir("/proc"):
        if not pid_s.isdigit() or int(pid_s) == os.getpid():
            continue
        base = f"/proc/{pid_s}"
        hows = [how for link, how in (("cwd", "working directory"), ("root", "root"))
                if _under(_readlink(f"{base}/{link}"), path, prefix)]
        try:
            fds = os.listdir(f"{base}/fd")
        except OSError:
            fds = []
        if any(_under(_readlink(f"{base}/fd/{fd}"), path, prefix) for fd in fds):
            hows.append("open file")
        if hows:
            try:
                with open(f"{base}/comm") as f:
                    name = f.read().strip()
            except OSError:
                name = "?"
            out.append((int(pid_s), name, ", ".join(hows)))
    return sorted(out)


def _readlink(p: str) -> str:
    try:
        return os.readlink(p)
    except OSError:
        return ""


def _under(target: str, path: str, prefix: str) -> bool:
    return target == path or target.startswith(prefix)


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
