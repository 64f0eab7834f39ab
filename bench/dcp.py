"""torch.distributed.checkpoint through mtcfs beside the same on a huge-page tmpfs.

The trainer's view of what crosses hosts. Real torch DCP, real processes:

1. save: 4 ranks (gloo, a file store) on 2 peered mtcfs hosts (ranks 0, 1 on a;
   2, 3 on b; --replicas 1), each saving 2 tensors of --size / 8 into the same
   step directory (`dcp.save`: every rank writes and fsyncs its `__<rank>_0.distcp`,
   rank 0 writes `.metadata` last and renames it into place); the clock runs from
   a barrier before the save to a barrier after it, on rank 0. Reference: the same
   4 ranks saving into one directory on a tmpfs with huge pages (as if every
   host's /ckpt were a bind mount of it).
2. resharded load on a third host: 2 ranks on a new host c (empty RAM tier,
   peered with a and b), rank j loading tensor j of every saving rank
   (`dcp.load(..., no_dist=True)`): each reads half of each shard file, in
   slices, from the peers that hold it; the clock runs from the start of the
   slowest rank's load to its end. Reference: the same load from the tmpfs.

Memory is warmed before each timed part on both sides (Scratch.warm). Each rep
uses a new step directory; host c is new each rep.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from common import BENCH_DIR, BenchError, Context, Row, code_version, err, save_details
from peers import Cluster, settle, status
from ramtier import _size

DETAILS = BENCH_DIR / "results" / "dcp.json"
RANKS = 4
LOADERS = 2

SAVE = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    root, step, rank, store, numel = sys.argv[1], sys.argv[2], int(sys.argv[3]), \\
        sys.argv[4], int(sys.argv[5])
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank,
                            world_size=int(sys.argv[6]))
    g = torch.Generator().manual_seed(rank)
    sd = {f"r{rank}.t{j}": torch.rand(numel, generator=g) for j in range(2)}
    path = os.path.join(root, step)
    dist.barrier()
    t0 = time.monotonic()
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    dcp.save(sd, checkpoint_id=path)
    dist.barrier()
    print(time.monotonic() - t0, flush=True)
    dist.destroy_process_group()
""")

LOAD = textwrap.dedent("""
    import sys, time
    import torch, torch.distributed.checkpoint as dcp
    path, j, ranks, numel = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    sd = {f"r{r}.t{j}": torch.empty(numel) for r in range(ranks)}
    t0 = time.monotonic()
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    t = time.monotonic() - t0
    for r in range(ranks):
        g = torch.Generator().manual_seed(r)
        want = [torch.rand(numel, generator=g) for _ in range(2)][j]
        assert torch.equal(sd[f"r{r}.t{j}"], want), (r, j)
    print(t, flush=True)
""")


def _run_all(cmds: list[list[str]], what: str) -> list[float]:
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in cmds]
    out = []
    for p in procs:
        o, e = p.communicate(timeout=600)
        if p.returncode != 0:
            raise BenchError(f"{what} failed: {e[-2000:]}")
        out.append(float(o.split()[-1]))
    return out


def save(roots: list[Path], step: str, numel: int, store: Path) -> float:
    """Seconds rank 0 measured for the save; rank r saves under roots[r]."""
    cmds = [[sys.executable, "-c", SAVE, str(roots[r]), step, str(r), str(store), str(numel),
             str(RANKS)] for r in range(RANKS)]
    try:
        return _run_all(cmds, "the DCP save")[0]
    finally:
        store.unlink(missing_ok=True)


def load(path: Path, numel: int) -> float:
    """Seconds of the slowest of the loading ranks."""
    cmds = [[sys.executable, "-c", LOAD, str(path), str(j), str(RANKS), str(numel)]
            for j in range(LOADERS)]
    return max(_run_all(cmds, "the DCP load"))


def group(ctx: Context) -> list[Row]:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise BenchError("the dcp group needs torch (pip install torch)") from None
    size = ctx.size
    numel = size // (RANKS * 2 * 4)  # float32 elements per tensor
    details: dict[str, Any] = {"size": size, "reps": ctx.reps, "code": code_version()}
    cl = Cluster(ctx)
    ref = ctx.scratch.huge_dir("dcp-ref")
    store_dir = ctx.scratch.tmp
    n = itertools.count()
    try:
        a = cl.start("a", ["b"])
        b = cl.start("b", ["a"])
        for m in (a, b):
            cl.wait_live(m, 1)
        err.print(f"  {RANKS} ranks save {_size(size)} on hosts a, b (K=1); {LOADERS} ranks "
                  f"load it resharded on a new host c", style="dim")

        def ours() -> tuple[float, float]:
            i = next(n)
            step = f"step_{i}"
            ctx.scratch.warm(3 * size)  # a's and b's shards, their replicas
            t_save = save([a.path, a.path, b.path, b.path], step, numel,
                          store_dir / f"store-{i}")
            settle(a, b)  # replicated: a restart could read it from either host
            c = cl.start(f"c{i}", ["a", "b"], replicas=0)
            try:
                cl.wait_live(c, 2)
                ctx.scratch.warm(2 * size)
                t_load = load(c.path / step, numel)
                if status(c)["fetch"]["bytes_by_source"].keys() - {"a", "b"}:
                    raise BenchError(f"c read from {status(c)['fetch']['bytes_by_source']}")
            finally:
                cl.stop(f"c{i}")
            for p in sorted((a.path / step).iterdir()):
                p.unlink()
            (a.path / step).rmdir()
            settle(a, b)
            return t_save, t_load

        def theirs() -> tuple[float, float]:
            i = next(n)
            step = f"step_{i}"
            ctx.scratch.warm(2 * size)
            t_save = save([ref] * RANKS, step, numel, store_dir / f"store-{i}")
            ctx.scratch.warm(size)
            t_load = load(ref / step, numel)
            for p in (ref / step).iterdir():
                p.unlink()
            (ref / step).rmdir()
            return t_save, t_load

        xs, ys = ctx.alternate(ours, theirs, label="DCP seconds (save, resharded load)")
    finally:
        for name in list(cl.hosts):
            cl.stop(name)
    details["dcp"] = {"save_s": [x[0] for x in xs], "load_s": [x[1] for x in xs],
                      "ref_save_s": [y[0] for y in ys], "ref_load_s": [y[1] for y in ys]}
    save_details(DETAILS, details)
    what = _size(size)
    note = "reference: the same ranks on one huge-page tmpfs directory"
    return [
        Row("dcp", f"torch DCP save of {what}, {RANKS} ranks over 2 peered hosts (K=1)", "s",
            [x[0] for x in xs], ref=[y[0] for y in ys], higher_is_better=False,
            min_ratio=0.9, note=note),
        Row("dcp", f"resharded torch DCP load of it, {LOADERS} ranks on a third, empty host",
            "s", [x[1] for x in xs], ref=[y[1] for y in ys], higher_is_better=False,
            min_ratio=0.6, note=note),
    ]


if __name__ == "__main__":  # pragma: no cover - a quick look without bench/run.py
    os.execv(sys.executable, [sys.executable, str(BENCH_DIR / "run.py"), "--only", "dcp",
                              *sys.argv[1:]])
