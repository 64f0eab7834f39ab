"""Checkpoints that can be restored: real torch DCP and Orbax jobs across hosts.

- What a save committed is visible on every host when the save returns (the
  ranks that did not commit check the marker at once).
- Orbax multi-host save and restore with the processes swapped, on freshly
  started mounts (each process sees its host's mount at the same path, /ckpt,
  through a mount namespace of its own, as two pods would).
- A committed step that lost the only copy of a shard is withdrawn on every
  host, and the restarted job resumes from the previous step.
- A rename of persisted data leaves every file in the bucket under its new
  name: a whole-job loss afterwards restores from the bucket alone.
- Hard links across hosts and in the bucket.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from support.mounts import MtcfsMount, blob, crc_of, force_unmount, free_port, mtcfs, wait_until

ORBAX_ROUNDS = int(os.environ.get("MTCFS_ORBAX_ROUNDS", "2"))

# -- torch DCP ------------------------------------------------------------------------------

DCP_JOB = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    mount, rank, world, store, steps = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                        sys.argv[4], [int(s) for s in sys.argv[5].split(",")])
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)

    def state(step):
        g = torch.Generator().manual_seed(1000 * step + rank)
        return {f"rank{rank}.w": torch.randn(512, 256, generator=g)}

    if steps[0] > 0:  # save these steps
        for step in steps:
            path = os.path.join(mount, f"step_{step}")
            os.makedirs(path, exist_ok=True)
            dcp.save(state(step), checkpoint_id=path)
            # Right after save() returns, on every rank, on every host: the commit.
            with open(os.path.join(path, ".metadata"), "rb") as f:
                assert f.read(1), "empty .metadata"
            print("saved", step, flush=True)
    else:  # resume: the newest step whose .metadata is there, as training scripts do
        done = sorted(int(n.split("_")[1]) for n in os.listdir(mount)
                      if n.startswith("step_") and n.split("_")[1].isdigit()
                      and os.path.exists(os.path.join(mount, n, ".metadata")))
        step = done[-1]
        sd = {f"rank{rank}.w": torch.zeros(512, 256)}
        dcp.load(sd, checkpoint_id=os.path.join(mount, f"step_{step}"))
        assert torch.equal(sd[f"rank{rank}.w"], state(step)[f"rank{rank}.w"])
        print("resumed", step, flush=True)
    dist.barrier()
    dist.destroy_process_group()
""")


