"""`mtcfs status`: what the daemon holds and how it is doing."""

from __future__ import annotations

import json
import os

import click

from mtcfs.cli.common import daemon_request, plural, print_table
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
    rows: list[list[str]] = []

    def row(key: str, value: str) -> None:
        rows.append([key, value])

    row("health", st["health"])
    row("node", st["node_id"])
    row("data path", st["data_path"])
    row("daemon", f"pid {st['pid']}, version {st['version']}, up {st['uptime']:.0f} s")
    row("RAM tier", f"{format_size(ram['used'])} of {format_size(ram['capacity'])} "
                    f"used ({pct:.1f}%), {format_size(ram['free'])} free")
    row("RAM dir", ram["dir"])
    hp = st.get("huge_pages") or {}
    if hp:
        probe = hp.get("probe") or {}
        row("huge pages", f"{'on' if hp['in_use'] else 'off'} (--huge-pages {hp['setting']}"
                          + (f"; first touch {probe['huge_ms_per_mib']:g} ms/MiB huge, "
                             f"{probe['small_ms_per_mib']:g} ms/MiB small"
                             if "huge_ms_per_mib" in probe else "") + ")")
    states = ", ".join(f"{n} {s}" for s, n in sorted(st["states"].items())) or "none"
    dirs = plural(st["directories"], "directory", "directories")
    row("files", f"{st['files']} ({states}) in {dirs}")
    row("open handles", str(st["open_handles"]))
    pt = st.get("bytes_written_passthrough", 0)
    row("traffic", f"{format_size(st['bytes_written'] + pt)} written"
                   + (f" ({format_size(pt)} through passthrough, counted as each version is "
                      f"sealed)" if pt else "")
                   + f", {format_size(st['bytes_read'])} read through the daemon")
    safe = st.get("newest_safe_step")
    row("newest safe step", safe["path"] if safe else "none")
    pf = (st.get("fetch") or {}).get("prefetch")
    if pf and pf["files_total"]:
        row("prefetch", f"{format_size(pf['bytes_done'])} of {format_size(pf['bytes_total'])}"
                        f" in RAM, {pf['files_done']} of {plural(pf['files_total'], 'file')}"
                        + (f", {pf['failed']} failed" if pf["failed"] else "")
                        + ("" if pf["finished"] else ", under way"))
    rs = st.get("restore")
    if rs and rs["files_total"]:
        eta = f", about {rs['eta_seconds']:g} s left" if rs.get("eta_seconds") else ""
        row("background restore",
            f"{format_size(rs['bytes_done'])} of {format_size(rs['bytes_total'])} in RAM, "
            f"{rs['files_done']} of {plural(rs['files_total'], 'file')}"
            + (f", {rs['failed']} failed" if rs["failed"] else "")
            + (f", {format_size(rs['bytes_per_second'])}/s{eta}" if rs["state"] == "running"
               else f", done in {rs['seconds']:g} s"))
    d = st.get("durable")
    if d:
        row("durable tier", f"{d['url']} (persist {d['policy']})")
        age = d.get("last_upload_age")
        row("uploads", f"{d['queued_files']} queued, {d['inflight_files']} in flight, "
                       f"{format_size(d['pending_bytes'])} pending; "
                       f"{plural(d['uploaded_files'], 'file')} / "
                       f"{format_size(d['uploaded_bytes'])} uploaded"
                       + (f", the last {age:.0f} s ago" if age is not None else ""))
        rt = d["readthrough"]
        row("read-through", f"{plural(rt['fetched_files'], 'file')} / "
                            f"{format_size(rt['fetched_bytes'])} fetched, "
                            f"{plural(rt['integrity_errors'], 'checksum error')}")
        if d["conflicts"]:
            row("conflicts", f"{plural(d['conflicts'], 'file')} not persisted "
                             f"(changed elsewhere)")
        if d["lost_files"]:
            row("lost", f"{plural(d['lost_files'], 'file')} to upload with no copy on any "
                        f"host (uploaded if one comes back)")
        err = d["last_error"] or rt["last_error"]
        if err:
            row("last error", err)
    else:
        row("durable tier", "none (mount with --bucket)")
    p = st.get("peers")
    if p:
        live = p["live_peers"]
        row("peer tier", f"listening on {p['listen']}, {live} of {plural(len(p['peers']), 'peer')}"
                         f" alive, K={p['replicas']}"
                         + (f", failure domain {p['failure_domain']}"
                            if p["failure_domain"] else ""))
        for peer in p["peers"]:  # (under the peer tier's row)
            seen = peer["last_seen_seconds"]
            row("", f"{peer['address']} {peer['node_id'] or '?'}: "
                    + ("alive" if peer["alive"] else "DEAD")
                    + (f", seen {seen:.0f} s ago" if seen is not None else ", never seen"))
        auth = st.get("peer_auth") or {}
        if auth:
            row("peer auth", ("token" if auth["mode"] == "token" else "none (--insecure)")
                + (", TLS" if auth["tls"] else "")
                + (", data channel encrypted" if auth["encryption"] else ""))
        row("replication", f"{plural(p['replication_queue'], 'file')} waiting; "
                           f"{plural(p['replicas_sent'], 'replica')} / "
                           f"{format_size(p['replica_bytes_sent'])} sent, "
                           f"{p['replicas_received']} / "
                           f"{format_size(p['replica_bytes_received'])} received, "
                           f"{p['replica_failures']} failed")
        idx = p["index"]
        row("index", f"{plural(idx['entries'], 'entry', 'entries')}, clock {idx['clock']}, "
                     f"{plural(p['broadcast_queue'], 'change')} to send, "
                     f"{plural(idx['conflicts'], 'conflict')}")
        row("peer reads", f"{plural(p['fetched_files'], 'file')} / "
                          f"{format_size(p['fetched_bytes'])} fetched, "
                          f"{plural(p['integrity_errors'], 'checksum error')}")
        if p["last_error"]:
            row("last peer error", p["last_error"])
    else:
        row("peer tier", "none (mount with --listen and --peers)")
    vis = st.get("visibility")
    if vis:
        avg = 1000 * vis["wait_seconds"] / vis["waits"] if vis["waits"] else 0.0
        row("visibility", f"on {vis['mode']} (commit timeout {vis['commit_timeout']:g} s): "
                          f"{plural(vis['waits'], 'wait')}, {avg:.1f} ms average, "
                          f"{vis['timeouts']} timed out")
        if vis["last_timeout"]:
            row("", f"last timeout: not answered by {vis['last_timeout']}")
    lc = st.get("lifecycle")
    if lc:
        fs_ = lc["fsync"]
        row("lifecycle", (f"keep {plural(lc['keep_steps'], 'step')}" if st.get("durable")
                          and lc["incomplete_grace"] is not None else "no retention")
            + f", full-timeout {lc['full_timeout']:.0f} s, fsync {fs_['level']}")
        ev = ", ".join(f"{reason} {n} ({format_size(lc['evicted_bytes'].get(reason, 0))})"
                       for reason, n in sorted(lc["evictions"].items()))
        row("evictions", ev or "none")
        if lc["writers_waiting"]:
            row("WAITING", f"{plural(lc['writers_waiting'], 'write')} wait for RAM tier space")
        if lc["last_full"]:
            row("last full", f"{lc['last_full']} ({lc['last_full_age']:.0f} s ago)")
        lags = [f"{what} {v:.2f} s" for what, v in (("close->K replicas",
                                                    lc["last_replication_lag"]),
                                                   ("close->persisted", lc["last_persist_lag"]))
                if v is not None]
        if lags:
            row("last lag", ", ".join(lags))
        if fs_["failures"]:
            row("fsync", f"{plural(fs_['failures'], 'fsync')} failed: level {fs_['level']} "
                         f"not reached in {fs_['timeout']:.0f} s")
    if ram["enospc"]:
        row("ENOSPC", f"{plural(ram['enospc'], 'write')} refused: the RAM tier was full")
    if ram.get("refused"):
        row("replicas refused", f"{plural(ram['refused'], 'replica')} from peers refused: full")
    if st.get("metrics_url"):
        row("metrics", st["metrics_url"])
    print_table(f"mtcfs {st['mountpoint']}", ["", ""], rows, show_header=False)
