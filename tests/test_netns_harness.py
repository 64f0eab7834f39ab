"""The network-namespace harness (tests/support/netns.py) itself: reachability, faults,
clean-up, and that mounts made inside a host are visible to the test process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.netns import (  # noqa: F401 - cluster_factory is a fixture
    NETNS_DIR,
    Cluster,
    Host,
    _owner_alive,
    cleanup_stale,
    cluster_factory,
    netns_unavailable,
)

pytestmark = pytest.mark.skipif(netns_unavailable() is not None,
                                reason=netns_unavailable() or "")

PORT = 7000

ECHO_SERVER = r"""
import socket, sys, threading
srv = socket.create_server(("0.0.0.0", int(sys.argv[1])), backlog=64)
print("ready", flush=True)
def serve(c):
    with c:
        while data := c.recv(65536):
            c.sendall(data)
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""

ECHO_CLIENT = r"""
import socket, sys
addr, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
try:
    with socket.create_connection((addr, port), timeout=timeout) as s:
        s.sendall(b"ping")
        print(s.recv(16).decode())
except OSError as e:
    print(type(e).__name__)
    sys.exit(1)
"""

# Prints the first datagram it gets within argv[2] seconds, or "nothing".
UDP_RECEIVER = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.settimeout(float(sys.argv[2]))
print("ready", flush=True)
try:
    print(s.recv(64).decode(), flush=True)
except TimeoutError:
    print("nothing", flush=True)
"""

UDP_SEND = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    s.sendto(sys.argv[3].encode(), (sys.argv[1], int(sys.argv[2])))
except OSError as e:
    print(type(e).__name__)
"""

PY = [sys.executable, "-I", "-c"]  # -I: no site, fast start-up


