"""Persisting to the durable tier through a real mount: the persist policies,
commit ordering, renames and deletes, outages (GCS server killed, daemon killed),
generation preconditions and the CLI around it.

Every behaviour that does not depend on the backend runs on both: gs:// on a real
fake-gcs-server and file:// on a directory. The bucket is always read directly
(google-cloud-storage for gs://, the plain directory for file://), never through
the mount under test.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import google_crc32c
import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from mtcfs import control
from mtcfs.config import mount_entry
from mtcfs.tiers.durable.localdir import LocalDirTier

from support.gcs_server import GcsServer, closed_port, free_port
from support.link_proxy import LinkProxy
from support.mounts import MtcfsMount, mtcfs, wait_until

MiB = 1 << 20
BACKENDS = ["gs", "file"]


# -- helpers -------------------------------------------------------------------------------------




def crc(data: bytes) -> int:
    return google_crc32c.value(data)


def write(path: Path, data: bytes) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


class Obj(NamedTuple):
    size: int
    crc32c: int | None
    generation: int


@dataclass
class Bucket:
    """The durable tier seen directly, not through mtcfs."""

    kind: str  # "gs" or "file"
    url: str
    server: GcsServer | None = None
    bucket: str = ""
    prefix: str = ""  # gs: "run/"
    root: Path | None = None  # file: the directory

    def __post_init__(self) -> None:
        self._client: storage.Client | None = None

    @property
    def client(self) -> storage.Client:
        assert self.server is not None
        if self._client is None:
            self._client = storage.Client(project="test", credentials=AnonymousCredentials(),
                                          client_options={"api_endpoint": self.server.url})
        return self._client

    @property
    def tier(self) -> str:
        """The durable tier's name in `tiers` of user.mtcfs.state."""
        return "gcs" if self.kind == "gs" else "file"

    def mount_args(self, persist: str | None = None) -> tuple[str, ...]:
        args: tuple[str, ...] = ("--bucket", self.url)
        if self.server is not None:
            args += ("--gcs-endpoint", self.server.url)
        if persist is not None:
            args += ("--persist", persist)
        return args

    def objects(self) -> dict[str, Obj]:
        """key -> (size, crc32c, generation) of every object under the prefix."""
        if self.kind == "gs":
            out = {}
            for b in self.client.list_blobs(self.bucket, prefix=self.prefix, timeout=10):
                c = int.from_bytes(base64.b64decode(b.crc32c), "big") if b.crc32c else None
                out[b.name[len(self.prefix):]] = Obj(int(b.size), c, int(b.generation))
            return out
        assert self.root is not None
        return {o.key: Obj(o.size, o.crc32c, o.generation)
                for o in LocalDirTier(str(self.root)).list()}

    def names(self) -> set[str]:
        return set(self.objects())

    def read(self, key: str) -> bytes:
        if self.kind == "gs":
            return self.client.bucket(self.bucket).blob(self.prefix + key).download_as_bytes(
                timeout=60)
        assert self.root is not None
        return (self.root / key).read_bytes()

    def put_behind_back(self, key: str, data: bytes) -> None:
        """Another writer replaces the object (a new generation), bypassing mtcfs."""
        if self.kind == "gs":
            self.client.bucket(self.bucket).blob(self.prefix + key).upload_from_string(data)
            return
        assert self.root is not None
        src = self.root.parent / "foreign-src"
        src.write_bytes(data)
        LocalDirTier(str(self.root)).put_file(key, str(src), crc(data))

    def has(self, files: dict[str, bytes]) -> bool:
        """True if every file is in the bucket with exactly its size and crc32c."""
        objs = self.objects()
        return all(k in objs and objs[k].size == len(v) and objs[k].crc32c == crc(v)
                   for k, v in files.items())

    def assert_holds(self, files: dict[str, bytes], exactly: bool = True) -> None:
        objs = self.objects()
        if exactly:
            assert set(objs) == set(files), f"bucket holds {sorted(objs)}"
        for key, data in files.items():
            assert objs[key].size == len(data), key
            assert objs[key].crc32c == crc(data), key
            assert self.read(key) == data, key


def gs_bucket(server: GcsServer, name: str) -> Bucket:
    server.create_bucket(name)
    return Bucket("gs", f"gs://{name}/run", server=server, bucket=name, prefix="run/")


def file_bucket(root: Path) -> Bucket:
    root.mkdir(parents=True, exist_ok=True)
    return Bucket("file", f"file://{root}", root=root)


@pytest.fixture(params=BACKENDS)
def bucket(request: pytest.FixtureRequest, tmp_path: Path) -> Bucket:
    if request.param == "gs":
        server: GcsServer = request.getfixturevalue("gcs_server")
        name = request.getfixturevalue("gcs_bucket")
        return gs_bucket(server, name)
    return file_bucket(tmp_path / "durable")


def dstatus(m: MtcfsMount) -> dict:
    """The durable section of the daemon's status (over the control socket: fast)."""
    return control.request(str(m.path), "status")["status"]["durable"]


def persisted(m: MtcfsMount, rel: str) -> bool:
    try:
        return bool(m.state(rel)["persisted"])
    except OSError:
        return False


