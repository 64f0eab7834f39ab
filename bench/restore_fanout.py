"""A whole-job restore: 8 empty hosts read the same persisted file at once.

One fake-gcs-server (filesystem backend in /dev/shm, as in the durable group)
holds one object of --size, uploaded the way mtcfs uploads (with its chunk
crc32cs in the metadata). Per rep:

- mtcfs: 8 fresh hosts (empty RAM dirs, peered with each other, --bucket on the
  server) are started (untimed); then the 8 read the file at once with the C
  reader (1 MiB reads), from the moment the 8 readers start to the moment the
  last one has the whole file. The bucket's bytes are what the 8 daemons report
  reading from the durable tier (`mtcfs status --json`: the read-through's
  `durable_bytes`), in copies of the file.
- reference: 8 processes with google-cloud-storage (started and imported
  first, untimed) each Blob.download_to_filename the object into /dev/shm at
  once; from their release to the last one's end. Each downloads the whole
  object: 8 copies from the bucket.

Target: the bucket serves at most 2 copies between the 8 mtcfs hosts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import (
    BENCH_DIR,
    BenchError,
    Context,
    MiB,
    Mount,
    Row,
    code_version,
    drop_caches,
    err,
    save_details,
)
from durable import BUCKET, Gcs
from peers import Cluster, status
from ramtier import _size

from mtcfs.tiers.durable import (
    CHUNK_META_KEY,
    chunk_crcs_of_fd,
    crc_of_chunks,
    encode_chunk_meta,
    open_durable,
)

DETAILS = BENCH_DIR / "results" / "restore_fanout.json"
HOSTS = 8
PREFIX = "fanout"
KEY = "step-1/model.pt"

# One google-cloud-storage download in a process of its own, released by a line on stdin.
DOWNLOAD = """
import sys, time
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
url, bucket, key, dest = sys.argv[1:5]
client = storage.Client(project="mtcfs-bench", credentials=AnonymousCredentials(),
                        client_options={"api_endpoint": url})
blob = client.bucket(bucket).blob(key)
print("ready", flush=True)
sys.stdin.readline()
blob.download_to_filename(dest)
print("done", flush=True)
"""


def upload(gcs: Gcs, src: Path, size: int) -> None:
    """The object as mtcfs's uploader writes it (chunk crc32cs in its metadata)."""
    with open(src, "wb") as f:
        for off in range(0, size, 64 * MiB):
            f.write(os.urandom(min(64 * MiB, size - off)))
    tier = open_durable(f"gs://{BUCKET}/{PREFIX}", gcs.url, retry_deadline=60)
    try:
        fd = os.open(src, os.O_RDONLY)
        try:
            chunk, crcs = chunk_crcs_of_fd(fd, size)
        finally:
            os.close(fd)
        tier.put_file(KEY, str(src), crc_of_chunks(chunk, crcs, size),
                      metadata={CHUNK_META_KEY: encode_chunk_meta(chunk, crcs)})
    finally:
        tier.close()
        src.unlink()


def start_hosts(ctx: Context, gcs: Gcs) -> tuple[Cluster, list[Mount]]:
    cl = Cluster(ctx)
    names = [f"h{i}" for i in range(HOSTS)]
    for n in names:
        cl.port(n)
    # The data channel on any free port (the default, the peer port + 1, may be another
    # host's peer port).
    extra = ["--bucket", f"gs://{BUCKET}/{PREFIX}", "--gcs-endpoint", gcs.url,
             "--data-listen", "127.0.0.1:0"]

    with ThreadPoolExecutor(HOSTS) as pool:  # at once: each waits for its peers at start
        mounts = list(pool.map(lambda n: cl.start(n, [p for p in names if p != n],
                                                  extra=extra), names))
    deadline = time.monotonic() + 60
    for m in mounts:
        while not all(p["alive"] and p["data_port"] for p in status(m)["peers"]["peers"]):
            if time.monotonic() > deadline:
                raise BenchError(f"{m.path}: its peers' data channels not known after 60 s")
            time.sleep(0.05)
    return cl, mounts


