"""The `mtcfs` command line (DESIGN.md, "Command line"): exit status 0 on
success, 2 for usage errors, 1 for other failures, one clear line on stderr,
and bad input refused before anything is mounted."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mtcfs.config import mount_entry

from support.mounts import force_unmount, mtcfs

MOUNT_OPTIONS = (
    "--ram-dir", "--ram-size", "--node-id", "--listen", "--peers", "--peers-file",
    "--replicas", "--token-file", "--insecure", "--bucket", "--gcs-endpoint", "--persist",
    "--keep-steps", "--fsync", "--metrics-port", "--log-level", "--config", "-o", "--daemon",
)
COMMANDS = ("mount", "umount", "status", "persist", "prefetch", "steps", "demo", "csi",
            "controller", "discover")


def one_line(stderr: str) -> str:
    """The error output is exactly one non-empty line, starting with 'mtcfs'."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    assert lines[0].startswith("mtcfs"), lines[0]
    return lines[0]


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


class Daemons:
    """Mounts made with `mtcfs mount --daemon`; all of them are unmounted and
    their daemons stopped at teardown, also when the test fails."""

    def __init__(self, tmp_path: Path, ram_root: Path) -> None:
        self.tmp_path = tmp_path
        self.ram_root = ram_root
        self.mounts: list[tuple[Path, Path]] = []

    def paths(self, name: str) -> tuple[Path, Path]:
        mp = self.tmp_path / f"mp-{name}"
        mp.mkdir(exist_ok=True)
        return mp, self.ram_root / f"ram-{name}"

    def mount(self, mp: Path, ram_dir: Path, *args: str) -> subprocess.CompletedProcess:
        self.mounts.append((mp, ram_dir))
        return mtcfs("mount", str(mp), "--daemon", "--ram-dir", str(ram_dir), *args)

    def pid_of(self, ram_dir: Path, mp: Path | None = None) -> int | None:
        """The pid of the daemon that serves (or served) ram_dir [on mp]."""
        try:
            info = json.loads((ram_dir / "daemon.json").read_text())
        except (OSError, ValueError):
            return None
        if mp is not None and info.get("mountpoint") != str(mp):
            return None
        return info.get("pid")

    def cleanup(self) -> None:
        for mp, ram_dir in self.mounts:
            pid = self.pid_of(ram_dir, mp)
            if mount_entry(str(mp)) is not None:
                mtcfs("umount", str(mp), timeout=60)
            if mount_entry(str(mp)) is not None:
                subprocess.run(["fusermount3", "-uz", str(mp)], capture_output=True)
                force_unmount(str(mp))
            if pid is not None:
                deadline = time.monotonic() + 10
                while _pid_alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if _pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def daemons(tmp_path: Path, ram_root: Path) -> Iterator[Daemons]:
    d = Daemons(tmp_path, ram_root)
    try:
        yield d
    finally:
        d.cleanup()


# -- usage errors: exit 2, one line, nothing mounted --------------------------


@pytest.mark.parametrize("size", ["abc", "-5", "0", "12XB"])
def test_bad_ram_size(tmp_path, ram_root, size):
    mp = tmp_path / "mp"
    mp.mkdir()
    ram_dir = ram_root / "ram"
    r = mtcfs("mount", str(mp), "--ram-dir", str(ram_dir), "--ram-size", size)
    assert r.returncode == 2, r
    line = one_line(r.stderr)
    assert "size" in line and repr(size) in line, line
    assert mount_entry(str(mp)) is None
    assert not ram_dir.exists(), "a RAM dir was created for a refused mount"


def test_missing_mountpoint(tmp_path, ram_root):
    r = mtcfs("mount", str(tmp_path / "nope"), "--ram-dir", str(ram_root / "ram"))
    assert r.returncode == 2
    line = one_line(r.stderr)
    assert "nope" in line and "does not exist" in line
    assert not (ram_root / "ram").exists()


def test_mountpoint_is_a_file(tmp_path, ram_root):
    f = tmp_path / "file"
    f.write_text("x")
    r = mtcfs("mount", str(f), "--ram-dir", str(ram_root / "ram"))
    assert r.returncode == 2
    line = one_line(r.stderr)
    assert str(f) in line and "file" in line
    assert mount_entry(str(f)) is None


def test_mountpoint_in_use(mnt, ram_root):
    r = mtcfs("mount", str(mnt.path), "--ram-dir", str(ram_root / "other"))
    assert r.returncode == 2
    assert "in use" in one_line(r.stderr)
    # The first mount is untouched.
    os.getxattr(mnt.path, "user.mtcfs.control")
    (mnt.path / "f").write_bytes(b"still here")
    assert (mnt.path / "f").read_bytes() == b"still here"