def run_dcp(mounts: list[MtcfsMount], steps: str, tmp_path: Path,
            timeout: float = 240) -> list[str]:
    """One rank per mount listed (a host may appear twice: two ranks on it)."""
    pytest.importorskip("torch")
    store = tmp_path / f"store-{uuid.uuid4().hex[:8]}"
    procs = [subprocess.Popen([sys.executable, "-c", DCP_JOB, str(m.path), str(r),
                               str(len(mounts)), str(store), steps],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, m in enumerate(mounts)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-3000:]
        outs.append(out)
    return outs


@pytest.mark.slow
def test_dcp_ranks_see_the_commit_when_save_returns(make_cluster, tmp_path):
    """4 ranks on 2 hosts: every rank reads .metadata right after each save() returns."""
    c = make_cluster(2, replicas=1)
    a, b = c["a"], c["b"]
    outs = run_dcp([a, a, b, b], "1,2,3,4,5", tmp_path)
    assert all(o.count("saved") == 5 for o in outs), outs


@pytest.mark.slow
def test_dcp_step_that_lost_its_only_copy_is_withdrawn_and_the_job_resumes(make_cluster,
                                                                          tmp_path):
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    c = make_cluster(2, replicas=1, start=False,
                     extra=("--bucket", f"file://{bucket}", "--persist", "manual"))
    c.define("b", replicas=0)  # b keeps its shards' only copy: the K=1 window, made certain
    c.start("a", "b")
    a, b = c["a"], c["b"]
    run_dcp([a, b], "1", tmp_path)
    for m in (a, b):  # step 1 is safe in the bucket
        r = mtcfs("persist", str(m.path), "step_1", "--wait", timeout=120)
        assert r.returncode == 0, r.stderr
    run_dcp([a, b], "2", tmp_path)
    assert b.state("step_2/__1_0.distcp")["replicas"] == 0
    c.kill9("b")  # step 2's commit returned; b's shard of it had no other copy
    wait_until(lambda: "step_2.mtcfs-withdrawn" in os.listdir(a.path), timeout=30,
               what="step 2 withdrawn")
    assert ".metadata.mtcfs-withdrawn" in os.listdir(a.path / "step_2.mtcfs-withdrawn")
    assert "step_2" not in os.listdir(a.path)
    assert "withdrew step step_2" in a.log()
    new_b = c.replace("b")  # a replacement host: empty RAM
    assert sorted(n for n in os.listdir(new_b.path) if n.startswith("step_")) == [
        "step_1", "step_2.mtcfs-withdrawn"]
    steps = {s["path"]: s for s in _steps(a)}
    assert steps["step_2.mtcfs-withdrawn"]["withdrawn"]
    assert steps["step_2.mtcfs-withdrawn"]["lost_files"] == [
        "step_2.mtcfs-withdrawn/__1_0.distcp"]
    outs = run_dcp([a, new_b], "0", tmp_path)  # the restarted job resumes
    assert all("resumed 1" in o for o in outs), outs


def _steps(m: MtcfsMount) -> list[dict]:
    import json

    r = mtcfs("steps", str(m.path), "--json", check=True)
    return json.loads(r.stdout)["steps"]


# -- Orbax (jax on CPU, 2 processes on 2 hosts) -------------------------------------------------

ORBAX_JOB = textwrap.dedent("""
    import os, sys
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    pid, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                               initialization_timeout=120)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import orbax.checkpoint as ocp
    devs = np.array(jax.devices())
    sh = NamedSharding(Mesh(devs, ("x",)), P("x"))
    n = 1 << 18

    def make(step):
        g = np.arange(len(devs) * n, dtype=np.float32) * (step + 1)
        return jax.make_array_from_callback(g.shape, sh, lambda idx: g[idx])

    mgr = ocp.CheckpointManager("/ckpt/run", options=ocp.CheckpointManagerOptions(
        max_to_keep=5, create=True))
    if mode.startswith("save"):
        for step in [int(s) for s in mode.split(":")[1].split(",")]:
            mgr.save(step, args=ocp.args.StandardSave({"w": make(step)}))
            mgr.wait_until_finished()
            print("saved", step, flush=True)
    else:
        step = mgr.latest_step()
        abstract = {"w": jax.ShapeDtypeStruct((len(devs) * n,), np.float32, sharding=sh)}
        got = mgr.restore(step, args=ocp.args.StandardRestore(abstract))["w"]
        want = make(step)
        for x, y in zip(got.addressable_shards, want.addressable_shards):
            assert np.array_equal(np.asarray(x.data), np.asarray(y.data)), step
        print("restored", step, flush=True)
    mgr.close()
""")


def run_orbax(mounts: list[MtcfsMount], mode: str, timeout: float = 240) -> list[str]:
    """Process i runs with mounts[i] bound at /ckpt in a mount namespace of its own."""
    pytest.importorskip("orbax.checkpoint")
    port = free_port()
    procs = []
    for pid, m in enumerate(mounts):
        script = (f"mkdir -p /ckpt && mount --bind {m.path} /ckpt && "
                  f"exec {sys.executable} -c \"$JOB\" {pid} {port} {mode}")
        procs.append(subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            env={**os.environ, "JOB": ORBAX_JOB}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, f"orbax {mode} failed:\n{err[-4000:]}"
        outs.append(out)
    return outs


@pytest.fixture
def orbax_ready() -> None:
    pytest.importorskip("orbax.checkpoint")
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")


@pytest.mark.slow
def test_orbax_multihost_save_then_restore_swapped_on_fresh_mounts(make_cluster, orbax_ready):
    for i in range(ORBAX_ROUNDS):
        c = make_cluster(2, replicas=1)
        a, b = c["a"], c["b"]
        run_orbax([a, b], "save:1,2")
        outs = run_orbax([b, a], "restore")  # process 0 on host b, process 1 on host a
        assert all("restored 2" in o for o in outs), (i, outs)
        c.close()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["umount", "kill9"])
def test_steps_survive_a_whole_job_restart_over_intact_ram(make_cluster, tmp_path, how):
    """Both daemons go down over their RAM dirs (a node-pool restart, a bad rollout) and
    come back one after the other: the first one up finds its peer dead, and that peer
    holds the only copy of its rank's shard of every step. Nothing is withdrawn, and
    the restarted job resumes from the newest step."""
    c = make_cluster(2, replicas=0)  # each host holds its own rank's shards only
    a, b = c["a"], c["b"]
    run_dcp([a, b], "1,2", tmp_path)
    assert a.state("step_2/__1_0.distcp")["holders"] == ["node-b"]
    if how == "kill9":
        for name in ("a", "b"):
            c.kill9(name)
    else:  # together: one after the other, b could outlive a by the withdrawal grace under load
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(MtcfsMount.stop, (a, b)))
    c.restart("a")
    time.sleep(4)  # a is live and has found b dead
    assert b.proc is not None and b.proc.poll() is not None
    c.restart("b")
    outs = run_dcp([a, b], "0", tmp_path)
    assert all("resumed 2" in o for o in outs), outs
    for m in (a, b):
        assert sorted(n for n in os.listdir(m.path) if n.startswith("step_")) == [
            "step_1", "step_2"]
        assert "withdrew" not in m.log()


