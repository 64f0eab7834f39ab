"""Multi-host tests on one machine: each host is a Linux network namespace.

    with Cluster(3) as c:
        srv = c.hosts[0].popen([sys.executable, "-m", "mtcfs", ...])
        c.hosts[1].run(["ping", "-c1", c.hosts[0].addr])
        c.hosts[0].link_down()                      # pull host 0's cable
        c.hosts[0].drop_incoming_from(c.hosts[1])   # one-way packet loss
        c.hosts[0].heal()                           # back to a healthy network

In a test module, `from netns import cluster_factory  # noqa: F401` gives the
fixture `cluster_factory` (make(n=3) -> started Cluster, closed at teardown);
ruff also wants `# noqa: F811` on a test that takes it as an argument.

Topology: every host is a netns `mtcfs-<id>-<i>` whose `eth0` (10.x.y.<i+1>/24,
x/y random per cluster) is one end of a veth pair; the other end is a port of
bridge `br0` in a netns of its own (`mtcfs-<id>-br`), so nothing is added to
the root namespace. A host has only lo and the /24 route, no default route:
traffic to any address outside the cluster fails with ENETUNREACH and never
leaves the machine.

Processes are started with `nsenter --net=...`, which switches the network
namespace only. `ip netns exec` would also unshare the mount namespace, so a
FUSE mount made by a daemon in the host would be invisible to the test process.
Each host has its own port space, so every host can listen on the same port.

Faults:
- link_down()/link_up() set the bridge-side end of the host's veth down/up: the
  host sees NO-CARRIER but keeps its address and route, so its packets and those
  sent to it vanish silently (connects time out, open TCP connections hang)
  rather than failing fast with ENETUNREACH.
- drop_incoming_from()/drop_outgoing_to() add nftables rules inside the host's
  netns (table `inet mtcfs`, input/output hooks) that drop IPv4 packets from/to
  the other host's address, open connections included. ARP is not affected. A
  drop is per packet, so a TCP connection in either direction stalls; one-way
  only shows for datagrams. A UDP sendto() to a dropped address fails with EPERM
  (netfilter's answer to a locally generated packet); TCP just retransmits.
- heal() removes both kinds of fault from the host.

Clean-up: Cluster.close() (also on an exception in the `with` body) stops the
processes started with popen() (SIGTERM to the process group, SIGKILL after a
grace period), SIGKILLs anything else still in the namespaces and deletes
them. A cluster holds an flock on /run/mtcfs-netns/<id>.lock while it lives;
cleanup_stale(), run at every Cluster start, deletes `mtcfs-*` namespaces
whose lock nobody holds (left by a crashed or SIGKILLed run), so concurrent
test runs don't tear down each other's clusters. A FUSE daemon that close()
kills leaves its mount behind: unmount it before the cluster closes.

Needs root, `ip` (iproute2), `nsenter` (util-linux) and, for the drops, `nft`
(Debian package nftables; scripts/bootstrap.sh installs it).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import pytest

PREFIX = "mtcfs-"
NETNS_DIR = Path("/var/run/netns")
LOCK_DIR = Path("/run/mtcfs-netns")
NFT_TABLE = "mtcfs"
HOST_IF = "eth0"
BRIDGE = "br0"

Argv = Sequence[str | os.PathLike[str]]


def netns_unavailable() -> str | None:
    """Why network-namespace clusters can't run here, or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [b for b in ("ip", "nsenter") if shutil.which(b) is None]
    if missing:
        return f"missing binaries: {', '.join(missing)}"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {res.stderr.strip()}")
    return res


def _list_netns() -> list[str]:
    # Reading the directory beats forking `ip netns list` and is what it reads too.
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def _netns_pids(name: str) -> list[int]:
    res = _ip("netns", "pids", name, check=False)
    return [int(p) for p in res.stdout.split()] if res.returncode == 0 else []


def _kill_netns_procs(name: str) -> None:
    # Anything left in the namespace (e.g. daemons forked from run()) would keep
    # the namespace alive after its name is gone, holding ports and addresses.
    for pid in _netns_pids(name):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _delete_netns(name: str) -> None:
    _kill_netns_procs(name)
    _ip("netns", "del", name, check=False)


def _lock_path(cluster_id: str) -> Path:
    return LOCK_DIR / f"{cluster_id}.lock"


