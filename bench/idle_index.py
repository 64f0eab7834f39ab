"""What a daemon whose index is large costs at idle and while its job saves small
files: the periodic work that reads the whole index (the replicator's retry, the
withdrawal pass) grows with it, the rest does not.

Three daemons peered on loopback (`--replicas 1`, `--data-path fuse`, no bucket).
The first one's metadata store is built before it starts with ENTRIES files (the
index bench/scale.py's joiner pulls: 10 steps of 8 files per host, as a long job's
index holds), as a daemon restarting over its RAM dir finds it; the other two
start empty. (They do not take those entries: the simulation's ids are not ids a
daemon accepts, and the security checks drop them, so only the first daemon holds
the large index.) Then each daemon's CPU (utime + stime, % of a core) over 60 s of
idle, and over 60 s with a save on every host every 10 s (bench/idle.py's save).

    .venv/bin/python bench/idle_index.py [--entries 80010]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import idle
import scale
from common import Mount, Scratch
from peers import free_ports


def seed_store(ram: Path, entries: int) -> None:
    """ENTRIES files in `ram`/meta.db, as the daemon will open it."""
    src = scale._build_source(entries, str(ram))  # its store in ram/snap-source
    src.close()
    for suffix in ("", "-wal", "-shm"):
        f = ram / "snap-source" / f"meta.db{suffix}"
        if f.exists():
            os.rename(f, ram / f"meta.db{suffix}")


def run(entries: int, seconds: float) -> dict:
    scratch = Scratch()
    mounts: list[Mount] = []
    try:
        token = scratch.tmp / "token"
        token.write_text(secrets.token_hex(32) + "\n")
        token.chmod(0o600)
        ports = free_ports(6)
        addrs = [f"127.0.0.1:{p}" for p in ports[:3]]
        # The large index on the host with the largest node id: the withdrawal pass's
        # acting host (the smallest) is one of the others.
        for i, node in enumerate(("z9", "n1", "n2")):
            ram = scratch.shm / f"ram-{node}"
            if i == 0:
                seed_store(ram, entries)
            args = ["--node-id", node, "--listen", addrs[i],
                    "--data-listen", f"127.0.0.1:{ports[3 + i]}",
                    "--peers", ",".join(a for a in addrs if a != addrs[i]),
                    "--token-file", str(token), "--replicas", "1",
                    "--log-level", "warning", "--data-path", "fuse"]
            m = Mount(scratch.tmp / f"mnt-{node}", ram, "256MiB", args)
            scratch.mounts.append(m)
            mounts.append(m)
        mounts[0].start()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda m: m.start(), mounts[1:]))
        deadline = time.monotonic() + 60
        while not all(idle.alive_peers(m) >= 2 for m in mounts):
            if time.monotonic() > deadline:
                raise TimeoutError("the daemons did not all see each other in time")
            time.sleep(0.5)
        time.sleep(idle.SETTLE)
        files = [m.status()["files"] for m in mounts]
        pct = idle.cpu_pct(mounts, seconds)
        saving, steps = idle.save_steps(mounts, seconds, 10.0)
        return {"entries": entries, "files": files, "idle_cpu_pct": pct,
                "save_cpu_pct": saving, "saves": steps}
    finally:
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(scratch.unmount, mounts))
        scratch.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/idle_index.py", description=__doc__.split("\n")[0])
    p.add_argument("--entries", type=int, default=80_010, help="files in the large index")
    p.add_argument("--seconds", type=float, default=60.0, help="each window [60]")
    args = p.parse_args(argv)
    r = run(args.entries, args.seconds)
    print(f"{r['files'][0]} files in the first daemon's index: idle "
          f"{r['idle_cpu_pct'][0]:.2f} % of a core (the others {r['idle_cpu_pct'][1]:.2f}, "
          f"{r['idle_cpu_pct'][2]:.2f}); saving every 10 s {r['save_cpu_pct'][0]:.2f} % "
          f"({r['save_cpu_pct'][1]:.2f}, {r['save_cpu_pct'][2]:.2f})", file=sys.stderr)
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
