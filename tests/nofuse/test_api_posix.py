"""POSIX semantics of `Filesystem`, in-process: names, renames, links, errors,
attributes, set-id bits. The FUSE suites (test_posix_semantics, test_posix_property,
pjdfstest) check the same through the kernel."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from mtcfs.core.versions import MAX_SHARED_SIZE
from mtcfs.fs.filesystem import RENAME_EXCHANGE, RENAME_NOREPLACE, FsError

from support.inprocess import Host

pytestmark = [pytest.mark.nofuse, pytest.mark.trio]


async def expect(err: int, coro_or_fn, *args, **kwargs) -> None:
    with pytest.raises(FsError) as info:
        result = coro_or_fn(*args, **kwargs)
        if hasattr(result, "__await__"):
            await result
    assert info.value.errno == err, (errno.errorcode[info.value.errno], errno.errorcode[err])


async def test_write_read_and_sizes(make_host) -> None:
    h: Host = await make_host()
    data = os.urandom(300_000)
    node = await h.write_file("f", data)
    assert node.size == len(data)
    assert await h.read_file("f") == data
    # O_APPEND writes at the end whatever the offset asked.
    fh = await h.open("f", os.O_WRONLY | os.O_APPEND)
    await h.write(fh, 0, b"tail")
    await h.close(fh)
    assert await h.read_file("f") == data + b"tail"


async def test_names(make_host) -> None:
    h: Host = await make_host()
    root = h.node("")
    await expect(errno.ENAMETOOLONG, h.mkdir, "x" * 256)
    h.mkdir("x" * 255)
    await expect(errno.EEXIST, h.mkdir, "x" * 255)
    await expect(errno.ENOENT, h.node, "nope")
    await expect(errno.EINVAL, h.fs.names.mkdir, root.ino, b"a/b", 0o755, 0, 0)
    await h.write_file("file", b"x")
    await expect(errno.ENOTDIR, h.fs.names.lookup, h.node("file").ino, b"sub")


async def test_directories(make_host) -> None:
    h: Host = await make_host()
    h.makedirs("a/b")
    await h.write_file("a/b/f", b"1")
    await expect(errno.ENOTEMPTY, h.rmdir, "a/b")
    await expect(errno.EISDIR, h.unlink, "a/b")
    await expect(errno.ENOTDIR, h.rmdir, "a/b/f")
    h.unlink("a/b/f")
    h.rmdir("a/b")
    assert h.listdir("a") == []
    # A directory handle lists what was there at opendir, minus what went since.
    for i in range(5):
        await h.write_file(f"a/{i}", b"")
    fh = h.fs.names.opendir(h.node("a"))
    h.unlink("a/3")
    names = [n.decode() for _, n, _ in h.fs.names.readdir(fh, 0)]
    h.fs.names.releasedir(fh)
    assert names == ["0", "1", "2", "4"]


async def test_rename_rules(make_host) -> None:
    h: Host = await make_host()
    h.makedirs("d/e")
    await h.write_file("f", b"f")
    await h.write_file("g", b"g")
    await expect(errno.EINVAL, h.rename, "d", "d/e/x")  # into itself
    await expect(errno.EISDIR, h.rename, "f", "d")
    await expect(errno.ENOTDIR, h.rename, "d", "f")
    await expect(errno.EEXIST, h.rename, "f", "g", RENAME_NOREPLACE)
    await expect(errno.ENOENT, h.rename, "f", "nope", RENAME_EXCHANGE)
    await h.write_file("d/e/x", b"x")
    h.mkdir("full")
    await h.write_file("full/y", b"y")
    await expect(errno.ENOTEMPTY, h.rename, "d", "full")
    # Over an existing file: the target is replaced, its data gone.
    await h.rename("f", "g")
    assert not h.exists("f") and await h.read_file("g") == b"f"
    # Exchange swaps two names atomically.
    await h.write_file("f", b"new")
    await h.rename("f", "g", RENAME_EXCHANGE)
    assert await h.read_file("f") == b"f" and await h.read_file("g") == b"new"
    # A directory moves with its tree.
    await h.rename("d", "full/d2")
    assert await h.read_file("full/d2/e/x") == b"x"


async def test_hard_links(make_host) -> None:
    h: Host = await make_host()
    h.mkdir("d")
    await h.write_file("d/f", b"data")
    h.link("d/f", "g")
    assert h.node("g") is h.node("d/f")
    assert h.node("g").nlink == 2
    await expect(errno.EPERM, h.link, "d", "d-link")  # no links to directories
    await expect(errno.EEXIST, h.link, "g", "d/f")
    h.unlink("d/f")
    assert h.node("g").nlink == 1 and await h.read_file("g") == b"data"
    # Writing through one name shows through all.
    h.link("g", "h")
    await h.write_file("h", b"other")
    assert await h.read_file("g") == b"other"


async def test_device_nodes_fifos_symlinks(make_host) -> None:
    h: Host = await make_host()
    root = h.node("").ino
    dev = h.fs.names.mknod(root, b"null", stat.S_IFCHR | 0o600, os.makedev(1, 3), 0, 0)
    assert stat.S_ISCHR(dev.mode) and dev.rdev == os.makedev(1, 3)
    fifo = h.fs.names.mknod(root, b"fifo", stat.S_IFIFO | 0o600, 0, 0, 0)
    assert stat.S_ISFIFO(fifo.mode)
    await expect(errno.EINVAL, h.fs.open, fifo, os.O_RDONLY)  # inert: never served as data
    h.symlink("l", "target/that/does/not/exist")
    assert h.fs.names.readlink(h.node("l")) == b"target/that/does/not/exist"
    await expect(errno.ENAMETOOLONG, h.symlink, "l2", "x" * 4096)
    reg = h.fs.names.mknod(root, b"reg", stat.S_IFREG | 0o644, 0, 0, 0)
    assert reg.size == 0 and h.state("reg")["state"] == "closed"


async def test_truncate_and_files_too_large_to_share(make_host) -> None:
    h: Host = await make_host()
    data = os.urandom(200_000)
    await h.write_file("f", data)
    node = await h.fs.setattr(h.node("f"), size=1000)
    assert node.size == 1000 and await h.read_file("f") == data[:1000]
    await h.fs.setattr(h.node("f"), size=5000)  # grows with zeros
    assert await h.read_file("f") == data[:1000] + bytes(4000)
    # Larger than the largest shared file: kept as tmpfs keeps it, here only (no
    # checksums, no copies, no upload), and shared again once it is small.
    await h.fs.setattr(h.node("f"), size=MAX_SHARED_SIZE + 1)
    fh = await h.open("f", os.O_WRONLY)
    h.fs.write(fh, MAX_SHARED_SIZE + 10, b"x")
    await h.close(fh)
    st = h.state("f")
    assert st["size"] == MAX_SHARED_SIZE + 11 and st["lifecycle"] == "local-only"
    assert st["crc32c"] is None and st["version"] >= 1
    await h.fs.setattr(h.node("f"), size=1000)
    assert h.state("f")["crc32c"] is not None and await h.read_file("f") == data[:1000]
    await expect(errno.EISDIR, h.fs.setattr, h.node(""), size=0)


async def test_set_id_bits_cleared_like_linux(make_host) -> None:
    h: Host = await make_host()
    await h.write_file("s", b"x")
    await h.fs.setattr(h.node("s"), mode=0o6755)
    assert h.mode("s") == 0o6755
    # A write by an unprivileged opener clears both (group-executable).
    h.uid = 1000
    fh = await h.open("s", os.O_WRONLY)
    await h.write(fh, 0, b"y")
    await h.close(fh)
    assert h.mode("s") == 0o755
    # chown clears them whoever does it (setgid without group-execute marks mandatory
    # locking and stays), and so does a write.
    h.uid = 0
    await h.fs.setattr(h.node("s"), mode=0o6755)
    await h.fs.setattr(h.node("s"), uid=5)
    assert h.mode("s") == 0o755
    await h.fs.setattr(h.node("s"), mode=0o6745)
    await h.fs.setattr(h.node("s"), gid=5)
    assert h.mode("s") == 0o2745
    h.uid = 1000
    fh = await h.open("s", os.O_WRONLY)
    await h.write(fh, 0, b"z")
    await h.close(fh)
    assert h.mode("s") == 0o2745


@pytest.mark.parametrize("call", ["write", "fallocate"])
async def test_the_writers_group_is_asked_at_the_write_not_at_the_open(make_host,
                                                                        call: str) -> None:
    """Set-group-ID without group execute stays for a writer in the file's group, and
    the group is the file's at the write: root may chown the file to the writer's
    group after the writer opened it (found by the POSIX model, through fallocate)."""
    h: Host = await make_host()
    await h.write_file("s", b"x")
    await h.fs.setattr(h.node("s"), mode=0o2646)  # others may write
    node = h.node("s")
    fh = await h.fs.open(node, os.O_WRONLY, 1000, lambda gid: gid == 1000)
    await h.fs.setattr(node, gid=1000)  # root: now the writer's group
    await h.fs.setattr(node, mode=0o2646)  # (the chown cleared nothing: no group x)
    if call == "write":
        await h.write(fh, 0, b"y")
    else:
        await h.fs.fallocate(fh, 0, 0, 1)
    assert h.mode("s") == 0o2646  # in the group now: kept
    await h.fs.setattr(node, gid=0)
    if call == "write":
        await h.write(fh, 0, b"z")
    else:
        await h.fs.fallocate(fh, 0, 0, 2)
    assert h.mode("s") == 0o646  # not in it: cleared
    await h.close(fh)


async def test_a_callers_groups_are_its_primary_and_its_supplementary_ones() -> None:
    from mtcfs.fs.fuse_ops import CallerGroups

    others = set(os.getgroups())
    member_of = CallerGroups(4242, os.getpid())
    assert member_of(4242) and all(member_of(g) for g in others)
    assert not member_of(max(others | {4242}) + 1)
    gone = CallerGroups(4242, 2**22 + 12345)  # no such process: as before, every group
    assert gone(1) and gone(4242)


async def test_xattrs(make_host) -> None:
    h: Host = await make_host()
    node = await h.write_file("f", b"x")
    h.fs.xattrs.setxattr(node, b"user.k", b"v")
    assert h.fs.xattrs.getxattr(node, b"user.k") == b"v"
    assert h.fs.xattrs.listxattr(node) == [b"user.k"]  # user.mtcfs.* are virtual, never listed
    await expect(errno.EPERM, h.fs.xattrs.setxattr, node, b"user.mtcfs.state", b"x")
    await expect(errno.EOPNOTSUPP, h.fs.xattrs.setxattr, node, b"other.k", b"v")
    await expect(errno.E2BIG, h.fs.xattrs.setxattr, node, b"user.big", bytes(65537))
    await expect(errno.ENODATA, h.fs.xattrs.getxattr, node, b"user.none")
    h.fs.xattrs.removexattr(node, b"user.k")
    await expect(errno.ENODATA, h.fs.xattrs.removexattr, node, b"user.k")


async def test_with_the_writeback_cache_a_write_keeps_the_kernels_times(make_host) -> None:
    """The kernel keeps a written file's mtime (writeback cache) and sends it; pages it
    writes back after that must not stamp the daemon's clock over it. A `make test`
    saw big.bin's mtime 46 ms later after kill -9 than the trainer had seen."""
    h: Host = await make_host()
    assert h.fs.kernel_times  # the in-process layer stands for the FUSE data path
    fh = await h.open("f", os.O_WRONLY | os.O_CREAT)
    await h.write(fh, 0, b"a" * 4096)
    node = h.node("f")
    await h.fs.setattr(node, mtime_ns=1_000_000_123, ctime_ns=1_000_000_456)
    await h.write(fh, 4096, b"b" * 4096)  # a page written back after the times
    await h.close(fh)
    assert (node.mtime_ns, node.ctime_ns) == (1_000_000_123, 1_000_000_456)
    assert node.size == 8192