def test_ram_dir_below_a_regular_file(tmp_path):
    mp = tmp_path / "mp"
    mp.mkdir()
    f = tmp_path / "regular"
    f.write_text("x")
    r = mtcfs("mount", str(mp), "--ram-dir", str(f / "ram"))
    assert r.returncode == 2
    line = one_line(r.stderr)
    assert "RAM dir" in line and "Not a directory" in line
    assert mount_entry(str(mp)) is None


def test_ram_dir_read_only(tmp_path, ram_root):
    mp = tmp_path / "mp"
    mp.mkdir()
    ro = ram_root / "ro"
    ro.mkdir()
    subprocess.run(["mount", "--bind", str(ro), str(ro)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], check=True)
        for ram_dir in (ro, ro / "sub"):
            r = mtcfs("mount", str(mp), "--ram-dir", str(ram_dir))
            assert r.returncode == 2, r
            line = one_line(r.stderr)
            assert "RAM dir" in line and "Read-only file system" in line, line
            assert mount_entry(str(mp)) is None
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_unknown_option(tmp_path):
    mp = tmp_path / "mp"
    mp.mkdir()
    r = mtcfs("mount", str(mp), "--frobnicate")
    assert r.returncode == 2
    assert "--frobnicate" in one_line(r.stderr)
    r = mtcfs("--frobnicate")
    assert r.returncode == 2
    assert "--frobnicate" in one_line(r.stderr)
    r = mtcfs("frobnicate")
    assert r.returncode == 2
    assert "frobnicate" in one_line(r.stderr)


@pytest.mark.parametrize(("args", "why"), [
    (("--persist", "on-close"), "needs --bucket"),
    (("--bucket", "gs://x"), "invalid bucket name"),
    (("--bucket", "s3://b"), "gs://bucket"),
    (("--bucket", "file:///tmp/x", "--persist", "sometimes"), "invalid persist policy"),
    (("--bucket", "file:///tmp/x", "--persist", "interval:0"), "seconds > 0"),
])
def test_bad_durable_options(tmp_path, ram_root, args, why):
    assert_refused_before_mount(tmp_path, ram_root, args, why)


@pytest.mark.parametrize(("args", "why"), [
    (("--peers", "127.0.0.1:7000"), "--peers needs --listen"),
    (("--replicas", "2"), "--replicas needs --listen"),
    (("--listen", "127.0.0.1:7000"), "--token-file"),
    (("--listen", "127.0.0.1"), "invalid --listen address"),
    (("--listen", "127.0.0.1:99999", "--insecure"), "port must be 1-65535"),
    (("--listen", "127.0.0.1:7000", "--insecure", "--peers", "nohost"), "invalid peer address"),
    (("--listen", "127.0.0.1:7000", "--token-file", "/nonexistent/token"), "token file"),
    (("--listen", "127.0.0.1:7000", "--insecure", "--replicas", "-1"), "invalid --replicas"),
    (("--listen", "127.0.0.1:7000", "--insecure", "--tls-cert", "/etc/hostname"),
     "both --tls-cert and --tls-key"),
    (("--listen", "127.0.0.1:7000", "--insecure", "--peers-file", "/nonexistent"),
     "peers file"),
])
def test_bad_peer_options(tmp_path, ram_root, args, why):
    assert_refused_before_mount(tmp_path, ram_root, args, why)


def assert_refused_before_mount(tmp_path, ram_root, args: tuple[str, ...], why: str) -> None:
    """A usage error (exit 2) naming `why`, and nothing mounted."""
    mp = tmp_path / "mp"
    mp.mkdir()
    r = mtcfs("mount", str(mp), "--ram-dir", str(ram_root / "ram"), *args)
    assert r.returncode == 2, r.stderr
    assert why in one_line(r.stderr)
    assert mount_entry(str(mp)) is None


@pytest.mark.parametrize(("args", "why"), [
    (("--keep-steps", "3"), "--keep-steps needs --bucket"),
    (("--keep-steps", "0", "--bucket", "file:///tmp/x"), "invalid --keep-steps"),
    (("--fsync", "replicas"), "--fsync replicas needs peers"),
    (("--fsync", "gcs"), "--fsync gcs needs --bucket"),
    (("--fsync", "disk"), "'disk' is not one of"),
    (("--full-timeout", "-1"), "invalid --full-timeout"),
    (("--fsync-timeout", "0"), "invalid --fsync-timeout"),
    (("--metrics-port", "70000"), "invalid --metrics-port"),
    (("--log-format", "xml"), "'xml' is not one of"),
])
def test_lifecycle_option_errors(tmp_path, ram_root, args, why):
    assert_refused_before_mount(tmp_path, ram_root, args, why)


def test_controller_usage_error(tmp_path):
    r = mtcfs("controller", str(tmp_path))  # takes no arguments
    assert r.returncode == 2
    line = one_line(r.stderr)
    assert "controller" in line and "unexpected extra argument" in line


