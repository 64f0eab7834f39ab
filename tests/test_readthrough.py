"""Read-through from the durable tier, end to end through real mounts.

The whole-job loss case: every host mounts again on an
empty RAM dir, sees the newest step that is complete in the durable tier and
reads it through. Each test runs against gs:// (fake-gcs-server) and file://
(a directory) where the behaviour is the same. The resumable-upload recovery
test at the end runs against gcp-storage-emulator (fake-gcs-server finalizes a
resumable upload on a status query, so it cannot show a resumed upload).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import google_crc32c
import pytest

from mtcfs.tiers.durable import (
    CHUNK_META_KEY,
    DurableTier,
    chunk_crcs_of_fd,
    encode_chunk_meta,
    open_durable,
)
from mtcfs.tiers.durable.gcs import GcsTier

from support.gcs_server import GcsServer, free_port
from support.link_proxy import LinkProxy
from support.mounts import MtcfsMount, mtcfs, wipe_ram_dir

MiB = 1 << 20
CHUNK = 16 * MiB  # the per-chunk crc32c granularity of uploads up to 8 GiB
PREFIX = "run-1"
BACKENDS = ["gs", "file"]


def data_of(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def crc_hex(data: bytes) -> str:
    return f"{google_crc32c.value(data):08x}"


def wait_for(pred: Callable[[], Any], timeout: float = 30.0, what: str = "condition",
             interval: float = 0.05) -> Any:
    """Poll `pred` until it returns something true; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def flip_byte(path: Path, offset: int) -> None:
    """Corrupt one byte in place (the file keeps its inode and xattrs)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def tree_of(root: Path) -> dict[str, int]:
    """{relative path: size} of every regular file under root."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = p.stat().st_size
    return out


