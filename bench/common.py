"""Shared machinery of `make bench`: scratch space, mtcfs mounts, the C I/O
tool, timing, medians, and the result table.

Every benchmark group is a function `group(ctx: Context) -> list[Row]` in a
module of bench/ (see bench/ramtier.py) registered in bench/run.py. A group
measures mtcfs and its reference in the same run, alternating them (A/B, B/A,
...) so that the noise of a shared machine falls on both sides, and returns
one `Row` per figure.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.table import Table
from rich.text import Text

from mtcfs.config import format_size, mount_entry, process_alive

BENCH_DIR = Path(__file__).resolve().parent
# The benchmarks share their GCS server, Kubernetes API server and netns hosts with
# the tests: tests/support, imported as `support`.
if str(BENCH_DIR.parent / "tests") not in sys.path:
    sys.path.insert(0, str(BENCH_DIR.parent / "tests"))
KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
MTCFS = [sys.executable, "-m", "mtcfs"]
T = TypeVar("T")

# Progress goes to stderr, so that `--json` leaves stdout machine-readable.
err = Console(stderr=True, highlight=False)


class BenchError(RuntimeError):
    """A benchmark could not run (not a slow result: a broken set-up)."""


def run(cmd: list[str], timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        why = (r.stderr or r.stdout).strip().splitlines()
        raise BenchError(f"{' '.join(cmd)} failed ({r.returncode}): {why[-1] if why else '?'}")
    return r


def drop_caches() -> None:
    """Write back, then drop the page cache (FUSE files included; tmpfs data stays)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


# -- the I/O tool ----------------------------------------------------------------


class IoTool:
    """bench/iotool.c, compiled once per run: a C loop used on both sides."""

    def __init__(self, build_dir: Path) -> None:
        self.bin = build_dir / "iotool"
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise BenchError("a C compiler is needed for bench/iotool.c (apt-get install gcc)")
        run([cc, "-O2", "-Wall", "-o", str(self.bin), str(BENCH_DIR / "iotool.c")])

    def _run(self, *args: object) -> tuple[float, int]:
        out = run([str(self.bin), *map(str, args)]).stdout.split()
        return float(out[0]), int(out[1])

    def write(self, path: Path, size: int, bs: int, fsync: bool = True) -> float:
        """Seconds for open + `size` bytes in `bs` writes + [fsync] + close."""
        return self._run("write", path, size, bs, int(fsync))[0]

    def read(self, path: Path, bs: int) -> tuple[float, int]:
        """(seconds, bytes) for open + reading to EOF in `bs` reads + close."""
        return self._run("read", path, bs)

    def tree(
        self, root: Path, ndirs: int, nfiles: int, size: int, bs: int, fsync: bool = False
    ) -> float:
        """Seconds for `ndirs` mkdirs and `nfiles` open/write/[fsync]/close."""
        return self._run("tree", root, ndirs, nfiles, size, bs, int(fsync))[0]


# -- mtcfs mounts ----------------------------------------------------------------