def idle(m: MtcfsMount) -> bool:
    d = dstatus(m)
    return d["queued_files"] == 0 and d["inflight_files"] == 0 and d["pending_deletes"] == 0


class Watcher:
    """Lists the bucket over and over in a background thread, recording every listing."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self.listings: list[dict[str, Obj]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.listings.append(self.bucket.objects())
            except Exception:
                self.errors += 1
            time.sleep(0.005)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def assert_marker_never_early(listings: list[dict[str, Obj]], shards: dict[str, bytes],
                              marker: str) -> None:
    """In no listing is the marker present while a shard is missing or incomplete."""
    assert listings, "the watcher recorded no listing"
    for i, objs in enumerate(listings):
        if marker in objs:
            for key, data in shards.items():
                assert key in objs, f"listing {i}: {marker} visible, {key} missing"
                assert objs[key].size == len(data), f"listing {i}: {key} incomplete"
    final = listings[-1]
    assert marker in final
    # The marker's object was created after every shard's (generations grow with time).
    assert final[marker].generation > max(final[k].generation for k in shards)


# -- 1. the persist policies ---------------------------------------------------------------------


def test_on_close_uploads_every_closed_file(make_mount, bucket: Bucket) -> None:
    m = make_mount(extra=bucket.mount_args("on-close"))
    files = {
        "top": os.urandom(1000),
        "d/shard-0": os.urandom(3 * MiB),
        "d/e/deep": os.urandom(12 * MiB),  # resumable upload on gs://
        "empty": b"",
    }
    for rel, data in files.items():
        write(m.path / rel, data)
    wait_until(lambda: bucket.has(files), what="every closed file in the bucket")
    bucket.assert_holds(files)
    for rel, data in files.items():
        st = m.state(rel)
        assert st["persisted"] is True
        assert st["crc32c"] == f"{crc(data):08x}"
        assert st["tiers"] == ["ram", bucket.tier]
        assert st["generation"] == bucket.objects()[rel].generation
    d = dstatus(m)
    assert d["policy"] == "on-close"
    assert d["uploaded_files"] == len(files)
    assert d["uploaded_bytes"] == sum(len(v) for v in files.values())
    assert d["last_error"] is None and d["errors"] == 0


def test_on_close_lone_file_is_uploaded(make_mount, bucket: Bucket) -> None:
    """One file closed while nothing else happens: nothing else wakes the uploader."""
    m = make_mount(extra=bucket.mount_args("on-close"))
    data = write(m.path / "only", b"the only file")
    wait_until(lambda: bucket.has({"only": data}), timeout=5, what="the lone file")
    # A descriptor open for writing that wrote nothing since the seal does not hold
    # the sealed content back.
    held = write(m.path / "held", b"sealed, then opened for writing again")
    with open(m.path / "held", "r+b"):
        wait_until(lambda: bucket.has({"held": held}), timeout=5, what="the held file")


def test_on_close_temporary_names_wait_for_rename(make_mount, bucket: Bucket) -> None:
    m = make_mount(extra=bucket.mount_args("on-close"))
    tmpdir = m.path / "x.orbax-checkpoint-tmp-1"
    f1 = write(tmpdir / "f", os.urandom(2000))
    f2 = write(tmpdir / "sub" / "g", os.urandom(3000))
    a = write(m.path / "a.tmp", os.urandom(4000))
    s = write(m.path / "sentinel", b"closed last")
    # Uploads are FIFO: once the sentinel is in, the temporary files were passed over.
    wait_until(lambda: bucket.has({"sentinel": s}), what="the sentinel")
    # The object is visible a moment before the uploader records it as done.
    wait_until(lambda: idle(m), what="the uploader to go idle")
    assert bucket.names() == {"sentinel"}
    assert not persisted(m, "a.tmp") and not persisted(m, "x.orbax-checkpoint-tmp-1/f")

    os.rename(tmpdir, m.path / "x")
    os.rename(m.path / "a.tmp", m.path / "a")
    final = {"sentinel": s, "x/f": f1, "x/sub/g": f2, "a": a}
    wait_until(lambda: bucket.has(final), what="the renamed files")
    bucket.assert_holds(final)  # under the final names only
    assert persisted(m, "x/sub/g") and persisted(m, "a")


def test_step_policy_uploads_on_marker_rename(make_mount, bucket: Bucket) -> None:
    m = make_mount(extra=bucket.mount_args())  # step is the default
    assert dstatus(m)["policy"] == "step"
    shards = {f"100/__{r}_0.distcp": write(m.path / f"100/__{r}_0.distcp", os.urandom(MiB + r))
              for r in range(3)}
    meta = write(m.path / "100/.metadata.tmp", os.urandom(500))
    other = write(m.path / "200/__0_0.distcp", os.urandom(700))  # a step without a marker
    # Seals queue uploads synchronously: nothing queued means nothing will be uploaded.
    assert dstatus(m)["queued_files"] == 0 and idle(m)
    assert bucket.names() == set()

    os.rename(m.path / "100/.metadata.tmp", m.path / "100/.metadata")
    final = {**shards, "100/.metadata": meta}
    wait_until(lambda: bucket.has(final), what="step 100 in the bucket")
    wait_until(lambda: idle(m))
    bucket.assert_holds(final)
    assert not persisted(m, "200/__0_0.distcp")
    assert other and "200/__0_0.distcp" not in bucket.names()

    # A file added to a step that is already committed is uploaded as well.
    extra = write(m.path / "100/extra.bin", os.urandom(900))
    wait_until(lambda: bucket.has({"100/extra.bin": extra}), what="the late file")


def test_step_policy_orbax_tmp_dir_renamed(make_mount, bucket: Bucket) -> None:
    m = make_mount(extra=bucket.mount_args("step"))
    tmp = m.path / "7.orbax-checkpoint-tmp"
    tmp.mkdir()
    files = {"_CHECKPOINT_METADATA": write(tmp / "_CHECKPOINT_METADATA", b'{"step": 7}')}
    for rel in ("ocdbt.process_0/d/0a1b2c", "ocdbt.process_0/d/3d4e5f",
                "ocdbt.process_1/d/6a7b8c", "array_metadatas/process_0"):
        files[rel] = write(tmp / rel, os.urandom(256 * 1024 + len(rel)))
    # tensorstore: write `<name>.__lock`, rename the still-open file into place, close.
    data = os.urandom(4096)
    fd = os.open(tmp / "ocdbt.process_0/manifest.ocdbt.__lock", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
        os.rename(tmp / "ocdbt.process_0/manifest.ocdbt.__lock",
                  tmp / "ocdbt.process_0/manifest.ocdbt")
    finally:
        os.close(fd)
    files["ocdbt.process_0/manifest.ocdbt"] = data
    files["commit_success.txt"] = write(tmp / "commit_success.txt", b"ok")
    # Markers present, but in a directory with a temporary name: not committed.
    assert idle(m) and bucket.names() == set()

    os.rename(tmp, m.path / "7")
    final = {f"7/{k}": v for k, v in files.items()}
    wait_until(lambda: bucket.has(final), what="step 7 under its final name")
    wait_until(lambda: idle(m))
    bucket.assert_holds(final)
    steps = json.loads(mtcfs("steps", str(m.path), "--json", check=True).stdout)
    assert steps["newest_complete_safe"] == "7"


@pytest.mark.parametrize("policy", ["step", "on-close"])
def test_temporary_files_inside_a_step(make_mount, bucket: Bucket, policy: str) -> None:
    """A file under a temporary name inside a committed step is not uploaded (until
    renamed), and does not hold the step's marker back either."""
    m = make_mount(extra=bucket.mount_args(policy))
    shard = write(m.path / "50/shard", os.urandom(3000))
    write(m.path / "50/stray.tmp", os.urandom(100))  # e.g. left by a crashed writer
    meta = write(m.path / "50/.metadata", b"m")
    wait_until(lambda: bucket.has({"50/shard": shard, "50/.metadata": meta}), timeout=10,
               what="the step with its marker")
    late = write(m.path / "50/late.pt.tmp", os.urandom(2000))  # torch.save to tmp + rename
    wait_until(lambda: idle(m))
    assert bucket.names() == {"50/shard", "50/.metadata"}
    os.rename(m.path / "50/late.pt.tmp", m.path / "50/late.pt")
    wait_until(lambda: persisted(m, "50/late.pt") and idle(m))
    bucket.assert_holds({"50/shard": shard, "50/.metadata": meta, "50/late.pt": late})