def start_echo(host: Host) -> subprocess.Popen:
    proc = host.popen([*PY, ECHO_SERVER, str(PORT)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def echo(client: Host, server: Host, timeout: float = 1.0) -> str:
    """'ping' if `client` got an echo from `server`, else the error's name."""
    res = client.run([*PY, ECHO_CLIENT, server.addr, str(PORT), str(timeout)],
                     capture_output=True, text=True, timeout=timeout + 10)
    return res.stdout.strip()


def echo_fails_fast(client: Host, server: Host) -> None:
    t0 = time.monotonic()
    assert echo(client, server, timeout=1.0) != "ping"
    assert time.monotonic() - t0 < 2.0


def echo_recovers(client: Host, server: Host, within: float = 3.0) -> None:
    deadline = time.monotonic() + within
    while echo(client, server, timeout=0.5) != "ping":
        assert time.monotonic() < deadline, f"{client} -> {server} did not recover"


def udp_delivered(src: Host, dst: Host, port: int = 7001) -> bool:
    rx = dst.popen([*PY, UDP_RECEIVER, str(port), "0.5"], stdout=subprocess.PIPE, text=True)
    assert rx.stdout is not None and rx.stdout.readline() == "ready\n"
    src.run([*PY, UDP_SEND, dst.addr, str(port), "hello"], capture_output=True, timeout=10)
    got = rx.stdout.readline().strip()
    rx.wait(timeout=5)
    return got == "hello"


def root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


def test_topology(cluster_factory) -> None:  # noqa: F811
    before = root_links()
    c = cluster_factory(3)
    assert len(c.hosts) == 3
    prefix = c.subnet.rsplit(".", 1)[0]
    for i, h in enumerate(c.hosts):
        assert h.name == f"mtcfs-{c.id}-{i}"
        assert h.addr == f"{prefix}.{i + 1}"
        assert h.netns_path == f"/var/run/netns/{h.name}"
        assert Path(h.netns_path).exists()
        routes = h.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
        # Only the cluster's /24: nothing a host sends can leave the cluster.
        assert routes.split()[0] == c.subnet and "default" not in routes, routes
        lo = h.run(["ip", "-o", "link", "show", "lo"], capture_output=True, text=True).stdout
        assert ",UP," in lo, lo
    # The bridge lives in its own namespace; the root one gets no new interface.
    bridge = subprocess.run(["ip", "-n", c.bridge_ns, "-o", "-d", "link", "show", "br0"],
                            capture_output=True, text=True).stdout
    assert "bridge" in bridge
    assert root_links() == before


@pytest.mark.serial  # a timing bound: must not share the machine
def test_echo_and_link_down(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory(3)
    h0, h1, h2 = c.hosts
    start_echo(h0)
    assert echo(h1, h0) == "ping"
    assert echo(h2, h0) == "ping"

    h0.link_down()
    echo_fails_fast(h1, h0)
    echo_fails_fast(h2, h0)
    h0.link_up()
    echo_recovers(h1, h0)
    assert echo(h2, h0) == "ping"


@pytest.mark.serial  # a timing bound: must not share the machine
def test_one_way_drops(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory(3)
    h0, h1, h2 = c.hosts
    start_echo(h0)
    assert echo(h1, h0) == "ping"

    h0.drop_incoming_from(h1)
    echo_fails_fast(h1, h0)
    assert echo(h2, h0) == "ping"
    # One way: h0 -> h1 datagrams still arrive, h1 -> h0 ones don't.
    assert udp_delivered(h0, h1)
    assert not udp_delivered(h1, h0)
    h0.heal()
    assert echo(h1, h0) == "ping"
    assert udp_delivered(h1, h0)

    h0.drop_outgoing_to(h1)  # h0's SYN-ACKs to h1 vanish
    echo_fails_fast(h1, h0)
    assert echo(h2, h0) == "ping"
    assert udp_delivered(h1, h0)
    assert not udp_delivered(h0, h1)
    h0.heal()
    assert echo(h1, h0) == "ping"


@pytest.mark.serial  # a timing bound: must not share the machine
def test_heal_also_restores_link(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory(2)
    h0, h1 = c.hosts
    start_echo(h0)
    h0.link_down()
    h0.drop_incoming_from(h1)
    echo_fails_fast(h1, h0)
    c.heal()
    echo_recovers(h1, h0)


def test_exit_deletes_namespaces_and_kills_processes() -> None:
    with pytest.raises(RuntimeError, match="boom"), Cluster(2) as c:
        names = c.namespaces
        assert all(n in os.listdir(NETNS_DIR) for n in names)
        # A process group: the shell and its background child must both die.
        sh = c.hosts[0].popen(["sh", "-c", "sleep 60 & echo $!; wait"],
                              stdout=subprocess.PIPE, text=True)
        assert sh.stdout is not None
        child = int(sh.stdout.readline())
        stray = c.hosts[1].run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"],
                               capture_output=True, text=True).stdout
        raise RuntimeError("boom")
    present = set(os.listdir(NETNS_DIR))
    assert not any(n in present for n in names)
    assert sh.returncode is not None
    for pid in (child, int(stray)):  # popen'd group member, and a run() leftover
        assert not _alive(pid), pid


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead too


def test_cleanup_stale_spares_live_clusters(cluster_factory) -> None:  # noqa: F811
    live = cluster_factory(1)
    stale = "mtcfs-0badc0de-0"  # as a crashed run leaves it: no lock holder
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert not _owner_alive("0badc0de") and _owner_alive(live.id)
        assert stale in cleanup_stale()
        present = os.listdir(NETNS_DIR)
        assert stale not in present
        assert all(n in present for n in live.namespaces)
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


def test_mount_under_nsenter_is_visible_outside(cluster_factory, tmp_path: Path) -> None:  # noqa: F811
    # Stands in for a FUSE daemon run in a host: its mount must be seen by the test.
    h = cluster_factory(1).hosts[0]
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    h.run(["mount", "-t", "tmpfs", "-o", "size=1m", "mtcfs-netns-test", str(mnt)], check=True)
    try:
        assert os.path.ismount(mnt)
        h.run(["sh", "-c", f"echo inside > {mnt}/f"], check=True)
        assert (mnt / "f").read_text() == "inside\n"
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    assert not os.path.ismount(mnt)


def test_ip_netns_exec_would_hide_mounts(cluster_factory, tmp_path: Path) -> None:  # noqa: F811
    # Why the harness uses nsenter --net: `ip netns exec` makes a private mount
    # namespace, and a mount made in it is gone for everyone else.
    h = cluster_factory(1).hosts[0]
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run(["ip", "netns", "exec", h.name, "sh", "-c",
                          f"mount -t tmpfs -o size=1m mtcfs-netns-test {mnt} && "
                          f"mountpoint -q {mnt}"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert not os.path.ismount(mnt)
