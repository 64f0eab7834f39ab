"""user.mtcfs.state and the files' status (mtcfs.fs.state_view.FileStateView),
in-process: what a file shows in each state (open, sealing, closed, incomplete,
persisted, evictable, evicted), directories and steps, symlinks and special files,
and the counts `mtcfs status` takes from it."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import google_crc32c
import pytest

from mtcfs.fs.filesystem import FsError
from mtcfs.fs.fuse_ops import FuseOperations
from mtcfs.fs.state_view import STATE_XATTR

from support.inprocess import Host, until
from support.onemount import crash, mount_at, pt_write, remounted_after_a_crash_mid_write

pytestmark = [pytest.mark.nofuse, pytest.mark.trio]


def hexcrc(data: bytes) -> str:
    return f"{google_crc32c.value(data):08x}"


async def test_a_closed_file_here_alone(make_host) -> None:
    h: Host = await make_host()
    await h.write_file("f", b"data")
    assert h.state("f") == {
        "state": "closed", "path": "f", "size": 4, "crc32c": hexcrc(b"data"),
        "version": 1, "holders": ["a"], "sources": [], "replicas": 0, "writer": "a",
        "persisted": False, "generation": None, "tiers": ["ram"], "lifecycle": "closed",
    }


async def test_a_new_file_being_written(make_host) -> None:
    h: Host = await make_host()
    fh = await h.open("f", os.O_WRONLY | os.O_CREAT)
    await h.write(fh, 0, b"partial")
    st = h.state("f")
    assert (st["state"], st["lifecycle"], st["crc32c"], st["holders"]) == (
        "open", "open", None, [])
    assert st["size"] == 7 and st["version"] == 0 and st["writer"] is None
    assert st["tiers"] == ["ram"]
    await h.close(fh)
    assert h.state("f")["state"] == "closed"


async def test_a_sealed_file_being_rewritten_shows_no_checksum(make_host) -> None:
    h: Host = await make_host()
    await h.write_file("f", b"v1")
    fh = await h.open("f", os.O_WRONLY)
    await h.write(fh, 0, b"v2!")
    st = h.state("f")
    assert st["state"] == "open" and st["crc32c"] is None
    assert st["version"] == 1 and st["writer"] == "a"  # the version others still have
    await h.close(fh)
    st = h.state("f")
    assert st["version"] == 2 and st["crc32c"] == hexcrc(b"v2!")


async def test_a_file_closed_through_passthrough_is_sealing(tmp_path: Path) -> None:
    m = mount_at(tmp_path, passthrough=True)
    h = Host(m)
    fh = await h.open("f", os.O_WRONLY | os.O_CREAT)
    pt_write(h, fh, 0, b"through the kernel")
    st = h.state("f")
    assert st["state"] == "open" and st["size"] == 18  # size from the RAM file
    await h.fs.flush(fh)
    st = h.state("f")
    assert st["state"] == st["lifecycle"] == "sealing" and st["crc32c"] is None
    await h.fs.release(fh)
    st = h.state("f")
    assert st["state"] == "closed" and st["crc32c"] == hexcrc(b"through the kernel")
    crash(m)


async def test_a_passthrough_writer_of_a_sealed_file_shows_it_open(tmp_path: Path) -> None:
    """Its writer may change it unseen: open, the sealed version's checksum beside."""
    m = mount_at(tmp_path, passthrough=True)
    h = Host(m)
    await h.write_file("f", b"sealed")
    fh = await h.fs.open(h.node("f"), os.O_RDWR)
    st = h.state("f")
    assert st["state"] == st["lifecycle"] == "open"
    assert st["crc32c"] == hexcrc(b"sealed") and st["version"] == 1
    await h.close(fh)
    assert h.state("f")["state"] == h.state("f")["lifecycle"] == "closed"
    crash(m)


async def test_an_incomplete_file_is_in_no_tier(tmp_path: Path) -> None:
    m = await remounted_after_a_crash_mid_write(tmp_path)
    st = Host(m).state("f")
    assert (st["state"], st["lifecycle"], st["tiers"], st["crc32c"], st["holders"]) == (
        "incomplete", "incomplete", [], None, [])
    crash(m)


async def test_a_directory(make_host) -> None:
    h: Host = await make_host()
    h.makedirs("a/b")
    assert h.state("a/b") == {"type": "directory", "path": "a/b"}


