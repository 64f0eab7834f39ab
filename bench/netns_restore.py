"""Restores between hosts in network namespaces, over veth links as they are and
shaped to 1 Gbit/s per holder (tc tbf), so that the links, not the two CPUs of
this machine, are the limit.

Hosts (tests/support/netns.py): h0, h1, h2 hold every file (h0 writes it, K=2);
per rep and per k in 1, 2, 3 a new empty host r<k>, peered with h0..h<k-1> only,
reads the file (a subprocess reading through its mount, open to EOF). Its blocks
come from all k holders at once over the data channel (striped). Over the
links as they are, one more reader per k in 1, 3 restores the file into its RAM
tier without reading it (`mtcfs prefetch`: request to every block verified).

Reference, measured in the same run over the same links: a raw sendfile() stream
of the same bytes from a Python process in h0 to one in the reader's host
(recv_into + pwrite into /dev/shm), connect to acknowledgement. Shaped, one
holder's link carries at most 1 Gbit/s (119 MiB/s), so three holders can reach
about three times that.

CPU seconds per GiB (user + system, from /proc) are taken over each restore for
the reader's daemon and for the holders' daemons together.

Last, the holders restart with TLS (--tls-cert/--tls-key/--tls-ca: a CA and a
certificate per host made for the run) and the restores run again over the
links as they are: TLS's cost against the same restores without it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from bulk import RECEIVER
from common import (
    BENCH_DIR,
    BenchError,
    Context,
    Row,
    code_version,
    cpu_seconds,
    err,
    median,
    mib_s,
    save_details,
)
from peers import prefetch_seconds
from ramtier import _size

DETAILS = BENCH_DIR / "results" / "netns_restore.json"
RATE = "1gbit"
HOLDERS = 3

_SENDER = r"""
import socket, sys, time
src, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open(src, "rb") as f:
    t0 = time.monotonic()
    s = socket.create_connection((addr, port))
    s.sendfile(f)
    assert s.recv(1) == b"k"
    print(time.monotonic() - t0, flush=True)
