"""The demo behind `mtcfs demo` / `make demo`.

Everything is real: the daemon runs as its own process with a FUSE mount,
the checkpoint is written by torch.save (or numpy when torch is absent) in
this process, and the state shown is read back from the mount itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from mtcfs.config import format_size

console = Console()


def _mtcfs(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mtcfs", *args], text=True,
                          capture_output=True, check=check)


def _make_checkpoint(nbytes: int) -> tuple[str, Any]:
    try:
        import torch
    except ImportError:
        import numpy as np

        rng = np.random.default_rng(0)
        n = nbytes // 4 // 8
        return "numpy", {f"layer{i}.weight": rng.standard_normal(n, dtype=np.float32)
                         for i in range(8)}
    torch.manual_seed(0)
    width = 1024
    layers = max(1, nbytes // (width * width * 4))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=True)
                                  for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return "torch", {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 100}


def _save(kind: str, ckpt: Any, path: str) -> None:
    if kind == "torch":
        import torch

        torch.save(ckpt, path)
    else:
        import numpy as np

        with open(path, "wb") as f:
            np.savez(f, **ckpt)


def _equal(kind: str, a: Any, path: str) -> bool:
    if kind == "torch":
        import torch

        b = torch.load(path, weights_only=True)
        return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    import numpy as np

    with np.load(path) as b:
        return all(np.array_equal(a[k], b[k]) for k in a)


def run_demo(nbytes: int, keep: bool) -> None:
    work = tempfile.mkdtemp(prefix="mtcfs-demo-")
    mnt = os.path.join(work, "ckpt")
    ram_dir = f"/dev/shm/mtcfs-demo-{os.getpid()}"
    os.makedirs(mnt)
    console.rule("[bold]mtcfs demo: a checkpoint saved at RAM speed")
    r = _mtcfs("mount", mnt, "--daemon", "--ram-dir", ram_dir, "--ram-size", "4GiB",
               "--node-id", "demo-node-0", check=False)
    if r.returncode != 0:
        console.print(f"[red]mount failed:[/red] {r.stderr.strip()}")
        sys.exit(1)
    console.print(f"mounted mtcfs at [bold]{mnt}[/bold] (RAM dir {ram_dir}, 4 GiB budget)")
    try:
        kind, ckpt = _make_checkpoint(nbytes)
        step_dir = os.path.join(mnt, "step_100")
        os.makedirs(step_dir)
        path = os.path.join(step_dir, "model.pt" if kind == "torch" else "model.npz")
        t0 = time.perf_counter()
        _save(kind, ckpt, path)
        save_s = time.perf_counter() - t0
        size = os.path.getsize(path)
        # The same save to plain tmpfs, for reference.
        ref = os.path.join("/dev/shm", f"mtcfs-demo-ref-{os.getpid()}")
        t0 = time.perf_counter()
        _save(kind, ckpt, ref)
        ref_s = time.perf_counter() - t0
        os.unlink(ref)
        t0 = time.perf_counter()
        ok = _equal(kind, ckpt, path)
        load_s = time.perf_counter() - t0
        state = json.loads(os.getxattr(path, "user.mtcfs.state"))

        t = Table(title=f"{kind} checkpoint {os.path.relpath(path, mnt)}")
        t.add_column("what")
        t.add_column("figure", justify="right")
        t.add_row("size", format_size(size))
        t.add_row(f"{kind}.save to mtcfs", f"{save_s:.2f} s  ({size / save_s / 2**20:.0f} MiB/s)")
        t.add_row(f"{kind}.save to raw tmpfs", f"{ref_s:.2f} s  ({size / ref_s / 2**20:.0f} MiB/s)")
        t.add_row("load and compare", f"{load_s:.2f} s, {'identical' if ok else 'DIFFERENT'}")
        console.print(t)
        console.print("user.mtcfs.state:", state)
        console.print(_mtcfs("status", mnt).stdout)
        if not ok:
            console.print("[red]the checkpoint read back differs from what was saved[/red]")
            sys.exit(1)
    finally:
        if keep:
            console.print(f"left mounted: {mnt} (unmount with: mtcfs umount {mnt})")
        else:
            r = _mtcfs("umount", mnt, check=False)
            if r.returncode != 0:
                console.print(f"[red]umount failed:[/red] {r.stderr.strip()}")
            shutil.rmtree(ram_dir, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)
            console.print("unmounted and cleaned up")