@pytest.mark.serial  # a timing bound: must not share the machine
def test_interval_policy_uploads_newest_complete_step(make_mount, bucket: Bucket) -> None:
    m = make_mount(extra=bucket.mount_args("interval:1"))
    assert dstatus(m)["policy"] == "interval:1"
    # Step 20 is committed before step 10, so whenever the timer fires, 20 is the
    # newest complete step and 10 is never the one chosen.
    s20 = {"20/shard": write(m.path / "20/shard", os.urandom(5000)),
           "20/.metadata": write(m.path / "20/.metadata", b"m20")}
    t0 = time.monotonic()
    s10 = {"10/shard": write(m.path / "10/shard", os.urandom(5000)),
           "10/.metadata": write(m.path / "10/.metadata", b"m10")}
    write(m.path / "30/shard", os.urandom(100))  # no marker: not complete
    wait_until(lambda: bucket.has(s20), timeout=10, what="step 20")
    assert time.monotonic() - t0 < 3
    # A few more ticks of the timer: still only the newest complete step.
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        assert bucket.names() == set(s20)
        time.sleep(0.1)
    assert not persisted(m, "10/shard")
    assert s10

    s40 = {"40/a": write(m.path / "40/a", os.urandom(3000)),
           "40/commit_success.txt": write(m.path / "40/commit_success.txt", b"ok")}
    t1 = time.monotonic()
    wait_until(lambda: bucket.has(s40), timeout=10, what="step 40")
    assert time.monotonic() - t1 < 3
    bucket.assert_holds({**s20, **s40})


