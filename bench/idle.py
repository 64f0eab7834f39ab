"""What a real daemon costs while nothing happens: N mtcfs daemons peered on
loopback (each its own RAM dir and mount, --replicas 1, no bucket), no file
written, and the CPU each spends over a window after start-up.

A daemon's CPU is utime + stime from /proc/PID/stat (all its threads), read at
the start and end of the window: the figure is CPU time, not wall-clock work,
so it holds on a machine other work loads (the daemons get the CPU they ask
for, later). Goal: <= 0.3 % of a core per daemon.

Then, with --save-every S (standalone) or in the group at the largest N, a save
on every host every S seconds over a window of the same length: each host's
trainer makes the step's directory (every host makes the same one, as torch
DCP ranks do) and writes SAVE_FILES files of SAVE_BYTES into it through the
mount; each daemon seals them, publishes them to the job's index and pushes a
replica to a peer (--replicas 1). The cost of saving small files is each
daemon's CPU beyond its idle rate from the first save until the job has taken
in the last (the daemons' CPU back near idle, DRAIN_MOST at most), per save;
the figure is that cost at a save every S seconds plus the idle rate (goal:
<= 2 % of a core beyond the bytes moved, which at these sizes cost under
0.01 % here); the trainers' own CPU is not in it. (CPU over the window alone
would read the machine's limit, not the daemons' cost, once 64 daemons on 2
cores saturate it: work then spills past the window.)

With --kill K (standalone) or in the group at the largest N: K daemons are
killed at once (SIGKILL), and the time until every survivor's status shows
all of them dead is the detection time (SWIM's bound: 10 s); the survivors'
CPU over that time is the catch-up cost.

    .venv/bin/python bench/idle.py --hosts 4,16 [--seconds 60] [--save-every 10] [--kill 5]
    .venv/bin/python bench/run.py --only idle [--hosts 4,16]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import (
    Context,
    Mount,
    Row,
    Scratch,
    cpu_seconds,
    median,
    proc_field,
)
from peers import free_ports

from mtcfs import control

GOAL = 0.3  # % of a core per idle daemon
SAVE_GOAL = 2.0  # % of a core per daemon while its trainer saves small files
SAVE_FILES, SAVE_BYTES = 8, 64 << 10  # a step's files per host, and each one's size
DETECT_GOAL = 10.0  # s until every survivor has every killed host dead
SETTLE = 5.0  # s after every mount is live before the window opens
RAM_SIZE = "64MiB"
DRAIN_MOST = 60.0  # s after the window, at most, for the job to take in the last save


def start_cluster(scratch: Scratch, n: int, tag: str, peer_group: int = 0) -> list[Mount]:
    """n peered daemons on loopback, started at the same time; returns once all are
    live and every one sees the n - 1 others alive."""
    token = scratch.tmp / f"token-{tag}"
    token.write_text(secrets.token_hex(32) + "\n")
    token.chmod(0o600)
    # Data ports chosen here too: one the kernel picked for a daemon started first
    # could be another's gRPC port.
    ports = free_ports(2 * n)
    addrs = [f"127.0.0.1:{p}" for p in ports[:n]]
    mounts = []
    for i, addr in enumerate(addrs):
        peers = ",".join(a for a in addrs if a != addr)
        args = ["--node-id", f"{tag}-{i}", "--listen", addr,
                "--data-listen", f"127.0.0.1:{ports[n + i]}",
                "--token-file", str(token), "--replicas", "1", "--log-level", "warning",
                "--peer-group", str(peer_group)]
        if peers:
            args += ["--peers", peers]
        ram = scratch.shm / f"ram-{tag}-{i}"
        m = Mount(scratch.tmp / f"mnt-{tag}-{i}", ram, RAM_SIZE, args)
        scratch.mounts.append(m)
        mounts.append(m)
    with ThreadPoolExecutor(min(n, 16)) as pool:
        list(pool.map(lambda m: m.start(), mounts))
    deadline = time.monotonic() + 60 + n
    while not all(alive_peers(m) >= n - 1 for m in mounts):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n} daemons did not all see each other in time")
        time.sleep(0.5)
    return mounts


def _arg(m: Mount, flag: str) -> str:
    return m.args[m.args.index(flag) + 1]


def _status(m: Mount) -> dict:
    try:
        return control.request(str(m.path), "status")["status"]
    except control.ControlError as e:
        # A daemon gone in the middle of a run: say why, from its log (removed with
        # its RAM dir at the end).
        log = m.ram_dir / "mtcfs.log"
        tail = log.read_text(errors="replace").splitlines()[-40:] if log.exists() else []
        raise RuntimeError(f"{e}; its log ends:\n" + "\n".join(tail)) from None


def alive_peers(m: Mount) -> int:
    return sum(1 for p in _status(m)["peers"]["peers"] if p.get("alive"))


def dead_seen(m: Mount, node_ids: set[str]) -> bool:
    peers = {p["node_id"]: p for p in _status(m)["peers"]["peers"]}
    return all(nid in peers and not peers[nid].get("alive") for nid in node_ids)


def cpu_pct(mounts: list[Mount], seconds: float) -> list[float]:
    """Each daemon's CPU over `seconds`, in % of a core."""
    pids = [m.pid for m in mounts]
    before = [cpu_seconds(p) for p in pids]
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    return [100 * (cpu_seconds(p) - b) / wall for p, b in zip(pids, before, strict=True)]


