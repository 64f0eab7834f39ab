"""A mount without the optional parts (no --bucket, no --listen, no --keep-steps): the
assembly gives it null objects (mtcfs.absent), which answer like the real parts with
nothing to do. Nothing else asks whether a part is there."""

from __future__ import annotations

import errno
import os

import pytest
import trio

from mtcfs.absent import (
    NoDurable,
    NoListing,
    NoMetrics,
    NoPeers,
    NoRetention,
    NoUploader,
    NoWithdrawal,
)
from mtcfs.control.handlers import ControlHandler
from mtcfs.core.namespace import Inode
from mtcfs.lifecycle.durability import GCS, LOCAL, REPLICAS, Durability
from mtcfs.status import mount_status
from mtcfs.tiers.durable import DurableError

from support.inprocess import Host

pytestmark = [pytest.mark.nofuse, pytest.mark.trio]


async def test_a_bare_mount_is_built_of_null_parts(make_host) -> None:
    h: Host = await make_host()
    m = h.mount
    assert isinstance(m.uploader, NoUploader)
    assert isinstance(m.listing, NoListing)
    assert isinstance(m.peers, NoPeers)
    assert isinstance(m.retention, NoRetention)
    assert isinstance(m.withdrawal, NoWithdrawal)
    assert isinstance(m.fetcher.tier, NoDurable)
    # The background tasks of absent parts end at once; the mount keeps working.
    await trio.sleep(0.05)
    await h.write_file("f", b"data", fsync=True)
    assert await h.read_file("f") == b"data"
    assert m.uploader.idle() and not m.uploader.settling()
    assert not m.peers.busy(h.node("f")) and m.peers.missing_copies() == []


async def test_the_status_of_a_bare_mount(make_host) -> None:
    h: Host = await make_host(commit_timeout=7)
    await h.write_file("f", b"x" * 1000)
    st = mount_status(h.mount)
    assert st["health"] == "ok"
    assert st["durable"] is None and st["peers"] is None and st["metrics_url"] is None
    assert st["visibility"]["commit_timeout"] == 7
    assert st["visibility"]["timeouts"] == 0 and st["visibility"]["broadcast_queue"] == 0
    assert st["lifecycle"]["incomplete_grace"] is None
    assert st["lifecycle"]["removed_incomplete_steps"] == []
    assert "withdrawn_steps" not in st["lifecycle"]
    assert st["peer_auth"] == {"mode": "none", "tls": False, "encryption": False}
    # Its only copy is here: nothing else holds it.
    assert st["ram"]["only_copy_files"] == 1 and st["ram"]["only_copy_bytes"] == 1000


async def test_a_bare_mounts_steps_report(make_host) -> None:
    h: Host = await make_host()
    h.mkdir("step_1")
    await h.write_file("step_1/shard", b"x")
    await h.write_file("step_1/commit_success.txt", b"ok")
    report = h.mount.step_report.steps()
    assert report["durable"] is None and report["keep_steps"] is None
    (step,) = report["steps"]
    assert step["complete"] and not step["withdrawn"] and step["lost_files"] == []
    assert step["kept"] is None  # no retention: "kept" means nothing
    assert not step["persisted"] and not step["safe"]


async def test_fsync_levels_without_a_bucket_or_peers(make_host) -> None:
    h: Host = await make_host()
    await h.write_file("f", b"x")
    node = h.node("f")
    m = h.mount

    def durability(level: str, peers: bool) -> Durability:
        return Durability(m.ns, m.copies, m.events, m.fs.rules, level, 1.0, NoUploader(),
                          peers)

    # gcs without a durable tier: replicas with peers and K, else local.
    assert durability(GCS, peers=False).level_for(node) == LOCAL
    m.copies.replicas = 1
    assert durability(GCS, peers=True).level_for(node) == REPLICAS
    m.copies.replicas = 0
    assert durability(GCS, peers=True).level_for(node) == LOCAL
    with trio.fail_after(2):  # local: an fsync returns at once
        await durability(GCS, peers=False).wait(node)


async def test_fsync_gcs_with_a_bucket_waits_for_the_upload(make_host, tmp_path) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    h: Host = await make_host(bucket=f"file://{bucket}", persist="manual", fsync="gcs")
    with trio.fail_after(20):
        node = await h.write_file("f", b"persist me", fsync=True)
    assert node.persisted and (bucket / "f").read_bytes() == b"persist me"
    # Under a temporary name nothing is uploaded: the level falls back to local.
    await h.write_file("g.tmp", b"x")
    assert h.mount.durability.level_for(h.node("g.tmp")) == LOCAL


async def test_control_requests_say_what_is_not_configured(make_host) -> None:
    h: Host = await make_host()
    await h.write_file("f", b"x")
    handler = ControlHandler(h.mount, lambda: None)
    reply = await handler({"op": "persist", "paths": ["f"]})
    assert reply == {"ok": False,
                     "error": "this mount has no durable tier (mount with --bucket)"}
    reply = await handler({"op": "persist_progress", "inos": [h.node("f").ino]})
    assert not reply["ok"] and "no durable tier" in reply["error"]
    # A file with no copy here, and nowhere to fetch it from.
    h.mount.copies.elsewhere_only(h.node("f"))
    reply = await handler({"op": "prefetch", "paths": ["f"]})
    assert reply == {"ok": False,
                     "error": "this mount has no peers and no durable tier to fetch from"}
    status = (await handler({"op": "status"}))["status"]
    assert status["durable"] is None and status["metrics_url"] is None
    restore = await handler({"op": "prefetch", "restore": True})
    assert restore["ok"] and restore["files"] == 0


async def test_a_lost_copy_without_peers_or_bucket_is_eio(make_host) -> None:
    h: Host = await make_host()
    await trio.sleep(0.05)  # the fetcher's task is running
    await h.write_file("f", b"data")
    node = h.node("f")
    h.mount.ram.remove(node.ino)
    h.mount.copies.elsewhere_only(node)  # its data left this host; no one else has it
    with pytest.raises(Exception) as info:
        await h.read_file("f")
    assert getattr(info.value, "errno", None) == errno.EIO
    assert h.mount.fetcher.stats.errors == 1
    assert "no copy is reachable: not on a live peer" in h.mount.fetcher.stats.last_error
    assert "durable tier" not in h.mount.fetcher.stats.last_error


async def test_null_sources_hold_nothing() -> None:
    tier = NoDurable()
    assert not tier.may_hold(0) and not tier.may_hold(5)
    assert tier.stat("k") is None and list(tier.list()) == []
    for call in (lambda: tier.check(), lambda: tier.delete("k"),
                 lambda: tier.download("k", 0)):
        with pytest.raises(DurableError, match="no durable tier"):
            call()
    peers = NoPeers(3.0)
    node = Inode(ino=5, mode=0o100644, uid=0, gid=0, parent=1, name=b"f")
    r, w = os.pipe()
    try:
        assert await peers.download(node, w, lambda off, n: None) == {}
        assert await peers.restore(node, w, tier, "k", 1, 4, lambda off, n: None) is None
    finally:
        os.close(r)
        os.close(w)
    assert await peers.wait_applied("fsync", node) == []
    assert peers.hosts_accounted() and peers.broadcaster.quiet()
    assert peers.status() is None
    metrics = NoMetrics()
    metrics.close()
    assert metrics.url is None
    retention = NoRetention()
    assert retention.kept() == set() and retention.keep is None
    withdrawal = NoWithdrawal()
    assert not withdrawal.lost(node) and not withdrawal.is_withdrawn(node)
    assert withdrawal.status() == {}