def test_manual_policy_persist_wait(make_mount, bucket: Bucket) -> None:
    m = make_mount(extra=bucket.mount_args("manual"))
    files = {
        "5/shard-0": write(m.path / "5/shard-0", os.urandom(9 * MiB)),
        "5/shard-1": write(m.path / "5/shard-1", os.urandom(2 * MiB)),
        "5/.metadata": write(m.path / "5/.metadata", b"meta"),
    }
    loose = write(m.path / "notes.txt", b"not part of step 5")
    assert idle(m) and bucket.names() == set()

    r = mtcfs("persist", str(m.path), str(m.path / "5"), "--wait")
    assert r.returncode == 0, r.stderr
    assert "persisting" in r.stderr and "persisted 3 files" in r.stderr, r.stderr
    assert "MiB" in r.stderr  # the bar counts bytes
    bucket.assert_holds(files)  # done when --wait returned; nothing outside the path
    for rel in files:
        st = m.state(rel)
        assert st["persisted"] is True and st["tiers"] == ["ram", bucket.tier]
    assert m.state("notes.txt")["persisted"] is False

    # A relative path inside the mount, and then everything.
    r = mtcfs("persist", str(m.path), "--wait")
    assert r.returncode == 0, r.stderr
    bucket.assert_holds({**files, "notes.txt": loose})
    assert m.state("notes.txt")["persisted"] is True


# -- 2. commit ordering ------------------------------------------------------------------------


def test_marker_never_visible_before_shards(make_mount, bucket: Bucket) -> None:
    m = make_mount(extra=bucket.mount_args("step"))
    shards = {f"300/shard-{i}": write(m.path / f"300/shard-{i}", os.urandom((12 + 10 * i) * MiB))
              for i in range(4)}
    meta = write(m.path / "300/.metadata.tmp", os.urandom(2000))
    assert bucket.names() == set()
    with Watcher(bucket) as w:
        os.rename(m.path / "300/.metadata.tmp", m.path / "300/.metadata")
        wait_until(lambda: w.listings and "300/.metadata" in w.listings[-1], timeout=60,
                   what="the marker")
    assert_marker_never_early(w.listings, shards, "300/.metadata")
    bucket.assert_holds({**shards, "300/.metadata": meta})


def test_on_close_marker_waits_for_the_shards(make_mount, bucket: Bucket) -> None:
    m = make_mount(extra=bucket.mount_args("on-close"))
    with Watcher(bucket) as w:
        shards = {f"400/shard-{i}": write(m.path / f"400/shard-{i}", os.urandom(40 * MiB))
                  for i in range(3)}
        meta = write(m.path / "400/.metadata", b"written right after the shards")
        early = [not persisted(m, k) for k in shards]
        wait_until(lambda: w.listings and "400/.metadata" in w.listings[-1], timeout=60,
                   what="the marker")
    assert any(early), "the shards were persisted before the marker was written"
    assert_marker_never_early(w.listings, shards, "400/.metadata")
    bucket.assert_holds({**shards, "400/.metadata": meta})


def test_a_held_marker_says_what_it_waits_for(make_mount, gcs_server: GcsServer,
                                              gcs_bucket: str) -> None:
    """While a commit marker waits for a shard to be persisted, `mtcfs status` names the
    marker and the file it waits for; once the shard is in, the marker follows and the
    list is empty. The GCS server is frozen (SIGSTOP) so that the wait is certain."""
    bucket = gs_bucket(gcs_server, gcs_bucket)
    m = make_mount(extra=bucket.mount_args("on-close"))
    assert gcs_server.proc is not None
    gcs_server.proc.send_signal(signal.SIGSTOP)
    try:
        shard = write(m.path / "500/shard-0", os.urandom(MiB))
        meta = write(m.path / "500/.metadata", b"the commit")
        held = wait_until(lambda: next((h for h in dstatus(m)["markers_held"]
                                        if h["path"] == "500/.metadata"), None),
                          timeout=20, what="the marker listed as held")
        assert held["why"].startswith("waits for 500/shard-0 (written by "), held
        assert held["why"].endswith(") to be persisted"), held
        assert held["seconds"] >= 0
    finally:
        gcs_server.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: bucket.has({"500/shard-0": shard, "500/.metadata": meta}), timeout=120,
               what="the shard, then the marker")
    wait_until(lambda: dstatus(m)["markers_held"] == [], what="no marker held")


# -- 3. renames and deletes ----------------------------------------------------------------------


def test_rename_persisted_file_and_dir(make_mount, bucket: Bucket) -> None:
    m = make_mount(extra=bucket.mount_args("on-close"))
    a = write(m.path / "a", os.urandom(3000))
    d1 = write(m.path / "d/one", os.urandom(1000))
    d2 = write(m.path / "d/sub/two", os.urandom(1500))
    wait_until(lambda: bucket.has({"a": a, "d/one": d1, "d/sub/two": d2}))
    old_gen = bucket.objects()["a"].generation

    os.rename(m.path / "a", m.path / "b")
    os.rename(m.path / "d", m.path / "e")
    final = {"b": a, "e/one": d1, "e/sub/two": d2}
    wait_until(lambda: bucket.names() == set(final) and bucket.has(final),
               what="objects under the new names only")
    wait_until(lambda: idle(m))
    bucket.assert_holds(final)
    st = m.state("b")
    assert st["persisted"] is True and st["generation"] != old_gen
    assert dstatus(m)["deleted_objects"] == 3