@pytest.mark.slow
def test_orbax_step_that_lost_its_only_copy_is_withdrawn(make_cluster, orbax_ready, tmp_path):
    """The primary host dies with the only copy of its process's files of step 2 (the
    other host never read them; the primary reads everyone's files to finalize, so its
    own are the ones at risk): the other host withdraws step 2 and the restarted job
    restores step 1."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    c = make_cluster(2, replicas=1, start=False,
                     extra=("--bucket", f"file://{bucket}", "--persist", "manual"))
    c.define("a", replicas=0)
    c.start("a", "b")
    a, b = c["a"], c["b"]
    run_orbax([a, b], "save:1")
    for m in (a, b):
        assert mtcfs("persist", str(m.path), "run/1", "--wait", timeout=120).returncode == 0
    run_orbax([a, b], "save:2")
    c.kill9("a")
    try:
        wait_until(lambda: "2.mtcfs-withdrawn" in os.listdir(b.path / "run"), timeout=30,
                   what="step 2 withdrawn")
    except AssertionError:
        print(mtcfs("steps", str(b.path), "--json").stdout[-6000:])
        raise
    assert "2" not in os.listdir(b.path / "run")
    new_a = c.replace("a")
    outs = run_orbax([new_a, b], "restore")
    assert all("restored 1" in o for o in outs), outs


# -- renames of persisted data, whole-job loss ---------------------------------------------------


def test_rename_of_a_persisted_directory_then_whole_job_loss(make_cluster, tmp_path,
                                                            ram_root):
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    c = make_cluster(2, replicas=1, extra=("--bucket", f"file://{bucket}",
                                           "--persist", "on-close"))
    a, b = c["a"], c["b"]
    (a.path / "step_7").mkdir()
    wait_until(lambda: (b.path / "step_7").is_dir())
    files = {}
    for m, tag in ((a, "a"), (b, "b")):
        for i in range(3):
            data = blob(hash((tag, i)) & 0xFFFF, 200_000 + i)
            (m.path / "step_7" / f"{tag}{i}.bin").write_bytes(data)
            files[f"{tag}{i}.bin"] = data
    for name in files:
        wait_until(lambda n=name: ((a.path / "step_7" / n).exists()  # (b's files arrive
                                   and a.state(f"step_7/{n}")["persisted"]), timeout=30)
    (a.path / "archive").mkdir()
    os.rename(a.path / "step_7", a.path / "archive" / "step_7")  # holds b's files too
    for name in files:
        for m in (a, b):
            wait_until(lambda n=name, m=m: (m.path / "archive" / "step_7" / n).exists()
                       and m.state(f"archive/step_7/{n}")["persisted"],
                       timeout=30, what=f"{name} persisted under its new name on {m.node_id}")
    wait_until(lambda: not (bucket / "step_7").exists()
               or not any((bucket / "step_7").iterdir()), timeout=30, what="old objects removed")
    for name in files:
        assert (bucket / "archive" / "step_7" / name).read_bytes() == files[name]
    # Whole-job loss: every RAM dir gone; a new host mounts the bucket alone.
    c.close()
    fresh = MtcfsMount(tmp_path / "fresh", ram_root / "fresh", node_id="node-z",
                       extra=("--bucket", f"file://{bucket}"))
    fresh.path.mkdir()
    try:
        fresh.start()
        assert sorted(os.listdir(fresh.path / "archive" / "step_7")) == sorted(files)
        for name, data in files.items():
            assert (fresh.path / "archive" / "step_7" / name).read_bytes() == data
        assert not (fresh.path / "step_7").exists()
    finally:
        fresh.stop()
        force_unmount(str(fresh.path))


def test_hard_links_across_hosts_and_in_the_bucket(make_cluster, tmp_path):
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    c = make_cluster(2, replicas=1, extra=("--bucket", f"file://{bucket}",
                                           "--persist", "on-close"))
    a, b = c["a"], c["b"]
    data = blob(5, 300_000)
    (a.path / "d").mkdir()
    (a.path / "d" / "f").write_bytes(data)
    os.link(a.path / "d" / "f", a.path / "g")
    dfd = os.open(a.path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)  # the link is on every host when this returns
    finally:
        os.close(dfd)
    assert os.stat(b.path / "g").st_nlink == 2
    assert (b.path / "g").read_bytes() == data
    assert os.stat(b.path / "g").st_ino == os.stat(b.path / "d" / "f").st_ino
    wait_until(lambda: (bucket / "g").exists() and (bucket / "d" / "f").exists(), timeout=30,
               what="both names in the bucket")
    assert crc_of((bucket / "g").read_bytes()) == crc_of(data)
    os.unlink(a.path / "d" / "f")  # the name it was known by
    wait_until(lambda: not (bucket / "d" / "f").exists(), timeout=30)
    wait_until(lambda: not (b.path / "d" / "f").exists() and os.stat(b.path / "g").st_nlink == 1,
               timeout=10)
    assert (bucket / "g").read_bytes() == data
    time.sleep(0.5)
    assert (b.path / "g").read_bytes() == data


def _withdrawn_for_bs_lost_file(c) -> MtcfsMount:
    """Step 1 with a file of a and one of b (its only copy), committed; b crashes:
    withdrawn on a, which is returned."""
    c.define("b", replicas=0)  # b keeps its file's only copy
    c.start("a", "b")
    a, b = c["a"], c["b"]
    (a.path / "step_1").mkdir()
    (a.path / "step_1" / "a0").write_bytes(blob(1, 100_000))
    # a's mkdir reaches b by the index, a moment later (CI once wrote before it came)
    wait_until(lambda: (b.path / "step_1").is_dir(), timeout=10, what="step_1 on b")
    (b.path / "step_1" / "b0").write_bytes(blob(2, 100_000))
    wait_until(lambda: (a.path / "step_1" / "b0").exists(), timeout=10, what="b0 on a")
    (a.path / "step_1" / "commit_success.txt").write_bytes(b"ok")
    c.kill9("b")
    wait_until(lambda: "step_1.mtcfs-withdrawn" in os.listdir(a.path), timeout=40,
               what="step 1 withdrawn")
    return a


@pytest.mark.slow
def test_a_withdrawn_step_whose_lost_file_was_removed_stays_withdrawn(make_cluster):
    """Reinstating a step needs its lost files back. A 30-minute chaos run saw a lost
    file removed (an old step's retention), the rest of its withdrawn step all with
    copies, and the step reinstated: its marker went to the bucket beside a missing
    shard."""
    c = make_cluster(2, replicas=1, start=False)
    a = _withdrawn_for_bs_lost_file(c)
    os.unlink(a.path / "step_1.mtcfs-withdrawn" / "b0")  # the lost file goes
    time.sleep(16)  # REINSTATE_AFTER (10 s) and passes
    assert "step_1.mtcfs-withdrawn" in os.listdir(a.path), os.listdir(a.path)
    assert "reinstated" not in a.log()


@pytest.mark.slow
def test_a_withdrawn_step_is_reinstated_once_its_lost_file_is_back_and_persisted(
        make_cluster, tmp_path):
    """b comes back over its intact RAM dir: its file is back, and once it is in the
    bucket (a holder entry alone may be stale) the step gets its names back."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    c = make_cluster(2, replicas=1, start=False,
                     extra=("--bucket", f"file://{bucket}", "--persist", "manual"))
    a = _withdrawn_for_bs_lost_file(c)
    b = c.restart("b")  # its RAM dir intact: b0 is back, not in the bucket yet
    time.sleep(14)  # REINSTATE_AFTER (10 s) and passes: held only by b
    assert "step_1.mtcfs-withdrawn" in os.listdir(a.path)
    r = mtcfs("persist", str(b.path), "step_1.mtcfs-withdrawn", "--wait", timeout=120)
    assert r.returncode == 0, r.stderr
    try:
        wait_until(lambda: "step_1" in os.listdir(a.path), timeout=40, what="step 1 reinstated")
    except AssertionError:
        # What each host thinks, should it fail again (it did when no pass was woken:
        # tests/nofuse/test_api_withdrawal_wakes.py).
        for h in (a, b):
            for f in ("a0", "b0", "commit_success.txt.mtcfs-withdrawn"):
                print(h.node_id, f, h.state(f"step_1.mtcfs-withdrawn/{f}"))
            print(h.node_id, mtcfs("status", str(h.path), "--json").stdout[-6000:])
        raise
    assert (a.path / "step_1" / "commit_success.txt").read_bytes() == b"ok"
    assert (a.path / "step_1" / "b0").read_bytes() == blob(2, 100_000)


