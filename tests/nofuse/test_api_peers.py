"""The replicated index and the peer tier, in-process: two hosts in one trio loop,
talking gRPC over loopback as daemons do. Names, versions and holders merge; what
one host commits is on the other when the call returns; data is fetched from the
holder, verified; replicas are counted by both."""

from __future__ import annotations

import os

import google_crc32c
import pytest
import trio

from support.inprocess import Host, until
from support.ports import free_port

pytestmark = [pytest.mark.nofuse, pytest.mark.trio]






async def pair(make_host, **cli) -> tuple[Host, Host]:
    pa, pb = free_port(), free_port()
    # The data channel on any free port (its default, port + 1, may be taken: a port
    # another test, or xdist worker, is using).
    common = {"insecure": True, "replicas": 1, "commit_timeout": 10,
              "data_listen": "127.0.0.1:0", **cli}
    a = await make_host("a", start=False, listen=f"127.0.0.1:{pa}",
                        peers=f"127.0.0.1:{pb}", **common)
    b = await make_host("b", start=False, listen=f"127.0.0.1:{pb}",
                        peers=f"127.0.0.1:{pa}", **common)
    await make_host.start(a, b)
    return a, b


async def test_a_commit_is_on_the_other_host_when_it_returns(make_host) -> None:
    a, b = await pair(make_host, replicas=0)  # (b holds no replica: it reads from a)
    data = os.urandom(700_000)
    a.makedirs("step_1")
    await a.write_file("step_1/shard", data, fsync=True)  # fsync: visible everywhere
    st = b.state("step_1/shard")
    assert st["state"] == "closed" and st["crc32c"] == f"{google_crc32c.value(data):08x}"
    assert st["writer"] == "a" and "ram" not in st["tiers"]
    # b reads it from a, verified block by block, and keeps a cached copy.
    assert await b.read_file("step_1/shard") == data
    await until(lambda: "ram" in b.state("step_1/shard")["tiers"], what="b's cached copy")
    assert b.mount.fetcher.sources == {"a": len(data)}
    # The commit marker's close returns once b has it too.
    await a.write_file("step_1/commit_success.txt", b"ok")
    assert b.exists("step_1/commit_success.txt")


async def test_replicas_are_counted_on_both_hosts(make_host) -> None:
    a, b = await pair(make_host)
    await a.write_file("f", os.urandom(300_000), fsync=True)
    await until(lambda: a.state("f")["replicas"] == 1, what="a replica on b")
    assert sorted(a.state("f")["holders"]) == ["a", "b"]
    await until(lambda: sorted(b.state("f")["holders"]) == ["a", "b"], what="b knows")
    assert b.state("f")["lifecycle"] in ("replicated", "closed")
    assert b.mount.copies.kind(b.node("f")) == "replica"


async def test_renames_and_removals_merge(make_host) -> None:
    a, b = await pair(make_host)
    a.mkdir("d")
    await a.write_file("d/f", b"one", fsync=True)
    await b.rename("d/f", "d/g")
    await b.fs.names.fsyncdir(b.node("d"))  # every entry of d is on a when this returns
    assert a.listdir("d") == ["g"] and await a.read_file("d/g") == b"one"
    a.unlink("d/g")
    await a.fs.names.fsyncdir(a.node("d"))
    assert b.listdir("d") == []


async def test_concurrent_creates_of_one_name_converge(make_host) -> None:
    a, b = await pair(make_host)
    # Both hosts create x before hearing of the other's: one version wins on both.
    async with trio.open_nursery() as n:
        n.start_soon(a.write_file, "x", b"from a")
        n.start_soon(b.write_file, "x", b"from b")
    await a.fs.names.fsyncdir(a.node(""))
    await b.fs.names.fsyncdir(b.node(""))
    await until(lambda: a.state("x")["crc32c"] == b.state("x")["crc32c"], what="one x")
    assert await a.read_file("x") == await b.read_file("x")
    assert a.listdir() == b.listdir() == ["x"]