def write_tree(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


def steps_json(m: MtcfsMount) -> dict:
    r = mtcfs("steps", str(m.path), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def steps_by_path(m: MtcfsMount) -> dict[str, dict]:
    return {s["path"]: s for s in steps_json(m)["steps"]}


def rt_status(m: MtcfsMount) -> dict:
    # Through the CLI, as before status() asked the socket: at that pace
    # test_unlink_while_fetching passes; unlinked right after its fetch starts, the
    # download fails ("generation ... was replaced or deleted") and counts an error.
    return m.status(cli=True)["durable"]["readthrough"]


def persisted(m: MtcfsMount, rels: list[str], old_gens: dict[str, int] | None = None) -> bool:
    for rel in rels:
        st = m.state(rel)
        if not st["persisted"]:
            return False
        if old_gens is not None and st["generation"] == old_gens.get(rel):
            return False
    return True


def wipe_and_remount(m: MtcfsMount, extra: tuple[str, ...] | None = None) -> None:
    """All RAM gone: stop the daemon, delete its RAM dir, mount on an empty one."""
    m.stop()
    wipe_ram_dir(m.ram_dir)
    assert not m.ram_dir.exists()
    if extra is not None:
        m.extra = extra
    m.start()


def full_log(m: MtcfsMount) -> str:
    return m.log_path.read_text(errors="replace")


def pread_all(fd: int, size: int, piece: int = 4 * MiB) -> bytes:
    parts, off = [], 0
    while off < size:
        data = os.pread(fd, min(piece, size - off), off)
        if not data:
            break
        parts.append(data)
        off += len(data)
    return b"".join(parts)


# -- the durable tier, seen from outside mtcfs --------------------------------------------------


class Durable:
    """gs://BUCKET/run-1 on a fake-gcs-server, or file://DIR; what tests do to it
    behind mtcfs's back goes through a plain client or plain file I/O."""

    def __init__(self, kind: str, *, server: GcsServer | None = None, bucket: str = "",
                 root: Path | None = None) -> None:
        self.kind = kind
        self.server = server
        self.bucket = bucket
        self.root = root
        self._tier: DurableTier | None = None
        self._client: Any = None

    @property
    def tier_name(self) -> str:
        """The durable tier's name in user.mtcfs.state's `tiers`."""
        return "gcs" if self.kind == "gs" else "file"

    @property
    def url(self) -> str:
        return f"gs://{self.bucket}/{PREFIX}" if self.kind == "gs" else f"file://{self.root}"

    def mount_args(self, *more: str, endpoint: str | None = None) -> tuple[str, ...]:
        args: tuple[str, ...] = ("--bucket", self.url)
        if self.kind == "gs":
            assert self.server is not None
            args += ("--gcs-endpoint", endpoint or self.server.url)
        return args + more

    @property
    def tier(self) -> DurableTier:
        if self._tier is None:
            self._tier = open_durable(self.url, self.server.url if self.server else None,
                                      retry_deadline=10)
        return self._tier

    @property
    def client(self) -> Any:
        """A plain google-cloud-storage client (another tool, not mtcfs)."""
        if self._client is None:
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import storage

            assert self.server is not None
            self._client = storage.Client(project="test", credentials=AnonymousCredentials(),
                                          client_options={"api_endpoint": self.server.url})
        return self._client

    def put_foreign(self, key: str, data: bytes) -> None:
        """An object written by another tool under the prefix: no mtcfs metadata."""
        if self.kind == "gs":
            self.put_outside(f"{PREFIX}/{key}", data)
        else:
            assert self.root is not None
            write_tree(self.root, {key: data})

    def put_outside(self, name: str, data: bytes) -> None:
        """An object anywhere in the bucket (full object name)."""
        self.client.bucket(self.bucket).blob(name).upload_from_string(
            data, content_type="application/octet-stream")

    def object_file(self, key: str) -> Path:
        """Where the object's bytes are stored as a plain file."""
        if self.kind == "gs":
            assert self.server is not None
            return self.server.object_path(self.bucket, f"{PREFIX}/{key}")
        assert self.root is not None
        return self.root / key

    def read_object(self, key: str) -> bytes:
        if self.kind == "gs":
            return self.client.bucket(self.bucket).blob(f"{PREFIX}/{key}").download_as_bytes()
        assert self.root is not None
        return (self.root / key).read_bytes()

    def close(self) -> None:
        if self._tier is not None:
            self._tier.close()


@pytest.fixture(params=BACKENDS)
def durable(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Durable]:
    """The durable tier: gs:// on the session's fake-gcs-server (memory backend), or file://."""
    if request.param == "gs":
        d = Durable("gs", server=request.getfixturevalue("gcs_server"),
                    bucket=request.getfixturevalue("gcs_bucket"))
    else:
        root = tmp_path / "durable"
        root.mkdir()
        d = Durable("file", root=root)
    yield d
    d.close()


@pytest.fixture
def gs_durable(gcs_server: GcsServer, gcs_bucket: str) -> Iterator[Durable]:
    """gs:// only: for what needs a network link between mtcfs and the tier."""
    d = Durable("gs", server=gcs_server, bucket=gcs_bucket)
    yield d
    d.close()


@pytest.fixture(params=BACKENDS)
def corruptible(request: pytest.FixtureRequest, tmp_path: Path,
                make_gcs_server: Callable[..., GcsServer]) -> Iterator[Durable]:
    """A durable tier whose objects are plain files a test can corrupt: gs:// on a
    fake-gcs-server with the filesystem backend, or file://."""
    if request.param == "gs":
        server = make_gcs_server("filesystem")
        d = Durable("gs", server=server, bucket=server.create_bucket("corrupt"))
    else:
        root = tmp_path / "durable"
        root.mkdir()
        d = Durable("file", root=root)
    yield d
    d.close()


# -- 1. whole-job loss ---------------------------------------------------------------------------


def checkpoint_files() -> dict[str, bytes]:
    """Three complete steps (torch DCP layout, one with a nested directory and an
    empty shard, one shard spanning two 16 MiB chunks) and one step without marker."""
    files = {
        "step-100/__0_0.distcp": data_of(MiB + 17, 1),
        "step-100/__1_0.distcp": data_of(300 * 1024, 2),
        "step-200/__0_0.distcp": data_of(20 * MiB + 5, 3),
        "step-200/__1_0.distcp": b"",
        "step-200/optim/state.bin": data_of(64 * 1024, 4),
        "step-300/__0_0.distcp": data_of(3 * MiB, 5),
        "step-300/__1_0.distcp": data_of(3 * MiB + 1, 6),
        "step-400/__0_0.distcp": data_of(2 * MiB, 7),  # never committed
    }
    return files


def test_whole_job_loss(make_mount, durable: Durable) -> None:
    m = make_mount(extra=durable.mount_args())
    files = checkpoint_files()
    write_tree(m.path, files)
    for step in ("step-100", "step-200", "step-300"):  # the commit marker goes last
        marker = f"{step}/.metadata"
        files[marker] = json.dumps({"step": step}).encode()
        (m.path / marker).write_bytes(files[marker])

    complete = ["step-100", "step-200", "step-300"]
    wait_for(lambda: all(steps_by_path(m)[s]["persisted"] for s in complete), 60,
             "the committed steps to persist (policy step)")
    assert not steps_by_path(m)["step-400"]["persisted"]  # no marker: not persisted by policy
    r = mtcfs("persist", str(m.path), str(m.path / "step-400"), "--wait")
    assert r.returncode == 0, r.stderr
    before = {rel: m.state(rel) for rel in files}
    assert all(st["persisted"] and st["generation"] for st in before.values())

    wipe_and_remount(m)

    # The whole tree at once: no listing has to warm up.
    assert tree_of(m.path) == {rel: len(data) for rel, data in files.items()}
    steps = steps_json(m)
    by_path = {s["path"]: s for s in steps["steps"]}
    assert steps["newest_complete_safe"] == "step-300"
    for s in complete:
        assert by_path[s]["complete"] and by_path[s]["persisted"], by_path[s]
        assert by_path[s]["in_ram"] is False and by_path[s]["files_in_ram"] == 0
    assert by_path["step-400"]["complete"] is False
    assert by_path["step-400"]["persisted"] is True
    assert by_path["step-300"]["files"] == 3
    assert by_path["step-200"]["bytes"] == sum(
        len(d) for rel, d in files.items() if rel.startswith("step-200/"))

    for rel, data in files.items():
        st = m.state(rel)
        assert st["state"] == "closed"
        assert st["size"] == len(data)
        assert st["crc32c"] == crc_hex(data) == before[rel]["crc32c"]
        assert st["generation"] == before[rel]["generation"]
        assert st["persisted"] is True
        assert st["tiers"] == [durable.tier_name], (rel, st)
        assert st["holders"] == []
    rt0 = rt_status(m)
    assert rt0["fetched_files"] == 0 and rt0["fetched_bytes"] == 0
    assert rt0["listed_objects"] == len(files)

    for rel, data in files.items():
        got = (m.path / rel).read_bytes()
        assert len(got) == len(data) and sha256(got) == sha256(data), rel

    def all_in_ram() -> bool:
        return all(m.state(rel)["tiers"] == ["ram", durable.tier_name] for rel in files)

    wait_for(all_in_ram, 20, "every file to be cached in the RAM tier")
    for rel in files:
        assert m.state(rel)["holders"] == ["node-a"]
    rt1 = rt_status(m)
    assert rt1["fetched_files"] == len(files)
    assert rt1["fetched_bytes"] == sum(len(d) for d in files.values())
    assert rt1["integrity_errors"] == 0 and rt1["errors"] == 0
    assert rt1["fetching"] == 0
    assert all(s["in_ram"] for s in steps_json(m)["steps"])
    # Served from RAM now: reading again fetches nothing.
    assert (m.path / "step-200/__0_0.distcp").read_bytes() == files["step-200/__0_0.distcp"]
    assert rt_status(m)["fetched_files"] == len(files)


# -- 2. a torch checkpoint restored in a fresh mount ---------------------------------------------

TORCH_COMPARE = textwrap.dedent("""
    import sys
    import torch

    def same(a, b, where):
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor), where
            assert a.dtype == b.dtype and a.shape == b.shape, where
            assert torch.equal(a, b), where
            return 1
        if isinstance(a, dict):
            assert isinstance(b, dict) and list(a) == list(b), where
            return sum(same(a[k], b[k], f"{where}.{k}") for k in a)
        if isinstance(a, (list, tuple)):
            assert type(a) is type(b) and len(a) == len(b), where
            return sum(same(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
        assert a == b, where
        return 0

    restored = torch.load(sys.argv[1], weights_only=True)
    reference = torch.load(sys.argv[2], weights_only=True)
    print(same(restored, reference, "ckpt"))
""")


def test_torch_checkpoint_restored_from_durable_tier(make_mount, durable: Durable,
                                                     tmp_path: Path) -> None:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.LayerNorm(2048),
                                torch.nn.ReLU(), torch.nn.Linear(2048, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        loss = model(torch.randn(4, 512)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 2}

    m = make_mount(extra=durable.mount_args())
    step = m.path / "step-2"
    step.mkdir()
    torch.save(ckpt, step / "model.pt")
    (step / ".metadata").write_bytes(b'{"format": "torch.save"}')
    torch.save(ckpt, tmp_path / "reference.pt")
    original = (step / "model.pt").read_bytes()
    assert len(original) > CHUNK  # more than one verified chunk
    wait_for(lambda: steps_by_path(m)["step-2"]["persisted"], 60, "step-2 to persist")
    assert sha256(durable.read_object("step-2/model.pt")) == sha256(original)

    wipe_and_remount(m)
    assert m.state("step-2/model.pt")["tiers"] == [durable.tier_name]
    r = subprocess.run([sys.executable, "-c", TORCH_COMPARE, str(step / "model.pt"),
                        str(tmp_path / "reference.pt")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    n_tensors = len(ckpt["model"]) + sum(len(s) for s in ckpt["optimizer"]["state"].values())
    assert int(r.stdout.strip()) == n_tensors
    assert sha256((step / "model.pt").read_bytes()) == sha256(original)
    assert rt_status(m)["fetched_files"] == 1


# -- 3. integrity: corrupt objects are never served ----------------------------------------------


def test_corrupt_object_is_never_served(make_mount, corruptible: Durable) -> None:
    d = corruptible
    m = make_mount(extra=d.mount_args("--persist", "on-close"))
    big = data_of(40 * MiB, 11)  # chunks [0,16) [16,32) [32,40) MiB
    small = data_of(MiB + 3, 12)
    write_tree(m.path, {"ckpt/big.bin": big, "ckpt/small.bin": small})
    wait_for(lambda: persisted(m, ["ckpt/big.bin", "ckpt/small.bin"]), 60, "persist")
    gens = {rel: m.state(rel)["generation"] for rel in ("ckpt/big.bin", "ckpt/small.bin")}
    m.stop()
    wipe_ram_dir(m.ram_dir)
    bad_at = CHUNK + 4 * MiB + 12345  # inside the second chunk
    flip_byte(d.object_file("ckpt/big.bin"), bad_at)
    flip_byte(d.object_file("ckpt/small.bin"), 1000)
    m.start()

    with pytest.raises(OSError) as e:
        (m.path / "ckpt/small.bin").read_bytes()
    assert e.value.errno == errno.EIO

    fd = os.open(m.path / "ckpt/big.bin", os.O_RDONLY)
    try:
        # A range inside a good chunk is served once that chunk is verified...
        assert os.pread(fd, MiB, 2 * MiB) == big[2 * MiB:3 * MiB]
        # ...the corrupted chunk's range never is.
        with pytest.raises(OSError) as e:
            os.pread(fd, 64 * 1024, bad_at - 1000)
        assert e.value.errno == errno.EIO
        # Whatever a read returns is the original data; the bad chunk is always EIO.
        for off in (0, CHUNK, bad_at & ~4095, 2 * CHUNK + MiB):
            try:
                got = os.pread(fd, 128 * 1024, off)
            except OSError as err:
                assert err.errno == errno.EIO
                continue
            assert got == big[off:off + 128 * 1024], off
            assert not off <= bad_at < off + 128 * 1024, "corrupted range was served"
        with pytest.raises(OSError) as e:
            (m.path / "ckpt/big.bin").read_bytes()
        assert e.value.errno == errno.EIO

        rt = rt_status(m)
        assert rt["integrity_errors"] >= 2
        assert "big.bin" in rt["last_error"] or "small.bin" in rt["last_error"]
        assert "crc32c" in rt["last_error"]
        for rel in ("ckpt/big.bin", "ckpt/small.bin"):
            st = m.state(rel)
            assert st["tiers"] == [d.tier_name] and st["holders"] == [], st
        assert "crc32c" in full_log(m)

        # Repaired (same bytes, same generation): the same open file now reads fine.
        flip_byte(d.object_file("ckpt/big.bin"), bad_at)
        flip_byte(d.object_file("ckpt/small.bin"), 1000)
        assert os.pread(fd, 64 * 1024, bad_at - 1000) == big[bad_at - 1000:bad_at - 1000 + 65536]
        assert sha256(pread_all(fd, len(big))) == sha256(big)
    finally:
        os.close(fd)
    assert (m.path / "ckpt/small.bin").read_bytes() == small
    assert sha256((m.path / "ckpt/big.bin").read_bytes()) == sha256(big)
    wait_for(lambda: m.state("ckpt/big.bin")["tiers"] == ["ram", d.tier_name], 20, "big.bin in RAM")
    for rel, gen in gens.items():
        assert m.state(rel)["generation"] == gen
    assert m.proc is not None and m.proc.poll() is None


def test_corrupt_foreign_object_is_never_served(make_mount, corruptible: Durable,
                                                tmp_path: Path) -> None:
    """An object without per-chunk checksums (written by another tool) is verified
    as a whole: a corrupted one fails with EIO, nothing of it is served."""
    d = corruptible
    data = data_of(20 * MiB + 7, 21)
    good = data_of(3 * MiB, 22)
    if d.kind == "gs":
        d.put_foreign("foreign/bad.bin", data)  # the server records the crc32c
        d.put_foreign("foreign/good.bin", good)
    else:
        # A file placed by plain tools has no recorded crc32c at all and cannot be
        # verified (LocalDirTier serves it as is). One with its crc32c recorded but
        # no chunk metadata, as another writer of the tier would leave it:
        for key, payload in (("foreign/bad.bin", data), ("foreign/good.bin", good)):
            src = tmp_path / "src"
            src.write_bytes(payload)
            d.tier.put_file(key, str(src), google_crc32c.value(payload))
    assert CHUNK_META_KEY not in d.tier.stat("foreign/bad.bin").metadata
    flip_byte(d.object_file("foreign/bad.bin"), 17 * MiB)

    m = make_mount(extra=d.mount_args())
    assert tree_of(m.path) == {"foreign/bad.bin": len(data), "foreign/good.bin": len(good)}
    fd = os.open(m.path / "foreign/bad.bin", os.O_RDONLY)
    try:
        for off in (0, 17 * MiB):  # whole-object verification: nothing is served
            with pytest.raises(OSError) as e:
                os.pread(fd, 4096, off)
            assert e.value.errno == errno.EIO
    finally:
        os.close(fd)
    assert (m.path / "foreign/good.bin").read_bytes() == good
    rt = rt_status(m)
    assert rt["integrity_errors"] >= 1 and "bad.bin" in rt["last_error"]
    assert m.state("foreign/bad.bin")["tiers"] == [d.tier_name]

    flip_byte(d.object_file("foreign/bad.bin"), 17 * MiB)  # repaired
    assert sha256((m.path / "foreign/bad.bin").read_bytes()) == sha256(data)


# -- 4. reads start before the whole file has arrived --------------------------------------------


def test_reads_start_before_the_file_has_arrived(make_mount, gs_durable: Durable) -> None:
    durable = gs_durable
    size = 96 * MiB
    data = data_of(size, 31)
    m = make_mount(extra=durable.mount_args("--persist", "on-close"))
    (m.path / "big.bin").write_bytes(data)
    wait_for(lambda: persisted(m, ["big.bin"]), 60, "big.bin to persist")

    assert durable.server is not None
    with LinkProxy(durable.server.port, rate=30 * MiB) as link:  # ~3.2 s for the file
        wipe_and_remount(m, durable.mount_args("--persist", "on-close", endpoint=link.url))
        t0 = time.monotonic()
        fd = os.open(m.path / "big.bin", os.O_RDONLY)
        try:
            first = os.pread(fd, MiB, 0)
            t_first = time.monotonic() - t0
            in_flight = m.state("big.bin")
            wait_for(lambda: "ram" in m.state("big.bin")["tiers"], 60, "the fetch to finish",
                     interval=0.02)
            t_done = time.monotonic() - t0
            rest = pread_all(fd, size)
        finally:
            os.close(fd)
        downstream = link.downstream_bytes
    assert first == data[:MiB]
    assert in_flight["tiers"] == ["gcs"], "the first read waited for the whole file"
    assert sha256(rest) == sha256(data)
    assert downstream >= size  # the data really came over the slow link
    assert t_done > 2.0, f"the link was not slow: whole file in {t_done:.2f}s"
    print(f"first MiB after {t_first:.2f}s, whole file after {t_done:.2f}s")
    assert t_first < 0.8 * t_done and t_done - t_first > 0.5, (t_first, t_done)
    rt = rt_status(m)
    assert rt["fetched_files"] == 1 and rt["fetched_bytes"] == size and rt["fetching"] == 0


# -- 5. objects written by other tools ------------------------------------------------------------


def test_foreign_objects_appear(make_mount, durable: Durable) -> None:
    d = durable
    inside = {
        "top.txt": b"written by another tool\n",
        "foreign/a.bin": data_of(100 * 1024, 41),
        "deep/x/y/z.bin": data_of(5000, 42),
    }
    for key, data in inside.items():
        d.put_foreign(key, data)
    long_name = "n" * 256
    if d.kind == "gs":
        d.put_outside(f"{PREFIX}-other/x.bin", b"outside the prefix")
        d.put_outside("elsewhere/y.bin", b"outside the prefix")
        d.put_outside(PREFIX, b"the prefix itself as an object")
        d.put_foreign(f"long/{long_name}", b"name too long for POSIX")
        d.put_foreign(f"{'d' * 300}/f.bin", b"directory name too long")
    else:
        assert d.root is not None
        write_tree(d.root, {".mtcfs-tmp-partial": b"an interrupted put"})

    m = make_mount(extra=d.mount_args("--list-refresh", "1"))
    assert tree_of(m.path) == {k: len(v) for k, v in inside.items()}
    assert sorted(os.listdir(m.path)) == ["deep", "foreign", "top.txt"]
    for key, data in inside.items():
        assert (m.path / key).read_bytes() == data
        assert m.state(key)["persisted"] is True
    if d.kind == "gs":
        log = full_log(m)
        assert f"skipping bucket object long/{long_name}: a name is longer than 255" in log
        assert f"skipping bucket object {'d' * 300}/f.bin" in log

    # While mounted: new objects show up within a refresh or two.
    later = data_of(70 * 1024, 43)
    d.put_foreign("later/b.bin", later)
    if d.kind == "gs":
        d.put_outside(f"{PREFIX}-other/later.bin", b"still outside")
        d.put_foreign(f"later/{'m' * 300}", b"too long, on refresh")
    wait_for(lambda: "later" in os.listdir(m.path), 15, "later/ to appear (refresh 1 s)")
    wait_for(lambda: os.listdir(m.path / "later") == ["b.bin"], 10, "later/b.bin")
    assert m.state("later/b.bin")["tiers"] == [d.tier_name]
    assert (m.path / "later/b.bin").read_bytes() == later
    assert "run-1-other" not in os.listdir(m.path)
    if d.kind == "gs":
        wait_for(lambda: f"later/{'m' * 300}" in full_log(m), 10, "the skip to be logged")
    assert m.proc is not None and m.proc.poll() is None
    assert rt_status(m)["errors"] == 0


# -- 6. writing to a file that is only in the durable tier ---------------------------------------


def test_write_to_read_through_file(make_mount, durable: Durable) -> None:
    d = durable
    originals = {
        "data/a.bin": data_of(3 * MiB + 1, 51),
        "data/b.bin": data_of(2 * MiB, 52),
        "data/c.bin": data_of(MiB, 53),
        "data/d.bin": data_of(MiB, 54),
    }
    m = make_mount(extra=d.mount_args("--persist", "on-close"))
    write_tree(m.path, originals)
    rels = list(originals)
    wait_for(lambda: persisted(m, rels), 60, "persist")
    gens = {rel: m.state(rel)["generation"] for rel in rels}
    wipe_and_remount(m)
    assert rt_status(m)["fetched_files"] == 0

    new = dict(originals)
    with open(m.path / "data/a.bin", "ab") as f:  # append: fetched first, then written
        f.write(b"appended tail")
    new["data/a.bin"] = originals["data/a.bin"] + b"appended tail"
    assert rt_status(m)["fetched_files"] == 1

    with open(m.path / "data/b.bin", "r+b") as f:  # in place
        f.seek(100)
        f.write(b"XYZ")
    b = originals["data/b.bin"]
    new["data/b.bin"] = b[:100] + b"XYZ" + b[103:]
    assert rt_status(m)["fetched_files"] == 2

    os.truncate(m.path / "data/d.bin", 1000)  # truncate(2) keeping a prefix: fetched first
    new["data/d.bin"] = originals["data/d.bin"][:1000]
    assert rt_status(m)["fetched_files"] == 3

    with open(m.path / "data/c.bin", "wb") as f:  # O_TRUNC: nothing to fetch
        f.write(b"replaced")
    new["data/c.bin"] = b"replaced"
    rt = rt_status(m)
    assert rt["fetched_files"] == 3
    assert rt["fetched_bytes"] == sum(len(originals[f"data/{n}.bin"]) for n in "abd")

    for rel, data in new.items():
        assert (m.path / rel).read_bytes() == data, rel
        st = m.state(rel)
        assert st["state"] == "closed" and st["size"] == len(data)
        assert st["crc32c"] == crc_hex(data)
        assert "ram" in st["tiers"]
    wait_for(lambda: persisted(m, rels, old_gens=gens), 30, "the new versions to persist")
    for rel, data in new.items():
        st = m.state(rel)
        assert st["generation"] != gens[rel] and st["tiers"] == ["ram", d.tier_name]
        key = rel
        assert d.read_object(key) == data, rel
        info = d.tier.stat(key)
        assert info is not None and info.generation == st["generation"]
        assert f"{info.crc32c:08x}" == crc_hex(data)
    assert rt_status(m)["fetched_files"] == 3
    assert m.status()["durable"]["errors"] == 0


# -- 7. resumable-upload recovery (gcp-storage-emulator) ------------------------------------------
#
# fake-gcs-server finalizes a resumable session on a status query, so it cannot
# show a resumed upload; gcp-storage-emulator keeps the session and answers the
# status query with the bytes it holds. Its limits, as of 2026.7.19:
# - it serves one request at a time (http.server.HTTPServer), so the proxy must
#   close both sides at once when it cuts (link_proxy does);
# - it reads a request body with one read(): after a connection reset (RST) it
#   keeps nothing of that request, after a clean end of stream (FIN) it keeps
#   the bytes that arrived, like GCS keeps what it received;
# - for a session holding 0 bytes it answers the status query with
#   "Range: bytes=0-0" (one byte) instead of no Range header, so a client that
#   follows the protocol resumes at byte 1 and gets HTTP 400. A cut before any
#   byte was kept therefore cannot be tested; the cuts below come after.


@pytest.fixture
def gcs_emulator() -> Iterator[str]:
    """gcp-storage-emulator (in memory) with bucket "emu"; yields its URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
         "--port", str(port), "--in-memory", "--default-bucket", "emu", "--quiet"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"gcp-storage-emulator exited: {proc.stderr.read()!r}")
            try:
                with urllib.request.urlopen(f"{url}/storage/v1/b/emu", timeout=1) as r:
                    return r.status == 200
            except (urllib.error.URLError, OSError):
                return False

        wait_for(up, 20, "gcp-storage-emulator to answer")
        yield url
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("cut, chunk", [("fin", None), ("rst", 4 * MiB)],
                         ids=["one-stream-fin", "chunked-rst"])
def test_resumable_upload_resumes_after_dropped_connection(
        gcs_emulator: str, tmp_path: Path, cut: str, chunk: int | None) -> None:
    port = int(gcs_emulator.rsplit(":", 1)[1])
    size = 20 * MiB + 12345  # above the 8 MiB multipart limit: a resumable session
    data = data_of(size, 61)
    src = tmp_path / "shard.bin"
    src.write_bytes(data)
    fd = os.open(src, os.O_RDONLY)
    try:
        chunk_size, crcs = chunk_crcs_of_fd(fd, size)
    finally:
        os.close(fd)
    meta = {CHUNK_META_KEY: encode_chunk_meta(chunk_size, crcs)}
    crc = google_crc32c.value(data)

    # One stream: cut 7 MiB into the PUT. Chunked: cut the second 4 MiB chunk's PUT
    # 3 MiB in (every request is its own connection on this server).
    with LinkProxy(port, drop_after=(7 if chunk is None else 3) * MiB, drop=cut,
                   drop_nth=1 if chunk is None else 2) as link:
        tier = GcsTier("emu", f"{PREFIX}/", endpoint=link.url, retry_deadline=30,
                       upload_chunk_size=chunk)
        sent: list[tuple[int, int]] = []
        try:
            tier.check()
            info = tier.put_file("step-1/shard.bin", str(src), crc, if_generation_match=0,
                                 progress=lambda off, n: sent.append((off, n)),
                                 metadata=meta)
        finally:
            tier.close()
        assert link.dropped.is_set()
        upstream = link.upstream_bytes

    assert info.size == size and info.crc32c == crc and info.generation > 0
    assert info.metadata == meta
    # Resumed, not restarted: after the cut the upload went on from where the
    # server stood, not from byte 0, and the bytes sent stay well under twice the file.
    restarts = [off for (prev, n), (off, _) in zip(sent, sent[1:], strict=False)
                if off != prev + n]
    assert len(restarts) == 1, restarts
    if chunk is None:
        assert 6 * MiB < restarts[0] <= 7 * MiB
    else:
        assert restarts[0] == chunk
    assert upstream < 1.5 * size

    check = GcsTier("emu", f"{PREFIX}/", endpoint=gcs_emulator, retry_deadline=10)
    try:
        stat = check.stat("step-1/shard.bin")
        assert stat is not None and stat.crc32c == crc and stat.size == size
        assert stat.generation == info.generation
        out = os.open(tmp_path / "back.bin", os.O_RDWR | os.O_CREAT, 0o600)
        verified: list[tuple[int, int]] = []
        try:
            check.download("step-1/shard.bin", out, on_verified=lambda o, n: verified.append(
                (o, n)))
            assert sha256(pread_all(out, size + 1)) == sha256(data)
        finally:
            os.close(out)
        assert sorted(verified) == [(o, min(CHUNK, size - o)) for o in range(0, size, CHUNK)]
    finally:
        check.close()


# -- the file changes while it is being fetched ----------------------------------------------------


@pytest.fixture
def slow_fetch(make_mount, gs_durable: Durable) -> Iterator[Callable]:
    """make(size, *mount_args) -> (mount, data): a file `big.bin` persisted to gs://,
    the RAM tier wiped, and the mount back over a ~20 MiB/s link, so a fetch of it
    takes seconds."""
    links: list[LinkProxy] = []

    def make(size: int, *args: str) -> tuple[MtcfsMount, bytes, Durable]:
        d = gs_durable
        assert d.server is not None
        m = make_mount(extra=d.mount_args("--persist", "on-close", *args))
        data = data_of(size, 71)
        (m.path / "big.bin").write_bytes(data)
        wait_for(lambda: persisted(m, ["big.bin"]), 60, "big.bin to persist")
        link = LinkProxy(d.server.port, rate=20 * MiB)
        links.append(link)
        wipe_and_remount(m, d.mount_args("--persist", "on-close", *args, endpoint=link.url))
        return m, data, d

    yield make
    for link in links:
        link.close()


@pytest.mark.slow
def test_unlink_while_fetching(slow_fetch) -> None:
    """The fetch goes on into a file that is gone; it never writes anywhere else."""
    m, _, _ = slow_fetch(64 * MiB)
    os.close(os.open(m.path / "big.bin", os.O_RDONLY))  # starts the fetch
    wait_for(lambda: rt_status(m)["fetching"] == 1, 10, "the fetch to start")
    os.unlink(m.path / "big.bin")
    written = {f"new-{i}.bin": data_of(4 * MiB, 80 + i) for i in range(4)}
    with contextlib.ExitStack() as stack:
        # New files whose RAM fds are opened while the fetch runs.
        files = {name: stack.enter_context(open(m.path / name, "wb")) for name in written}
        for name, f in files.items():
            f.write(written[name][:MiB])
            f.flush()
        wait_for(lambda: rt_status(m)["fetching"] == 0, 30, "the fetch to end")
        for name, f in files.items():
            f.write(written[name][MiB:])
    rt = rt_status(m)
    assert rt["errors"] == 0, rt["last_error"]
    m.restart()  # read the RAM tier itself, not the kernel's page cache
    assert tree_of(m.path) == {name: len(data) for name, data in written.items()}
    for name, data in written.items():
        assert (m.path / name).read_bytes() == data, name


def test_truncate_while_fetching(slow_fetch) -> None:
    """O_TRUNC while a reader's fetch runs: the new content is not overwritten by
    the old bytes still arriving, and it is what gets persisted."""
    m, _, d = slow_fetch(64 * MiB)
    reader = os.open(m.path / "big.bin", os.O_RDONLY)  # starts the fetch
    try:
        wait_for(lambda: rt_status(m)["fetching"] == 1, 10, "the fetch to start")
        new = data_of(40 * MiB, 72)
        with open(m.path / "big.bin", "wb") as f:
            f.write(new)
        wait_for(lambda: rt_status(m)["fetching"] == 0, 30, "the fetch to end")
        assert os.pread(reader, MiB, 8 * MiB) == new[8 * MiB:9 * MiB]
    finally:
        os.close(reader)
    st = wait_for(lambda: (s := m.state("big.bin"))["persisted"] and s, 30, "persisted")
    assert st["size"] == len(new) and st["crc32c"] == crc_hex(new)
    assert sha256(d.read_object("big.bin")) == sha256(new)
    m.restart()  # the RAM tier itself, not the page cache
    assert sha256((m.path / "big.bin").read_bytes()) == sha256(new)


def test_object_replaced_while_fetching(slow_fetch) -> None:
    """Another tool overwrites the object while this node fetches the old
    generation: once the listing refresh has seen the new generation, reads give
    the new bytes only, and the old fetch does not land in the RAM tier."""
    size = 48 * MiB
    m, _, d = slow_fetch(size, "--list-refresh", "1")
    old_gen = m.state("big.bin")["generation"]
    os.close(os.open(m.path / "big.bin", os.O_RDONLY))  # starts the fetch
    new = data_of(size, 73)
    # The old generation's fetch runs (~2.4 s over the link) when the object is
    # replaced. (Checked before the upload: under load the upload took long enough
    # for the 1 s listing refresh to see the new generation and drop that fetch.)
    assert rt_status(m)["fetching"] == 1
    d.put_foreign("big.bin", new)
    st = wait_for(lambda: (s := m.state("big.bin"))["generation"] != old_gen and s, 20,
                  "the refresh to pick up the new generation")
    assert st["size"] == size and st["crc32c"] == crc_hex(new)
    assert sha256((m.path / "big.bin").read_bytes()) == sha256(new)
    wait_for(lambda: rt_status(m)["fetching"] == 0, 30, "the fetches to end")
    assert m.state("big.bin")["tiers"] == ["ram", "gcs"]
    m.restart()  # the RAM tier itself, not the page cache
    assert sha256((m.path / "big.bin").read_bytes()) == sha256(new)


def test_object_replaced_after_read(make_mount, gs_durable: Durable) -> None:
    """A file read (so cached by the kernel, keep_cache) whose object another tool
    then overwrites: after the refresh, reads give the new bytes, not cached pages."""
    d = gs_durable
    m = make_mount(extra=d.mount_args("--list-refresh", "1"))
    old = data_of(3 * MiB, 76)
    d.put_foreign("f.bin", old)
    wait_for(lambda: "f.bin" in os.listdir(m.path), 10, "f.bin to appear")
    assert (m.path / "f.bin").read_bytes() == old
    old_gen = m.state("f.bin")["generation"]
    new = data_of(3 * MiB, 77)
    d.put_foreign("f.bin", new)
    wait_for(lambda: m.state("f.bin")["generation"] != old_gen, 20, "the refresh")
    assert m.state("f.bin")["tiers"] == ["gcs"]
    assert (m.path / "f.bin").read_bytes() == new


def test_object_replaced_by_another_size(make_mount, gs_durable: Durable) -> None:
    """The kernel trusts its own size of a cached file (writeback cache): a refresh
    gives the replaced file a new inode and drops the kernel's entry."""
    durable = gs_durable
    m = make_mount(extra=durable.mount_args("--persist", "on-close", "--list-refresh", "1"))
    old = data_of(3 * MiB, 74)
    (m.path / "f.bin").write_bytes(old)
    wait_for(lambda: persisted(m, ["f.bin"]), 30, "persist")
    old_gen = m.state("f.bin")["generation"]
    assert (m.path / "f.bin").stat().st_size == len(old)  # the kernel caches the inode
    new = data_of(MiB + 5, 75)
    durable.put_foreign("f.bin", new)
    wait_for(lambda: m.state("f.bin")["generation"] != old_gen, 20, "the refresh")
    assert (m.path / "f.bin").stat().st_size == len(new)
    assert (m.path / "f.bin").read_bytes() == new
