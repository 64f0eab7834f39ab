"""`mtcfs status`: what the daemon holds and how it is doing."""

from __future__ import annotations

import json
import os

import click
from rich.table import Table

from mtcfs.cli.common import daemon_request, table_console
from mtcfs.sizes import format_size


@click.command("status")
@click.argument("mountpoint", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def status(mountpoint: str, as_json: bool) -> None:
    """Show tiers, usage and health of the mount at MOUNTPOINT."""
    st = daemon_request(os.path.abspath(mountpoint), "status")["status"]
    if as_json:
        click.echo(json.dumps(st, indent=2, sort_keys=True))
        return
    ram = st["ram"]
    pct = 100.0 * ram["used"] / ram["capacity"] if ram["capacity"] else 0.0
    t = Table(title=f"mtcfs {st['mountpoint']}", show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("health", st["health"])
    t.add_row("node", st["node_id"])
    t.add_row("data path", st["data_path"])
    t.add_row("daemon", f"pid {st['pid']}, version {st['version']}, up {st['uptime']:.0f} s")
    t.add_row("RAM tier", f"{format_size(ram['used'])} of {format_size(ram['capacity'])} "
                          f"used ({pct:.1f}%), {format_size(ram['free'])} free")
    t.add_row("RAM dir", ram["dir"])
    states = ", ".join(f"{n} {s}" for s, n in sorted(st["states"].items())) or "none"
    t.add_row("files", f"{st['files']} ({states}) in {st['directories']} directories")
    t.add_row("open handles", str(st["open_handles"]))
    t.add_row("traffic", f"{format_size(st['bytes_written'])} written, "
                         f"{format_size(st['bytes_read'])} read")
    d = st.get("durable")
    if d:
        t.add_row("durable tier", f"{d['url']} (persist {d['policy']})")
        t.add_row("uploads", f"{d['queued_files']} queued, {d['inflight_files']} in flight, "
                             f"{format_size(d['pending_bytes'])} pending; "
                             f"{d['uploaded_files']} files / {format_size(d['uploaded_bytes'])} "
                             f"uploaded")
        rt = d["readthrough"]
        t.add_row("read-through", f"{rt['fetched_files']} files / "
                                  f"{format_size(rt['fetched_bytes'])} fetched, "
                                  f"{rt['integrity_errors']} checksum errors")
        if d["conflicts"]:
            t.add_row("conflicts", f"{d['conflicts']} files not persisted (changed elsewhere)")
        err = d["last_error"] or rt["last_error"]
        if err:
            t.add_row("last error", err)
    else:
        t.add_row("durable tier", "none (mount with --bucket)")
    p = st.get("peers")
    if p:
        live = p["live_peers"]
        t.add_row("peer tier", f"listening on {p['listen']}, {live} of {len(p['peers'])} peers "
                               f"alive, K={p['replicas']}"
                               + (f", failure domain {p['failure_domain']}"
                                  if p["failure_domain"] else ""))
        for peer in p["peers"]:
            seen = peer["last_seen_seconds"]
            t.add_row("", f"{peer['address']} {peer['node_id'] or '?'}: "
                          + ("alive" if peer["alive"] else "DEAD")
                          + (f", seen {seen:.0f} s ago" if seen is not None else ", never seen"))
        t.add_row("replication", f"{p['replication_queue']} files waiting; "
                                 f"{p['replicas_sent']} replicas / "
                                 f"{format_size(p['replica_bytes_sent'])} sent, "
                                 f"{p['replicas_received']} / "
                                 f"{format_size(p['replica_bytes_received'])} received, "
                                 f"{p['replica_failures']} failed")
        idx = p["index"]
        t.add_row("index", f"{idx['entries']} entries, clock {idx['clock']}, "
                           f"{p['broadcast_queue']} changes to send, {idx['conflicts']} conflicts")
        t.add_row("peer reads", f"{p['fetched_files']} files / "
                                f"{format_size(p['fetched_bytes'])} fetched, "
                                f"{p['integrity_errors']} checksum errors")
        if p["last_error"]:
            t.add_row("last peer error", p["last_error"])
    else:
        t.add_row("peer tier", "none (mount with --listen and --peers)")
    vis = st.get("visibility")
    if vis:
        avg = 1000 * vis["wait_seconds"] / vis["waits"] if vis["waits"] else 0.0
        t.add_row("visibility", f"on {vis['mode']} (commit timeout {vis['commit_timeout']:g} s): "
                                f"{vis['waits']} waits, {avg:.1f} ms average, "
                                f"{vis['timeouts']} timed out")
        if vis["last_timeout"]:
            t.add_row("", f"last timeout: not answered by {vis['last_timeout']}")
    lc = st.get("lifecycle")
    if lc:
        fs_ = lc["fsync"]
        t.add_row("lifecycle", (f"keep {lc['keep_steps']} steps" if st.get("durable")
                                and lc["incomplete_grace"] is not None else "no retention")
                  + f", full-timeout {lc['full_timeout']:.0f} s, fsync {fs_['level']}")
        ev = ", ".join(f"{reason} {n} ({format_size(lc['evicted_bytes'].get(reason, 0))})"
                       for reason, n in sorted(lc["evictions"].items()))
        t.add_row("evictions", ev or "none")
        if lc["writers_waiting"]:
            t.add_row("WAITING", f"{lc['writers_waiting']} writes wait for RAM tier space")
        if lc["last_full"]:
            t.add_row("last full", f"{lc['last_full']} ({lc['last_full_age']:.0f} s ago)")
        lags = [f"{what} {v:.2f} s" for what, v in (("close->K replicas",
                                                    lc["last_replication_lag"]),
                                                   ("close->persisted", lc["last_persist_lag"]))
                if v is not None]
        if lags:
            t.add_row("last lag", ", ".join(lags))
        if fs_["failures"]:
            t.add_row("fsync", f"{fs_['failures']} fsyncs failed: level {fs_['level']} not "
                               f"reached in {fs_['timeout']:.0f} s")
    if ram["enospc"]:
        t.add_row("ENOSPC", f"{ram['enospc']} writes refused: the RAM tier was full")
    if ram.get("refused"):
        t.add_row("replicas refused", f"{ram['refused']} replicas from peers refused: full")
    if st.get("metrics_url"):
        t.add_row("metrics", st["metrics_url"])
    table_console().print(t)
