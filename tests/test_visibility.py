"""What one host fsynced or committed, every host sees when the call returns.

Multi-host checkpointers synchronise with barriers outside the filesystem and
then read each other's files at once, so these tests check on the other host
the instant the writer's call returns: no polling, no sleeping. Each check runs
many times in a row, because the failure they guard against is a race.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from support.mounts import blob, mtcfs, wait_until

N = int(os.environ.get("MTCFS_VISIBILITY_ROUNDS", "100"))


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_fsync_of_a_file_is_visible_on_the_other_host_when_it_returns(make_cluster):
    c = make_cluster(2, replicas=1)
    a, b = c["a"], c["b"]
    (a.path / "step").mkdir()
    for i in range(N):
        data = blob(i, 1 + (i * 7919) % 300_000)
        fd = os.open(a.path / "step" / f"shard_{i}", os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
            # Still open on its writer: visible at its fsynced size, read from the writer.
            assert read(b.path / "step" / f"shard_{i}") == data, f"round {i}"
        finally:
            os.close(fd)
    states = [b.state(f"step/shard_{i}") for i in range(0, N, 10)]
    assert all(s["state"] == "closed" for s in states)


def test_fsync_then_more_writes_then_close_reaches_the_peer_at_close(make_cluster):
    """An fsynced file's close waits for its final seal to reach every live peer."""
    c = make_cluster(2, replicas=1)
    a, b = c["a"], c["b"]
    for i in range(N // 4):
        first, rest = blob(2 * i, 50_000), blob(2 * i + 1, 70_000)
        with open(a.path / f"f{i}", "wb") as f:
            f.write(first)
            f.flush()
            os.fsync(f.fileno())
            assert read(b.path / f"f{i}") == first
            f.write(rest)
        assert read(b.path / f"f{i}") == first + rest, f"round {i}"


def test_commit_rename_is_visible_on_the_other_host_when_it_returns(make_cluster):
    """torch DCP: `.metadata.tmp` renamed to `.metadata` is the commit."""
    c = make_cluster(2, replicas=1)
    a, b = c["a"], c["b"]
    for i in range(N):
        step = a.path / f"step_{i}"
        step.mkdir()
        meta = json.dumps({"step": i, "pad": "x" * (i * 97)}).encode()
        with open(step / ".metadata.tmp", "wb") as f:
            f.write(meta)  # no fsync: the rename alone must make it visible
        os.rename(step / ".metadata.tmp", step / ".metadata")
        assert read(b.path / f"step_{i}" / ".metadata") == meta, f"round {i}"


def test_orbax_style_commit_of_a_tmp_directory(make_cluster):
    """The primary writes the marker, then renames the tmp directory into place; the
    other host sees the step, with the first host's files in it, at once."""
    c = make_cluster(2, replicas=1)
    a, b = c["a"], c["b"]
    for i in range(N // 2):
        tmp = a.path / f"{i}.orbax-checkpoint-tmp-123"
        tmp.mkdir()
        # The other host polls until the primary's tmp dir appears (as Orbax does),
        # then writes its process's files into it.
        wait_until(lambda t=tmp: (b.path / t.name).is_dir(), timeout=10, interval=0.005)
        mine = b.path / tmp.name / "ocdbt.process_1"
        mine.mkdir()
        data = blob(i, 10_000 + i)
        with open(mine / "d", "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        with open(tmp / "commit_success.txt", "wb") as f:
            f.write(b"ok")
        os.rename(tmp, a.path / str(i))
        assert read(b.path / str(i) / "commit_success.txt") == b"ok", f"round {i}"
        assert read(a.path / str(i) / "ocdbt.process_1" / "d") == data, f"round {i}"


def test_tensorstore_pattern_rename_of_an_open_locked_file_then_dir_fsync(make_cluster):
    """tensorstore: write `<name>.__lock`, fsync, rename the still-open file, fsync the
    directory; the other host sees `<name>` when the directory's fsync returns."""
    import fcntl

    c = make_cluster(2, replicas=1)
    a, b = c["a"], c["b"]
    (a.path / "ocdbt").mkdir()
    for i in range(N // 2):
        lock = a.path / "ocdbt" / f"manifest_{i}.__lock"
        final = a.path / "ocdbt" / f"manifest_{i}"
        data = blob(1000 + i, 3000 + i)
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            os.write(fd, data)
            os.fsync(fd)
            os.rename(lock, final)
            dfd = os.open(a.path / "ocdbt", os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            assert read(b.path / "ocdbt" / f"manifest_{i}") == data, f"round {i}"
            assert not (b.path / "ocdbt" / f"manifest_{i}.__lock").exists()
        finally:
            os.close(fd)


@pytest.mark.serial  # a timing bound: must not share the machine
def test_plain_close_stays_asynchronous_and_visibility_close_waits(make_cluster):
    c = make_cluster(2, replicas=0)
    a, b = c["a"], c["b"]
    os.kill(b.proc.pid, signal.SIGSTOP)  # b answers nothing, but is not dead yet
    try:
        t0 = time.monotonic()
        with open(a.path / "plain", "wb") as f:
            f.write(b"x" * 4096)
        plain = time.monotonic() - t0
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    assert plain < 0.5, f"a plain close took {plain:.2f} s"
    # With --visibility close every close waits: b sees the file when close returns.
    c.define("a", extra=("--visibility", "close"), mount=a)
    c.restart("a")
    for i in range(N // 4):
        with open(a.path / f"v{i}", "wb") as f:
            f.write(blob(i, 1000))
        assert read(b.path / f"v{i}") == blob(i, 1000)


def test_close_in_a_step_being_written_is_visible_when_it_returns(make_cluster):
    """Orbax writes each process's array_metadatas/process_<i> without fsync and its
    primary lists them right after a barrier: a close under a temporary step name waits
    for the peers (a plain close elsewhere does not)."""
    c = make_cluster(2, replicas=0)
    a, b = c["a"], c["b"]
    tmp = "7.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp/array_metadatas"
    (a.path / tmp).mkdir(parents=True)
    wait_until(lambda: (b.path / tmp).is_dir())
    for i in range(N):
        with open(a.path / tmp / f"process_{i}", "wb") as f:
            f.write(blob(i, 100 + i))
        assert sorted(os.listdir(b.path / tmp)) == sorted(f"process_{j}" for j in range(i + 1))
        assert read(b.path / tmp / f"process_{i}") == blob(i, 100 + i), f"round {i}"
    os.kill(b.proc.pid, signal.SIGSTOP)  # b answers nothing, but is not dead yet
    try:
        t0 = time.monotonic()
        with open(a.path / tmp / "late", "wb") as f:
            f.write(b"x")
        waited = time.monotonic() - t0
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    assert waited > 0.5, f"the close returned after {waited:.2f} s without b"


@pytest.mark.serial  # a timing bound: must not share the machine
def test_a_peer_that_does_not_answer_bounds_fsync_by_the_commit_timeout(make_cluster):
    c = make_cluster(2, replicas=0, extra=("--commit-timeout", "1.5"))
    a, b = c["a"], c["b"]
    os.kill(b.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with open(a.path / "f", "wb") as f:
            f.write(b"data")
            f.flush()
            os.fsync(f.fileno())
        took = time.monotonic() - t0
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    assert 1.0 <= took < 4.0, took
    vis = a.status()["visibility"]
    assert vis["timeouts"] >= 1
    assert "node-b" in vis["last_timeout"]
    assert "did not answer" in a.log()


def test_first_save_after_mounting_is_as_safe_as_any_other(make_cluster):
    """Fresh mounts started together: the first fsync already reaches the other host."""
    for i in range(max(3, N // 20)):
        c = make_cluster(2, replicas=1)
        a, b = c["a"], c["b"]
        data = blob(i, 123_456)
        with open(a.path / "first", "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            assert read(b.path / "first") == data, f"cluster {i}"
        c.close()


def test_status_reports_visibility(make_cluster):
    c = make_cluster(2, replicas=0)
    a = c["a"]
    with open(a.path / "f", "wb") as f:
        f.write(b"x")
        f.flush()
        os.fsync(f.fileno())
    vis = a.status()["visibility"]
    assert vis["mode"] == "fsync" and vis["commit_timeout"] == 10.0
    assert vis["waits"] >= 1 and vis["timeouts"] == 0
    text = mtcfs("status", str(a.path)).stdout
    assert "visibility" in text.lower()


@pytest.mark.parametrize("bad", ["0", "-1", "abc"])
def test_commit_timeout_is_validated(tmp_path, bad):
    (tmp_path / "m").mkdir()
    r = mtcfs("mount", str(tmp_path / "m"), "--commit-timeout", bad)
    assert r.returncode == 2 and "commit-timeout" in r.stderr
