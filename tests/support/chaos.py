"""The chaos suite: a training loop on three hosts with a bucket, under random faults.

    python tests/support/chaos.py --minutes 5 --seed 1 --fsync local     # or: make chaos
    python tests/support/chaos.py --help

Three hosts are network namespaces (tests/support/netns.py), each running a foreground
`python -m mtcfs mount` on its own address (--replicas 1, --persist step,
--keep-steps 2); a fake-gcs-server with the filesystem backend (objects survive
its restarts) runs in a fourth namespace. The FUSE mounts are in the runner's
mount namespace (nsenter switches the network namespace only).

The writer is a DCP-like training loop: per step, every host writes its shard
files straight under their final names into `step_<n>/` and fsyncs each; then
one host (rotating) writes `.metadata.tmp`, fsyncs it and renames it to
`.metadata`: the commit. A step counts as committed only once that rename
returned without an error. Every call on a mount runs in a subprocess
(tests/support/chaos_io.py) the runner waits for: a host whose daemon is dead gets
ENOTCONN (or finds its bare mountpoint) and retries, a frozen one blocks until
the daemon is resumed or killed.

Meanwhile a seeded schedule injects faults (at most --max-host-faults hosts at
a time, so the others stay up; one GCS fault at a time):

    kill_remount  kill -9 the daemon, detach its dead mount, mount again on the
                  same RAM dir after 1-5 s
    kill_replace  kill -9 the daemon (its process group: the host is lost), drop
                  its RAM dir, mount a replacement with an empty one (same node id)
    sigstop       SIGSTOP the daemon's process group for 2-8 s, then SIGCONT
    netcut        cut the host's link (link_down) for 3-10 s
    gcs_stop      SIGSTOP the GCS server for 3-15 s
    gcs_restart   kill -9 the GCS server, start it again after 1-5 s

A daemon that exits on its own is a crash: recorded, and mounted again. Then
everything is healed, the daemons are left to settle (every peer alive,
replication quiet, uploads idle, every committed step persisted or withdrawn),
and every committed step is read back through every host's mount and from the
bucket (google-cloud-storage against the fake server, from inside its
namespace) and compared byte for byte with what the writer wrote. The bucket is
also listed every few seconds during the run: a commit marker whose step is not
complete there is counted at once, not only at the end.

Each committed step is: verified (right bytes everywhere); withdrawn by mtcfs
(acceptable only with --fsync local, for a step one of whose files lost its
last copy: its writer was replaced); or it has lost files (missing or
unreadable somewhere) or corrupt ones (readable, wrong bytes: never
acceptable). The run prints a table and one JSON line (`CHAOS_RESULT {...}`),
keeps its logs (daemons, GCS server, events.jsonl, result.json) in the work
directory, and exits 1 when an invariant was broken.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import json
import os
import queue
import random
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import google_crc32c

from mtcfs.control import request_socket

if __package__ in (None, ""):  # run as a script (make chaos): tests/ holds `support`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support import chaos_io as cio  # noqa: E402
from support.gcs_server import fake_gcs_binary  # noqa: E402
from support.netns import Cluster, Host, netns_unavailable  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
IO = Path(__file__).with_name("chaos_io.py")
PORT = 7000
GCS_PORT = 4443
BUCKET = "chaos"
PREFIX = "run"
# A host back from a cut has its queued changes out within this (its peers see it alive
# again, then its outbox drains): replaced sooner, they may never have left it.
UNSENT_GRACE = 10.0
KINDS = ("kill_remount", "kill_replace", "sigstop", "netcut", "gcs_stop", "gcs_restart")
HOST_KINDS = KINDS[:4]
# Seconds (low, high) each fault lasts.
DURATIONS = {"kill_remount": (1.0, 5.0), "kill_replace": (1.0, 5.0), "sigstop": (2.0, 8.0),
             "netcut": (3.0, 10.0), "gcs_stop": (3.0, 15.0), "gcs_restart": (1.0, 5.0)}
DEFAULT_WEIGHTS = {"kill_remount": 2, "kill_replace": 1, "sigstop": 2, "netcut": 2,
                   "gcs_stop": 1, "gcs_restart": 1}
SLOW_OP = 60.0  # a mount call running this long is reported (bounded faults last <= 15 s)
HANG_OP = 300.0  # ... and this long is a hang
# A step's writes or commit failing this long (faults last <= 15 s, a remount retries
# for as long as the bucket is down) end the run with a finding instead of retrying
# forever: a host that never comes back must fail the run, not hang it.
GIVE_UP = 120.0


@dataclasses.dataclass
class Config:
    seconds: float = 180.0  # of chaos; the last step then completes
    seed: int = 1
    fsync: str = "local"  # --fsync of the daemons: local | replicas
    hosts: int = 3
    shards: int = 2  # files per host per step
    shard_kib: int = 2048  # their size (+-25%)
    step_interval: float = 1.0  # "training" between steps
    fault_every: float = 8.0  # mean seconds between fault starts (exponential)
    max_host_faults: int = 1  # hosts under a fault at once
    weights: dict[str, float] = dataclasses.field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    ram_size: str = "768MiB"
    keep_steps: int = 2
    commit_timeout: float = 10.0
    fsync_timeout: float = 60.0
    settle_timeout: float = 180.0
    log_level: str = "info"
    data_path: str = "auto"
    huge_pages: str = "auto"  # always: seals and transfers go through mappings
    mount_args: tuple[str, ...] = ()  # more `mtcfs mount` options for every daemon
    quiet: bool = False

    @property
    def shard_bytes(self) -> int:
        return self.shard_kib * 1024


# -- small helpers -----------------------------------------------------------------------------


def mounted(path: Path) -> bool:
    """Something is mounted at `path` (read from mountinfo: never touches the mount)."""
    want = str(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].encode().decode("unicode_escape")
            if mp == want:
                return True
    return False


def mounts_under(root: Path) -> list[str]:
    prefix = str(root) + os.sep
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].encode().decode("unicode_escape")
            if mp.startswith(prefix):
                out.append(mp)
    return out


def force_unmount(path: Path) -> None:
    for _ in range(3):
        if not mounted(path):
            return
        subprocess.run(["fusermount3", "-uz", str(path)], capture_output=True)
        if mounted(path):
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def unmount_under(root: Path) -> None:
    for mp in reversed(mounts_under(root)):
        subprocess.run(["umount", "-l", mp], capture_output=True)


def gcs_crc(data: bytes) -> str:
    return base64.b64encode(struct.pack(">I", google_crc32c.value(data))).decode()


def control(sock: Path, op: str, timeout: float = 10.0, **args: Any) -> dict:
    """A request on a daemon's control socket (never through the mount: it may be frozen).
    Raises ControlError (a RuntimeError) when the daemon cannot be reached or refuses."""
    return request_socket(str(sock), op, timeout=timeout, **args)


class Journal:
    """events.jsonl: every fault, error, retry and commit, with its time in the run."""

    def __init__(self, path: Path, quiet: bool) -> None:
        self.t0 = time.monotonic()
        self.f = open(path, "a", buffering=1)  # noqa: SIM115 - closed by close()
        self.quiet = quiet
        self.lock = threading.Lock()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def __call__(self, kind: str, say: str | None = None, **kw: Any) -> None:
        entry = {"t": self.now(), "kind": kind, **kw}
        with self.lock:
            self.f.write(json.dumps(entry, default=str) + "\n")
            if say is not None and not self.quiet:
                print(f"[{entry['t']:8.2f}s] {say}", flush=True)

    def close(self) -> None:
        self.f.close()


# -- the parts ---------------------------------------------------------------------------------


class Daemon:
    """One host's mtcfs daemon, foreground in the host's namespace; restartable."""

    def __init__(self, run: Chaos, index: int, host: Host) -> None:
        self.run = run
        self.index = index
        self.host = host
        self.node_id = f"h{index}"
        self.mp = run.dir / f"mnt-{self.node_id}"
        self.mp.mkdir()
        self.gen = 0
        self.ram_dir = run.ram_root / f"ram-{self.node_id}-0"
        self.log_path = run.dir / "logs" / f"{self.node_id}.log"
        self.proc: subprocess.Popen | None = None
        self.incarnation = 0

    @property
    def addr(self) -> str:
        return f"{self.host.addr}:{PORT}"

    @property
    def sock(self) -> Path:
        return self.ram_dir / "control.sock"

    def argv(self) -> list[str]:
        cfg = self.run.cfg
        peers = ",".join(d.addr for d in self.run.daemons if d is not self)
        return [sys.executable, "-m", "mtcfs", "mount", str(self.mp),
                "--ram-dir", str(self.ram_dir), "--ram-size", cfg.ram_size,
                "--node-id", self.node_id, "--log-level", cfg.log_level,
                "--listen", self.addr, "--peers", peers, "--token-file", str(self.run.token),
                "--replicas", "1", "--bucket", f"gs://{BUCKET}/{PREFIX}",
                "--gcs-endpoint", self.run.gcs.url, "--persist", "step",
                "--keep-steps", str(cfg.keep_steps), "--fsync", cfg.fsync,
                "--fsync-timeout", str(cfg.fsync_timeout),
                "--commit-timeout", str(cfg.commit_timeout), "--data-path", cfg.data_path,
                "--huge-pages", cfg.huge_pages, *cfg.mount_args]

    def spawn(self) -> int:
        """Start a daemon; returns the log offset its lines start at."""
        self.incarnation += 1
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== chaos: {self.node_id} incarnation {self.incarnation}, RAM dir "
                      f"{self.ram_dir}, run time {self.run.journal.now()} s =====\n".encode())
            offset = log.tell()
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            self.proc = self.host.popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, cwd=str(ROOT), env=env)
        return offset

    def log_since(self, offset: int, tail: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")[-tail:]
        except FileNotFoundError:
            return ""

    def wait_live(self, offset: int, timeout: float) -> str | None:
        """None once the daemon logged `mounted` (what --daemon waits for) and its mount is
        there; else why not (it exited, or the timeout)."""
        deadline = time.monotonic() + timeout
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"exited with {self.proc.returncode}"
            if f"mounted {self.mp}:" in self.log_since(offset, tail=10**9) and mounted(self.mp):
                return None
            time.sleep(0.1)
        return f"not live after {timeout:g} s"

    def start(self, why: str, timeout: float = 300.0) -> None:
        """Mount until it is live (a mount fails while the bucket is unreachable: retried,
        as a supervisor would)."""
        deadline = time.monotonic() + timeout
        tries = 0
        while True:
            tries += 1
            t0 = time.monotonic()
            offset = self.spawn()
            err = self.wait_live(offset, 90.0)
            if err is None:
                self.run.journal("mounted", say=None, host=self.node_id, why=why, tries=tries,
                                 seconds=round(time.monotonic() - t0, 2),
                                 ram_dir=str(self.ram_dir))
                return
            last = [ln for ln in self.log_since(offset).splitlines() if ln.strip()][-3:]
            self.run.journal("mount_failed", say=f"{self.node_id}: mount {err}: "
                             f"{last[-1][:160] if last else ''}", host=self.node_id,
                             error=err, log=last)
            self.run.counts["mount_failures"] += 1
            if self.proc.poll() is None:  # stuck starting: a finding in itself
                self.run.finding("startup_hang", f"{self.node_id} did not come up in time",
                                 log=last)
                self.kill9(group=True)
            force_unmount(self.mp)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.node_id} could not be mounted again: {err}")
            time.sleep(2.0)

    def kill9(self, group: bool = False) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        force_unmount(self.mp)

    def signal_group(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def new_ram_dir(self) -> None:
        """The host is lost: its RAM dir goes, the replacement gets an empty one."""
        old = self.ram_dir
        unmount_under(old)
        shutil.rmtree(old, ignore_errors=True)
        self.gen += 1
        self.ram_dir = self.run.ram_root / f"ram-{self.node_id}-{self.gen}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Gcs:
    """fake-gcs-server (filesystem backend) in a namespace host of its own."""

    def __init__(self, run: Chaos, host: Host) -> None:
        self.run = run
        self.host = host
        self.root = run.dir / "gcs"
        (self.root / "seed" / BUCKET).mkdir(parents=True)
        self.url = f"http://{host.addr}:{GCS_PORT}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> None:
        self._drop_partial_files()
        # Its temporary files (left behind when it is killed mid-write) stay in the run's
        # directory, not in /tmp.
        tmp = self.root / "tmp"
        tmp.mkdir(exist_ok=True)
        with open(self.run.dir / "logs" / "gcs.log", "ab") as log:
            self.proc = self.host.popen(
                [str(fake_gcs_binary()), "-scheme", "http", "-backend", "filesystem",
                 "-filesystem-root", str(self.root / "storage"), "-host", self.host.addr,
                 "-port", str(GCS_PORT), "-external-url", self.url,
                 "-data", str(self.root / "seed"), "-log-level", "warn"],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                env={**os.environ, "TMPDIR": str(tmp)})
        probe = ("import sys, urllib.request\n"
                 "urllib.request.urlopen(sys.argv[1], timeout=1).read()\n")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited with {self.proc.returncode}")
            r = self.host.run([sys.executable, "-I", "-c", probe,
                               f"{self.url}/storage/v1/b/{BUCKET}"], capture_output=True,
                              timeout=15)
            if r.returncode == 0:
                return
            time.sleep(0.2)
        raise TimeoutError("fake-gcs-server did not come up")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    # The filesystem backend writes an object to ".<name><random digits>" beside it and
    # renames it when done; killed meanwhile, it leaves that file, and from then on its
    # object listing answers 404 for the whole bucket (seen: every remount then failed
    # with "bucket does not exist"). Real GCS never shows a partial upload.
    PARTIAL = re.compile(r"\.(__\d+_\d+\.distcp|\.metadata)\d+")

    def _drop_partial_files(self) -> None:
        storage = self.root / "storage"
        if storage.is_dir():
            for p in storage.rglob(".*"):
                if p.is_file() and self.PARTIAL.fullmatch(p.name):
                    p.unlink(missing_ok=True)

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)


# -- the run -----------------------------------------------------------------------------------


class Chaos:
    def __init__(self, cfg: Config, workdir: Path | None = None) -> None:
        self.cfg = cfg
        rid = uuid.uuid4().hex[:8]
        self.own_dir = workdir is None
        self.dir = workdir or Path("/tmp") / f"mtcfs-chaos-{rid}"
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "logs").mkdir(exist_ok=True)
        self.ram_root = Path("/dev/shm") / f"mtcfs-chaos-{rid}"
        self.ram_root.mkdir()
        self.token = self.dir / "peer-token"
        self.token.write_text(uuid.uuid4().hex + uuid.uuid4().hex + "\n")
        self.token.chmod(0o600)
        self.journal = Journal(self.dir / "events.jsonl", cfg.quiet)
        self.rng = random.Random(cfg.seed)
        self.lock = threading.Lock()
        self.busy: dict[int, str] = {}  # host index -> the fault it is under
        self.gcs_busy: str | None = None
        self.faults: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()
        self.writer_errors: Counter[str] = Counter()
        self.findings: list[dict] = []
        self.replaced_at: dict[int, list[float]] = {}  # host -> times it was replaced
        self.written_at: dict[tuple[int, int], float] = {}  # (step, host) -> time written
        # (step, host or -1 for the commit) -> (start, end) of the attempt that succeeded
        self.write_window: dict[tuple[int, int], tuple[float, float]] = {}
        self.cuts: dict[int, list[list[float | None]]] = {}  # host -> [start, end] of link cuts
        self.committed: list[int] = []
        self.commit_host: dict[int, int] = {}
        self.attempted: list[int] = []
        self.marker_violations: dict[str, dict] = {}
        self.bucket_scans = 0
        self.stop_faults = threading.Event()
        self.stop_all = threading.Event()
        self.fault_threads: list[threading.Thread] = []
        self.crc_cache: dict[tuple[int, str], tuple[int, str]] = {}
        self.daemons: list[Daemon] = []
        self.cluster: Cluster | None = None
        self.gcs: Gcs

    def say(self, msg: str) -> None:
        if not self.cfg.quiet:
            print(msg, flush=True)

    def finding(self, kind: str, what: str, **kw: Any) -> None:
        self.findings.append({"t": self.journal.now(), "kind": kind, "what": what, **kw})
        self.journal(f"FINDING {kind}", say=f"FINDING {kind}: {what}", **kw)

    # -- subprocess I/O on the mounts --------------------------------------------------------

    def io(self, args: list[Any], what: str, host: int | None) -> dict:
        """Run one chaos_io command and wait for its JSON reply: reported when slow, a hang
        after HANG_OP seconds (the run goes on without it)."""
        proc = subprocess.Popen([sys.executable, str(IO), *map(str, args)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        t0 = time.monotonic()
        slow = False
        while True:
            try:
                out, err = proc.communicate(timeout=5.0)
                break
            except subprocess.TimeoutExpired:
                waited = time.monotonic() - t0
                if waited > SLOW_OP and not slow:
                    slow = True
                    self.journal("slow_op", say=f"{what}: still blocked after {waited:.0f} s "
                                 f"(faults now: {self.active_faults()})", what=what, host=host,
                                 faults=self.active_faults())
                    self.counts["slow_ops"] += 1
                if waited > HANG_OP:
                    self.finding("hang", f"{what} blocked for {waited:.0f} s",
                                 faults=self.active_faults())
                    proc.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.communicate(timeout=10)
                    return {"ok": False, "errname": "HANG", "op": what}
        lines = [ln for ln in out.splitlines() if ln.strip()]
        if proc.returncode != 0 or not lines:
            return {"ok": False, "errname": "CRASH", "op": what,
                    "error": (err or "")[-500:], "returncode": proc.returncode}
        res = json.loads(lines[-1])
        res["elapsed"] = round(time.monotonic() - t0, 3)
        return res

    def active_faults(self) -> dict[str, str]:
        with self.lock:
            out = {f"h{h}": k for h, k in self.busy.items()}
            if self.gcs_busy:
                out["gcs"] = self.gcs_busy
            return out

    # -- setup and teardown ------------------------------------------------------------------

    def setup(self) -> None:
        cfg = self.cfg
        self.cluster = Cluster(cfg.hosts + 1).start()
        self.gcs = Gcs(self, self.cluster.hosts[cfg.hosts])
        self.gcs.start()
        self.daemons = [Daemon(self, i, self.cluster.hosts[i]) for i in range(cfg.hosts)]
        with ThreadPoolExecutor(cfg.hosts) as pool:
            list(pool.map(lambda d: d.start("initial", timeout=120), self.daemons))
        self.wait_mesh(60)
        addrs = ", ".join(d.addr for d in self.daemons)
        self.journal("setup", say=f"{cfg.hosts} hosts up ({addrs}), GCS at {self.gcs.url}; "
                     f"work dir {self.dir}")

    def wait_mesh(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        want = {d.node_id for d in self.daemons}
        while time.monotonic() < deadline:
            ok = True
            for d in self.daemons:
                try:
                    peers = control(d.sock, "status", timeout=5)["status"]["peers"]
                    live = {p["node_id"] for p in peers["peers"] if p["alive"]}
                    ok = ok and live >= want - {d.node_id}
                except (OSError, RuntimeError, ValueError):
                    ok = False
            if ok:
                return True
            time.sleep(0.3)
        return False

    def teardown(self) -> None:
        for d in self.daemons:
            if d.proc is not None and d.proc.poll() is None:
                d.signal_group(signal.SIGCONT)
            force_unmount(d.mp)
        for d in self.daemons:
            if d.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    d.proc.wait(timeout=15)
        if getattr(self, "gcs", None) is not None:
            self.gcs.signal(signal.SIGCONT)
        if self.cluster is not None:
            self.cluster.close()
        unmount_under(self.ram_root)
        shutil.rmtree(self.ram_root, ignore_errors=True)
        self.journal.close()

    # -- faults ------------------------------------------------------------------------------

    def scheduler(self) -> None:
        cfg = self.cfg
        rng = self.rng
        while not self.stop_faults.is_set():
            wait = rng.expovariate(1.0 / cfg.fault_every)
            end = time.monotonic() + wait
            while time.monotonic() < end and not self.stop_faults.is_set():
                self.watch_daemons()
                time.sleep(0.2)
            if self.stop_faults.is_set():
                break
            with self.lock:
                free = [i for i in range(cfg.hosts) if i not in self.busy]
                host_ok = len(self.busy) < cfg.max_host_faults and free
                kinds = [k for k in KINDS if cfg.weights.get(k, 0) > 0 and (
                    (k in HOST_KINDS and host_ok) or (k not in HOST_KINDS and not self.gcs_busy))]
                if not kinds:
                    continue
                kind = rng.choices(kinds, [cfg.weights[k] for k in kinds])[0]
                duration = rng.uniform(*DURATIONS[kind])
                target = rng.choice(free) if kind in HOST_KINDS else None
                if target is not None:
                    self.busy[target] = kind
                else:
                    self.gcs_busy = kind
            t = threading.Thread(target=self.fault, args=(kind, target, duration), daemon=True)
            self.fault_threads.append(t)
            t.start()
        for t in self.fault_threads:
            t.join()

    def watch_daemons(self) -> None:
        """A daemon that exited without being killed by us crashed: recorded, remounted."""
        for d in self.daemons:
            with self.lock:
                if d.index in self.busy or d.alive():
                    continue
                self.busy[d.index] = "recover"
            code = d.proc.returncode if d.proc is not None else None
            self.finding("daemon_exit", f"{d.node_id} exited on its own with {code}",
                         log=d.log_since(0)[-3000:].splitlines()[-25:])
            t = threading.Thread(target=self.recover, args=(d,), daemon=True)
            self.fault_threads.append(t)
            t.start()

    def recover(self, d: Daemon) -> None:
        try:
            force_unmount(d.mp)
            d.start("after its crash")
        except Exception as e:
            self.finding("remount_failed", f"{d.node_id}: {e}")
        finally:
            with self.lock:
                self.busy.pop(d.index, None)

    def fault(self, kind: str, target: int | None, duration: float) -> None:
        self.faults[kind] += 1
        d = self.daemons[target] if target is not None else None
        who = d.node_id if d is not None else "gcs"
        self.journal("fault", say=f"fault {kind} {who} ({duration:.1f} s)", fault=kind,
                     target=who, duration=round(duration, 2))
        try:
            if kind == "kill_remount":
                d.kill9(group=False)
                time.sleep(duration)
                d.start("kill_remount")
            elif kind == "kill_replace":
                d.kill9(group=True)
                d.new_ram_dir()
                self.replaced_at.setdefault(d.index, []).append(time.monotonic())
                time.sleep(duration)
                d.start("kill_replace")
            elif kind == "sigstop":
                d.signal_group(signal.SIGSTOP)
                time.sleep(duration)
                d.signal_group(signal.SIGCONT)
            elif kind == "netcut":
                window: list[float | None] = [time.monotonic(), None]
                self.cuts.setdefault(d.index, []).append(window)
                d.host.link_down()
                time.sleep(duration)
                d.host.link_up()
                window[1] = time.monotonic()
            elif kind == "gcs_stop":
                self.gcs.signal(signal.SIGSTOP)
                time.sleep(duration)
                self.gcs.signal(signal.SIGCONT)
            elif kind == "gcs_restart":
                self.gcs.kill()
                time.sleep(duration)
                self.gcs.start()
        except Exception as e:
            self.finding("fault_failed", f"{kind} on {who}: {type(e).__name__}: {e}")
        finally:
            self.journal("fault_end", say=f"fault {kind} {who} over", fault=kind, target=who)
            with self.lock:
                if target is not None:
                    self.busy.pop(target, None)
                else:
                    self.gcs_busy = None

    def heal_all(self) -> None:
        """Whatever state the faults left: every link up, nothing stopped, all running."""
        assert self.cluster is not None
        self.cluster.heal()
        self.gcs.signal(signal.SIGCONT)
        if self.gcs.proc is None or self.gcs.proc.poll() is not None:
            self.gcs.start()
        for d in self.daemons:
            d.signal_group(signal.SIGCONT)
            if not d.alive():
                self.finding("daemon_exit", f"{d.node_id} was not running at the end",
                             log=d.log_since(0)[-3000:].splitlines()[-25:])
                force_unmount(d.mp)
                d.start("at the end")

    # -- bucket ------------------------------------------------------------------------------

    def expected(self, step: int, name: str) -> tuple[int, str]:
        """(size, GCS crc32c) of a file of a step."""
        key = (step, name)
        if key not in self.crc_cache:
            c = self.cfg
            data = cio.file_bytes(c.seed, step, name, c.hosts, c.shards, c.shard_bytes)
            self.crc_cache[key] = (len(data), gcs_crc(data))
        return self.crc_cache[key]

    def bucket_list(self) -> list[dict] | None:
        r = self.gcs.host.run([sys.executable, str(IO), "bucket-list", self.gcs.url, BUCKET,
                               PREFIX], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            return None
        return json.loads(r.stdout.strip().splitlines()[-1])["objects"]

    def check_bucket(self, objects: list[dict], final: bool) -> None:
        """Markers for steps not complete in the bucket; objects with wrong bytes; temporary
        names uploaded."""
        c = self.cfg
        by_dir: dict[str, dict[str, dict]] = {}
        for o in objects:
            d, _, name = o["name"].partition("/")
            by_dir.setdefault(d, {})[name] = o
        for d, objs in by_dir.items():
            base = d[:-len(cio.WITHDRAWN)] if d.endswith(cio.WITHDRAWN) else d
            if not base.startswith("step_") or not base[5:].isdigit():
                self.finding("unexpected_object", f"{d}/: {sorted(objs)[:5]}")
                continue
            step = int(base[5:])
            names = cio.expected_files(c.seed, step, c.hosts, c.shards, c.shard_bytes)
            for name, o in objs.items():
                if name.endswith(".tmp"):
                    key = f"tmp:{d}/{name}"
                    if key not in self.marker_violations:
                        self.marker_violations[key] = {}
                        self.finding("tmp_uploaded", f"{d}/{name} is in the bucket")
                    continue
                real = name[:-len(cio.WITHDRAWN)] if name.endswith(cio.WITHDRAWN) else name
                if real not in names:
                    continue
                size, crc = self.expected(step, real)
                if o["size"] != size or o["crc32c"] != crc:
                    key = f"corrupt:{d}/{name}"
                    if key not in self.marker_violations:
                        self.marker_violations[key] = o
                        self.finding("corrupt_object", f"{d}/{name} in the bucket: size "
                                     f"{o['size']} crc {o['crc32c']}, expected {size} {crc}")
            if cio.MARKER in objs and d == base:
                missing = [n for n in names if n not in objs]
                wrong = [n for n in names if n in objs
                         and (objs[n]["size"], objs[n]["crc32c"]) != self.expected(step, n)]
                if missing or wrong:
                    key = f"marker:{d}"
                    if key in self.marker_violations:
                        self.marker_violations[key]["final"] |= final
                    else:
                        cut = sorted(n for n in {*missing, *wrong}
                                     if self.cut_while_writing(step, n))
                        self.marker_violations[key] = {"missing": missing, "wrong": wrong,
                                                       "final": final, "cut_writers": cut}
                        self.finding("marker_incomplete", f"{d}/.metadata is in the bucket but "
                                     f"the step is not: missing {missing}, wrong {wrong}"
                                     + (f"; written while their host was cut off: {cut}"
                                        if cut else ""), final=final)

    def bucket_watch(self) -> None:
        while not self.stop_all.wait(8.0):
            if self.gcs_busy:
                continue
            try:
                objs = self.bucket_list()
            except subprocess.TimeoutExpired:
                continue
            if objs is not None:
                self.bucket_scans += 1
                self.check_bucket(objs, final=False)

    # -- the training loop -------------------------------------------------------------------

    def host_part(self, step: int, h: int) -> bool:
        c = self.cfg
        d = self.daemons[h]
        started = time.monotonic()
        while True:
            t0 = time.monotonic()
            res = self.io(["write", d.mp, c.seed, step, h, c.shards, c.shard_bytes],
                          f"step {step} shards of h{h}", h)
            if res["ok"]:
                self.written_at[(step, h)] = time.monotonic()
                self.write_window[(step, h)] = (t0, time.monotonic())
                return True
            self.note_error("write", step, h, res)
            if not self.retry(res, started, f"step {step} shards of h{h}"):
                return False

    def note_error(self, what: str, step: int, h: int, res: dict) -> None:
        name = res.get("errname", "?")
        self.writer_errors[f"{what}:{name}"] += 1
        faults = self.active_faults()
        self.journal("io_error", say=None, what=what, step=step, host=f"h{h}", res=res,
                     faults=faults)
        expected = name in ("ENOTCONN", "NOTMOUNTED", "ECONNABORTED") or f"h{h}" in faults
        if not expected:
            # An error on a host under no fault: worth a look (the journal has it).
            self.counts["errors_without_fault"] += 1
            self.journal("error_without_fault", say=f"step {step} {what} on h{h}: {name} "
                         f"({res.get('op')}: {res.get('error', '')[:120]}) with faults "
                         f"{faults}", step=step, host=f"h{h}", res=res)

    def commit(self, step: int, step_started: float) -> str:
        """The step's commit on its host: "committed", "failed" (training stops), or
        "abandoned": it failed after a host was replaced during the step. A real job
        then restarts from its newest intact step instead of committing this one
        without the shards the replaced host held (and the replacement may have
        withdrawn it already)."""
        c = self.cfg
        h = step % c.hosts
        d = self.daemons[h]
        started = time.monotonic()
        while True:
            t0 = time.monotonic()
            res = self.io(["commit", d.mp, c.seed, step, c.hosts, c.shards, c.shard_bytes],
                          f"commit of step {step} on h{h}", h)
            if res["ok"]:
                self.commit_host[step] = h
                self.write_window[(step, -1)] = (t0, time.monotonic())
                self.written_at[(step, -1)] = time.monotonic()
                self.journal("committed", say=f"step {step} committed on h{h} "
                             f"(rename {res['rename_s']:.2f} s)", step=step, host=f"h{h}",
                             rename_s=res["rename_s"], elapsed=res["elapsed"])
                return "committed"
            self.note_error("commit", step, h, res)
            replaced = sorted(f"h{r}" for r, times in self.replaced_at.items()
                              if any(t >= step_started for t in times))
            if replaced:
                self.counts["steps_abandoned_replaced"] += 1
                self.journal("step_abandoned", say=f"step {step} abandoned: its commit "
                             f"failed ({res.get('errname')}) after {', '.join(replaced)} "
                             "was replaced during the step", step=step, replaced=replaced)
                return "abandoned"
            if not self.retry(res, started, f"commit of step {step} on h{h}"):
                return "failed"

    def retry(self, res: dict, started: float, what: str) -> bool:
        """After a failed write or commit: wait a moment and try again (True), or give up
        (False) on a hang, at the end, or when it has failed for GIVE_UP seconds."""
        if res["errname"] == "HANG" or self.stop_all.is_set():
            return False
        if time.monotonic() - started > GIVE_UP:
            self.finding("writer_stuck", f"{what} failed for {GIVE_UP:.0f} s, last: "
                         f"{res.get('errname')} ({res.get('error', '')[:120]})")
            return False
        time.sleep(0.5)
        return True

    def train(self, until: float) -> None:
        c = self.cfg
        step = 0
        with ThreadPoolExecutor(c.hosts) as pool:
            while time.monotonic() < until:
                step += 1
                self.attempted.append(step)
                step_started = time.monotonic()
                parts = list(pool.map(lambda h, step=step: self.host_part(step, h),
                                      range(c.hosts)))
                if not all(parts):
                    self.journal("step_abandoned", say=f"step {step} abandoned", step=step)
                    return
                outcome = self.commit(step, step_started)
                if outcome == "failed":
                    return
                if outcome == "committed":
                    self.committed.append(step)
                time.sleep(c.step_interval)

    # -- the end -----------------------------------------------------------------------------

    def settle(self) -> tuple[bool, float, dict]:
        """Wait until every peer is alive, replication quiet, uploads idle and every
        committed step persisted (or withdrawn) on every host."""
        t0 = time.monotonic()
        # (Not a step whose commit may never have left its host: no host knows of it.)
        committed = {cio.step_dir(s) for s in self.committed
                     if not self.lost_unsent(s, cio.MARKER)}
        why: dict[str, Any] = {}
        while time.monotonic() - t0 < self.cfg.settle_timeout:
            why = {}
            for d in self.daemons:
                try:
                    st = control(d.sock, "status", timeout=10)["status"]
                    steps = control(d.sock, "steps", timeout=30)["steps"]
                except (OSError, RuntimeError, ValueError) as e:
                    why[d.node_id] = f"no status: {e}"
                    continue
                p, du = st["peers"], st["durable"]
                if p["live_peers"] < self.cfg.hosts - 1:
                    why[d.node_id] = f"{p['live_peers']} live peers"
                elif p.get("catch_ups", {}).get("pending") or p.get("catch_ups", {}).get("owed"):
                    why[d.node_id] = f"catching up: {p['catch_ups']}"
                elif not p["quiet"]:
                    tree, vis = p.get("tree", {}), st.get("visibility", {})
                    why[d.node_id] = (f"replication not quiet ({p.get('replication_pending_bytes')}"
                                      f" bytes pending; outbox {vis.get('outbox')}, tree "
                                      f"{tree.get('completed')}/{tree.get('published')} "
                                      f"completed, in flight {tree.get('in_flight')})")
                elif (du["queued_files"] or du["inflight_files"] or du["pending_deletes"]
                      or du.get("pending_copies")):
                    why[d.node_id] = (f"uploads: {du['queued_files']} queued, "
                                      f"{du['inflight_files']} in flight, "
                                      f"{du['pending_deletes']} deletes; last error "
                                      f"{(du.get('last_error') or '')[:100]}")
                else:
                    seen = {}
                    for s in steps:
                        base = s["path"][:-len(cio.WITHDRAWN)] if s["withdrawn"] else s["path"]
                        if base in committed:
                            seen[base] = s
                    bad = [b for b in sorted(committed) if b not in seen
                           or not (seen[b]["withdrawn"] or (seen[b]["complete"]
                                                            and seen[b]["persisted"]))]
                    if bad:
                        why[d.node_id] = (f"{len(bad)} committed steps not persisted: "
                                          + ", ".join(f"{b} ({seen[b]['files_persisted']}/"
                                                      f"{seen[b]['files']})" if b in seen
                                                      else f"{b} (absent)" for b in bad[:6]))
            if not why:
                return True, time.monotonic() - t0, {}
            time.sleep(1.0)
        return False, time.monotonic() - t0, why

    def read_back(self, d: Daemon) -> list[dict]:
        """Every committed step through one host's mount (a subprocess; a read with no
        progress for 120 s is a hang)."""
        c = self.cfg
        proc = subprocess.Popen([sys.executable, str(IO), "read", str(d.mp), str(c.seed),
                                 str(c.hosts), str(c.shards), str(c.shard_bytes),
                                 *map(str, self.committed)], stdout=subprocess.PIPE, text=True)
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        out = []
        while True:
            try:
                line = lines.get(timeout=120)
            except queue.Empty:
                self.finding("hang", f"read-back through {d.node_id} made no progress for "
                             f"120 s (after {len(out)} lines)")
                proc.kill()
                break
            if line is None:
                break
            out.append(json.loads(line))
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        return out

    def bucket_verify(self) -> list[dict]:
        c = self.cfg
        r = self.gcs.host.run([sys.executable, str(IO), "bucket-verify", self.gcs.url, BUCKET,
                               PREFIX, str(c.seed), str(c.hosts), str(c.shards),
                               str(c.shard_bytes), *map(str, self.committed)],
                              capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            self.finding("bucket_verify_failed", r.stderr[-500:])
        return [json.loads(ln) for ln in r.stdout.splitlines() if ln.strip()]

    def writer_of(self, step: int, name: str) -> int:
        return self.commit_host.get(step, -1) if name == cio.MARKER else int(name[2:].split("_")[0])

    def cut_while_writing(self, step: int, name: str) -> bool:
        """The host that wrote this file had its link cut while it wrote it."""
        h = self.writer_of(step, name)
        w = self.write_window.get((step, -1 if name == cio.MARKER else h))
        return w is not None and any(c0 <= w[1] and (c1 is None or c1 >= w[0])
                                     for c0, c1 in self.cuts.get(h, []))

    def lost_unsent(self, step: int, name: str) -> bool:
        """The K=1 window across a cut (--fsync local): the writer's link was cut while
        it wrote this file (or made the commit), and the host was replaced (its RAM
        lost) before UNSENT_GRACE s had passed since the link came back. Its change may
        never have left the host: no other host could know of the file, nor, for a
        marker, that the step was committed (its other files are then an abandoned
        incomplete step, which retention removes)."""
        if self.cfg.fsync != "local":
            return False
        h = self.writer_of(step, name)
        return unsent(self.write_window.get((step, -1 if name == cio.MARKER else h)),
                      self.cuts.get(h, []), self.replaced_at.get(h, []))

    def was_replaced_after_write(self, step: int, name: str) -> bool:
        """The writer of this file was replaced (its RAM lost) after writing it."""
        if name == cio.MARKER:
            h, t = self.commit_host.get(step, -1), self.written_at.get((step, -1))
        else:
            h = int(name[2:].split("_")[0])
            t = self.written_at.get((step, h))
        return t is not None and any(r > t for r in self.replaced_at.get(h, []))

    def verify(self) -> dict:
        c = self.cfg
        steps_info: dict[int, dict] = {s: {"hosts": {}, "bucket": {}} for s in self.committed}
        withdrawn_views: dict[int, dict[str, list[str]]] = {}
        for d in self.daemons:
            try:
                steps = control(d.sock, "steps", timeout=30)["steps"]
                (self.dir / f"steps-{d.node_id}.json").write_text(json.dumps(steps, indent=1))
                for s in steps:
                    if s["withdrawn"] and s["step"] in steps_info:
                        withdrawn_views.setdefault(s["step"], {})[d.node_id] = s["lost_files"]
            except (OSError, RuntimeError, ValueError) as e:
                self.finding("steps_failed", f"{d.node_id}: {e}")
        t0 = time.monotonic()
        for d in self.daemons:
            t1 = time.monotonic()
            lines = self.read_back(d)
            with open(self.dir / f"readback-{d.node_id}.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in lines)
            for r in lines:
                if "file" in r:
                    steps_info[r["step"]]["hosts"].setdefault(d.node_id, {})[r["file"]] = r
                elif "dirs" in r:
                    steps_info[r["step"]].setdefault("dirs", {})[d.node_id] = r["dirs"]
            self.say(f"read back through {d.node_id}: {time.monotonic() - t1:.1f} s")
        t1 = time.monotonic()
        bucket = self.bucket_verify()
        with open(self.dir / "readback-bucket.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in bucket)
        for r in bucket:
            steps_info[r["step"]]["bucket"][r["file"]] = r
        self.say(f"read back from the bucket: {time.monotonic() - t1:.1f} s")
        read_s = time.monotonic() - t0

        objs = self.bucket_list()
        if objs is None:
            self.finding("bucket_list_failed", "the final bucket listing failed")
        else:
            self.check_bucket(objs, final=True)

        verified, withdrawn, unexplained, broken, leftovers = [], [], [], [], []
        unsent_steps: list[int] = []
        unsent_files: dict[str, list[str]] = {}
        lost_files: dict[str, list[str]] = {}
        corrupt_files: dict[str, list[str]] = {}
        for step, info in steps_info.items():
            v = judge_step(step, info, len(self.daemons),
                           cio.expected_files(c.seed, step, c.hosts, c.shards, c.shard_bytes),
                           withdrawn_views.get(step, {}))
            if v.mode != "withdrawn" and (v.bad or v.mode != "committed") and not v.corrupt \
                    and len(info["hosts"]) == len(self.daemons) and (
                        self.lost_unsent(step, cio.MARKER) and v.mode != "committed"
                        or v.mode == "committed" and v.lost and all(
                            self.lost_unsent(step, k.rsplit("/", 1)[1]) for k in v.lost)):
                # Lost in the K=1 window across a cut: explained with --fsync local.
                unsent_steps.append(step)
                unsent_files.update(v.lost)
                self.journal("lost_unsent", say=None, step=step, lost=sorted(v.lost),
                             mode=v.mode)
                continue
            for kind, what in v.findings:
                self.finding(kind, what)
            lost_files.update(v.lost)
            corrupt_files.update(v.corrupt)
            if v.leftover:
                leftovers.append(step)
            if v.mode == "withdrawn":
                withdrawn.append(step)
                if c.fsync != "local" or not v.lost_names or v.bad or not all(
                        self.was_replaced_after_write(step, n) for n in v.lost_names):
                    unexplained.append(step)
                    self.finding("withdrawn_unexplained",
                                 f"step {step} withdrawn (lost {v.lost_names}) with --fsync "
                                 f"{c.fsync}; replaced hosts: "
                                 f"{ {f'h{h}': len(t) for h, t in self.replaced_at.items()} }")
            elif v.mode == "committed" and not v.bad:
                verified.append(step)
            else:
                broken.append(step)
        for key, where in lost_files.items():
            self.finding("lost", f"{key}: {'; '.join(where)}")
        for key, where in corrupt_files.items():
            self.finding("corrupt", f"{key}: {'; '.join(where)}")
        bucket_corrupt = [k for k in self.marker_violations if k.startswith("corrupt:")]
        markers, unsent_markers = {}, {}
        for k, m in self.marker_violations.items():
            if k.startswith("marker:"):
                step = int(k.split(":", 1)[1].removeprefix("step_"))
                explained = not m["wrong"] and all(self.lost_unsent(step, n)
                                                   for n in m["missing"])
                (unsent_markers if explained else markers)[k] = m
        return {
            "steps_committed": len(self.committed),
            "verified": len(verified),
            "lost_unsent": len(unsent_steps),
            "files_lost_unsent": len(unsent_files),
            "markers_unsent": len(unsent_markers),
            "lost_unsent_steps": unsent_steps,
            "withdrawn": len(withdrawn),
            "withdrawn_unexplained": len(unexplained),
            "steps_broken": len(broken),
            "leftover_withdrawn_dirs": len(leftovers),
            "files_lost": len(lost_files),
            "files_corrupt": len(corrupt_files) + len(bucket_corrupt),
            "bad_markers_in_gcs": len(markers),
            "bad_markers_at_end": sum(1 for v in markers.values() if v.get("final")),
            "withdrawn_steps": withdrawn,
            "broken_steps": broken,
            "read_back_seconds": round(read_s, 1),
        }

    def status_summary(self) -> dict:
        out = {}
        for d in self.daemons:
            try:
                st = control(d.sock, "status", timeout=10)["status"]
            except (OSError, RuntimeError, ValueError) as e:
                out[d.node_id] = str(e)
                continue
            lc = st.get("lifecycle") or {}
            du = st.get("durable") or {}
            out[d.node_id] = {
                "upload_conflicts": du.get("conflicts"),
                "upload_errors": du.get("errors"),
                "withdrawn_steps": lc.get("withdrawn_steps"),
                "reinstated_steps": lc.get("reinstated_steps"),
                "removed_incomplete_steps": lc.get("removed_incomplete_steps"),
                "fsync": lc.get("fsync"),
                "visibility_timeouts": (st.get("visibility") or {}).get("timeouts"),
                "integrity_errors": ((du.get("readthrough") or {}).get("integrity_errors", 0)
                                     + ((st.get("peers") or {}).get("integrity_errors") or 0)),
            }
        return out

    # -- all together ------------------------------------------------------------------------

    def run(self) -> dict:
        c = self.cfg
        result: dict[str, Any] = {"seed": c.seed, "fsync": c.fsync, "chaos_seconds": c.seconds,
                                  "hosts": c.hosts, "work_dir": str(self.dir)}
        t_start = time.monotonic()
        try:
            self.setup()
            threads = [threading.Thread(target=self.scheduler, daemon=True),
                       threading.Thread(target=self.bucket_watch, daemon=True)]
            for t in threads:
                t.start()
            until = time.monotonic() + c.seconds
            stopper = threading.Timer(c.seconds, self.stop_faults.set)
            stopper.start()
            try:
                self.train(until)
            finally:
                self.stop_faults.set()
                stopper.cancel()
                threads[0].join(timeout=120)
            self.journal("chaos_over", say=f"chaos over: {len(self.committed)} steps committed; "
                         f"faults {dict(self.faults)}")
            self.heal_all()
            if not self.wait_mesh(120):
                self.finding("mesh", "the hosts did not all see each other again in 120 s")
            ok, secs, why = self.settle()
            result["settle_seconds"] = round(secs, 1)
            if not ok:
                self.finding("settle_timeout", f"not settled after {secs:.0f} s: {why}")
            else:
                self.say(f"settled in {secs:.1f} s")
            self.stop_all.set()
            threads[1].join(timeout=60)
            result.update(self.verify())
            result["status"] = self.status_summary()
        except Exception as e:
            self.finding("runner_error", f"{type(e).__name__}: {e}")
            raise
        finally:
            self.stop_all.set()
            self.stop_faults.set()
            result.update({
                "faults": {k: self.faults.get(k, 0) for k in KINDS},
                "steps_attempted": len(self.attempted),
                "steps_abandoned_replaced": self.counts["steps_abandoned_replaced"],
                "writer_errors": dict(self.writer_errors),
                "mount_failures": self.counts["mount_failures"],
                "slow_ops": self.counts["slow_ops"],
                "errors_without_fault": self.counts["errors_without_fault"],
                "hangs": sum(1 for f in self.findings if f["kind"] == "hang"),
                "daemon_crashes": sum(1 for f in self.findings if f["kind"] == "daemon_exit"),
                "bucket_scans": self.bucket_scans,
                "findings": self.findings,
                "seconds": round(time.monotonic() - t_start, 1),
            })
            result["ok"] = ok_result(result)
            (self.dir / "result.json").write_text(json.dumps(result, indent=2, default=str))
            with contextlib.suppress(Exception):
                self.teardown()
        return result


@dataclasses.dataclass
class StepVerdict:
    mode: str  # committed | withdrawn | inconsistent
    bad: bool = False  # a file lost or corrupt somewhere, or a host not read
    leftover: bool = False  # committed beside a stale withdrawn directory
    lost_names: list[str] = dataclasses.field(default_factory=list)  # what mtcfs says it lost
    lost: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    corrupt: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    findings: list[tuple[str, str]] = dataclasses.field(default_factory=list)


def judge_step(step: int, info: dict[str, Any], hosts: int, expected: Any,
               withdrawn_views: dict[str, list[str]]) -> StepVerdict:
    """One committed step after the read-back. `info`: the step's directories per host
    ("dirs"), what each host's read-back found per file ("hosts": name -> {"result",
    "at", ...}) and the bucket's ("bucket"); `expected`: the file names the writer
    wrote; `withdrawn_views`: per host, the paths mtcfs says the step lost. A withdrawn
    step's intact files count where mtcfs put them (under the withdrawn names, read
    back intact): only a file mtcfs did not say it lost, missing or unreadable, is
    lost; a corrupt one is corrupt wherever it is."""
    final, hidden = cio.step_dir(step), cio.step_dir(step) + cio.WITHDRAWN
    states = {h: step_state(ds, final, hidden) for h, ds in info.get("dirs", {}).items()}
    v = StepVerdict(mode="inconsistent")
    if any(s == "committed+leftover" for s in states.values()):
        v.leftover = True
        v.findings.append(("leftover", f"step {step}: a stale {hidden}/ holding only "
                           f"withdrawn names beside the committed step: {states}"))
        states = {h: s.removesuffix("+leftover") for h, s in states.items()}
    if len(states) == hosts and set(states.values()) == {"committed"}:
        v.mode = "committed"
    elif len(states) == hosts and set(states.values()) == {"withdrawn"}:
        v.mode = "withdrawn"
    else:
        v.findings.append(("step_inconsistent", f"step {step} is neither committed nor "
                           f"withdrawn everywhere: {states}"))
    lost_names = {p.rsplit("/", 1)[1].removesuffix(cio.WITHDRAWN)
                  for paths in withdrawn_views.values() for p in paths}
    v.lost_names = sorted(lost_names)
    for name in expected:
        key = f"{final}/{name}"
        places = [(h, files.get(name) or {"result": "not read"})
                  for h, files in info["hosts"].items()]
        if v.mode != "withdrawn":
            places.append(("bucket", info["bucket"].get(name) or {"result": "not read"}))
        for where, r in places:
            at_final = where == "bucket" or r.get("at") == key
            if r["result"] == "ok" and (at_final or v.mode == "withdrawn"):
                continue
            detail = f"{where}: {r['result']} {r.get('errname', '')} {r.get('got', '')}".strip()
            if r.get("at") and not at_final:
                detail += f" (found at {r['at']})"
            if r["result"] == "corrupt":
                v.corrupt.setdefault(key, []).append(detail)
                v.bad = True
            elif not (v.mode == "withdrawn" and name in lost_names):
                v.lost.setdefault(key, []).append(detail)
                v.bad = True
    if len(info["hosts"]) < hosts:
        v.bad = True
    return v


def step_state(dirs: dict[str, Any], final: str, hidden: str) -> str:
    """A step as one host shows it: committed (its marker under its final name in its
    directory), withdrawn (both renamed aside) or what else it is."""
    here = {d: v for d, v in dirs.items() if isinstance(v, list)}
    if set(here) == {final} and cio.MARKER in here[final]:
        return "committed"
    if set(here) == {final, hidden} and cio.MARKER in here[final] and all(
            n.endswith(cio.WITHDRAWN) for n in here[hidden]):
        # Committed, beside a directory that holds nothing but withdrawn names (left
        # by a withdrawal that was undone): a job resumes from it; counted apart.
        return "committed+leftover"
    if set(here) == {hidden} and cio.MARKER + cio.WITHDRAWN in here[hidden]:
        return "withdrawn"
    return "; ".join(f"{d}: {len(v)} entries"
                     + (" with marker" if cio.MARKER in v else "")
                     + (" with hidden marker" if cio.MARKER + cio.WITHDRAWN in v else "")
                     for d, v in sorted(here.items())) or "absent"


def unsent(window: tuple[float, float] | None, cuts: list[list[float | None]],
           replaced: list[float]) -> bool:
    """A write in `window` (start, end) on a host whose link was cut meanwhile (`cuts`:
    [start, end or None]) and that was replaced (`replaced`: times) after the write
    started, before UNSENT_GRACE s had passed since that cut ended."""
    if window is None:
        return False
    for c0, c1 in cuts:
        if c0 is not None and c0 <= window[1] and (c1 is None or c1 >= window[0]) and any(
                r > window[0] and (c1 is None or r <= c1 + UNSENT_GRACE) for r in replaced):
            return True
    return False


def ok_result(r: dict) -> bool:
    return ("steps_committed" in r and r["files_corrupt"] == 0 and r["files_lost"] == 0
            and r["bad_markers_in_gcs"] == 0 and r["withdrawn_unexplained"] == 0
            and r["hangs"] == 0 and r["daemon_crashes"] == 0
            and r["verified"] + r["withdrawn"] + r.get("lost_unsent", 0) == r["steps_committed"]
            and not r["steps_broken"]
            and not any(f["kind"] in ("settle_timeout", "runner_error", "startup_hang",
                                      "tmp_uploaded", "corrupt_object", "remount_failed")
                        for f in r["findings"]))


def report(r: dict) -> str:
    rows = [
        ("steps committed", r.get("steps_committed", "-")),
        ("  verified (every host + bucket)", r.get("verified", "-")),
        ("  withdrawn by mtcfs", f"{r.get('withdrawn', '-')} (unexplained: "
                                 f"{r.get('withdrawn_unexplained', '-')})"),
        ("  lost in the K=1 window across a cut", f"{r.get('lost_unsent', '-')} steps, "
                                                 f"{r.get('files_lost_unsent', '-')} files, "
                                                 f"{r.get('markers_unsent', '-')} markers in GCS"),
        ("  broken (neither)", r.get("steps_broken", "-")),
        ("  verified, beside a stale *.mtcfs-withdrawn/", r.get("leftover_withdrawn_dirs", "-")),
        ("steps abandoned (commit failed, a host replaced)", r.get("steps_abandoned_replaced",
                                                                    0)),
        ("files lost", r.get("files_lost", "-")),
        ("files corrupt", r.get("files_corrupt", "-")),
        ("markers in GCS for incomplete steps", f"{r.get('bad_markers_in_gcs', '-')} (still at "
                                                f"the end: {r.get('bad_markers_at_end', '-')})"),
        ("hangs", r["hangs"]),
        ("daemon crashes", r["daemon_crashes"]),
        ("settle", f"{r.get('settle_seconds', '-')} s"),
        ("mount retries (bucket down at mount)", r["mount_failures"]),
        ("writer errors", ", ".join(f"{k} {v}" for k, v in sorted(r["writer_errors"].items()))
         or "none"),
        ("faults injected", ", ".join(f"{k} {v}" for k, v in r["faults"].items())),
        ("bucket scans during the run", r["bucket_scans"]),
        ("mtcfs counters (all hosts)", ", ".join(
            f"{k} {v}" for k, v in mtcfs_counters(r).items()) or "-"),
    ]
    w = max(len(k) for k, _ in rows)
    lines = [f"chaos run: seed {r['seed']}, --fsync {r['fsync']}, {r['chaos_seconds']:g} s of "
             f"chaos, {r['hosts']} hosts + GCS ({r['seconds']:.0f} s in all)"]
    lines += [f"  {k.ljust(w)}  {v}" for k, v in rows]
    for f in r["findings"]:
        lines.append(f"  FINDING [{f['t']:.1f}s] {f['kind']}: {f['what'][:300]}")
    lines.append(f"  {'PASS' if r['ok'] else 'FAIL'}; logs in {r['work_dir']}")
    return "\n".join(lines)


def mtcfs_counters(r: dict) -> dict[str, int]:
    """The daemons' own counts of what they noticed, summed over the hosts (the last
    incarnation of each: a restarted daemon starts from zero)."""
    total: Counter[str] = Counter()
    for st in (r.get("status") or {}).values():
        if isinstance(st, dict):
            for k in ("integrity_errors", "visibility_timeouts", "upload_conflicts",
                      "withdrawn_steps", "reinstated_steps"):
                total[k] += st.get(k) or 0
            total["fsync_failures"] += (st.get("fsync") or {}).get("failures") or 0
    return dict(total)


def summary_json(r: dict) -> str:
    keys = ("ok", "seed", "fsync", "chaos_seconds", "steps_committed", "verified", "withdrawn",
            "withdrawn_unexplained", "steps_broken", "leftover_withdrawn_dirs", "files_lost",
            "files_corrupt",
            "bad_markers_in_gcs", "bad_markers_at_end", "hangs", "daemon_crashes", "faults",
            "writer_errors", "settle_seconds", "seconds", "work_dir")
    out = {k: r.get(k) for k in keys}
    out["findings"] = Counter(f["kind"] for f in r["findings"])
    return "CHAOS_RESULT " + json.dumps(out)


def run(cfg: Config, workdir: Path | None = None) -> dict:
    reason = netns_unavailable()
    if reason:
        raise RuntimeError(reason)
    r = Chaos(cfg, workdir).run()
    print(report(r), flush=True)
    print(summary_json(r), flush=True)
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=3.0, help="of chaos (default 3)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fsync", choices=("local", "replicas"), default="local")
    ap.add_argument("--shards", type=int, default=Config.shards, help="files per host per step")
    ap.add_argument("--shard-kib", type=int, default=Config.shard_kib)
    ap.add_argument("--step-interval", type=float, default=Config.step_interval)
    ap.add_argument("--fault-every", type=float, default=Config.fault_every,
                    help="mean seconds between faults")
    ap.add_argument("--max-host-faults", type=int, default=Config.max_host_faults)
    ap.add_argument("--weights", default="",
                    help="fault weights, e.g. kill_replace=3,gcs_stop=0 "
                         f"(default {DEFAULT_WEIGHTS})")
    ap.add_argument("--data-path", choices=("auto", "passthrough", "fuse"), default="auto")
    ap.add_argument("--huge-pages", choices=("auto", "always", "never"), default="auto",
                    help="the daemons' RAM tiers (always: seal passes and data-channel "
                         "transfers go through mappings of the files)")
    ap.add_argument("--mount-args", default="",
                    help="more `mtcfs mount` options for every daemon, e.g. "
                         "'--peer-group 3 --peer-group-turn 2'")
    ap.add_argument("--workdir", type=Path, help="logs and results (default /tmp/mtcfs-chaos-*)")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    weights = dict(DEFAULT_WEIGHTS)
    for item in filter(None, a.weights.split(",")):
        k, _, v = item.partition("=")
        if k not in KINDS:
            ap.error(f"unknown fault {k!r} (one of {', '.join(KINDS)})")
        weights[k] = float(v)
    cfg = Config(seconds=a.minutes * 60, seed=a.seed, fsync=a.fsync, shards=a.shards,
                 shard_kib=a.shard_kib, step_interval=a.step_interval,
                 fault_every=a.fault_every, max_host_faults=a.max_host_faults,
                 weights=weights, data_path=a.data_path, quiet=a.quiet,
                 huge_pages=a.huge_pages, mount_args=tuple(shlex.split(a.mount_args)))
    return 0 if run(cfg, a.workdir)["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