def save_steps(mounts: list[Mount], seconds: float, every: float,
               idle_pct: list[float]) -> tuple[list[float], int, float, float]:
    """A step saved on every host at once every `every` seconds for `seconds`. Returns
    each daemon's CPU per save beyond its idle rate (`idle_pct`), in ms, counted
    until the daemons' CPU is back near idle after the window (the last save taken
    in everywhere); the steps saved; the seconds that took past the window; and the
    share of the machine's cores the daemons used over the window."""
    pids = [m.pid for m in mounts]
    before = [cpu_seconds(p) for p in pids]
    payload = os.urandom(SAVE_BYTES)

    def save(m: Mount, step: int) -> None:
        d = m.path / f"step_{step}"
        d.mkdir(exist_ok=True)
        host = _arg(m, "--node-id")
        for k in range(SAVE_FILES):
            (d / f"{host}-{k}.distcp").write_bytes(payload)

    t0 = time.monotonic()
    steps = 0
    with ThreadPoolExecutor(min(len(mounts), 16)) as pool:
        while steps * every < seconds:
            time.sleep(max(0.0, t0 + steps * every - time.monotonic()))
            list(pool.map(save, mounts, [steps] * len(mounts)))
            steps += 1
    time.sleep(max(0.0, t0 + seconds - time.monotonic()))
    window = time.monotonic() - t0
    busy = sum(cpu_seconds(p) - b for p, b in zip(pids, before, strict=True)) / window / (
        os.cpu_count() or 1)
    # Until the daemons' CPU over the last 2 s is back near their idle rate.
    idle_rate = sum(idle_pct) / 100
    samples = [(time.monotonic(), sum(cpu_seconds(p) for p in pids))]
    while time.monotonic() - t0 - window < DRAIN_MOST:
        time.sleep(0.5)
        samples.append((time.monotonic(), sum(cpu_seconds(p) for p in pids)))
        old = [x for x in samples if x[0] <= samples[-1][0] - 2.0]
        if old and (samples[-1][1] - old[-1][1]) / (samples[-1][0] - old[-1][0]) \
                <= 1.5 * idle_rate + 0.02:
            break
    wall = time.monotonic() - t0
    cost = [1000 * (cpu_seconds(p) - b - i / 100 * wall) / steps
            for p, b, i in zip(pids, before, idle_pct, strict=True)]
    return cost, steps, wall - window, busy


def kill_and_detect(mounts: list[Mount], k: int) -> tuple[float, list[float]]:
    """SIGKILL k daemons at once; seconds until every survivor shows them all dead,
    and the survivors' CPU (% of a core) over that time."""
    victims, survivors = mounts[-k:], mounts[:-k]
    ids = {_arg(m, "--node-id") for m in victims}
    before = [cpu_seconds(m.pid) for m in survivors]
    t0 = time.monotonic()
    for m in victims:
        os.kill(m.pid, signal.SIGKILL)
    left = list(survivors)
    while left:
        left = [m for m in left if not dead_seen(m, ids)]
        if time.monotonic() - t0 > 60:
            raise TimeoutError(f"{len(left)} survivors still miss a death after 60 s")
        time.sleep(0.1)
    took = time.monotonic() - t0
    cpu = [100 * (cpu_seconds(m.pid) - b) / took for m, b in zip(survivors, before, strict=True)]
    return took, cpu


def rss_mib(mounts: list[Mount]) -> float:
    return median([proc_field(m.pid, "status", "VmRSS") / (1 << 20) for m in mounts])


def leaders(mounts: list[Mount]) -> list[int]:
    """Indexes of the daemons that another daemon names as its group's leader at the
    time of asking (peers.tree.leader: an address; the lead may turn, see
    --peer-group-turn). Without groups every daemon names itself: none."""
    at = {_arg(m, "--listen"): i for i, m in enumerate(mounts)}
    named = set()
    for m in mounts:
        lead = _status(m)["peers"]["tree"].get("leader", "")
        if lead != _arg(m, "--listen"):
            named.add(lead)
    return sorted(at[a] for a in named if a in at)