def test_a_lost_file_whose_upload_landed_keeps_its_step(make_cluster, tmp_path):
    """b's upload of its shard landed in the bucket, and b died before the record of it
    reached a (a chaos run: its step was withdrawn, and the object came back from the
    bucket listing as a stray step directory beside the withdrawn one). a finds the
    object by the file's name, size and crc32c, keeps step 1 and serves the shard from
    the bucket; step 2, whose object under that name holds other bytes, is withdrawn."""
    from mtcfs.tiers.durable.localdir import LocalDirTier

    bucket = tmp_path / "bucket"
    bucket.mkdir()
    c = make_cluster(2, replicas=1, start=False,
                     extra=("--bucket", f"file://{bucket}", "--persist", "manual"))
    c.define("b", replicas=0)  # b keeps its shards' only copies
    c.start("a", "b")
    a, b = c["a"], c["b"]
    tier = LocalDirTier(str(bucket))
    for step, landed in ((1, blob(2, 100_000)), (2, blob(9, 100_000))):
        d = f"step_{step}"
        (a.path / d).mkdir()
        (a.path / d / "a0").write_bytes(blob(1, 100_000))
        wait_until(lambda d=d: (b.path / d).is_dir(), timeout=10, what=f"{d} on b")
        (b.path / d / "b0").write_bytes(blob(2, 100_000))
        wait_until(lambda d=d: (a.path / d / "b0").exists(), timeout=10, what="b0 on a")
        (a.path / d / "commit_success.txt").write_bytes(b"ok")
        src = tmp_path / f"landed{step}"
        src.write_bytes(landed)
        tier.put_file(f"{d}/b0", str(src), crc_of(landed))  # as b's upload would have
    assert b.state("step_1/b0")["persisted"] is False
    c.kill9("b")
    wait_until(lambda: "step_2.mtcfs-withdrawn" in os.listdir(a.path), timeout=40,
               what="step 2 withdrawn")
    wait_until(lambda: "step_1/b0 has no copy on any host, but its upload had landed"
               in a.log(), timeout=10, what="step 1's b0 found in the bucket")
    assert "step_1" in os.listdir(a.path) and "step_1.mtcfs-withdrawn" not in os.listdir(
        a.path)
    assert (a.path / "step_1" / "b0").read_bytes() == blob(2, 100_000)
    assert a.state("step_1/b0")["persisted"] is True
    steps = {s["path"]: s for s in _steps(a)}
    assert not steps["step_1"]["withdrawn"]
    assert steps["step_2.mtcfs-withdrawn"]["lost_files"] == ["step_2.mtcfs-withdrawn/b0"]