def test_unlink_persisted_file(make_mount, bucket: Bucket) -> None:
    m = make_mount(extra=bucket.mount_args("on-close"))
    keep = write(m.path / "keep", os.urandom(100))
    write(m.path / "gone", os.urandom(200))
    write(m.path / "dir/gone-too", os.urandom(300))
    wait_until(lambda: bucket.names() == {"keep", "gone", "dir/gone-too"})
    os.unlink(m.path / "gone")
    os.unlink(m.path / "dir/gone-too")
    wait_until(lambda: bucket.names() == {"keep"}, what="the deletions")
    wait_until(lambda: idle(m))
    bucket.assert_holds({"keep": keep})


def test_renamed_or_removed_before_persist_never_uploaded(make_mount, bucket: Bucket) -> None:
    m = make_mount(extra=bucket.mount_args("manual"))
    a = write(m.path / "old-a", os.urandom(1000))
    write(m.path / "old-b", os.urandom(1000))
    c = write(m.path / "step/shard", os.urandom(1000))
    os.rename(m.path / "old-a", m.path / "new-a")
    os.unlink(m.path / "old-b")
    os.rename(m.path / "step", m.path / "8")
    r = mtcfs("persist", str(m.path), "--wait")
    assert r.returncode == 0, r.stderr
    bucket.assert_holds({"new-a": a, "8/shard": c})


def test_rename_during_upload(make_mount, bucket: Bucket) -> None:
    """A file renamed while its upload runs ends up under the new name only."""
    m = make_mount(extra=bucket.mount_args("on-close"))
    data = write(m.path / "big", os.urandom(96 * MiB))
    # Usually the upload is in flight now (it may already be done on file://).
    wait_until(lambda: (d := dstatus(m))["inflight_files"] or d["uploaded_files"], timeout=10)
    os.rename(m.path / "big", m.path / "big-2")
    wait_until(lambda: bucket.names() == {"big-2"} and bucket.has({"big-2": data}), timeout=60,
               what="big-2 only")
    wait_until(lambda: idle(m))
    bucket.assert_holds({"big-2": data})
    assert m.state("big-2")["persisted"] is True


def test_replace_persisted_file(make_mount, bucket: Bucket) -> None:
    """Atomic replace (write a tmp file, rename it over the old one) and remove +
    create again: the new content replaces the old object, without a conflict."""
    m = make_mount(extra=bucket.mount_args("on-close"))
    write(m.path / "latest", b"step 0")
    write(m.path / "again", b"first")
    wait_until(lambda: persisted(m, "latest") and persisted(m, "again"))
    for step in range(1, 6):
        write(m.path / "latest.tmp", f"step {step}".encode())
        os.rename(m.path / "latest.tmp", m.path / "latest")
    os.unlink(m.path / "again")
    write(m.path / "again", b"second")
    final = {"latest": b"step 5", "again": b"second"}
    wait_until(lambda: persisted(m, "latest") and persisted(m, "again") and idle(m))
    bucket.assert_holds(final)
    d = dstatus(m)
    assert d["conflicts"] == 0 and d["last_error"] is None, d


def test_unstorable_name_does_not_take_the_mount_down(make_mount, bucket: Bucket) -> None:
    m = make_mount(extra=bucket.mount_args("on-close"))
    write(m.path / "bad\nname", b"a newline: no GCS object name")
    ok = write(m.path / "ok", b"fine")
    wait_until(lambda: persisted(m, "ok"))
    wait_until(lambda: dstatus(m)["last_error"], what="the error")
    assert m.proc is not None and m.proc.poll() is None
    assert (m.path / "bad\nname").read_bytes() == b"a newline: no GCS object name"
    d = dstatus(m)
    assert "bad\\nname" in d["last_error"] and d["conflicts"] == 1, d
    bucket.assert_holds({"ok": ok})


def test_rmtree_persisted_step(make_mount, bucket: Bucket) -> None:
    m = make_mount(extra=bucket.mount_args("step"))
    s1 = {f"1/shard-{i}": write(m.path / f"1/shard-{i}", os.urandom(2000)) for i in range(3)}
    s1["1/nested/x"] = write(m.path / "1/nested/x", os.urandom(10))
    s1["1/.metadata"] = write(m.path / "1/.metadata", b"m")
    s2 = {"2/shard": write(m.path / "2/shard", os.urandom(500)),
          "2/.metadata": write(m.path / "2/.metadata", b"m")}
    wait_until(lambda: bucket.has({**s1, **s2}))
    shutil.rmtree(m.path / "1")
    wait_until(lambda: bucket.names() == set(s2), what="step 1 gone from the bucket")
    wait_until(lambda: idle(m))
    bucket.assert_holds(s2)
    steps = json.loads(mtcfs("steps", str(m.path), "--json", check=True).stdout)
    assert [s["path"] for s in steps["steps"]] == ["2"]


