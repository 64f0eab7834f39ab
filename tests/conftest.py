"""Shared fixtures: real mtcfs daemons as subprocesses with real FUSE mounts, real
fake-gcs-servers, clusters of peered daemons on loopback. The helpers they use
(and that tests and benchmarks import) live in the `support` package.

Every fixture cleans up its mounts, processes and RAM dirs, also when the test fails.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import gcs_server as _gcs
from support.mounts import MtcfsMount, PeerCluster, dispose, free_port, unmount_under


@pytest.fixture
def ram_root() -> Iterator[Path]:
    """A directory on tmpfs for RAM dirs (and reference trees), removed afterwards."""
    root = Path("/dev/shm") / f"mtcfs-test-{uuid.uuid4().hex[:10]}"
    root.mkdir()
    yield root
    unmount_under(root)  # passthrough mounts make their RAM tier a tmpfs of its own
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def data_path() -> str:
    """--data-path of the mounts a test makes. Modules that cover both data paths
    override this with a fixture parametrized over "passthrough" and "fuse"."""
    return "auto"


@pytest.fixture
def make_mount(tmp_path: Path, ram_root: Path, data_path: str) -> Iterator:
    mounts: list[MtcfsMount] = []

    def make(name: str = "a", ram_size: str = "2GiB", extra: tuple[str, ...] = (),
             start: bool = True) -> MtcfsMount:
        mp = tmp_path / f"mnt-{name}"
        mp.mkdir(exist_ok=True)
        if "--data-path" not in extra:
            extra = (*extra, "--data-path", data_path)
        m = MtcfsMount(mp, ram_root / f"ram-{name}", ram_size, f"node-{name}", extra)
        mounts.append(m)
        return m.start() if start else m

    yield make
    for m in mounts:
        dispose(m)


@pytest.fixture
def mnt(make_mount) -> MtcfsMount:
    """A started mtcfs mount with a 2 GiB RAM tier."""
    return make_mount()


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[_gcs.GcsServer]:
    """One fake-gcs-server (memory backend) for the session; tests make their own buckets.

    Tests that kill or corrupt a server use make_gcs_server instead.
    """
    server = _gcs.GcsServer(backend="memory").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def gcs_bucket(gcs_server: _gcs.GcsServer) -> str:
    """A fresh, empty bucket on the session server."""
    if gcs_server.proc is None or gcs_server.proc.poll() is not None:
        gcs_server.start()  # a previous test took it down
    return gcs_server.create_bucket(f"test-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def make_gcs_server() -> Iterator:
    """Start private servers: make(backend="memory"|"filesystem") -> GcsServer.

    Each has kill(), start() and restart(downtime) on the same port; all are
    stopped at the end of the test.
    """
    servers: list[_gcs.GcsServer] = []

    def make(backend: str = "memory") -> _gcs.GcsServer:
        server = _gcs.GcsServer(backend=backend)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def make_cluster(tmp_path: Path, ram_root: Path, request: pytest.FixtureRequest,
                 data_path: str) -> Iterator:
    """make_cluster(n=3, replicas=1, extra=(), start=True) -> PeerCluster with hosts a, b, c...

    Each host: `--listen 127.0.0.1:PORT --peers <all others> --token-file F --replicas K`
    plus `extra`. The daemons start concurrently (each pulls the live peers' snapshots
    at start-up). Use cluster.add/replace/restart/kill9 for more hosts, replacements
    (empty RAM dir) and crashes. Everything is stopped and unmounted at the end, and the
    daemons' logs are printed when the test failed.
    """
    clusters: list[PeerCluster] = []

    def make(n: int = 3, replicas: int = 1, extra: tuple[str, ...] = (),
             start: bool = True) -> PeerCluster:
        c = PeerCluster(tmp_path / f"cluster{len(clusters)}", ram_root, replicas, extra,
                        data_path)
        clusters.append(c)
        names = [chr(ord("a") + i) for i in range(n)]
        for name in names:
            c.ports[name] = free_port()
        for name in names:
            c.define(name)
        if start:
            c.start(*names)
        return c

    yield make
    failed = getattr(request.node, "rep_call", None)
    for c in clusters:
        if failed is not None and failed.failed:
            print(c.logs()[-30000:])
        c.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `slow` first (stable otherwise): `make test` runs the suite on
    several xdist workers, and a long test handed out last would run alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Record each phase's report on the item (make_cluster prints logs on failure)."""
    rep = yield
    setattr(item, "rep_" + rep.when, rep)
    return rep