def test_a_renamed_files_object_left_under_its_old_name_is_moved(make_cluster, tmp_path):
    """A rename moves the file's object in the bucket by a server-side copy, pending in
    the mover's metadata store until it lands. a renames x to y while the bucket
    refuses writes, and dies; its replacement starts with an empty RAM dir, the copy
    gone with the old one. (A chaos run: the old name came back from the bucket
    listing as a stray step directory, for good.) The owner moves the object once a
    listing finds it by its generation, size and crc32c; x shows nowhere."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    c = make_cluster(2, replicas=1, start=False,
                     extra=("--bucket", f"file://{bucket}", "--persist", "on-close",
                            "--list-refresh", "2"))
    c.define("a", replicas=0)  # a keeps x's only copy in its RAM
    c.start("a", "b")
    a, b = c["a"], c["b"]
    data = blob(5, 300_000)
    (a.path / "x").write_bytes(data)
    wait_until(lambda: a.state("x")["persisted"], timeout=20, what="x persisted")
    subprocess.run(["mount", "--bind", str(bucket), str(bucket)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(bucket)], check=True)
        os.rename(a.path / "x", a.path / "y")
        wait_until(lambda: "y" in os.listdir(b.path), timeout=10, what="the rename on b")
        time.sleep(1)
        assert not (bucket / "y").exists()  # the copy waits for the bucket
        c.kill9("a")
    finally:
        subprocess.run(["umount", str(bucket)], check=True)
    new_a = c.replace("a")  # an empty RAM dir: the pending copy died with the old one
    wait_until(lambda: (bucket / "y").exists() and not (bucket / "x").exists(), timeout=30,
               what="y's object moved to its name")
    assert (bucket / "y").read_bytes() == data
    for m in (new_a, b):
        # (Until its word of the move arrives, a host knows y has no copy: EIO.)
        wait_until(lambda m=m: m.state("y")["persisted"], timeout=10,
                   what=f"y persisted, seen from {m.node_id}")
        wait_until(lambda m=m: "x" not in os.listdir(m.path), timeout=15,
                   what=f"no stale x on {m.node_id}")
        assert (m.path / "y").read_bytes() == data
    assert "its object is still under its old name x: moving it" in new_a.log()