def test_step_moved_away_marker_goes_first(make_mount, bucket: Bucket) -> None:
    """Deleting a step's objects (its directory renamed away, or removed) is ordered
    like uploading it: no listing shows its marker while a shard is already gone."""
    m = make_mount(extra=bucket.mount_args("step"))
    shards = {f"100/__{r}_0.distcp": write(m.path / f"100/__{r}_0.distcp", os.urandom(100 + r))
              for r in range(16)}
    shards |= {f"100/sub/{r}": write(m.path / f"100/sub/{r}", os.urandom(10)) for r in range(4)}
    write(m.path / "100/.metadata", b"m")
    wait_until(lambda: bucket.has(shards) and "100/.metadata" in bucket.names())
    wait_until(lambda: idle(m))
    with Watcher(bucket) as w:
        os.rename(m.path / "100", m.path / "100.old.tmp")  # a temporary name: not uploaded
        wait_until(lambda: not bucket.names(), what="step 100 gone from the bucket")
    for i, objs in enumerate(w.listings):
        if "100/.metadata" in objs:
            missing = set(shards) - set(objs)
            assert not missing, f"listing {i}: marker visible, {sorted(missing)[:3]} gone"


# -- 4. failures ---------------------------------------------------------------------------------


def test_gcs_killed_during_upload(make_mount, make_gcs_server) -> None:
    server = make_gcs_server("filesystem")
    b = gs_bucket(server, "outage")
    m = make_mount(extra=b.mount_args("on-close"))
    size = 200 * MiB
    data = write(m.path / "big", os.urandom(size))

    def sending() -> bool:  # some of the data is on its way, most of it is not
        d = dstatus(m)
        return d["inflight_files"] == 1 and MiB < size - d["pending_bytes"] < size // 2

    wait_until(sending, timeout=20, interval=0.01, what="the upload under way")
    server.kill()
    t_down = time.monotonic()
    # The trouble shows in `mtcfs status` while the server is down ...
    wait_until(lambda: dstatus(m)["last_error"], timeout=15, what="last_error")
    st = json.loads(mtcfs("status", str(m.path), "--json", check=True).stdout)
    assert "unavailable" in st["durable"]["last_error"], st["durable"]
    assert st["durable"]["pending_bytes"] > 0
    assert st["health"] == "degraded"
    # ... and the data stays readable from the mount.
    assert crc((m.path / "big").read_bytes()) == crc(data)
    assert m.state("big")["persisted"] is False
    time.sleep(max(0.0, 3.0 - (time.monotonic() - t_down)))  # a few seconds of outage
    server.start()
    wait_until(lambda: persisted(m, "big"), timeout=90, what="the upload after the outage")
    b.assert_holds({"big": data})
    assert m.state("big")["generation"] == b.objects()["big"].generation
    assert m.status()["health"] == "ok"
    d = dstatus(m)
    assert d["conflicts"] == 0 and d["uploaded_files"] == 1


def test_gcs_down_before_files_are_written(make_mount, gcs_server: GcsServer,
                                           make_gcs_server) -> None:
    server = make_gcs_server("memory")
    b = gs_bucket(server, "down-early")
    m = make_mount(extra=b.mount_args("on-close"))
    server.kill()
    files = {f"s/{i}": write(m.path / f"s/{i}", os.urandom(MiB * i + 17)) for i in range(1, 5)}
    wait_until(lambda: dstatus(m)["last_error"], timeout=15, what="last_error")
    for rel, data in files.items():
        assert (m.path / rel).read_bytes() == data
        assert not persisted(m, rel)
    server.start()
    wait_until(lambda: all(persisted(m, rel) for rel in files), timeout=60,
               what="the uploads after the outage")
    b.assert_holds(files)
    assert dstatus(m)["conflicts"] == 0


def test_unmount_during_outage_then_remount(make_mount, make_gcs_server) -> None:
    """A plain umount does not wait for GCS; the next daemon uploads what is left."""
    server = make_gcs_server("memory")
    b = gs_bucket(server, "umount-outage")
    m = make_mount(extra=b.mount_args("on-close"))
    server.kill()
    files = {f"f{i}": write(m.path / f"f{i}", os.urandom(MiB + i)) for i in range(6)}
    wait_until(lambda: dstatus(m)["last_error"], timeout=15, what="last_error")
    t0 = time.monotonic()
    r = mtcfs("umount", str(m.path), timeout=60)
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 < 10
    assert m.proc is not None and m.proc.wait(timeout=10) == 0
    server.start()
    m.start()
    wait_until(lambda: all(persisted(m, rel) for rel in files), timeout=60)
    b.assert_holds(files)