def test_help():
    r = mtcfs("--help")
    assert r.returncode == 0, r.stderr
    for cmd in COMMANDS:
        assert cmd in r.stdout, f"mtcfs --help does not mention {cmd}"
    r = mtcfs("mount", "--help")
    assert r.returncode == 0, r.stderr
    for opt in MOUNT_OPTIONS:
        assert opt in r.stdout.split() or f"{opt}," in r.stdout or f"{opt} " in r.stdout, (
            f"mtcfs mount --help does not mention {opt}")
    for cmd in ("umount", "status"):
        r = mtcfs(cmd, "--help")
        assert r.returncode == 0 and "MOUNTPOINT" in r.stdout


# -- config file ---------------------------------------------------------------


def test_config_file(daemons, tmp_path):
    cfg = tmp_path / "mtcfs.toml"
    cfg.write_text('ram-size = "1GiB"\nnode-id = "from-file"\nlog_level = "debug"\n')
    mp, ram_dir = daemons.paths("cfg")
    r = daemons.mount(mp, ram_dir, "--config", str(cfg))
    assert r.returncode == 0, r.stderr
    st = json.loads(mtcfs("status", str(mp), "--json", check=True).stdout)
    assert st["node_id"] == "from-file" and st["ram"]["capacity"] == 1 << 30
    assert mtcfs("umount", str(mp)).returncode == 0
    assert mount_entry(str(mp)) is None

    # The command line wins over the file.
    r = daemons.mount(mp, ram_dir, "--config", str(cfg), "--node-id", "from-cli")
    assert r.returncode == 0, r.stderr
    st = json.loads(mtcfs("status", str(mp), "--json", check=True).stdout)
    assert st["node_id"] == "from-cli" and st["ram"]["capacity"] == 1 << 30


def test_config_file_errors(tmp_path, ram_root):
    mp = tmp_path / "mp"
    mp.mkdir()
    base = ("mount", str(mp), "--ram-dir", str(ram_root / "ram"))
    cfg = tmp_path / "bad.toml"
    cfg.write_text('ram-size = "1GiB"\ncolour = "blue"\n')
    r = mtcfs(*base, "--config", str(cfg))
    assert r.returncode == 2
    line = one_line(r.stderr)
    assert "unknown key" in line and "colour" in line
    cfg.write_text('ram-size = "lots"\n')
    r = mtcfs(*base, "--config", str(cfg))
    assert r.returncode == 2
    assert "'lots'" in one_line(r.stderr)
    for body, key in (("o = 5", "o"), ('daemon = "no"', "daemon"), ("node-id = [1]", "node-id"),
                      ('replicas = "2"', "replicas")):
        cfg.write_text(body + "\n")
        r = mtcfs(*base, "--config", str(cfg))
        assert r.returncode == 2, (body, r)
        assert f"{key} must be" in one_line(r.stderr), body
    cfg.write_text("ram-size = \n")
    r = mtcfs(*base, "--config", str(cfg))
    assert r.returncode == 2
    assert str(cfg) in one_line(r.stderr)
    r = mtcfs(*base, "--config", str(tmp_path / "missing.toml"))
    assert r.returncode == 2
    assert "missing.toml" in one_line(r.stderr)
    assert mount_entry(str(mp)) is None


# -- --daemon ------------------------------------------------------------------


def test_daemon_returns_when_live(daemons):
    mp, ram_dir = daemons.paths("d")
    r = daemons.mount(mp, ram_dir, "--ram-size", "512MiB", "--node-id", "dnode")
    assert r.returncode == 0, r.stderr
    # Live the moment it returns: no polling.
    assert os.getxattr(mp, "user.mtcfs.control").decode() == str(ram_dir / "control.sock")
    (mp / "hello").write_bytes(b"hello")
    assert (mp / "hello").read_bytes() == b"hello"
    st = json.loads(mtcfs("status", str(mp), "--json", check=True).stdout)
    assert st["node_id"] == "dnode" and st["files"] == 1
    r = mtcfs("umount", str(mp))
    assert r.returncode == 0, r.stderr
    assert mount_entry(str(mp)) is None


def test_daemon_fails_when_ram_dir_locked(daemons):
    mp_a, ram_dir = daemons.paths("a")
    mp_b, _ = daemons.paths("b")
    r = daemons.mount(mp_a, ram_dir)
    assert r.returncode == 0, r.stderr
    pid = daemons.pid_of(ram_dir)
    r = daemons.mount(mp_b, ram_dir)
    assert r.returncode == 1
    line = one_line(r.stderr)
    assert "in use" in line and str(ram_dir) in line and str(pid) in line
    assert mount_entry(str(mp_b)) is None
    # The first daemon still serves its mount.
    assert daemons.pid_of(ram_dir) == pid
    os.getxattr(mp_a, "user.mtcfs.control")


