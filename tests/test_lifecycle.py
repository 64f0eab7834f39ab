"""The RAM tier's lifecycle on real daemons: retention (--keep-steps), eviction
under pressure (own data, replicas, read-through caches), writers waiting for
space and ENOSPC after --full-timeout, --fsync levels, metrics and JSON logs.

Every test mounts with --metrics-port and checks that /metrics reports what
happened. Durable tiers: file:// (a local directory) where the bucket's
behaviour does not matter, fake-gcs-server where a test stops the server.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mtcfs import __version__ as mtcfs_version

from support.mounts import blob, crc_of, free_port, mtcfs, wait_until

MiB = 1 << 20


@pytest.fixture
def data_path() -> str:
    """These tests drive the RAM budget through the daemon's own write path (writers
    that wait for room, exact accounting of what is written). With passthrough the
    kernel enforces the budget instead: tests/test_passthrough.py."""
    return "fuse"


def metrics(m) -> dict[tuple[str, tuple], float]:
    """Samples of the mount's /metrics: {(name, sorted labels): value}."""
    url = m.status()["metrics_url"]
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(m, name: str, **labels: str) -> float:
    return metrics(m).get((name, tuple(sorted(labels.items()))), 0.0)


def wait_metric(m, name: str, at_least: float, timeout: float = 20, **labels: str) -> float:
    """Metrics are snapshots taken every second: wait for one that shows it."""
    wait_until(lambda: metric(m, name, **labels) >= at_least, timeout=timeout,
               what=f"{name}{labels} >= {at_least}")
    return metric(m, name, **labels)


def mon(port: int | None = None) -> tuple[str, ...]:
    return ("--metrics-port", str(port or free_port()), "--metrics-address", "127.0.0.1")