async def test_a_step_directory_shows_its_step(make_host) -> None:
    h: Host = await make_host()
    h.makedirs("step_100")
    await h.write_file("step_100/shard", b"x" * 10)
    st = h.state("step_100")
    assert st["type"] == "directory" and st["path"] == "step_100" and st["step"] == 100
    assert st["files"] == 1 and st["bytes"] == 10 and st["complete"] is False
    assert "file_list" not in st
    await h.write_file("step_100/commit_success.txt", b"ok")
    assert h.state("step_100")["complete"] is True


async def test_symlinks_and_special_files(make_host) -> None:
    h: Host = await make_host()
    h.symlink("l", "nowhere")
    h.fs.names.mknod(h.node("").ino, b"p", stat.S_IFIFO | 0o600, 0, 0, 0)
    assert h.state("l") == {"type": "symlink", "path": "l"}
    assert h.state("p") == {"type": "special", "path": "p"}


async def test_persisted_evictable_then_evicted(tmp_path: Path, make_host) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    h: Host = await make_host(bucket=f"file://{bucket}", persist="on-close")
    await h.write_file("f", b"persist me")
    await until(lambda: h.state("f")["persisted"], what="f persisted")
    st = h.state("f")
    # Persisted and not in use: this host's copy may go.
    assert st["lifecycle"] == "evictable" and st["tiers"] == ["ram", "file"]
    assert st["generation"] is not None and st["holders"] == ["a"]
    node = h.node("f")
    h.mount.copies.evicted(node)
    st = h.state("f")
    assert (st["lifecycle"], st["tiers"], st["holders"]) == ("evicted", ["file"], [])
    assert st["writer"] == "a" and st["crc32c"] == hexcrc(b"persist me")


async def test_a_file_in_use_is_persisted_not_evictable(tmp_path: Path, make_host) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    h: Host = await make_host(bucket=f"file://{bucket}", persist="on-close")
    await h.write_file("f", b"persist me")
    await until(lambda: h.state("f")["persisted"], what="f persisted")
    fh = await h.open("f", os.O_RDONLY)
    assert h.state("f")["lifecycle"] == "persisted"  # open: not droppable now
    await h.close(fh)
    assert h.state("f")["lifecycle"] == "evictable"


async def test_the_xattr_is_the_state_as_json(make_host) -> None:
    h: Host = await make_host()
    await h.write_file("f", b"data")
    node = h.node("f")
    assert json.loads(h.mount.view.xattr(node)) == h.state("f")
    # The view answers it: the file's own extended attributes have no such name.
    with pytest.raises(FsError) as e:
        h.fs.xattrs.getxattr(node, STATE_XATTR)
    assert e.value.errno == errno.ENODATA


async def test_the_fuse_adapter_asks_the_view(make_host) -> None:
    h: Host = await make_host()
    await h.write_file("f", b"data")
    h.fs.xattrs.setxattr(h.node("f"), b"user.k", b"v")
    ops = FuseOperations(h.fs, h.mount.view)
    got = await ops.getxattr(h.node("f").ino, STATE_XATTR, None)
    assert json.loads(got)["crc32c"] == hexcrc(b"data")
    assert await ops.getxattr(h.node("f").ino, b"user.k", None) == b"v"


async def test_status_counts_files_states_handles_and_seals(make_host) -> None:
    h: Host = await make_host()
    h.makedirs("d")
    await h.write_file("d/a", b"12345")
    fh = await h.open("d/b", os.O_WRONLY | os.O_CREAT)
    await h.write(fh, 0, b"123")
    st = h.mount.view.status()
    assert st["node_id"] == "a" and st["files"] == 2 and st["directories"] == 2  # root, d
    assert st["states"] == {"closed": 1, "open": 1} and st["open_handles"] == 1
    assert st["bytes_written"] == 8 and st["seals"] == 1 and st["seal_full_passes"] == 0
    assert st["ram"]["used"] >= 8 and st["ram"]["free"] <= st["ram"]["capacity"]
    await h.close(fh)
    st = h.mount.view.status()
    assert st["states"] == {"closed": 2} and st["open_handles"] == 0 and st["seals"] == 2


async def test_status_counts_passthrough_bytes_apart(tmp_path: Path) -> None:
    m = mount_at(tmp_path, passthrough=True)
    h = Host(m)
    fh = await h.open("f", os.O_WRONLY | os.O_CREAT)
    pt_write(h, fh, 0, b"x" * 100)
    await h.close(fh)
    st = m.view.status()
    assert st["bytes_written"] == 0 and st["bytes_written_passthrough"] == 100
    assert st["seal_full_passes"] == 1  # unseen bytes: one pass
    crash(m)
