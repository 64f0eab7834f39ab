"""`make bench`: mtcfs side by side with its references, in one run.

    .venv/bin/python bench/run.py [--reps N] [--size SIZE] [--only NAME[,NAME]] [--json]
                                  [--steps N] [--step-interval SECONDS]   (lifecycle group)
                                  [--hosts N[,N]]                      (scale, idle groups)

Each figure is printed beside its reference measured in the same run, with
the ratio and its target (docs/benchmarks.md); the results are also
written to bench/results/latest.json. Needs root (FUSE mounts, drop_caches).
The scale group (bench/scale.py, simulated hosts: no FUSE) also prints its
figures as the last line: one JSON list, one object per --hosts value.

To add a benchmark group: write `def group(ctx: Context) -> list[Row]` in a
module of bench/ and register it in GROUPS below.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import bulk
import commit
import datapath
import dcp
import durable
import fsync
import idle
import k8s
import lifecycle
import netns_restore
import peers
import ramtier
import restore_fanout
import scale
from common import (
    BENCH_DIR,
    BenchError,
    Context,
    GiB,
    IoTool,
    MiB,
    Row,
    Scratch,
    err,
    facts_table,
    machine_facts,
    results_table,
    section,
)
from rich.console import Console

import csi  # bench/csi.py; ruff files it as first-party because of the top-level csi/ dir
from mtcfs.config import ConfigError, format_size, parse_size

Group = Callable[[Context], list[Row]]

# name -> (function, what it measures); run in this order.
GROUPS: dict[str, tuple[Group, str]] = {
    "write": (ramtier.seq_write, "sequential write, 1 MiB / 4 KiB / 64 KiB writes vs tmpfs"),
    "read": (ramtier.seq_read, "sequential read, cold page cache, vs tmpfs"),
    "create": (ramtier.create_files, "2,000 files of 64 KiB in 20 directories vs tmpfs"),
    "meta": (ramtier.metadata_cost, "1 file vs 1,024 files of the same bytes, vs tmpfs"),
    "rss": (ramtier.daemon_rss, "daemon peak RSS while writing 4 x --size"),
    "datapath": (
        datapath.group,
        "FUSE passthrough: mtcfs --data-path passthrough and fuse, libfuse's passthrough_hp, "
        "raw tmpfs; writes, cold/warm reads, 2,000 files, seal time",
    ),
    "durable": (
        durable.group,
        "GCS tier on a local fake-gcs-server: upload, read-through, writes during an "
        "upload, vs rclone mount",
    ),
    "peers": (
        peers.group,
        "peer tier on loopback: replication and restore vs a raw gRPC stream, writes during "
        "replication, lookups, the replicated index with 8-64 nodes",
    ),
    "bulk": (
        bulk.group,
        "the bulk data channel: replication push, close->replica, restore from 1 holder and "
        "striped over 2, vs a raw sendfile() stream between two Python processes",
    ),
    "dcp": (
        dcp.group,
        "torch DCP: a save of 4 ranks over 2 peered hosts and a resharded load on a third, "
        "empty host, vs the same ranks on one huge-page tmpfs directory",
    ),
    "replace": (
        bulk.replacement,
        "a replacement host (same node id, empty RAM dir) restores a step of 4 x --size "
        "from its holder in the background, vs a raw sendfile() stream",
    ),
    "budget": (
        bulk.budget,
        "the data channel's CPU per GiB, step by step (read, AES-GMAC, AES-GCM, crc32c, "
        "write into a huge-page tmpfs), in-process on 4 MiB buffers",
    ),
    "netns": (
        netns_restore.group,
        "restores in network namespaces onto an empty host from 1, 2 and 3 holders, over "
        "veth links as they are and shaped to 1 Gbit/s per holder (tc tbf), vs a raw "
        "sendfile() stream over the same link; CPU s/GiB on each side",
    ),
    "restore-fanout": (
        restore_fanout.group,
        "whole-job restore: 8 empty hosts read the same persisted file at once from "
        "fake-gcs-server; bytes from the bucket and time until all have it, vs 8 "
        "google-cloud-storage downloads at once",
    ),
    "lifecycle": (
        lifecycle.group,
        "training loop: --steps checkpoint steps of --size on 2 peered hosts (3 x --size RAM, "
        "K=1, --persist step, --keep-steps) over fake-gcs-server, vs tmpfs and "
        "google-cloud-storage",
    ),
    "commit": (
        commit.group,
        "the commit rule's cost per call: fsync, directory fsync and a marker rename on 2 "
        "peered hosts vs 1 host vs tmpfs",
    ),
    "fsync": (
        fsync.group,
        "cost of each --fsync level (local, replicas, gcs) on 2 peered hosts over "
        "fake-gcs-server (--persist manual): 1 big file, 100 small files, a DCP-like step, "
        "vs tmpfs",
    ),
    "csi": (
        csi.group,
        "CSI node plugin: NodePublishVolume to a usable target vs mount --bind, node-daemon "
        "restart to re-bound targets",
    ),
    "k8s": (
        k8s.group,
        "CheckpointConfiguration controller against an in-memory API server: reconcile time "
        "of a CPC change",
    ),
    "scale": (
        scale.group,
        "membership and index dissemination on --hosts simulated hosts (the real SWIM and "
        "tree code, virtual time): convergence, commit, detection, join, CPU and bytes per "
        "host; the last line printed is the figures as JSON",
    ),
    "idle": (
        idle.group,
        "real daemons peered on loopback doing nothing: CPU per daemon (utime+stime) over "
        "60 s beside the 0.3 % goal, for --hosts daemons [4,16]; at the largest, 5 killed "
        "at once: time until every survivor has them dead",
    ),
}

RESULTS = BENCH_DIR / "results" / "latest.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/run.py",
        description="mtcfs benchmarks, each figure beside its reference from the same run.",
        epilog="groups: " + "; ".join(f"{n}: {d}" for n, (_, d) in GROUPS.items()),
    )
    p.add_argument("--reps", type=int, default=5, help="repetitions per figure [5]")
    p.add_argument("--size", default="1GiB", help="bytes per sequential test [1GiB]")
    p.add_argument(
        "--steps", type=int, default=20, help="lifecycle: checkpoint steps of --size each [20]"
    )
    p.add_argument(
        "--step-interval",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="lifecycle: seconds between steps [0: from the measured GCS upload speed]",
    )
    p.add_argument(
        "--hosts",
        type=scale.parse_hosts,
        default=scale.parse_hosts("100,300,1000"),
        metavar="N[,N]",
        help="scale: simulated hosts, a comma list [100,300,1000]; idle: real daemons [4,16]",
    )
    p.add_argument("--only", metavar="NAME[,NAME]", help="run only these groups")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be at least 1")
    if args.steps < 2:
        p.error("--steps must be at least 2")
    if args.step_interval < 0:
        p.error("--step-interval must not be negative")
    try:
        args.size = parse_size(args.size)
    except ConfigError as e:
        p.error(str(e))
    if args.size < 4 * MiB or args.size % MiB:
        p.error("--size must be a multiple of 1 MiB, at least 4 MiB")
    names = list(GROUPS)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in GROUPS]
        if unknown or not names:
            p.error(
                f"unknown group {', '.join(unknown) or '(none)'}; choose from {', '.join(GROUPS)}"
            )
    args.groups = [n for n in GROUPS if n in names]
    return args


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        err.print("bench: error: run as root (FUSE mounts, /proc/sys/vm/drop_caches)")
        return 2
    # Also SIGINT: a shell that starts us in the background may have ignored it.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)

    facts = machine_facts()
    facts.update(reps=args.reps, size=format_size(args.size), groups=",".join(args.groups))
    err.print(facts_table(facts))
    started = time.monotonic()
    rows: list[Row] = []
    last_line: list[object] = []
    code = 0
    scratch = Scratch()
    try:
        held = scratch.keep_freed_memory()
        if held:
            err.print(f"  {held} (see docs/benchmarks.md, Method)", style="dim")
        ctx = Context(
            args.reps,
            args.size,
            scratch,
            IoTool(scratch.tmp),
            ram_size=f"{max(8, 3 * args.size // GiB)}GiB",
            steps=args.steps,
            step_interval=args.step_interval,
            hosts=args.hosts,
        )
        try:
            for name in args.groups:
                with section(f"{name}: {GROUPS[name][1]}"):
                    rows += GROUPS[name][0](ctx)
            last_line = ctx.last_line
        finally:
            ctx.close()
    except KeyboardInterrupt:
        err.print("[red]bench: interrupted: cleaning up[/]")
        code = 130
    except BenchError as e:
        err.print(f"[red]bench: error: {e}[/]")
        code = 1
    except Exception:
        err.print_exception()
        code = 1
    finally:
        # A second Ctrl-C must not leave mounts behind.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        scratch.close()

    facts["duration_s"] = round(time.monotonic() - started, 1)
    facts["loadavg_end"] = os.getloadavg()[0]
    result: dict[str, Any] = {
        "complete": code == 0,
        "machine": facts,
        "rows": [r.to_json() for r in rows],
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
    elif rows:
        out = Console(highlight=False, width=None if sys.stdout.isatty() else 140)
        out.print(facts_table(facts))
        out.print(
            results_table(
                rows,
                f"mtcfs vs references, median of {args.reps} reps "
                f"(ratio: mtcfs performance / reference)",
            )
        )
        err.print(f"results: {RESULTS}")
    if last_line:
        # The scale group's figures: one JSON list, one object per --hosts value.
        print(json.dumps(last_line))
    return code


if __name__ == "__main__":
    sys.exit(main())