def test_requested_files_rewritten_before_upload(make_mount, make_gcs_server) -> None:
    """`mtcfs persist --wait` under the manual policy: requested files rewritten before
    their uploads are done are uploaded in their new version, and the wait ends."""
    server = make_gcs_server("memory")
    b = gs_bucket(server, "rewritten")
    m = make_mount(extra=b.mount_args("manual"))
    files = {f"f{i}": write(m.path / f"f{i}", os.urandom(MiB + i)) for i in range(6)}
    server.kill()  # four uploads stall in flight, the others wait in the queue
    proc = subprocess.Popen([sys.executable, "-m", "mtcfs", "persist", str(m.path), "--wait"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (d := dstatus(m))["inflight_files"] == 4 and d["queued_files"] == 2)
        for rel in files:  # the queued ones, and those stalled in flight
            files[rel] = write(m.path / rel, f"{rel} rewritten during the outage".encode())
        server.start()
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    b.assert_holds(files)


@pytest.mark.parametrize("backend", BACKENDS)
def test_daemon_killed_during_upload(make_mount, backend: str, gcs_server: GcsServer,
                                     gcs_bucket: str, tmp_path: Path) -> None:
    b = gs_bucket(gcs_server, gcs_bucket) if backend == "gs" else file_bucket(tmp_path / "d")
    m = make_mount(extra=b.mount_args("on-close"))
    big = write(m.path / "big", os.urandom(200 * MiB))
    small = write(m.path / "small", os.urandom(1000))
    wait_until(lambda: dstatus(m)["inflight_files"] >= 1 or persisted(m, "big"), timeout=10)
    m.kill9()
    m.start()  # the same RAM dir: the closed files are re-adopted
    wait_until(lambda: persisted(m, "big") and persisted(m, "small"), timeout=90,
               what="the uploads after the restart")
    wait_until(lambda: idle(m))
    b.assert_holds({"big": big, "small": small})
    d = dstatus(m)
    assert d["conflicts"] == 0 and d["last_error"] is None, d
    if backend == "file":
        # A copy cut short by the kill leaves its temporary file; the tier removes it
        # on a listing (here: the next mount) once nobody wrote to it for a while.
        assert b.root is not None
        leftovers = [p for p in b.root.rglob("*") if p.name.startswith(".mtcfs-tmp-")]
        if leftovers:
            old = time.time() - 3600
            for p in leftovers:
                os.utime(p, (old, old))
            m.restart()
            assert not [p for p in leftovers if p.exists()]
            b.assert_holds({"big": big, "small": small})


def test_file_tier_collects_stale_temp_files(make_mount, tmp_path: Path) -> None:
    b = file_bucket(tmp_path / "durable")
    obj = write(tmp_path / "src", b"an object")
    LocalDirTier(str(b.root)).put_file("7/obj", str(tmp_path / "src"), crc(obj))
    assert b.root is not None
    stale, fresh = b.root / "7/.mtcfs-tmp-crashed", b.root / "7/.mtcfs-tmp-running"
    stale.write_bytes(b"x" * 1000)
    fresh.write_bytes(b"y" * 1000)
    old = time.time() - 3600
    os.utime(stale, (old, old))
    m = make_mount(extra=b.mount_args("on-close"))
    assert os.listdir(m.path / "7") == ["obj"]
    assert not stale.exists() and fresh.exists()
    b.assert_holds({"7/obj": obj})


def test_daemon_killed_after_manual_persist(make_mount, bucket: Bucket) -> None:
    m = make_mount(extra=bucket.mount_args("manual"))
    files = {f"9/shard-{i}": write(m.path / f"9/shard-{i}", os.urandom(30 * MiB))
             for i in range(4)}
    files["9/.metadata"] = write(m.path / "9/.metadata", b"m")
    r = mtcfs("persist", str(m.path))
    assert r.returncode == 0, r.stderr
    m.kill9()
    m.start()
    wait_until(lambda: all(persisted(m, rel) for rel in files), timeout=60,
               what="the requested uploads after the restart")
    wait_until(lambda: idle(m))
    bucket.assert_holds(files)
    d = dstatus(m)
    assert d["conflicts"] == 0 and d["last_error"] is None, d


# -- 5. generation preconditions -----------------------------------------------------------------


@pytest.mark.parametrize("size", [100, 12 * MiB], ids=["small", "resumable"])
def test_object_changed_behind_our_back_is_not_overwritten(make_mount, bucket: Bucket,
                                                           size: int) -> None:
    m = make_mount(extra=bucket.mount_args("on-close"))
    write(m.path / "f", os.urandom(size))
    wait_until(lambda: persisted(m, "f"))
    ours = bucket.objects()["f"].generation

    foreign = os.urandom(size + 1)
    bucket.put_behind_back("f", foreign)
    theirs = bucket.objects()["f"].generation
    assert theirs != ours

    v2 = write(m.path / "f", os.urandom(size))
    wait_until(lambda: dstatus(m)["conflicts"] == 1, what="the conflict")
    d = dstatus(m)
    assert "conflict" in d["last_error"] and "object f " in d["last_error"], d
    assert bucket.read("f") == foreign and bucket.objects()["f"].generation == theirs
    assert m.state("f")["persisted"] is False
    assert (m.path / "f").read_bytes() == v2
    assert dstatus(m)["uploaded_files"] == 1
    text = mtcfs("status", str(m.path), check=True).stdout
    assert "conflict" in text

    # A deletion is conditional too: the other writer's object stays.
    write(m.path / "g", b"g from mtcfs")
    wait_until(lambda: persisted(m, "g"))
    bucket.put_behind_back("g", b"g from elsewhere")
    os.unlink(m.path / "g")
    wait_until(lambda: dstatus(m)["pending_deletes"] == 0)
    assert bucket.read("g") == b"g from elsewhere"


# -- 6. the command line -------------------------------------------------------------------------


def test_steps_json(make_mount, bucket: Bucket) -> None:
    m = make_mount(extra=bucket.mount_args("manual"))
    write(m.path / "1/shard", os.urandom(1000))
    write(m.path / "1/.metadata", b"m")
    write(m.path / "2/shard", os.urandom(1000))
    write(m.path / "2/.metadata", b"m")
    write(m.path / "3/shard", os.urandom(1000))  # no marker
    write(m.path / "4.orbax-checkpoint-tmp/_CHECKPOINT_METADATA", b"m")
    assert mtcfs("persist", str(m.path), "1", "--wait").returncode == 0

    out = json.loads(mtcfs("steps", str(m.path), "--json", check=True).stdout)
    steps = {s["path"]: s for s in out["steps"]}
    assert set(steps) == {"1", "2", "3", "4.orbax-checkpoint-tmp"}
    want = {"complete": True, "persisted": True, "in_ram": True, "step": 1}
    assert want.items() <= steps["1"].items()
    assert {"complete": True, "persisted": False, "in_ram": True}.items() <= steps["2"].items()
    assert steps["3"]["complete"] is False and steps["3"]["persisted"] is False
    assert steps["4.orbax-checkpoint-tmp"]["complete"] is False
    assert steps["4.orbax-checkpoint-tmp"]["temporary"] is True
    assert out["newest_complete_safe"] == "1"
    assert out["durable"] == bucket.url
    text = mtcfs("steps", str(m.path), check=True).stdout
    assert "newest complete step safe (in the durable tier): 1" in text

    # A fresh node over the same bucket: step 1 is there, safe, but not in its RAM yet.
    m2 = make_mount(name="b", extra=bucket.mount_args("manual"))
    out = json.loads(mtcfs("steps", str(m2.path), "--json", check=True).stdout)
    steps = {s["path"]: s for s in out["steps"]}
    assert set(steps) == {"1"}
    assert {"complete": True, "persisted": True, "in_ram": False}.items() <= steps["1"].items()
    assert out["newest_complete_safe"] == "1"
    assert (m2.path / "1/shard").read_bytes() == (m.path / "1/shard").read_bytes()


def test_status_json_durable_section(make_mount, bucket: Bucket) -> None:
    m = make_mount(extra=bucket.mount_args("manual"))
    data = write(m.path / "x", os.urandom(5000))
    st = json.loads(mtcfs("status", str(m.path), "--json", check=True).stdout)
    d = st["durable"]
    assert d["url"] == bucket.url and d["policy"] == "manual"
    assert d["queued_files"] == 0 and d["uploaded_bytes"] == 0 and d["last_error"] is None
    assert mtcfs("persist", str(m.path), "--wait").returncode == 0
    d = json.loads(mtcfs("status", str(m.path), "--json", check=True).stdout)["durable"]
    assert d["uploaded_bytes"] == len(data) and d["uploaded_files"] == 1
    assert d["queued_files"] == 0 and d["pending_bytes"] == 0 and d["last_error"] is None
    text = mtcfs("status", str(m.path), check=True).stdout
    assert "durable tier" in text and "persist manual" in text, text


def test_umount_wait_finishes_uploads(make_mount) -> None:
    # The upload goes through a link of 40 MiB/s (about 2.5 s for the file), so it is
    # surely still pending when umount --wait starts: on loopback it may be done first.
    proxy_port = free_port()
    server = GcsServer("memory", external_url=f"http://127.0.0.1:{proxy_port}").start()
    try:
        with LinkProxy(server.port, up_rate=40 * MiB, port=proxy_port) as link:
            b = gs_bucket(server, "slow-link")
            m = make_mount(extra=("--bucket", b.url, "--gcs-endpoint", link.url,
                                  "--persist", "manual"))
            data = write(m.path / "big", os.urandom(100 * MiB))
            assert mtcfs("persist", str(m.path)).returncode == 0
            assert dstatus(m)["pending_bytes"] > 0
            r = mtcfs("umount", str(m.path), "--wait", timeout=120)
            assert r.returncode == 0, r.stderr
            assert mount_entry(str(m.path)) is None
            assert m.proc is not None and m.proc.wait(timeout=30) == 0
            assert link.upstream_bytes >= 100 * MiB
            b.assert_holds({"big": data})
    finally:
        server.stop()


@pytest.mark.parametrize("case", ["missing-bucket", "closed-port", "missing-dir"])
def test_mount_fails_fast_without_a_bucket(tmp_path: Path, ram_root: Path,
                                           gcs_server: GcsServer, case: str) -> None:
    mp = tmp_path / "mnt"
    mp.mkdir()
    if case == "missing-bucket":
        url, args = "gs://no-such-bucket-x/p", ["--gcs-endpoint", gcs_server.url]
    elif case == "closed-port":
        url, args = "gs://some-bucket/p", ["--gcs-endpoint", f"http://127.0.0.1:{closed_port()}"]
    else:
        url, args = f"file://{tmp_path}/no-such-dir", []
    name = url.split("//", 1)[1].split("/", 1)[0] if url.startswith("gs") else url
    for daemon in ([], ["--daemon"]):
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "mtcfs", "mount", str(mp), "--ram-dir",
                            str(ram_root / "ram"), "--bucket", url, *args, *daemon],
                           capture_output=True, text=True, timeout=30)
        assert time.monotonic() - t0 < 15
        assert r.returncode == 1, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and name in lines[0], r.stderr
        assert mount_entry(str(mp)) is None
