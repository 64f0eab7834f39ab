"""Real clients on a mount: torch, numpy, a shared mmap and fio, each checked
for content and for a sealed state whose crc32c matches the bytes."""

from __future__ import annotations

import json
import mmap
import os
import re
import subprocess
import sys
import textwrap
import time

import google_crc32c
import numpy as np
import pytest

from support.mounts import BOTH_DATA_PATHS


@pytest.fixture(params=BOTH_DATA_PATHS)
def data_path(request: pytest.FixtureRequest) -> str:
    """Every test here runs with passthrough and with every byte through the daemon."""
    return request.param


def drop_cache(path) -> None:
    """Drop the file's clean pages from the page cache, so the next read is
    served by the daemon, not by the kernel (the mount keeps the cache)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def file_crc(path) -> str:
    drop_cache(path)
    with open(path, "rb") as f:
        crc = 0
        while chunk := f.read(8 << 20):
            crc = google_crc32c.extend(crc, chunk)
    return f"{crc:08x}"


def assert_sealed(mnt, rel: str, size: int) -> dict:
    """The file is closed, with the right size and the crc32c of its bytes."""
    st = mnt.state(rel)
    assert st["state"] == "closed", st
    assert st["size"] == size == os.path.getsize(mnt.path / rel)
    assert re.fullmatch(r"[0-9a-f]{8}", st["crc32c"]), st
    assert st["crc32c"] == file_crc(mnt.path / rel), st
    assert st["holders"] == [mnt.node_id]
    return st


def test_torch_save_load_in_fresh_process(mnt, ram_root):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512),
        torch.nn.LayerNorm(512),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 512)).square().mean().backward()
    opt.step()  # Adam now has exp_avg / exp_avg_sq state per parameter
    ckpt = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 7}
    (mnt.path / "step_7").mkdir()
    target = mnt.path / "step_7" / "model.pt"
    torch.save(ckpt, target)
    reference = ram_root / "reference.pt"  # the same objects, outside the mount
    torch.save(ckpt, reference)
    size = target.stat().st_size
    assert size > 4 << 20
    assert_sealed(mnt, "step_7/model.pt", size)

    # A separate process: a fresh open() of the file, nothing from our page cache.
    check = textwrap.dedent("""
        import sys, torch
        got = torch.load(sys.argv[1], weights_only=True)
        ref = torch.load(sys.argv[2], weights_only=True)
        def same(a, b, where):
            if isinstance(a, torch.Tensor):
                assert isinstance(b, torch.Tensor), where
                assert a.dtype == b.dtype and a.shape == b.shape, where
                assert torch.equal(a, b), where
            elif isinstance(a, dict):
                assert isinstance(b, dict) and a.keys() == b.keys(), where
                for k in a:
                    same(a[k], b[k], f"{where}/{k}")
            elif isinstance(a, (list, tuple)):
                assert type(a) is type(b) and len(a) == len(b), where
                for i, (x, y) in enumerate(zip(a, b)):
                    same(x, y, f"{where}[{i}]")
            else:
                assert a == b, (where, a, b)
        same(got, ref, "")
        assert len(got["optim"]["state"]) == 6
        print("tensors", sum(1 for _ in got["model"]), "equal")
    """)
    drop_cache(target)
    r = subprocess.run([sys.executable, "-c", check, str(target), str(reference)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "equal" in r.stdout
    assert_sealed(mnt, "step_7/model.pt", size)


def test_numpy_save_and_mmap_load(mnt):
    rng = np.random.default_rng(1)
    arrays = {
        "f32.npy": rng.standard_normal((1000, 700), dtype=np.float32),
        "i64.npy": rng.integers(-(1 << 40), 1 << 40, size=300_001, dtype=np.int64),
        "small.npy": np.arange(7, dtype=np.uint8),
    }
    for name, a in arrays.items():
        np.save(mnt.path / name, a)
    for name, a in arrays.items():
        drop_cache(mnt.path / name)
        m = np.load(mnt.path / name, mmap_mode="r")
        assert isinstance(m, np.memmap)
        assert m.dtype == a.dtype and m.shape == a.shape
        assert np.array_equal(m, a)
        del m
        assert_sealed(mnt, name, os.path.getsize(mnt.path / name))


def test_shared_mmap_write(mnt):
    size = (16 << 20) + 12345
    rng = np.random.default_rng(2)
    data = rng.integers(0, 256, size=size, dtype=np.uint8).tobytes()
    path = mnt.path / "mapped.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        view = memoryview(mm)
        # Back to front, in uneven pieces: pages get dirtied out of order.
        step = 1_000_003
        for off in reversed(range(0, size, step)):
            view[off:off + step] = data[off:off + step]
        view.release()
        mm.flush()
        mm.close()
    finally:
        os.close(fd)
    st = assert_sealed(mnt, "mapped.bin", size)
    assert st["crc32c"] == f"{google_crc32c.value(data):08x}"
    assert path.read_bytes() == data


def _fio(mnt, name: str, rw: str, bs: str) -> None:
    path = mnt.path / name
    job = ["fio", f"--name={name}", f"--filename={path}", f"--rw={rw}", f"--bs={bs}",
           "--size=64m", "--ioengine=psync", "--direct=0", "--verify=crc32c",
           "--do_verify=1", "--randrepeat=1", "--verify_state_save=0", "--output-format=json"]

    def run(*extra: str) -> dict:
        r = subprocess.run([*job, *extra], capture_output=True, text=True, timeout=120,
                           cwd=mnt.path.parent)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr
        assert "verify" not in r.stderr.lower(), r.stderr
        out = json.loads(r.stdout[r.stdout.index("{"):])["jobs"][0]
        assert out["error"] == 0, out
        return out

    out = run()
    assert out["write"]["io_bytes"] == 64 << 20
    assert out["read"]["io_bytes"] == 64 << 20  # the verify pass read everything back
    # Verify again from the daemon's copy, not from the page cache.
    drop_cache(path)
    before = mnt.status()
    out = run("--verify_only=1")
    assert out["read"]["io_bytes"] == 64 << 20
    after = mnt.status()
    if after["data_path"] == "fuse":  # served by the daemon
        assert after["bytes_read"] - before["bytes_read"] >= 64 << 20
    else:  # straight from the RAM tier: the daemon only answered the open
        assert after["bytes_read"] == before["bytes_read"]
        assert (after["passthrough"]["passthrough_opens"]
                > before["passthrough"]["passthrough_opens"])


def test_fio_sequential_write_verify(mnt):
    _fio(mnt, "fio-seq", "write", "1m")
    st = assert_sealed(mnt, "fio-seq", 64 << 20)
    assert st["version"] >= 1


def test_fio_random_write_verify(mnt):
    _fio(mnt, "fio-rand", "randwrite", "4k")
    assert_sealed(mnt, "fio-rand", 64 << 20)
    # Written out of order (or unseen, through passthrough): one full pass at seal time.
    assert mnt.status()["seal_full_passes"] >= 1


def test_numpy_memmap_writer(mnt):
    """np.memmap closes its fd right after mapping: the data arrives through
    the mapping after close(), and the file is sealed when it is unmapped."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2048, 1024)).astype(np.float32)
    m = np.memmap(mnt.path / "memmap.f32", dtype=np.float32, mode="w+", shape=a.shape)
    m[::-1] = a[::-1]
    m.flush()
    del m
    deadline = time.monotonic() + 10
    while mnt.state("memmap.f32")["state"] != "closed" and time.monotonic() < deadline:
        time.sleep(0.05)  # the kernel sends release() after munmap asynchronously
    st = assert_sealed(mnt, "memmap.f32", a.nbytes)
    assert st["crc32c"] == f"{google_crc32c.value(a.tobytes()):08x}"
    r = np.fromfile(mnt.path / "memmap.f32", dtype=np.float32).reshape(a.shape)
    assert np.array_equal(r, a)