def group(ctx: Context) -> list[Row]:
    size = ctx.size
    details: dict[str, Any] = {"size": size, "hosts": HOSTS, "reps": ctx.reps,
                               "code": code_version()}
    gcs = Gcs(ctx.scratch.shm_dir("fanout-gcs"))
    ctx.scratch.defer(gcs.close)
    ref = ctx.ref_dir()
    copies: list[float] = []
    by_host: list[list[int]] = []
    restores: list[list[dict[str, Any]]] = []
    try:
        upload(gcs, ref / "fanout-src", size)
        err.print(f"  {HOSTS} hosts per rep, fresh; the object: gs://{BUCKET}/{PREFIX}/{KEY}",
                  style="dim")

        def ours() -> float:
            cl, mounts = start_hosts(ctx, gcs)
            try:
                drop_caches()
                ends: list[float] = []
                got: list[int] = []
                lock = threading.Lock()

                def read(m: Mount) -> None:
                    _, n = ctx.io.read(m.path / KEY, MiB)
                    with lock:
                        got.append(n)
                        ends.append(time.monotonic())

                threads = [threading.Thread(target=read, args=(m,)) for m in mounts]
                t0 = time.monotonic()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                if got != [size] * HOSTS:
                    raise BenchError(f"the hosts read {got} bytes, expected {size} each")
                took = max(ends) - t0
                from_bucket = [m.durable()["readthrough"]["durable_bytes"] for m in mounts]
                by_host.append(from_bucket)
                restores.append([{k: v for k, v in status(m)["peers"].items()
                                  if k.startswith("restore")} for m in mounts])
                copies.append(sum(from_bucket) / size)
            finally:
                for name in list(cl.hosts):
                    cl.stop(name)
            return took

        def theirs() -> float:
            drop_caches()
            procs = [subprocess.Popen([sys.executable, "-c", DOWNLOAD, gcs.url, BUCKET,
                                       f"{PREFIX}/{KEY}", str(ref / f"gcs-{i}")],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                     for i in range(HOSTS)]
            try:
                for p in procs:
                    assert p.stdout is not None
                    if p.stdout.readline().strip() != "ready":
                        raise BenchError("a google-cloud-storage download did not start")
                t0 = time.monotonic()
                for p in procs:
                    assert p.stdin is not None
                    p.stdin.write("go\n")
                    p.stdin.flush()
                for p in procs:
                    assert p.stdout is not None
                    if p.stdout.readline().strip() != "done":
                        raise BenchError("a google-cloud-storage download failed")
                took = time.monotonic() - t0
                for i in range(HOSTS):
                    if (ref / f"gcs-{i}").stat().st_size != size:
                        raise BenchError("a google-cloud-storage download is short")
            finally:
                for p in procs:
                    p.wait(timeout=600)
                for i in range(HOSTS):
                    (ref / f"gcs-{i}").unlink(missing_ok=True)
            return took

        xs, ys = ctx.alternate(ours, theirs, label=f"{HOSTS} hosts, time until all have it (s)",
                               warmup=False)
    finally:
        gcs.close()
    details["restore_fanout"] = {"all_have_it_s": xs, "gcs_python_8_downloads_s": ys,
                                 "bucket_copies": copies, "bucket_bytes_by_host": by_host,
                                 "restore_stats_by_host": restores}
    save_details(DETAILS, details)
    what = _size(size)
    note = (f"{HOSTS} fresh hosts read the same persisted file at once (C reader, 1 MiB "
            f"reads); reference: {HOSTS} google-cloud-storage processes, "
            "Blob.download_to_filename into /dev/shm, at once")
    return [
        Row("restore-fanout", f"bucket egress: {HOSTS} hosts read one {what} file at once",
            "copies", copies, [float(HOSTS)] * len(copies), ref_label="gcs-python",
            higher_is_better=False, max_value=2.0,
            note="mtcfs: bytes the daemons read from the durable tier (status: "
                 "durable_bytes), over the file's size; reference: 8 whole downloads"),
        Row("restore-fanout", f"time until all {HOSTS} hosts have the {what} file", "s",
            xs, ys, ref_label="gcs-python", higher_is_better=False, note=note),
    ]


if __name__ == "__main__":  # pragma: no cover - a quick look without bench/run.py
    os.execv(sys.executable, [sys.executable, str(BENCH_DIR / "run.py"), "--only",
                              "restore-fanout", *sys.argv[1:]])