def _owner_alive(cluster_id: str) -> bool:
    """True if a live Cluster holds the lock of `cluster_id`."""
    try:
        fd = os.open(_lock_path(cluster_id), os.O_RDWR)
    except FileNotFoundError:
        return False  # a Cluster takes its lock before it makes any namespace
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def cleanup_stale() -> list[str]:
    """Delete `mtcfs-*` namespaces (and their processes) whose cluster is dead.

    Returns the names deleted. Namespaces of clusters alive in this or another
    process are left alone (they hold their lock file).
    """
    by_cluster: dict[str, list[str]] = {}
    for name in _list_netns():
        if name.startswith(PREFIX):
            cluster_id = name[len(PREFIX):].split("-", 1)[0]
            by_cluster.setdefault(cluster_id, []).append(name)
    deleted: list[str] = []
    for cluster_id, names in by_cluster.items():
        if _owner_alive(cluster_id):
            continue
        for name in names:
            _delete_netns(name)
            deleted.append(name)
        with contextlib.suppress(FileNotFoundError):
            _lock_path(cluster_id).unlink()
    # Lock files without namespaces: a run that died after locking.
    if LOCK_DIR.is_dir():
        for lock in LOCK_DIR.glob("*.lock"):
            if lock.stem not in by_cluster and not _owner_alive(lock.stem):
                with contextlib.suppress(FileNotFoundError):
                    lock.unlink()
    return deleted


class Host:
    """One host of a Cluster: a network namespace with one address."""

    def __init__(self, cluster: Cluster, index: int, name: str, addr: str) -> None:
        self.cluster = cluster
        self.index = index
        self.name = name
        self.addr = addr
        self.netns_path = str(NETNS_DIR / name)
        self.bridge_port = f"vh{index}"  # the veth end inside the bridge netns
        self._nft_ready = False

    def __repr__(self) -> str:
        return f"Host({self.name!r}, addr={self.addr!r})"

    def cmd(self, argv: Argv) -> list[str]:
        """`argv` prefixed so that it runs in this host's network namespace only."""
        return [self.cluster.nsenter, f"--net={self.netns_path}", "--", *map(os.fspath, argv)]

    def popen(self, argv: Argv, **kw: Any) -> subprocess.Popen:
        """subprocess.Popen in this host; killed (with its process group) at close."""
        # Own session = own process group, so close() also gets its children.
        kw.setdefault("start_new_session", True)
        own_group = bool(kw["start_new_session"] or kw.get("process_group") == 0)
        proc = subprocess.Popen(self.cmd(argv), **kw)
        self.cluster._procs.append((proc, own_group))
        return proc

    def run(self, argv: Argv, **kw: Any) -> subprocess.CompletedProcess:
        """subprocess.run in this host (same arguments and defaults)."""
        return subprocess.run(self.cmd(argv), **kw)

    def pids(self) -> list[int]:
        """All processes currently in this host's network namespace."""
        return _netns_pids(self.name)

    # -- faults ---------------------------------------------------------------

    def link_down(self) -> None:
        """Cut the host's cable: packets to and from it are lost silently."""
        _ip("-n", self.cluster.bridge_ns, "link", "set", self.bridge_port, "down")

    def link_up(self) -> None:
        _ip("-n", self.cluster.bridge_ns, "link", "set", self.bridge_port, "up")

    def limit_outgoing(self, rate: str) -> None:
        """Shape what this host sends to `rate` (tc's form, e.g. "1gbit"): a token
        bucket (tbf) on its end of the cable, so transfers from it take a known time."""
        self.run(["tc", "qdisc", "replace", "dev", HOST_IF, "root", "tbf", "rate", rate,
                  "burst", "1mb", "latency", "100ms"], check=True, capture_output=True)

    def drop_incoming_from(self, other: Host) -> None:
        """Drop every IPv4 packet from `other` arriving at this host."""
        self._nft_rule("input", "saddr", other.addr)

    def drop_outgoing_to(self, other: Host) -> None:
        """Drop every IPv4 packet this host sends to `other`."""
        self._nft_rule("output", "daddr", other.addr)

    def heal(self) -> None:
        """Remove this host's packet drops and bring its link back up."""
        if self._nft_ready:
            self._nft(f"flush chain inet {NFT_TABLE} input\n"
                      f"flush chain inet {NFT_TABLE} output\n")
        self.link_up()

    def _nft_rule(self, chain: str, field: str, addr: str) -> None:
        if not self._nft_ready:
            # Made on first use, so clusters that need no drops don't need nft.
            self._nft(f"table inet {NFT_TABLE} {{\n"
                      f"  chain input {{ type filter hook input priority 0; policy accept; }}\n"
                      f"  chain output {{ type filter hook output priority 0; policy accept; }}\n"
                      f"}}\n")
            self._nft_ready = True
        self._nft(f"add rule inet {NFT_TABLE} {chain} ip {field} {addr} drop\n")

    def _nft(self, script: str) -> None:
        if shutil.which("nft") is None:
            raise RuntimeError("nft not found: install the Debian package nftables "
                               "(scripts/bootstrap.sh does)")
        res = self.run(["nft", "-f", "-"], input=script, capture_output=True, text=True,
                       timeout=30)
        if res.returncode != 0:
            raise RuntimeError(f"nft in {self.name} failed: {res.stderr.strip()}\n{script}")