# -- status --------------------------------------------------------------------


def test_status(mnt):
    data = os.urandom(3 << 20)
    (mnt.path / "d").mkdir()
    (mnt.path / "d" / "f").write_bytes(data)
    mnt.status()  # settled: no file is sealing any more
    r = mtcfs("status", str(mnt.path), "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["health"] == "ok"
    assert st["node_id"] == "node-a" and st["mountpoint"] == str(mnt.path)
    assert st["pid"] == mnt.proc.pid and st["node"] == "node-a"
    assert st["data_path"] in ("passthrough", "fuse")
    assert st["ram"]["capacity"] == 2 << 30 and st["ram"]["dir"] == str(mnt.ram_dir)
    assert len(data) <= st["ram"]["used"] <= len(data) + (1 << 20)
    assert st["ram"]["free"] == st["ram"]["capacity"] - st["ram"]["used"]
    assert st["files"] == 1 and st["directories"] == 2 and st["states"] == {"closed": 1}
    # With passthrough the writes went straight to the RAM tier, past the daemon.
    written = st["bytes_written"] if st["data_path"] == "fuse" else st["ram"]["used"]
    assert st["open_handles"] == 0 and written >= len(data)

    r = mtcfs("status", str(mnt.path))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "health" in out and "ok" in out and "node-a" in out
    assert "2.0 GiB" in out and "3.0 MiB" in out  # capacity and used
    assert "1 (1 closed)" in out  # files
    assert "…" not in out  # piped: as wide as it needs, nothing cut

    # Steps with long names, piped: every column whole.
    step = mnt.path / ("step_7_" + "x" * 120)
    step.mkdir()
    (step / "shard").write_bytes(b"s")
    (step / "commit_success.txt").write_bytes(b"ok")
    r = mtcfs("steps", str(mnt.path))
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout and step.name in r.stdout and "complete" in r.stdout
    row = next(line for line in r.stdout.splitlines() if step.name in line)
    assert " yes " in row  # complete

    # A relative path works too.
    r = mtcfs("status", os.path.relpath(mnt.path), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["pid"] == mnt.proc.pid


def test_status_not_mtcfs(tmp_path):
    r = mtcfs("status", str(tmp_path))
    assert r.returncode == 1
    assert "not an mtcfs mount" in one_line(r.stderr)


# -- umount --------------------------------------------------------------------


def test_umount_not_mounted(tmp_path):
    r = mtcfs("umount", str(tmp_path))
    assert r.returncode == 1
    line = one_line(r.stderr)
    assert str(tmp_path) in line and "not mounted" in line
    r = mtcfs("umount", "/dev")  # mounted, but not mtcfs
    assert r.returncode == 1
    assert "not mtcfs" in one_line(r.stderr)


def test_umount_busy(mnt):
    (mnt.path / "sub").mkdir()
    squatter = subprocess.Popen(["sleep", "60"], cwd=mnt.path / "sub")
    try:
        r = mtcfs("umount", str(mnt.path))
        assert r.returncode == 1
        line = one_line(r.stderr)
        assert "busy" in line and str(mnt.path) in line
        # Still mounted and working.
        assert mnt.proc.poll() is None
        (mnt.path / "sub" / "f").write_bytes(b"ok")
        assert (mnt.path / "sub" / "f").read_bytes() == b"ok"
        assert mnt.status()["health"] == "ok"
    finally:
        squatter.kill()
        squatter.wait()
    r = mtcfs("umount", str(mnt.path))
    assert r.returncode == 0, r.stderr
    assert mnt.proc.wait(timeout=10) == 0
    assert mount_entry(str(mnt.path)) is None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_unmounts_cleanly(mnt, sig):
    (mnt.path / "f").write_bytes(b"x" * 100_000)
    mnt.proc.send_signal(sig)
    assert mnt.proc.wait(timeout=20) == 0, mnt.log()
    assert mount_entry(str(mnt.path)) is None
    assert not (mnt.path / "f").exists()  # the bare mountpoint directory
    # The data survives: a new daemon on the same RAM dir serves it.
    mnt.start()
    assert (mnt.path / "f").read_bytes() == b"x" * 100_000


def test_umount_dead_mount(mnt):
    mnt.kill9()
    # (os.stat of the mount root may still be answered from the attribute cache.)
    for call in (os.listdir, os.statvfs):
        with pytest.raises(OSError) as e:
            call(mnt.path)
        assert e.value.errno == errno.ENOTCONN
    r = mtcfs("status", str(mnt.path))
    assert r.returncode == 1
    assert "dead mount" in one_line(r.stderr)
    r = mtcfs("umount", str(mnt.path))
    assert r.returncode == 0, r.stderr
    assert "cleaned up" in r.stdout
    assert mount_entry(str(mnt.path)) is None
    assert os.path.isdir(mnt.path)
