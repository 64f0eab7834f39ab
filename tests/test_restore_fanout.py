"""A whole-job restore reads each object from the bucket once (mtcfs.peer.restore).

Fresh hosts (empty RAM dirs) over a bucket holding a persisted file all read it
at once: each reads its share of the chunks from the bucket and takes the rest
from the others, so the bucket serves about one copy between them. Real FUSE
mounts, real daemons, the real fake-gcs-server behind a TCP proxy that counts
the bytes the bucket sends (what a bucket bills as egress).
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mtcfs.tiers.durable import (
    CHUNK_META_KEY,
    chunk_crcs_of_fd,
    crc_of_chunks,
    encode_chunk_meta,
    open_durable,
)

from support.gcs_server import GcsServer
from support.link_proxy import LinkProxy
from support.mounts import PeerCluster, blob, crc_of, data_files, file_crc, pstatus, wait_until

MiB = 1 << 20
PREFIX = "run-1"


def put_persisted(server: GcsServer, bucket: str, key: str, data: bytes) -> None:
    """The object as mtcfs uploads it: with its chunk crc32cs in the metadata."""
    tier = open_durable(f"gs://{bucket}/{PREFIX}", server.url, retry_deadline=10)
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as f:
        f.write(data)
        f.flush()
        chunk, crcs = chunk_crcs_of_fd(f.fileno(), len(data))
        tier.put_file(key, f.name, crc_of_chunks(chunk, crcs, len(data)),
                      metadata={CHUNK_META_KEY: encode_chunk_meta(chunk, crcs)})
    tier.close()


@pytest.fixture
def bucket_link(gcs_server: GcsServer) -> Iterator[LinkProxy]:
    with LinkProxy(gcs_server.port) as link:
        yield link


def restore_cluster(make_cluster, n: int, bucket: str, link: LinkProxy) -> PeerCluster:
    c = make_cluster(n, replicas=1, extra=("--bucket", f"gs://{bucket}/{PREFIX}",
                                           "--gcs-endpoint", link.url))
    for m in c.hosts.values():  # each knows the others' data channels
        wait_until(lambda m=m: all(p["alive"] and p["data_port"]
                                   for p in pstatus(m)["peers"]), 15,
                   what=f"{m.node_id} knows its peers' data ports")
    return c


def read_all_at_once(c: PeerCluster, names: list[str], rel: str) -> dict[str, int]:
    got: dict[str, int] = {}

    def read(name: str) -> None:
        got[name] = file_crc(c[name].path / rel)

    threads = [threading.Thread(target=read, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a read did not finish"
    return got


def durable_bytes(m) -> int:
    return m.status()["durable"]["readthrough"]["durable_bytes"]


@pytest.mark.slow
def test_hosts_restoring_the_same_file_read_the_bucket_once(make_cluster, gcs_server,
                                                             gcs_bucket, bucket_link):
    size = 128 * MiB + 12345
    data = blob(41, size)
    want = crc_of(data)
    put_persisted(gcs_server, gcs_bucket, "step-7/model.pt", data)
    del data
    c = restore_cluster(make_cluster, 4, gcs_bucket, bucket_link)
    before = bucket_link.downstream_bytes  # the listings at start-up

    t0 = time.monotonic()
    got = read_all_at_once(c, ["a", "b", "c"], "step-7/model.pt")
    took = time.monotonic() - t0
    assert got == {"a": want, "b": want, "c": want}
    served = bucket_link.downstream_bytes - before
    by_host = {n: durable_bytes(c[n]) for n in "abc"}
    print(f"3 hosts restored {size >> 20} MiB in {took:.1f} s; the bucket sent {served} "
          f"bytes ({served / size:.2f}x); by host {by_host}")
    assert served <= 1.5 * size, (served, by_host)
    assert sum(by_host.values()) <= 1.5 * size, by_host
    for n in "abc":
        s = pstatus(c[n])
        assert s["restores"] == 1 and s["integrity_errors"] == 0, s
        st = c[n].state("step-7/model.pt")
        assert st["crc32c"] == f"{want:08x}" and "ram" in st["tiers"], st
        # A copy read through is a source, never a holder (it counts as no replica).
        assert st["replicas"] == 0, st

    # A host that reads it afterwards takes it from those that have it.
    before = bucket_link.downstream_bytes
    assert file_crc(c["d"].path / "step-7/model.pt") == want
    assert bucket_link.downstream_bytes - before < 1 * MiB
    assert durable_bytes(c["d"]) == 0
    assert pstatus(c["d"])["restore_peer_bytes"] == size


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill9", "sigstop"])
def test_a_source_lost_mid_restore_does_not_fail_the_others(make_cluster, gcs_server,
                                                             gcs_bucket, bucket_link, fault):
    """A source is killed (-9) or stopped (SIGSTOP: its connections stay open, silent)
    once it has a quarter of the file: the others drop it and read its share from
    the bucket or from each other, and get the file's exact bytes."""
    size = 192 * MiB
    data = blob(43, size)
    want = crc_of(data)
    put_persisted(gcs_server, gcs_bucket, "step-9/opt.bin", data)
    del data
    bucket_link.rate = 120 * MiB  # ~1.6 s for one copy: time to kill a source halfway
    c = restore_cluster(make_cluster, 3, gcs_bucket, bucket_link)
    got: dict[str, int] = {}
    threads = [threading.Thread(target=lambda n=n: got.__setitem__(
        n, file_crc(c[n].path / "step-9/opt.bin"))) for n in ("a", "b")]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    victim = c["c"]
    # The victim reads it too (a source), and dies once it has a part of it.
    reader = threading.Thread(target=lambda: _read_quietly(victim.path / "step-9/opt.bin"))
    reader.start()

    def arrived() -> int:
        return sum(p.stat().st_blocks * 512 for p in data_files(victim.ram_dir))

    wait_until(lambda: arrived() >= size // 4, 30, interval=0.005, what="a quarter arrived")
    proc = victim.proc
    assert proc is not None
    if fault == "kill9":
        c.kill9("c")
    else:
        proc.send_signal(signal.SIGSTOP)
    try:
        assert all(t.is_alive() for t in threads), "the others finished before the fault"
        for t in threads:
            t.join(90)
        assert not any(t.is_alive() for t in threads), "a restore did not finish"
        took = time.monotonic() - t0
    finally:
        if fault == "sigstop":
            proc.send_signal(signal.SIGCONT)
    reader.join(30)
    print(f"{fault}: restored {size >> 20} MiB on 2 hosts in {took:.1f} s; from the "
          f"bucket by host {[durable_bytes(c[n]) for n in 'ab']}")
    assert got == {"a": want, "b": want}
    for n in ("a", "b"):
        assert pstatus(c[n])["integrity_errors"] == 0


def _read_quietly(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.read(fd, 8 * MiB):
                pass
        finally:
            os.close(fd)
    except OSError:
        pass  # its daemon was killed