class Cluster:
    """N hosts on one bridge, each in its own network namespace (see module doc).

    Use as a context manager, or call start() and close() yourself.
    """

    def __init__(self, n: int = 3, *, term_grace: float = 3.0) -> None:
        if not 1 <= n <= 253:
            raise ValueError("a cluster has 1 to 253 hosts (one /24)")
        self.n = n
        self.term_grace = term_grace  # seconds between SIGTERM and SIGKILL at close
        self.id = uuid.uuid4().hex[:8]
        self.bridge_ns = f"{PREFIX}{self.id}-br"
        self.hosts: list[Host] = []
        self.subnet = ""
        self.nsenter = shutil.which("nsenter") or "nsenter"
        self._procs: list[tuple[subprocess.Popen, bool]] = []  # (proc, leads its group)
        self._lock: TextIO | None = None
        self._made: list[str] = []  # namespaces created, deleted at close
        self._closed = False

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def namespaces(self) -> list[str]:
        """All namespace names of this cluster (bridge first)."""
        return [self.bridge_ns, *(h.name for h in self.hosts)]

    def start(self) -> Cluster:
        reason = netns_unavailable()
        if reason:
            raise RuntimeError(reason)
        cleanup_stale()
        self._take_lock()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _take_lock(self) -> None:
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        path = _lock_path(self.id)
        while True:
            lock = open(path, "a")  # noqa: SIM115 - held until close()
            fcntl.flock(lock, fcntl.LOCK_EX)
            # A concurrent cleanup_stale() may have taken it for dead between our
            # open() and flock() and unlinked it: then lock a fresh file.
            try:
                if os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino:
                    self._lock = lock
                    return
            except FileNotFoundError:
                pass
            lock.close()

    def _build(self) -> None:
        x, y = self._pick_subnet()
        self.subnet = f"10.{x}.{y}.0/24"
        self._add_netns(self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", BRIDGE, "up")
        for i in range(self.n):
            host = Host(self, i, f"{PREFIX}{self.id}-{i}", f"10.{x}.{y}.{i + 1}")
            self._add_netns(host.name)
            self.hosts.append(host)
            # Both veth ends are born in their namespaces: no names in the root ns
            # that could clash with a concurrent cluster.
            _ip("-n", self.bridge_ns, "link", "add", host.bridge_port, "type", "veth",
                "peer", "name", HOST_IF, "netns", host.name)
            _ip("-n", self.bridge_ns, "link", "set", host.bridge_port, "master", BRIDGE, "up")
            _ip("-n", host.name, "addr", "add", f"{host.addr}/24", "dev", HOST_IF)
            _ip("-n", host.name, "link", "set", "lo", "up")
            _ip("-n", host.name, "link", "set", HOST_IF, "up")

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    @staticmethod
    def _pick_subnet() -> tuple[int, int]:
        # Clusters are isolated from each other, so a clash would still work;
        # random subnets just keep logs of concurrent runs unambiguous. Subnets
        # the root namespace uses are skipped so an address is never ambiguous.
        used = _ip("-4", "-o", "addr", "show", check=False).stdout
        while True:
            x, y = random.randint(100, 254), random.randint(0, 254)
            if f" 10.{x}.{y}." not in used:
                return x, y

    def heal(self) -> None:
        """heal() every host."""
        for host in self.hosts:
            host.heal()

    def close(self) -> None:
        """Stop processes and delete the namespaces; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stop_procs()
        finally:
            for name in reversed(self._made):
                _delete_netns(name)
            if self._lock is not None:
                with contextlib.suppress(FileNotFoundError):
                    _lock_path(self.id).unlink()
                self._lock.close()  # releases the flock
                self._lock = None

    def _stop_procs(self) -> None:
        live = [p for p, _ in self._procs if p.poll() is None]
        for proc, own_group in self._procs:
            # Also for exited leaders: their children may still be in the group.
            _signal(proc, own_group, signal.SIGTERM)
        deadline = time.monotonic() + self.term_grace
        for proc in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for proc, own_group in self._procs:
            _signal(proc, own_group, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()


def _signal(proc: subprocess.Popen, own_group: bool, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if own_group:
            # A group outlives its reaped leader while members remain (and its id
            # is not reused as a pid meanwhile), so orphaned children are hit too.
            os.killpg(proc.pid, sig)
        elif proc.poll() is None:
            proc.send_signal(sig)


@pytest.fixture
def cluster_factory() -> Iterator[Callable[..., Cluster]]:
    """make(n=3, **kw) -> a started Cluster, closed at teardown. Skips without root."""
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    clusters: list[Cluster] = []

    def make(n: int = 3, **kw: Any) -> Cluster:
        cluster = Cluster(n, **kw)
        clusters.append(cluster)
        return cluster.start()

    yield make
    for cluster in reversed(clusters):
        cluster.close()
