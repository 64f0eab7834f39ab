"""The trainer of bench/lifecycle.py, a process of its own:

    python bench/lifecycle_trainer.py ROOT STEPS STEP_SIZE INTERVAL KEEP

Saves STEPS checkpoint steps of STEP_SIZE bytes under ROOT, torch DCP style:
`step_<n>/` with 4 shard files `__<i>_0.distcp` (1 MiB writes, fsync, close),
then `.metadata.tmp` written, fsynced and renamed to `.metadata`. Step n starts
at t0 + n x INTERVAL, or at once if the previous save overran its slot. Prints
{"ready": true}, waits for a line on stdin, then prints one JSON line per step:
its times (time.monotonic(), comparable across processes), each file's size,
crc32c (computed while writing) and close time, and any OSError. KEEP > 0:
delete step n-KEEP after step n is committed (for the tmpfs reference).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import time
from pathlib import Path

import google_crc32c

MiB = 1 << 20
SHARDS = 4
MARKER = ".metadata"


def trainer(root: Path, steps: int, step_size: int, interval: float, keep: int) -> int:
    """Save `steps` steps of `step_size` bytes under `root`, one JSON line per
    step on stdout. keep > 0: delete step n-keep after step n is committed (the
    tmpfs reference has no eviction of its own)."""
    shard = step_size // SHARDS
    pool = os.urandom(64 * MiB)
    blocks = len(pool) // MiB
    pview = memoryview(pool)
    out = sys.stdout
    print(json.dumps({"ready": True}), file=out, flush=True)
    sys.stdin.readline()  # the bench says go once its poller runs
    t0 = time.monotonic()
    for n in range(steps):
        due = t0 + n * interval
        now = time.monotonic()
        if due > now:
            time.sleep(due - now)
        d = root / f"step_{n}"
        rec: dict = {"step": n, "due": due, "start": time.monotonic(), "files": [], "errors": []}
        try:
            os.mkdir(d)
            for s in range(SHARDS):
                rel = f"step_{n}/__{s}_0.distcp"
                fd = os.open(root / rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                crc = 0
                opened = time.monotonic()
                try:
                    for i in range(shard // MiB):
                        off = ((n * 7919 + s * 104729 + i * 31) % blocks) * MiB
                        # a 24-byte header (step, shard, block): no two blocks alike
                        buf = b"".join((struct.pack("<QQQ", n, s, i), pview[off + 24 : off + MiB]))
                        view = memoryview(buf)
                        done = 0
                        while done < MiB:
                            done += os.write(fd, view[done:])
                        crc = google_crc32c.extend(crc, buf)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                rec["files"].append(
                    {
                        "rel": rel,
                        "size": shard,
                        "crc": crc,
                        "opened": opened,
                        "closed": time.monotonic(),
                    }
                )
            meta = json.dumps({"step": n, "files": rec["files"]}).encode().ljust(4096, b" ")
            tmp, final = root / f"step_{n}/{MARKER}.tmp", root / f"step_{n}/{MARKER}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, meta)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
            rec["end"] = time.monotonic()
            rec["files"].append(
                {
                    "rel": f"step_{n}/{MARKER}",
                    "size": len(meta),
                    "crc": google_crc32c.value(meta),
                    "opened": rec["end"],
                    "closed": rec["end"],
                }
            )
        except OSError as e:
            rec["errors"].append({"errno": e.errno, "error": str(e), "at": time.monotonic()})
            rec["end"] = time.monotonic()
        if keep and n >= keep:
            shutil.rmtree(root / f"step_{n - keep}", ignore_errors=True)
        print(json.dumps(rec), file=out, flush=True)
    return 0


if __name__ == "__main__":
    r, st, sz, iv, kp = sys.argv[1:6]
    sys.exit(trainer(Path(r), int(st), int(sz), float(iv), int(kp)))