def write(path: Path, data: bytes, fsync: bool = False) -> None:
    with open(path, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def in_ram(m, rel: str) -> bool:
    return "ram" in m.state(rel)["tiers"]


def state_or_none(m, rel: str) -> dict | None:
    """The file's state on m, or None while m does not know the file yet."""
    try:
        return m.state(rel)
    except FileNotFoundError:
        return None


def save_step(root: Path, n: int, size: int, files: int = 2) -> dict[str, bytes]:
    """A committed step like torch DCP makes: shards, then .metadata by rename."""
    d = root / f"step_{n}"
    d.mkdir()
    out = {}
    for i in range(files):
        data = blob(n * 100 + i, size)
        write(d / f"shard_{i}", data, fsync=True)
        out[f"step_{n}/shard_{i}"] = data
    write(d / ".metadata.tmp", f"step {n}".encode(), fsync=True)
    os.rename(d / ".metadata.tmp", d / ".metadata")
    return out


# -- retention --------------------------------------------------------------------------


def test_keep_steps_keeps_exactly_n_complete_steps(make_mount, tmp_path):
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    m = make_mount(ram_size="256MiB", extra=("--bucket", f"file://{bucket}", "--keep-steps",
                                             "2", *mon()))
    written = {}
    for n in range(1, 6):
        written |= save_step(m.path, n, 4 * MiB)

    def settled() -> bool:
        return all(in_ram(m, f"step_{n}/shard_0") == (n >= 4) for n in range(1, 6))

    wait_until(settled, timeout=30, what="steps 1-3 evicted, 4-5 in RAM")
    steps = json.loads(mtcfs("steps", str(m.path), "--json", check=True).stdout)
    by_path = {s["path"]: s for s in steps["steps"]}
    assert [by_path[f"step_{n}"]["in_ram"] for n in range(1, 6)] == [False] * 3 + [True] * 2
    assert all(by_path[f"step_{n}"]["persisted"] and by_path[f"step_{n}"]["complete"]
               for n in range(1, 6))
    assert steps["newest_complete_safe"] == "step_5"
    # Evicted files keep their metadata and read through from the bucket.
    st = m.state("step_1/shard_0")
    assert st["persisted"] and st["size"] == 4 * MiB and st["tiers"] == ["file"]
    for rel, data in written.items():
        assert crc_of((m.path / rel).read_bytes()) == crc_of(data), rel
    lc = m.status()["lifecycle"]
    assert lc["evictions"]["retention"] >= 6  # 3 steps x (2 shards + .metadata)
    assert wait_metric(m, "mtcfs_evictions_total", 6, reason="retention") >= 6
    assert wait_metric(m, "mtcfs_fetched_bytes_total", 12 * MiB, tier="file") >= 12 * MiB


def test_stale_incomplete_steps_are_removed_after_grace(make_mount, tmp_path):
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    m = make_mount(ram_size="256MiB", extra=("--bucket", f"file://{bucket}", "--keep-steps",
                                             "1", "--incomplete-grace", "1", *mon()))
    # An abandoned Orbax save (tmp dir) and an uncommitted step, both older than
    # the newest complete step; a newer tmp dir (a save in progress); an old one
    # with a file still open.
    for name in ("3.orbax-checkpoint-tmp-17", "step_4", "step_9.tmp", "step_2"):
        (m.path / name).mkdir()
        write(m.path / name / "shard", blob(1, MiB))
    held = open(m.path / "step_2" / "open_shard", "wb")  # noqa: SIM115
    try:
        held.write(b"x" * 1000)
        save_step(m.path, 5, MiB)
        wait_until(lambda: not (m.path / "step_4").exists()
                   and not (m.path / "3.orbax-checkpoint-tmp-17").exists(), timeout=30,
                   what="stale incomplete steps removed")
        assert (m.path / "step_9.tmp" / "shard").read_bytes() == blob(1, MiB)
        assert (m.path / "step_2" / "shard").exists(), "a step with an open file was removed"
        assert (m.path / "step_5" / ".metadata").exists()
        removed = m.status()["lifecycle"]["removed_incomplete_steps"]
        assert sorted(removed) == ["3.orbax-checkpoint-tmp-17", "step_4"]
    finally:
        held.close()
    assert "removed incomplete step step_4" in m.log()


# -- eviction under pressure -------------------------------------------------------------


def test_pressure_evicts_persisted_own_data_oldest_first(make_mount, tmp_path):
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    m = make_mount(ram_size="64MiB", extra=("--bucket", f"file://{bucket}", "--persist",
                                            "on-close", *mon()))
    files = {f"f{i}": blob(i, 20 * MiB) for i in range(5)}
    for name, data in files.items():
        write(m.path / name, data)
        wait_until(lambda n=name: m.state(n)["persisted"], what=f"{name} persisted")
    # 100 MiB written into 64 MiB: the oldest went, the newest stayed.
    assert not in_ram(m, "f0") and in_ram(m, "f4")
    assert m.status()["ram"]["enospc"] == 0
    for name, data in files.items():
        assert crc_of((m.path / name).read_bytes()) == crc_of(data), name
    assert wait_metric(m, "mtcfs_evictions_total", 1, reason="own") >= 1
    assert metric(m, "mtcfs_enospc_total") == 0


def test_pressure_evicts_read_through_cache_before_own_data(make_mount, tmp_path):
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    url = f"file://{bucket}"
    first = make_mount("first", extra=("--bucket", url, "--persist", "on-close"))
    for i in range(2):
        write(first.path / f"remote{i}", blob(10 + i, 16 * MiB))
    wait_until(lambda: all(first.state(f"remote{i}")["persisted"] for i in range(2)))
    first.stop()
    m = make_mount("second", ram_size="64MiB", extra=("--bucket", url, "--persist", "on-close",
                                                      *mon()))
    for i in range(2):  # read through: cache copies
        assert crc_of((m.path / f"remote{i}").read_bytes()) == crc_of(blob(10 + i, 16 * MiB))
    write(m.path / "own0", blob(20, 16 * MiB))
    wait_until(lambda: m.state("own0")["persisted"])
    assert all(in_ram(m, n) for n in ("remote0", "remote1", "own0"))
    write(m.path / "own1", blob(21, 24 * MiB))  # 72 MiB > 64 MiB: something must go
    assert not in_ram(m, "remote0"), "the cache copy should go first"
    assert in_ram(m, "own0"), "own persisted data went before a cache copy"
    assert wait_metric(m, "mtcfs_evictions_total", 1, reason="cache") >= 1
    assert metric(m, "mtcfs_evictions_total", reason="own") == 0


def _fill_unpersisted(m, names: list[str], size: int) -> None:
    for name in names:
        write(m.path / name, blob(hash(name) & 0xFFFF, size))


def _mount_over_dead_bucket(make_mount, make_gcs_server, ram_size: str, full_timeout: int):
    """A mount over a GCS server that is then killed: uploads cannot finish, so
    nothing becomes evictable until the server is started again."""
    server = make_gcs_server("memory")
    bucket = server.create_bucket("lifecycle")
    m = make_mount(ram_size=ram_size, extra=(
        "--bucket", f"gs://{bucket}", "--gcs-endpoint", server.url, "--persist", "on-close",
        "--full-timeout", str(full_timeout), *mon()))
    server.kill()
    return m, server


def test_writer_waits_for_upload_then_resumes(make_mount, make_gcs_server):
    m, server = _mount_over_dead_bucket(make_mount, make_gcs_server, "64MiB", 60)
    _fill_unpersisted(m, ["a", "b"], 24 * MiB)
    result: dict[str, object] = {}

    def writer() -> None:
        t0 = time.monotonic()
        try:
            write(m.path / "c", blob(3, 24 * MiB))
            result["ok"] = True
        except OSError as e:
            result["errno"] = e.errno
        result["took"] = time.monotonic() - t0

    t = threading.Thread(target=writer)
    t.start()
    wait_until(lambda: m.status()["lifecycle"]["writers_waiting"] >= 1, timeout=20,
               what="the writer waits for space")
    assert m.status()["health"] == "degraded"
    assert wait_metric(m, "mtcfs_writers_waiting", 1) >= 1  # one per blocked FUSE write
    time.sleep(2)
    assert t.is_alive(), f"the writer did not wait: {result}"
    server.start()  # uploads complete -> a and b become evictable -> the write resumes
    t.join(timeout=90)
    assert result.get("ok"), result
    assert result["took"] >= 2
    assert (m.path / "c").read_bytes() == blob(3, 24 * MiB)
    assert m.status()["ram"]["enospc"] == 0
    assert wait_metric(m, "mtcfs_space_wait_seconds_total", 2) >= 2
    assert metric(m, "mtcfs_evictions_total", reason="own") >= 1


def test_enospc_after_full_timeout_says_why(make_mount, make_gcs_server):
    m, _server = _mount_over_dead_bucket(make_mount, make_gcs_server, "48MiB", 2)
    _fill_unpersisted(m, ["a"], 40 * MiB)
    t0 = time.monotonic()
    with pytest.raises(OSError) as e:
        write(m.path / "b", blob(4, 16 * MiB))
    took = time.monotonic() - t0
    assert e.value.errno == errno.ENOSPC
    assert 1.5 <= took < 30
    lc = m.status()["lifecycle"]
    assert lc["enospc"] >= 1 and "not yet persisted" in lc["last_full"], lc
    assert "ENOSPC writing b: RAM tier full" in m.log()
    # Nothing committed was lost, and the daemon still serves.
    assert (m.path / "a").read_bytes() == blob(hash("a") & 0xFFFF, 40 * MiB)
    assert wait_metric(m, "mtcfs_enospc_total", 1) >= 1


def test_no_durable_tier_no_peers_enospc_at_once(make_mount):
    m = make_mount(ram_size="32MiB", extra=mon())
    write(m.path / "a", blob(1, 24 * MiB))
    t0 = time.monotonic()
    with pytest.raises(OSError) as e:
        write(m.path / "b", blob(2, 16 * MiB))
    assert e.value.errno == errno.ENOSPC
    assert time.monotonic() - t0 < 5  # nothing can become safe: no point waiting
    assert (m.path / "a").read_bytes() == blob(1, 24 * MiB)


# -- replicas ------------------------------------------------------------------------------


def test_full_peer_refuses_replicas_and_sender_picks_another(make_cluster):
    c = make_cluster(3, replicas=1, start=False)
    c.define("b", ram_size="40MiB", extra=mon())
    c.define("a", extra=mon())
    c.start("a", "b", "c")
    a, b = c["a"], c["b"]
    write(b.path / "b_own", blob(1, 36 * MiB))  # b is full of its own unreplicated...
    wait_until(lambda: len(b.state("b_own")["holders"]) == 2)  # ...(replicated, not persisted)
    for i in range(4):
        write(a.path / f"x{i}", blob(10 + i, 8 * MiB))
    wait_until(lambda: all(a.state(f"x{i}")["replicas"] >= 1 for i in range(4)), timeout=40,
               what="every file got its replica")
    holders = [set(a.state(f"x{i}")["holders"]) for i in range(4)]
    assert all(h == {"node-a", "node-c"} for h in holders), holders
    # b refused (or was never asked: placement); when it was asked it said why.
    refused = b.status()["ram"]["refused"]
    if refused:
        assert "RESOURCE_EXHAUSTED" in a.log()
        assert wait_metric(b, "mtcfs_replicas_refused_total", 1) >= 1


def test_replicas_of_persisted_files_are_evicted_for_own_writes(make_cluster, tmp_path):
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    c = make_cluster(2, replicas=1, start=False,
                     extra=("--bucket", f"file://{bucket}", "--persist", "on-close"))
    c.define("b", ram_size="64MiB", extra=mon())
    c.start("a", "b")
    a, b = c["a"], c["b"]
    for i in range(3):
        write(a.path / f"x{i}", blob(i, 16 * MiB))
    def replicated_and_persisted(i: int) -> bool:
        st = state_or_none(b, f"x{i}")
        return bool(st and st["tiers"][:1] == ["ram"] and st["persisted"])

    wait_until(lambda: all(replicated_and_persisted(i) for i in range(3)), timeout=30,
               what="b holds persisted replicas")
    write(b.path / "mine", blob(9, 40 * MiB))  # needs the replicas' room
    assert in_ram(b, "mine")
    gone = [i for i in range(3) if not in_ram(b, f"x{i}")]
    assert gone, "no replica was evicted"
    # a hears that b dropped them; they are still readable on b (from a or the bucket).
    wait_until(lambda: all("node-b" not in a.state(f"x{i}")["holders"] for i in gone))
    for i in range(3):
        assert crc_of((b.path / f"x{i}").read_bytes()) == crc_of(blob(i, 16 * MiB))
    assert wait_metric(b, "mtcfs_evictions_total", 1, reason="replica") >= 1


def test_unpersisted_replicas_are_never_evicted(make_cluster):
    """No durable tier: b's replicas of a's files are the only other copies; b's own
    write must not take their room (it gets ENOSPC instead)."""
    c = make_cluster(2, replicas=1, start=False)
    c.define("b", ram_size="48MiB", extra=("--full-timeout", "1", *mon()))
    c.start("a", "b")
    a, b = c["a"], c["b"]
    for i in range(2):
        write(a.path / f"x{i}", blob(i, 16 * MiB))
    wait_until(lambda: all(a.state(f"x{i}")["replicas"] == 1 for i in range(2)))
    with pytest.raises(OSError) as e:
        write(b.path / "mine", blob(9, 24 * MiB))
    assert e.value.errno == errno.ENOSPC
    assert all(in_ram(b, f"x{i}") for i in range(2))
    assert metric(b, "mtcfs_evictions_total", reason="replica") == 0


# -- fsync levels ------------------------------------------------------------------------------


def _peer_has(m, rel: str, data: bytes) -> bool:
    """The peer holds a verified copy: its state says so and its RAM file matches."""
    st = m.state(rel)
    return m.node_id in st["holders"] and "ram" in st["tiers"] and st["crc32c"] == \
        f"{crc_of(data):08x}"


def test_fsync_replicas_returns_after_k_verified_copies(make_cluster):
    c = make_cluster(3, replicas=2, start=False, extra=("--fsync", "replicas"))
    c.define("a", extra=mon())
    c.start("a", "b", "c")
    a, b, cc = c["a"], c["b"], c["c"]
    data = blob(5, 32 * MiB)
    with open(a.path / "shard", "wb") as f:
        f.write(data)
        f.flush()
        t0 = time.monotonic()
        os.fsync(f.fileno())
        took = time.monotonic() - t0
        # Checked on the peers themselves, the moment fsync returned.
        assert _peer_has(b, "shard", data) and _peer_has(cc, "shard", data)
    st = a.state("shard")
    assert st["replicas"] == 2 and st["version"] == 1, st  # close did not seal again
    assert took > 0
    # O_SYNC: the level is paid at close (not on every write).
    data2 = blob(6, 8 * MiB)
    fd = os.open(a.path / "synced", os.O_WRONLY | os.O_CREAT | os.O_SYNC, 0o644)
    try:
        for off in range(0, len(data2), MiB):
            os.write(fd, data2[off:off + MiB])
    finally:
        os.close(fd)
    assert _peer_has(b, "synced", data2) and _peer_has(cc, "synced", data2)
    fsync = a.status()["lifecycle"]["fsync"]
    assert fsync["waits"]["replicas"] >= 2 and fsync["failures"] == 0, fsync
    assert wait_metric(a, "mtcfs_fsync_wait_seconds_count", 2, level="replicas") >= 2
    assert wait_metric(a, "mtcfs_replication_lag_seconds_count", 2) >= 2


def test_fsync_replicas_times_out_with_eio_when_peers_are_gone(make_cluster):
    c = make_cluster(2, replicas=1, start=False,
                     extra=("--fsync", "replicas", "--fsync-timeout", "2"))
    c.define("a", extra=mon())
    c.start("a", "b")
    c.kill9("b")
    a = c["a"]
    wait_until(lambda: not a.status()["peers"]["live_peers"], timeout=20)
    with open(a.path / "shard", "wb") as f:
        f.write(blob(1, MiB))
        f.flush()
        with pytest.raises(OSError) as e:
            os.fsync(f.fileno())
    assert e.value.errno == errno.EIO
    assert "level replicas not reached" in a.log()
    # The data is still there (fsync's level failed, not the write).
    assert (a.path / "shard").read_bytes() == blob(1, MiB)
    assert wait_metric(a, "mtcfs_errors_total", 1, kind="fsync_level_not_reached") >= 1


def test_fsync_gcs_persists_whatever_the_policy(make_mount, make_gcs_server):
    server = make_gcs_server("filesystem")
    bucket = server.create_bucket("fsync")
    m = make_mount(extra=("--bucket", f"gs://{bucket}", "--gcs-endpoint", server.url,
                          "--persist", "manual", "--fsync", "gcs", *mon()))
    data = blob(7, 12 * MiB)
    (m.path / "d").mkdir()
    with open(m.path / "d" / "shard", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        st = m.state("d/shard")
        assert st["persisted"], st
    assert crc_of(server.object_path(bucket, "d/shard").read_bytes()) == crc_of(data)
    # A temporary name is never uploaded: fsync of it does not wait for the bucket.
    with open(m.path / "d" / ".metadata.tmp", "wb") as f:
        f.write(b"meta")
        f.flush()
        os.fsync(f.fileno())
    assert not m.state("d/.metadata.tmp")["persisted"]
    assert wait_metric(m, "mtcfs_fsync_wait_seconds_count", 1, level="gcs") >= 1
    # Buckets start at 1 ms (a local fsync takes about that long).
    assert ("mtcfs_fsync_wait_seconds_bucket", (("le", "0.001"), ("level", "gcs"))) \
        in metrics(m)


# -- observability ----------------------------------------------------------------------------


def test_metrics_and_healthz(make_cluster, tmp_path):
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    port = free_port()
    c = make_cluster(2, replicas=1, start=False,
                     extra=("--bucket", f"file://{bucket}", "--persist", "on-close"))
    c.define("a", extra=mon(port))
    c.start("a", "b")
    a = c["a"]
    for i in range(3):
        write(a.path / f"f{i}", blob(i, 2 * MiB))
    wait_until(lambda: all(a.state(f"f{i}")["persisted"] and a.state(f"f{i}")["replicas"]
                           for i in range(3)))
    wait_metric(a, "mtcfs_persist_lag_seconds_count", 3)
    wait_metric(a, "mtcfs_replication_lag_seconds_count", 3)
    # The gauges come from a status snapshot taken every second: one taken after the
    # files settled (the lag histograms above are live).
    written = [("mtcfs_application_written_bytes_total", (("data_path", "fuse"),)),
               ("mtcfs_replica_sent_bytes_total", ()),
               ("mtcfs_uploaded_bytes_total", (("tier", "file"),))]
    s = wait_until(lambda: (s := metrics(a)).get(("mtcfs_files", (("state", "closed"),))) == 3
                   and s.get(("mtcfs_upload_queue_files", ())) == 0
                   and all(s.get(k, 0) >= 6 * MiB for k in written) and s, timeout=20,
                   what="a metrics snapshot with the 3 files closed, replicated and uploaded")
    assert s[("mtcfs_files", (("state", "closed"),))] == 3
    for k in written:
        assert s[k] >= 6 * MiB, k
    assert s[("mtcfs_health", (("state", "ok"),))] == 1
    assert s[("mtcfs_build_info", (("node", "node-a"), ("version", mtcfs_version)))] == 1
    assert s[("mtcfs_seconds_since_last_persist", ())] >= 0
    assert ("process_resident_memory_bytes", ()) in s and ("python_info" in {n for n, _ in s})
    assert s[("mtcfs_peer_up", (("node", "node-b"), ("peer", c.addr("b"))))] == 1
    assert s[("mtcfs_upload_queue_files", ())] == 0
    assert s[("mtcfs_ram_used_bytes", ())] >= 6 * MiB
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
        assert r.status == 200 and json.loads(r.read())["ok"] is True
    c.kill9("b")
    wait_until(lambda: metric(a, "mtcfs_peer_up", node="node-b", peer=c.addr("b")) == 0,
               timeout=20)
    # A stopped daemon: /healthz (and the port) go away with it.
    os.kill(a.proc.pid, 19)  # SIGSTOP: the event loop stalls; the HTTP thread too
    try:
        # (The stop is asynchronous: a request sent at once was answered once, in a
        # loaded parallel run.)
        stat = Path(f"/proc/{a.proc.pid}/stat")
        wait_until(lambda: stat.read_text().rsplit(")", 1)[1].split()[0] == "T", timeout=5,
                   what="the daemon stopped")
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)
    finally:
        os.kill(a.proc.pid, 18)  # SIGCONT


def test_json_logs_one_object_per_line(make_mount):
    m = make_mount(extra=("--log-format", "json"))
    write(m.path / "x", b"hello")
    m.stop()
    lines = [ln for ln in m.log().splitlines() if ln.strip()]
    assert lines
    objs = [json.loads(ln) for ln in lines]  # each line is one JSON object
    assert all({"time", "severity", "message", "logger"} <= set(o) for o in objs)
    assert any("mounted" in o["message"] for o in objs)


def test_status_and_steps_show_lifecycle(make_mount, tmp_path):
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    m = make_mount(ram_size="128MiB", extra=("--bucket", f"file://{bucket}", "--keep-steps",
                                             "1"))
    save_step(m.path, 1, MiB)
    save_step(m.path, 2, MiB)
    wait_until(lambda: not in_ram(m, "step_1/shard_0"))
    out = subprocess.run([*mtcfs_cmd(), "status", str(m.path)], capture_output=True,
                         text=True, check=True).stdout
    assert "lifecycle" in out and "keep 1" in out and "retention" in out
    out = subprocess.run([*mtcfs_cmd(), "steps", str(m.path)], capture_output=True,
                         text=True, check=True).stdout
    assert "step_1" in out and "evicted" in out


def mtcfs_cmd() -> list[str]:
    from support.mounts import MTCFS

    return list(MTCFS)


def test_replicated_own_data_waits_for_its_upload(make_cluster, make_gcs_server):
    """With a bucket, a writer never drops its own unpersisted data because a peer holds
    a replica: the upload reads it from this host's RAM. (It did once, and the files
    were never persisted.) The writer waits for the upload instead."""
    server = make_gcs_server("memory")
    bucket = server.create_bucket("own")
    c = make_cluster(2, replicas=1, start=False, extra=(
        "--bucket", f"gs://{bucket}", "--gcs-endpoint", server.url, "--persist", "on-close"))
    c.define("a", ram_size="64MiB", extra=("--full-timeout", "60", *mon()))
    c.start("a", "b")
    a = c["a"]
    server.kill()
    _fill_unpersisted(a, ["x", "y"], 24 * MiB)
    wait_until(lambda: all(a.state(n)["replicas"] == 1 for n in ("x", "y")))
    done: dict[str, object] = {}
    t = threading.Thread(target=lambda: (write(a.path / "z", blob(5, 24 * MiB)),
                                         done.setdefault("ok", True)))
    t.start()
    wait_until(lambda: a.status()["lifecycle"]["writers_waiting"] >= 1, timeout=20)
    assert all(in_ram(a, n) for n in ("x", "y")), "own unpersisted data was evicted"
    server.start()
    t.join(timeout=90)
    assert done.get("ok")
    wait_until(lambda: all(a.state(n)["persisted"] for n in ("x", "y", "z")), timeout=60)
    assert "no longer in this host's RAM" not in a.log()
    assert wait_metric(a, "mtcfs_evictions_total", 1, reason="own") >= 1  # after the upload
