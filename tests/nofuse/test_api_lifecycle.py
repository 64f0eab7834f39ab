"""Eviction, retention and persist ordering, in-process, over a real file:// durable
tier: what leaves the RAM tier and when, writers waiting for room, and the order in
which a step's objects appear in (and leave) the bucket."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import trio

from mtcfs.fs.filesystem import FsError

from support.inprocess import Host, until

pytestmark = [pytest.mark.nofuse, pytest.mark.trio]

MiB = 1 << 20




async def save_step(h: Host, n: int, files: int = 3, size: int = 100_000) -> dict[str, bytes]:
    """A step as frameworks save it: its files, then the commit marker."""
    h.mkdir(f"step_{n}")
    data = {f"step_{n}/shard{i}": os.urandom(size) for i in range(files)}
    for path, blob in data.items():
        await h.write_file(path, blob)
    await h.write_file(f"step_{n}/commit_success.txt", b"ok")
    return data


async def test_step_objects_appear_with_the_marker_last(make_host, tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    h: Host = await make_host(bucket=f"file://{bucket}", persist="step")
    violations: list[str] = []

    async def watch(step: str, names: list[str]) -> None:
        """Whenever the marker's object exists, every file of its step does too.
        (The marker is looked for again after the files: one removed between the two
        looks went after the marker, as it should.)"""
        marker = bucket / step / "commit_success.txt"
        while True:
            if marker.exists():
                missing = [n for n in names if not (bucket / step / n).exists()]
                if missing and marker.exists():
                    violations.append(f"marker of {step} without {missing}")
            await trio.sleep(0)

    async with trio.open_nursery() as n:
        n.start_soon(watch, "step_1", ["shard0", "shard1", "shard2"])
        data = await save_step(h, 1)
        await until(lambda: all(h.node(p).persisted for p in [*data, "step_1/commit_success.txt"]),
                    what="step_1 persisted")
        for path, blob in data.items():
            assert (bucket / path).read_bytes() == blob
        # Removing a committed step: the marker's object goes first.
        for i in range(3):
            h.unlink(f"step_1/shard{i}")
        h.unlink("step_1/commit_success.txt")
        await until(lambda: not any((bucket / "step_1").glob("*")), what="step_1 deleted")
        n.cancel_scope.cancel()
    assert not violations
    # An uncommitted step is not uploaded (policy `step`).
    h.mkdir("step_2")
    await h.write_file("step_2/shard0", b"x")
    await trio.sleep(0.3)
    assert not (bucket / "step_2" / "shard0").exists()


async def test_retention_keeps_the_newest_steps_in_ram(make_host, tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    h: Host = await make_host(bucket=f"file://{bucket}", persist="step", keep_steps=1)
    old = await save_step(h, 1)
    await until(lambda: all(h.node(p).persisted for p in old), what="step_1 persisted")
    new = await save_step(h, 2)
    await until(lambda: all(h.node(p).persisted for p in new), what="step_2 persisted")
    assert h.mount.retention is not None
    h.mount.retention.pass_once()
    assert all(h.state(p)["lifecycle"] == "evicted" for p in old)
    assert all(h.state(p)["tiers"] == ["ram", "file"] for p in new)
    # An evicted file reads back from the bucket, verified.
    for path, blob in old.items():
        assert await h.read_file(path) == blob
    await until(lambda: all("ram" in h.state(p)["tiers"] for p in old), what="cached copies")
    assert h.mount.fetcher.stats.fetched_files == len(old)


async def test_a_full_tier_evicts_what_is_safe_and_waits_for_uploads(make_host,
                                                                  tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    h: Host = await make_host(bucket=f"file://{bucket}", persist="on-close",
                              ram_size="8MiB", full_timeout=20)
    blobs = {f"f{i}": os.urandom(2 * MiB) for i in range(8)}  # twice the tier
    for path, blob in blobs.items():
        await h.write_file(path, blob)  # waits for room while earlier files upload
    space = h.mount.space.status()
    assert space["enospc"] == 0 and sum(space["evictions"].values()) >= 4
    assert h.mount.ram.used <= h.mount.ram.capacity
    for path, blob in blobs.items():
        try:
            assert await h.read_file(path) == blob
        except FsError:
            raise AssertionError(f"{path}: {h.mount.fetcher.stats.last_error} "
                                 f"{h.mount.space.status()} {h.mount.ram.used}") from None


async def test_enospc_when_nothing_can_become_safe(make_host) -> None:
    h: Host = await make_host(ram_size="4MiB", full_timeout=1)  # no bucket, no peers
    await h.write_file("a", os.urandom(3 * MiB))
    with pytest.raises(FsError) as e:
        await h.write_file("b", os.urandom(2 * MiB))
    assert e.value.errno == errno.ENOSPC
    status = h.mount.space.status()
    assert status["enospc"] == 1 and "not yet persisted" in (status["last_full"] or "")
    assert await h.read_file("a") and h.state("a")["state"] == "closed"  # nothing lost