def proc_field(pid: int, name: str, key: str) -> int:
    """A number from /proc/PID/NAME, e.g. ("status", "VmHWM") or ("io", "syscr");
    figures given in kB are returned in bytes."""
    with open(f"/proc/{pid}/{name}") as f:
        for line in f:
            if line.startswith(key + ":"):
                parts = line.split()
                return int(parts[1]) * (KiB if parts[2:] == ["kB"] else 1)
    raise BenchError(f"no {key} in /proc/{pid}/{name}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_alive = process_alive  # a zombie counts as gone


def force_unmount(path: Path) -> None:
    for cmd in (["fusermount3", "-uz", str(path)], ["umount", "-l", str(path)]):
        if mount_entry(str(path)) is None:
            return
        subprocess.run(cmd, capture_output=True)


class Mount:
    """One mtcfs daemon (`mtcfs mount --daemon`) and its mountpoint."""

    def __init__(self, path: Path, ram_dir: Path, ram_size: str, args: Sequence[str] = ()) -> None:
        self.path = path
        self.ram_dir = ram_dir
        self.ram_size = ram_size
        self.args = list(args)  # more `mtcfs mount` options, e.g. --bucket
        self.pid: int | None = None

    def start(self) -> Mount:
        self.path.mkdir(parents=True, exist_ok=True)
        run(
            [
                *MTCFS,
                "mount",
                str(self.path),
                "--daemon",
                "--ram-dir",
                str(self.ram_dir),
                "--ram-size",
                self.ram_size,
                *self.args,
            ],
            timeout=60,
        )
        self.pid = int(self.status()["pid"])
        return self

    def status(self) -> dict[str, Any]:
        return json.loads(run([*MTCFS, "status", str(self.path), "--json"], timeout=30).stdout)

    def durable(self) -> dict[str, Any]:
        """The "durable" section of `mtcfs status --json` (mounts with --bucket)."""
        d = self.status()["durable"]
        if not d:
            raise BenchError(f"{self.path} has no durable tier")
        return d

    def memory(self, key: str = "VmHWM") -> int:
        """A memory figure of the daemon from /proc/PID/status, in bytes."""
        assert self.pid is not None
        return proc_field(self.pid, "status", key)

    def read_syscalls(self) -> int:
        """read() calls the daemon has made: one per FUSE request it received."""
        assert self.pid is not None
        return proc_field(self.pid, "io", "syscr")

    def stop(self) -> None:
        """Unmount and wait for the daemon to exit; never leaves a mount behind."""
        if mount_entry(str(self.path)) is not None:
            r = run([*MTCFS, "umount", str(self.path)], timeout=90, check=False)
            if r.returncode != 0:
                err.print(
                    f"[yellow]mtcfs umount {self.path} failed: {r.stderr.strip()}; detaching it[/]"
                )
                force_unmount(self.path)
        if self.pid is not None:
            deadline = time.monotonic() + 30
            while _alive(self.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(self.pid):
                err.print(f"[yellow]daemon {self.pid} still running after unmount: killing it[/]")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, 9)
            self.pid = None
        force_unmount(self.path)


class Scratch:
    """Owns every directory and mount of one run, and removes them all at the
    end, also after an error or Ctrl-C."""

    def __init__(self) -> None:
        tag = f"mtcfs-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.shm = Path("/dev/shm") / tag  # RAM dirs and the raw tmpfs references
        self.tmp = Path("/tmp") / tag  # mountpoints and the compiled tool
        self.mounts: list[Mount] = []
        self._deferred: list[Callable[[], None]] = []
        self.shm.mkdir(mode=0o700)
        self.tmp.mkdir(mode=0o700)

    def shm_dir(self, name: str) -> Path:
        d = self.shm / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def mount(self, name: str, ram_size: str, args: Sequence[str] = ()) -> Mount:
        """A started mtcfs mount with a fresh RAM dir; `args`: more mount options.
        Huge pages always (unless `args` say otherwise): the benchmarks warm memory
        before each timed part (see warm), where --huge-pages auto's probe would
        see the cold first touch of returned memory and turn them off."""
        ram_dir = self.shm / f"ram-{name}-{uuid.uuid4().hex[:6]}"
        if "--huge-pages" not in args:
            args = [*args, "--huge-pages", "always"]
        m = Mount(self.tmp / f"mnt-{name}", ram_dir, ram_size, args)
        self.mounts.append(m)
        return m.start()

    def unmount(self, m: Mount) -> None:
        """Stop one mount and free its RAM dir."""
        m.stop()
        self.mounts.remove(m)
        # The RAM tier's own tmpfs (passthrough) outlives its daemon on purpose (a
        # restarted daemon finds its data): a benchmark that is done with it detaches it.
        force_unmount(m.ram_dir / "data")
        shutil.rmtree(m.ram_dir, ignore_errors=True)

    def keep_freed_memory(self) -> str | None:
        """Make this VM hand back to its host only memory free in the largest blocks
        for the run (restored at close()); returns what it did, or None where the
        kernel has no such setting or refuses it.

        Free page reporting (see warm) hands back free 2 MiB blocks by default: the
        pages a benchmark frees between two reps were often gone again before the
        next rep took them, so the same code measured 566-985 MiB/s from one push to
        the next. Reporting only 4 MiB blocks (order 10) keeps most of them backed:
        five pushes in a row then gave 906-957 MiB/s. Both sides of every ratio run
        under the same setting; a node whose memory is not reported behaves so always."""
        knob = Path("/sys/module/page_reporting/parameters/page_reporting_order")
        try:
            before = knob.read_text().strip()
            if int(before) >= 10:
                return None
            knob.write_text("10")
        except (OSError, ValueError):
            return None

        def restore() -> None:
            with contextlib.suppress(OSError):
                knob.write_text(before)

        self.defer(restore)
        return f"free page reporting: order {before} -> 10 for this run"

    def warm(self, nbytes: int) -> None:
        """Write `nbytes` into a tmpfs file with huge pages and free it again, so
        that the next allocations of that much memory land on pages the
        hypervisor backs.

        This VM returns memory that stayed free to its host (virtio-balloon free
        page reporting), and the first write into such memory costs a host fault
        per page, far more with huge pages: 2 GiB written with dd took 5.03 s into
        a huge-page tmpfs on returned memory against 0.21 s on memory just freed
        (small pages: 1.05 s against 0.79 s). The RAM tiers of new hosts take
        fresh huge pages while a reference that rewrites one file reuses its own;
        benchmarks warm memory just before each timed part, on both sides."""
        if nbytes <= 0:
            return
        where = self.tmp / "warm"
        if mount_entry(str(where)) is None:
            where.mkdir(exist_ok=True)
            for opts in ("huge=always,size=50%", "size=50%"):  # no huge pages for tmpfs here
                if run(["mount", "-t", "tmpfs", "-o", opts, "mtcfs-bench-warm", str(where)],
                       check=False).returncode == 0:
                    break
            else:
                raise BenchError(f"cannot mount a tmpfs at {where} to warm memory")
            self.defer(lambda: force_unmount(where))
        chunk = bytes(4 << 20)
        fd = os.open(where / "fill", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            left = nbytes
            while left > 0:
                left -= os.write(fd, chunk[:min(left, len(chunk))])
        except OSError:
            pass  # full: warmed what fits
        finally:
            os.close(fd)
            (where / "fill").unlink(missing_ok=True)

    def huge_dir(self, name: str) -> Path:
        """A directory on a tmpfs of its own with huge pages where the file covers
        them (huge=within_size, as the RAM tier): the strongest reference for bytes
        that land in RAM. Without huge pages for tmpfs here, a plain one."""
        where = self.tmp / f"huge-{name}"
        if mount_entry(str(where)) is None:
            where.mkdir(exist_ok=True)
            for opts in ("huge=within_size,size=50%", "size=50%"):
                if run(["mount", "-t", "tmpfs", "-o", opts, f"mtcfs-bench-{name}", str(where)],
                       check=False).returncode == 0:
                    break
            else:
                raise BenchError(f"cannot mount a tmpfs at {where}")
            self.defer(lambda: force_unmount(where))
        return where

    def defer(self, fn: Callable[[], None]) -> None:
        """Run `fn` at close(), after the mtcfs mounts are gone (last deferred
        first): for servers and foreign mounts a group starts. `fn` must be
        idempotent, as the group usually cleans up itself as well."""
        self._deferred.append(fn)

    def close(self) -> None:
        for m in list(self.mounts):
            try:
                self.unmount(m)
            except Exception as e:  # keep cleaning up the others
                err.print(f"[red]cleanup of {m.path} failed: {e}[/]")
                force_unmount(m.path)
        while self._deferred:
            fn = self._deferred.pop()
            try:
                fn()
            except Exception as e:
                err.print(f"[red]cleanup failed: {e}[/]")
        for root in (self.shm, self.tmp):
            if any(mount_entry(str(m.path)) for m in self.mounts):
                err.print(f"[red]{root} left in place: a mount inside is still busy[/]")
                continue
            shutil.rmtree(root, ignore_errors=True)


# -- statistics and results ------------------------------------------------------


def mib_s(size: int, seconds: float) -> float:
    return size / (1 << 20) / seconds


def alternating_pair(a: Callable[[], T], b: Callable[[], T]) -> Callable[[], tuple[T, T]]:
    """A call that runs both a and b, in the order a b, then b a, a b, ... (neither
    always goes first on a noisy machine); it returns (a's result, b's result)."""
    calls = 0

    def both() -> tuple[T, T]:
        nonlocal calls
        calls += 1
        if calls % 2 == 0:
            y = b()
            return a(), y
        x = a()
        return x, b()

    return both


def median(values: list[float]) -> float:
    return statistics.median(values)


@dataclass
class Row:
    """One figure: mtcfs beside its reference, with the ratio and the target.

    `ratio` is always mtcfs's performance relative to the reference: the ratio
    of medians, inverted for lower-is-better units, so < 1 means slower.
    """

    group: str
    name: str
    unit: str
    mtcfs: list[float]
    ref: list[float] | None = None
    ref_label: str = "tmpfs"
    higher_is_better: bool = True
    min_ratio: float | None = None  # target: ratio >= min_ratio
    max_value: float | None = None  # target: mtcfs median < max_value
    note: str = ""
    compare: bool = True  # False: show the reference, but no ratio

    @property
    def ratio(self) -> float | None:
        if not self.ref or not self.compare:
            return None
        a, b = median(self.mtcfs), median(self.ref)
        if not self.higher_is_better:
            a, b = b, a
        return a / b if b else None

    @property
    def target(self) -> str:
        if self.min_ratio is not None:
            return f">= {self.min_ratio:.2f}x"
        if self.max_value is not None:
            return f"< {self.max_value:g} {self.unit}"
        return ""

    @property
    def met(self) -> bool | None:
        if self.min_ratio is not None:
            ratio = self.ratio
            return ratio is not None and ratio >= self.min_ratio
        if self.max_value is not None:
            return median(self.mtcfs) < self.max_value
        return None

    def to_json(self) -> dict[str, Any]:
        def series(values: list[float] | None) -> dict[str, Any] | None:
            if not values:
                return None
            return {
                "median": median(values),
                "min": min(values),
                "max": max(values),
                "values": values,
            }

        return {
            "group": self.group,
            "name": self.name,
            "unit": self.unit,
            "higher_is_better": self.higher_is_better,
            "mtcfs": series(self.mtcfs),
            "reference": {"label": self.ref_label, **(series(self.ref) or {})}
            if self.ref
            else None,
            "ratio": self.ratio,
            "target": self.target or None,
            "met": self.met,
            "note": self.note or None,
        }


def fmt(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def spread(values: list[float]) -> str:
    """Half the range of the reps, in percent of the median (absolute when
    the median is near zero)."""
    if len(values) < 2:
        return ""
    m = median(values)
    half = (max(values) - min(values)) / 2
    if m <= 0 or half > m:
        return f"±{fmt(half)}"
    return f"±{100 * half / m:.0f}%"


def results_table(rows: list[Row], title: str) -> Table:
    t = Table(title=title, title_justify="left", show_lines=False)
    t.add_column("group", style="dim")
    t.add_column("benchmark")
    t.add_column("mtcfs", justify="right")
    t.add_column("reference", justify="right")
    t.add_column("ratio", justify="right")
    t.add_column("target", justify="right")
    t.add_column("", justify="left")
    for r in rows:
        ours = Text(f"{fmt(median(r.mtcfs))} {r.unit}")
        ours.append(f" {spread(r.mtcfs)}", style="dim")
        if r.ref:
            ref = Text(f"{fmt(median(r.ref))} {r.unit}")
            ref.append(f" {spread(r.ref)}", style="dim")
            ref.append(f" {r.ref_label}", style="dim")
        else:
            ref = Text("—", style="dim")
        ratio = r.ratio
        met = r.met
        verdict = {
            True: Text("ok", style="green"),
            False: Text("MISSED", style="bold red"),
            None: Text(""),
        }[met]
        t.add_row(
            r.group,
            r.name + (f"\n[dim]{r.note}[/]" if r.note else ""),
            ours,
            ref,
            f"{ratio:.2f}x" if ratio is not None else "",
            r.target,
            verdict,
        )
    return t


# -- the machine -----------------------------------------------------------------


def _libfuse_version() -> str:
    """The libfuse that pyfuse3 is linked against (from ldd)."""
    try:
        import pyfuse3

        r = run(["ldd", pyfuse3.__file__], check=False)
        for line in r.stdout.splitlines():
            m = re.search(r"libfuse3\.so\S*\s*=>\s*(\S+)", line)
            if m:
                real = os.path.realpath(m.group(1))
                v = re.search(r"\.so\.(\d+\.\d+\.\d+)$", real)
                return f"{v.group(1) if v else '?'} ({real})"
    except Exception:
        pass
    return "?"


def machine_facts() -> dict[str, Any]:
    import pyfuse3

    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    shm = shutil.disk_usage("/dev/shm")
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "memory": format_size(mem),
        "dev_shm_free": format_size(shm.free),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "pyfuse3": getattr(pyfuse3, "__version__", "?"),
        "libfuse": _libfuse_version(),
        "loadavg_start": os.getloadavg()[0],
    }


def facts_table(facts: dict[str, Any]) -> Table:
    t = Table(show_header=False, box=None, padding=(0, 1))
    t.add_column(style="bold")
    t.add_column()
    for k, v in facts.items():
        t.add_row(k, str(v))
    return t


# -- the context handed to each group ---------------------------------------------


@dataclass
class Context:
    reps: int
    size: int
    scratch: Scratch
    io: IoTool
    ram_size: str = "8GiB"
    steps: int = 20  # the lifecycle group: checkpoint steps per training run
    step_interval: float = 0.0  # the lifecycle group: seconds between steps (0: measured)
    hosts: list[int] = field(default_factory=lambda: [100, 300, 1000])  # the scale group
    # JSON a group wants printed as the run's last line (the scale group's figures)
    last_line: list[object] = field(default_factory=list)
    _shared: Mount | None = field(default=None, repr=False)

    def mtcfs(self) -> Mount:
        """The mount shared by the groups (started on first use)."""
        if self._shared is None:
            self._shared = self.scratch.mount("shared", self.ram_size)
        return self._shared

    def ref_dir(self) -> Path:
        """A plain directory on tmpfs: the raw reference."""
        return self.scratch.shm_dir("ref")

    def close(self) -> None:
        if self._shared is not None:
            self.scratch.unmount(self._shared)
            self._shared = None

    def alternate(
        self, a: Callable[[], T], b: Callable[[], T], label: str = "", warmup: bool = True
    ) -> tuple[list[T], list[T]]:
        """Run `a` (mtcfs) and `b` (reference) `reps` times each, in the order
        A B, B A, A B, ... and return both lists of results. With `warmup`,
        each runs once more first, untimed: the first runs after a change of
        workload are slower on both sides (page allocation, caches)."""
        if warmup:
            a()
            b()
        xs: list[T] = []
        ys: list[T] = []
        for i in range(self.reps):
            order = ((a, xs), (b, ys)) if i % 2 == 0 else ((b, ys), (a, xs))
            for fn, out in order:
                out.append(fn())
            if label:
                err.print(
                    f"  {label}: rep {i + 1}/{self.reps}: mtcfs {_show(xs[-1])}, "
                    f"reference {_show(ys[-1])}",
                    style="dim",
                )
        return xs, ys


def _show(value: object) -> str:
    if isinstance(value, float):
        return fmt(value)
    if isinstance(value, tuple):
        return "/".join(_show(v) for v in value)
    return str(value)


@contextlib.contextmanager
def section(name: str) -> Iterator[None]:
    t0 = time.monotonic()
    err.rule(f"[bold]{name}")
    yield
    err.print(f"  {name} took {time.monotonic() - t0:.0f} s", style="dim")


# -- which code a group measured -----------------------------------------------------

MTCFS_CODE = ("mtcfs_tree", "mtcfs_diff")


def code_version() -> dict[str, Any]:
    """The commit, and a digest of the uncommitted changes under mtcfs/ (others may
    be editing the tree while the benchmark runs)."""
    import hashlib

    def git(*args: str) -> str:
        r = subprocess.run(["git", *args], capture_output=True, text=True, cwd=BENCH_DIR.parent)
        return r.stdout.strip()

    diff = git("diff", "HEAD", "--", "mtcfs")
    return {
        "head": git("rev-parse", "--short", "HEAD"),
        "mtcfs_tree": git("rev-parse", "--short", "HEAD:mtcfs"),
        "mtcfs_diff": hashlib.sha256(diff.encode()).hexdigest()[:12] if diff else None,
    }


def save_details(path: Path, details: dict[str, Any]) -> None:
    """Write a group's per-run details (details["code"] = code_version() at its start),
    warning when mtcfs/ changed while it ran."""
    after = code_version()
    if [after[k] for k in MTCFS_CODE] != [details["code"].get(k) for k in MTCFS_CODE]:
        details["code_after"] = after
        err.print("[yellow]  mtcfs/ changed while this group ran: figures mix versions[/]")
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(details, indent=2) + "\n")
    err.print(f"  details: {path}", style="dim")
