"""Basic life cycle of a mount: data round trip, state xattr, status, unmount."""

from __future__ import annotations

import google_crc32c

from mtcfs.config import mount_entry

from support.mounts import mtcfs


def test_write_read_state_status_umount(mnt):
    data = b"hello mtcfs\n" * 1000
    (mnt.path / "f").write_bytes(data)
    assert (mnt.path / "f").read_bytes() == data
    st = mnt.state("f")
    assert st["state"] == "closed"
    assert st["size"] == len(data)
    assert int(st["crc32c"], 16) == google_crc32c.value(data)
    assert st["holders"] == ["node-a"] and st["replicas"] == 0 and st["persisted"] is False
    status = mnt.status(cli=True)  # `mtcfs status --json`
    assert status["files"] == 1 and status["ram"]["capacity"] == 2 << 30
    assert status["health"] == "ok"
    r = mtcfs("umount", str(mnt.path))
    assert r.returncode == 0, r.stderr
    assert mnt.proc.wait(timeout=10) == 0
    assert mount_entry(str(mnt.path)) is None