def measure(scratch: Scratch, n: int, seconds: float, kill: int = 0,
            save_every: float = 0.0, peer_group: int = 0) -> dict:
    mounts = start_cluster(scratch, n, f"n{n}", peer_group)
    try:
        time.sleep(SETTLE)
        pct = cpu_pct(mounts, seconds)
        out: dict = {"hosts": n, "seconds": seconds, "cpu_pct": pct,
                     "cpu_pct_median": median(pct), "cpu_pct_max": max(pct),
                     "rss_mib_median": rss_mib(mounts)}
        if save_every:
            cost, steps, drain, busy = save_steps(mounts, seconds, save_every, pct)
            # A daemon's CPU at a save every `save_every` seconds: its idle rate and
            # its cost per save.
            saving = [i + c / (10 * save_every) for i, c in zip(pct, cost, strict=True)]
            lead = leaders(mounts)
            if lead:
                out.update(leaders=len(lead),
                           save_cpu_pct_leaders=median([saving[i] for i in lead]),
                           save_cpu_pct_members=median([p for i, p in enumerate(saving)
                                                        if i not in lead]))
            out.update(save_every_s=save_every, saves=steps, save_cpu_pct=saving,
                       save_cpu_pct_median=median(saving), save_cpu_pct_max=max(saving),
                       # CPU per daemon per save, beyond its idle CPU
                       save_cpu_ms=median(cost), save_drain_s=drain,
                       save_machine_busy_pct=100 * busy)
        if kill and n > kill:
            took, cpu = kill_and_detect(mounts, kill)
            out.update(killed=kill, detect_s=took, catchup_cpu_pct_median=median(cpu))
        return out
    finally:
        with ThreadPoolExecutor(min(n, 16)) as pool:
            list(pool.map(scratch.unmount, mounts))


def group(ctx: Context) -> list[Row]:
    """bench/run.py's "idle" group: per-daemon CPU at idle for each --hosts value
    (default 4 and 16) beside the goal; detection after killing 5 at the largest."""
    hosts = ctx.hosts if ctx.hosts != [100, 300, 1000] else [4, 16]
    rows: list[Row] = []
    for n in hosts:
        largest = n == max(hosts)
        r = measure(ctx.scratch, n, 60.0, kill=5 if largest and n > 5 else 0,
                    save_every=10.0 if largest else 0.0)
        ctx.last_line.append(r)
        rows.append(Row("idle", f"{n} daemons: CPU per idle daemon", "% core",
                        r["cpu_pct"], higher_is_better=False, max_value=GOAL,
                        note=f"60 s, utime+stime; max {r['cpu_pct_max']:.2f} %, "
                             f"RSS {r['rss_mib_median']:.0f} MiB"))
        if "saves" in r:
            rows.append(Row("idle", f"{n} daemons: CPU per daemon, a save every 10 s", "% core",
                            r["save_cpu_pct"], higher_is_better=False, max_value=SAVE_GOAL,
                            note=f"{SAVE_FILES} files of {SAVE_BYTES >> 10} KiB per host "
                                 f"per save, {r['saves']} saves; {r['save_cpu_ms']:.0f} "
                                 f"CPU-ms per daemon per save beyond idle, counted until "
                                 f"the last was taken in ({r['save_drain_s']:.1f} s after "
                                 f"the window; the machine's cores "
                                 f"{r['save_machine_busy_pct']:.0f} % busy)"))
        if "detect_s" in r:
            rows.append(Row("idle", f"{n} daemons: 5 killed at once, all dead everywhere",
                            "s", [r["detect_s"]], higher_is_better=False,
                            max_value=DETECT_GOAL,
                            note=f"survivors' CPU meanwhile {r['catchup_cpu_pct_median']:.2f} %"))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/idle.py", description=__doc__.split("\n")[0])
    p.add_argument("--hosts", default="4,16", help="daemons per run, e.g. 4,16,64 [4,16]")
    p.add_argument("--seconds", type=float, default=60.0, help="idle window [60]")
    p.add_argument("--save-every", type=float, default=0.0,
                   help="then a save on every host every this many seconds [0: none]")
    p.add_argument("--kill", type=int, default=0, help="then kill this many at once [0]")
    p.add_argument("--peer-group", type=int, default=0,
                   help="the daemons' --peer-group (hosts per dissemination group) [0: auto]")
    args = p.parse_args(argv)
    scratch = Scratch()
    try:
        for n in (int(h) for h in args.hosts.split(",")):
            r = measure(scratch, n, args.seconds, args.kill, args.save_every,
                        args.peer_group)
            line = (f"{n} daemons: {r['cpu_pct_median']:.3f} % of a core per idle daemon "
                    f"(max {r['cpu_pct_max']:.3f}; goal <= {GOAL} %), "
                    f"RSS {r['rss_mib_median']:.0f} MiB")
            if "saves" in r:
                line += (f"; saving every {r['save_every_s']:g} s: "
                         f"{r['save_cpu_pct_median']:.3f} % (max {r['save_cpu_pct_max']:.3f}; "
                         f"goal <= {SAVE_GOAL} %), {r['save_cpu_ms']:.0f} CPU-ms per save "
                         f"(taken in {r['save_drain_s']:.1f} s after the window; cores "
                         f"{r['save_machine_busy_pct']:.0f} % busy meanwhile)")
            if "leaders" in r:
                line += (f"; the {r['leaders']} leading at the end "
                         f"{r['save_cpu_pct_leaders']:.3f} %, "
                         f"the others {r['save_cpu_pct_members']:.3f} % (medians)")
            if "detect_s" in r:
                line += (f"; {r['killed']} killed: all dead everywhere in {r['detect_s']:.2f} s "
                         f"(survivors {r['catchup_cpu_pct_median']:.2f} % meanwhile)")
            print(line, flush=True)
            print(json.dumps(r), flush=True)
    finally:
        scratch.close()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