"""


def _shape(host: Any, on: bool) -> None:
    host.run(["tc", "qdisc", "del", "dev", "eth0", "root"], check=False, capture_output=True)
    if on:
        host.run(["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", RATE,
                  "burst", "1mb", "latency", "100ms"], check=True, capture_output=True)


def _use_tls(cluster: Any, root: Path, tls: dict[int, list[str]]) -> None:
    """A CA and a certificate per host (its address as IP SAN): --tls-* arguments."""
    from support.certs import make_ca, make_cert

    ca = make_ca("mtcfs bench CA")
    (root / "ca.crt").write_bytes(ca[2])
    for i, host in enumerate(cluster.hosts):
        cert, key = make_cert(ca, f"host-{i}", ips=(host.addr,))
        (root / f"host-{i}.crt").write_bytes(cert)
        (root / f"host-{i}.key").write_bytes(key)
        (root / f"host-{i}.key").chmod(0o600)
        tls[i] = ["--tls-cert", str(root / f"host-{i}.crt"), "--tls-key",
                  str(root / f"host-{i}.key"), "--tls-ca", str(root / "ca.crt")]


def group(ctx: Context) -> list[Row]:
    from support.mounts import wait_until
    from support.netns import Cluster, netns_unavailable
    from support.netns_hosts import PORT, READER, Node, finish_read

    why = netns_unavailable()
    if why:
        raise BenchError(f"network namespaces unavailable: {why}")
    if shutil.which("tc") is None:
        raise BenchError("needs tc (iproute2)")
    size = ctx.size
    root = ctx.scratch.tmp / f"netns-{uuid.uuid4().hex[:6]}"
    ram_root = ctx.scratch.shm / f"netns-{uuid.uuid4().hex[:6]}"
    root.mkdir()
    ram_root.mkdir()
    token = root / "peer-token"
    token.write_text(uuid.uuid4().hex + uuid.uuid4().hex + "\n")
    token.chmod(0o600)
    ram = f"{max(2, 3 * size // (1 << 30) + 1)}GiB"
    details: dict[str, Any] = {"size": size, "reps": ctx.reps, "rate": RATE,
                               "code": code_version()}
    src = os.urandom(size)
    cluster = Cluster(HOLDERS + 1).start()
    nodes: list[Node] = []

    tls: dict[int, list[str]] = {}  # host index -> --tls-* arguments, once TLS is on

    def node(i: int, name: str, peers: list[str], replicas: int) -> Node:
        host = cluster.hosts[i]
        mp = root / f"mnt-{name}"
        mp.mkdir()
        n = Node(host, name, mp, ram_root / f"ram-{name}", root / f"{name}.log",
                 ["--listen", f"{host.addr}:{PORT}", "--peers", ",".join(peers),
                  "--token-file", str(token), "--replicas", str(replicas),
                  *tls.get(i, [])], ram_size=ram)
        nodes.append(n)
        n.spawn()
        n.wait_live()
        return n

    def stop(n: Node) -> None:
        n.stop()
        nodes.remove(n)
        subprocess.run(["umount", "-l", str(n.ram_dir / "data")], capture_output=True)
        shutil.rmtree(n.ram_dir, ignore_errors=True)

    reader_host = cluster.hosts[HOLDERS]
    try:
        addrs = [f"{h.addr}:{PORT}" for h in cluster.hosts[:HOLDERS]]
        holders = [node(i, f"h{i}", [a for j, a in enumerate(addrs) if j != i], HOLDERS - 1)
                   for i in range(HOLDERS)]
        for h in holders:
            want = {f"h{i}" for i in range(HOLDERS)} - {h.node_id}
            wait_until(lambda h=h, want=want: h.live_peers() >= want, 30,
                       what=f"{h.node_id} to see its peers")
        err.print(f"  hosts h0..h{HOLDERS - 1} hold each file (K={HOLDERS - 1}); per rep "
                  f"readers r1..r{HOLDERS} peered with the first 1..{HOLDERS}", style="dim")
        ref_src = ram_root / "sendfile-src"
        ref_src.write_bytes(src)
        seq = iter(range(1_000_000))

        def restore(k: int, rel: str, prefetch: bool = False) -> tuple[float, float, float]:
            """(MiB/s, reader CPU s/GiB, holders' CPU s/GiB) of one restore from k holders:
            read through the mount, or (prefetch) into its RAM tier."""
            r = node(HOLDERS, f"r{k}-{next(seq)}", addrs[:k], 0)
            try:
                wait_until(lambda: r.live_peers() >= {f"h{i}" for i in range(k)}, 30,
                           what=f"{r.node_id} to see h0..h{k - 1}")
                pids = [h.proc.pid for h in holders[:k] if h.proc is not None]
                assert r.proc is not None
                ctx.scratch.warm(2 * size)  # the copy and the page cache (see Scratch.warm)
                c0 = cpu_seconds(r.proc.pid), sum(cpu_seconds(p) for p in pids)
                if prefetch:
                    res = {"ok": True, "size": size, "elapsed": prefetch_seconds(r.mp, [rel])}
                else:
                    res = finish_read(subprocess.Popen([sys.executable, "-c", READER,
                                                        str(r.path(rel))],
                                                       stdout=subprocess.PIPE, text=True),
                                      600, f"restore on {r.node_id}")
                c1 = cpu_seconds(r.proc.pid), sum(cpu_seconds(p) for p in pids)
                if not res["ok"] or res["size"] != size:
                    raise BenchError(f"restore on {r.node_id}: {res}")
                by = r.status()["fetch"]["bytes_by_source"]
                sources.setdefault(f"{mode_now[0]} {'p' * prefetch}{k}", []).append(
                    {h: round(n / size, 2) for h, n in sorted(by.items())})
                gib = size / (1 << 30)
                return (mib_s(size, res["elapsed"]), (c1[0] - c0[0]) / gib,
                        (c1[1] - c0[1]) / gib)
            finally:
                stop(r)

        def sendfile_ref() -> float:
            dest = ram_root / "sendfile-dest"
            ctx.scratch.warm(2 * size)
            recv = reader_host.popen([sys.executable, "-c", RECEIVER, reader_host.addr,
                                      str(dest), str(size)], stdout=subprocess.PIPE, text=True)
            try:
                assert recv.stdout is not None
                port = recv.stdout.readline().strip()
                out = holders[0].host.run([sys.executable, "-c", _SENDER, str(ref_src),
                                           reader_host.addr, port], capture_output=True,
                                          text=True, check=True, timeout=600)
                return mib_s(size, float(out.stdout))
            finally:
                recv.wait(timeout=60)
                dest.unlink(missing_ok=True)

        results: dict[str, dict[str, list[float]]] = {}
        sources: dict[str, list[dict[str, float]]] = {}  # share of the bytes per holder
        mode_now = [""]
        for mode in ("unlimited", "shaped", "tls"):
            mode_now[0] = mode
            for h in holders:
                _shape(h.host, mode == "shaped")
            if mode == "tls":
                _use_tls(cluster, root, tls)
                for i, h in enumerate(holders):  # restarted over their RAM dirs, with TLS
                    h.stop()
                    h.args = [*h.args, *tls[i]]
                    h.spawn()
                    h.wait_live()
                for h in holders:
                    want = {f"h{i}" for i in range(HOLDERS)} - {h.node_id}
                    wait_until(lambda h=h, want=want: h.live_peers() >= want, 30,
                               what=f"{h.node_id} to see its peers over TLS")
            res = results[mode] = {"sendfile": [], **{f"{k}": [] for k in range(1, 4)},
                                   **{f"cpu_reader_{k}": [] for k in range(1, 4)},
                                   **{f"cpu_holders_{k}": [] for k in range(1, 4)}}
            prefetches = (1, HOLDERS) if mode == "unlimited" else ()
            for k in prefetches:
                res.update({f"p{k}": [], f"cpu_reader_p{k}": [], f"cpu_holders_p{k}": []})
            for rep in range(ctx.reps):
                rel = f"{mode}-{rep}.bin"
                holders[0].write(rel, src)
                wait_until(lambda rel=rel: len((holders[0].state(rel) or {}).get("holders", []))
                           == HOLDERS, 120, what=f"{rel} on every holder")
                # alternate the order of the restores and the reference between reps
                order = [1, 2, 3] if rep % 2 == 0 else [3, 2, 1]
                if rep % 2:
                    res["sendfile"].append(sendfile_ref())
                for k in order:
                    mib, cpu_r, cpu_h = restore(k, rel)
                    res[str(k)].append(mib)
                    res[f"cpu_reader_{k}"].append(cpu_r)
                    res[f"cpu_holders_{k}"].append(cpu_h)
                for k in prefetches:
                    mib, cpu_r, cpu_h = restore(k, rel, prefetch=True)
                    res[f"p{k}"].append(mib)
                    res[f"cpu_reader_p{k}"].append(cpu_r)
                    res[f"cpu_holders_p{k}"].append(cpu_h)
                if not rep % 2:
                    res["sendfile"].append(sendfile_ref())
                err.print(f"  {mode} rep {rep + 1}/{ctx.reps}: sendfile "
                          f"{res['sendfile'][-1]:.0f} MiB/s; restore from 1/2/3 holders "
                          + "/".join(f"{res[str(k)][-1]:.0f}" for k in (1, 2, 3))
                          + "".join(f"; prefetch from {k}: {res[f'p{k}'][-1]:.0f}"
                                    for k in prefetches)
                          + " MiB/s (shares per holder: "
                          + "; ".join(str(sources[f"{mode} {k}"][-1]) for k in (1, 2, 3))
                          + ")", style="dim")
                os.unlink(holders[0].path(rel))
        details["results"] = results
        details["bytes_by_holder"] = sources
        save_details(DETAILS, details)
    finally:
        for n in list(nodes):
            try:
                stop(n)
            except Exception as e:  # keep cleaning up
                err.print(f"[red]cleanup of {n} failed: {e}[/]")
        cluster.close()
        shutil.rmtree(ram_root, ignore_errors=True)

    what = _size(size)
    rows = []
    for mode, label in (("unlimited", "veth"), ("shaped", f"veth shaped to {RATE} per holder"),
                        ("tls", "veth, TLS")):
        res = results[mode]
        if mode == "tls":  # TLS's cost: against the same restores without it
            for k in (1, HOLDERS):
                rows.append(Row("netns", f"restore of {what} from {k} holder(s), {label}",
                                "MiB/s", res[str(k)], ref=results["unlimited"][str(k)],
                                ref_label="no TLS", note="reference: the same restore over "
                                "veth without TLS; CPU s/GiB: reader "
                                f"{median(res[f'cpu_reader_{k}']):.2f}, holders "
                                f"{median(res[f'cpu_holders_{k}']):.2f}"))
            continue
        ref = dict(ref=res["sendfile"], ref_label="sendfile",
                   note=f"reference: raw sendfile() stream h0 -> reader host over {label}")
        for k in (1, 2, 3):
            cpu = (f"CPU s/GiB: reader {median(res[f'cpu_reader_{k}']):.2f}, "
                   f"holders {median(res[f'cpu_holders_{k}']):.2f}")
            if mode == "shaped" and k == HOLDERS:
                # The striping target: three shaped links against one.
                rows.append(Row("netns", f"restore of {what} from {k} holders, {label}",
                                "MiB/s", res[str(k)], ref=res["1"], ref_label="1 holder",
                                min_ratio=2.5, note=f"reference: the same restore from one "
                                f"holder over {label}; {cpu}"))
                continue
            rows.append(Row("netns", f"restore of {what} from {k} holder(s), {label}", "MiB/s",
                            res[str(k)], min_ratio=0.8 if (mode, k) == ("unlimited", 1)
                            else None, **{**ref, "note": f"{ref['note']}; {cpu}"}))
            if f"p{k}" in res:
                cpu = (f"CPU s/GiB: reader {median(res[f'cpu_reader_p{k}']):.2f}, "
                       f"holders {median(res[f'cpu_holders_p{k}']):.2f}")
                rows.append(Row("netns", f"restore of {what} into RAM (mtcfs prefetch) from "
                                f"{k} holder(s), {label}", "MiB/s", res[f"p{k}"],
                                min_ratio=0.8 if k == 1 else None,
                                **{**ref, "note": f"{ref['note']}; {cpu}"}))
    return rows


if __name__ == "__main__":  # pragma: no cover - a quick look without bench/run.py
    os.execv(sys.executable, [sys.executable, str(BENCH_DIR / "run.py"), "--only", "netns",
                              *sys.argv[1:]])
