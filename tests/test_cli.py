"""The `mtcfs` command line (docs/usage.md): exit status 0 on
success, 2 for usage errors, 1 for other failures, one clear line on stderr,
and bad input refused before anything is mounted."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mtcfs.config import mount_entry
from mtcfs.probes import process_alive

from support.mounts import force_unmount, mtcfs

MOUNT_OPTIONS = (
    "--ram-dir", "--ram-size", "--node-id", "--listen", "--peers", "--peers-file",
    "--replicas", "--token-file", "--insecure", "--bucket", "--gcs-endpoint", "--persist",
    "--keep-steps", "--fsync", "--metrics-port", "--log-level", "--config", "-o", "--daemon",
    "--huge-pages",
)
COMMANDS = ("mount", "umount", "status", "persist", "prefetch", "steps", "demo", "csi",
            "controller", "discover")


def one_line(stderr: str) -> str:
    """The error output is exactly one non-empty line, starting with 'mtcfs'."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    assert lines[0].startswith("mtcfs"), lines[0]
    return lines[0]



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
                while process_alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if process_alive(pid):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def daemons(tmp_path: Path, ram_root: Path) -> Iterator[Daemons]:
    d = Daemons(tmp_path, ram_root)
    try:
        yield d
    finally:
        d.cleanup()


# -- usage errors: exit 2, one line, nothing mounted --------------------------


@pytest.mark.parametrize("size", ["abc", "-5", "0", "12XB", "1.5", "1", "1MiB", "0.5Ki"])
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
    (("--listen", "127.0.0.1:7000", "--insecure", "--peer-group", "-1"), "invalid --peer-group"),
    (("--listen", "127.0.0.1:7000", "--insecure", "--peer-group", "5000"),
     "invalid --peer-group"),
    (("--listen", "127.0.0.1:7000", "--insecure", "--peer-group-turn", "-1"),
     "invalid --peer-group-turn"),
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
        # Who holds it: the squatter, by pid and name.
        assert f"pid {squatter.pid} sleep (working directory)" in line, line
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


# -- bad input and leftovers -----------------------------------------------------


def ram_mounts_under(root: Path) -> list[str]:
    """Mount points below `root` in /proc/self/mountinfo (a RAM tier's tmpfs left over)."""
    from mtcfs.mountinfo import mountinfo

    return [e.mount_point for e in mountinfo() if e.mount_point.startswith(f"{root}/")]


def super_options(path: Path) -> set[str]:
    """The superblock options /proc/self/mountinfo shows for the mount at `path`."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(path):
            return set(fields[fields.index("-") + 3].split(","))
    raise AssertionError(f"{path} is not a mount point")


def listening_socket(port: int = 0) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_ram_size_larger_than_memory_leaves_no_ram_dir(tmp_path, ram_root):
    mp = tmp_path / "mp"
    mp.mkdir()
    ram_dir = ram_root / "ram"
    r = mtcfs("mount", str(mp), "--ram-dir", str(ram_dir), "--ram-size", "999Ti")
    assert r.returncode == 2, r
    assert "--ram-size" in one_line(r.stderr)
    assert not ram_dir.exists(), "a RAM dir was created for a refused mount"


def test_kubernetes_quantities(daemons, tmp_path):
    from mtcfs.sizes import parse_size

    assert parse_size("64Gi") == 64 << 30 and parse_size("512Mi") == 512 << 20
    assert parse_size("1e9") == 10**9 and parse_size("8GiB") == 8 << 30
    assert parse_size("1.5Gi") == 3 << 29
    mp, ram_dir = daemons.paths("k8s")
    r = daemons.mount(mp, ram_dir, "--ram-size", "512Mi")
    assert r.returncode == 0, r.stderr
    st = json.loads(mtcfs("status", str(mp), "--json", check=True).stdout)
    assert st["ram"]["capacity"] == 512 << 20


def test_nonempty_mountpoint(daemons, ram_root):
    mp, ram_dir = daemons.paths("full")
    (mp / "precious").write_bytes(b"keep me")
    r = mtcfs("mount", str(mp), "--ram-dir", str(ram_dir))
    assert r.returncode == 2, r
    line = one_line(r.stderr)
    assert "not empty" in line and "'precious'" in line and "-o nonempty" in line
    assert mount_entry(str(mp)) is None and not ram_dir.exists()
    # Asked for explicitly: mounted over it, the file hidden meanwhile, back afterwards.
    r = daemons.mount(mp, ram_dir, "-o", "nonempty")
    assert r.returncode == 0, r.stderr
    assert os.listdir(mp) == []
    assert mtcfs("umount", str(mp)).returncode == 0
    assert (mp / "precious").read_bytes() == b"keep me"


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_busy_listen_port(tmp_path, ram_root, log_format):
    mp = tmp_path / "mp"
    mp.mkdir()
    ram_dir = ram_root / "ram"
    with listening_socket() as busy:
        port = busy.getsockname()[1]
        r = mtcfs("mount", str(mp), "--ram-dir", str(ram_dir), "--daemon", "--insecure",
                  "--listen", f"127.0.0.1:{port}", "--data-listen", "127.0.0.1:0",
                  "--log-format", log_format)
    assert r.returncode == 2, r
    line = one_line(r.stderr)  # no gRPC line asking for GRPC_VERBOSITY
    assert "--listen" in line and f"port {port} is already in use" in line, line
    assert mount_entry(str(mp)) is None
    assert not ram_dir.exists() and ram_mounts_under(ram_root) == []


def test_data_port_collision(tmp_path, ram_root):
    """Two daemons on one machine with --listen P and P+1: the data channel's default
    port (the --listen port + 1) is the other's gRPC port."""
    mp = tmp_path / "mp"
    mp.mkdir()
    ram_dir = ram_root / "ram"
    for _ in range(20):  # a free port whose successor is free too
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port < 65535:
            try:
                other = listening_socket(port + 1)
                break
            except OSError:
                continue
    with other:
        r = mtcfs("mount", str(mp), "--ram-dir", str(ram_dir), "--daemon", "--insecure",
                  "--listen", f"127.0.0.1:{port}")
        assert r.returncode == 2, r
        line = one_line(r.stderr)
        assert f"port {port + 1}" in line and "--data-listen" in line and "in use" in line
        r = mtcfs("mount", str(mp), "--ram-dir", str(ram_dir), "--daemon", "--insecure",
                  "--listen", f"127.0.0.1:{port}", "--data-listen", f"127.0.0.1:{port + 1}")
        assert r.returncode == 2, r
        assert f"--data-listen 127.0.0.1:{port + 1}" in one_line(r.stderr)
    assert mount_entry(str(mp)) is None
    assert not ram_dir.exists() and ram_mounts_under(ram_root) == []


@pytest.mark.parametrize("existing_ram_dir", [False, True])
def test_failed_mount_leaves_nothing(tmp_path, ram_root, existing_ram_dir):
    """An unreachable bucket fails the mount after the RAM tier's tmpfs was made: it
    is unmounted again, and the RAM dir removed if this mount created it."""
    mp = tmp_path / "mp"
    mp.mkdir()
    ram_dir = ram_root / "ram"
    if existing_ram_dir:
        ram_dir.mkdir()
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = closed.getsockname()[1]
    r = mtcfs("mount", str(mp), "--ram-dir", str(ram_dir), "--daemon", "--data-path",
              "passthrough", "--bucket", "gs://nobody-home", "--gcs-endpoint",
              f"http://127.0.0.1:{dead}", timeout=120)
    assert r.returncode == 1, r
    assert "cannot reach" in one_line(r.stderr)
    assert mount_entry(str(mp)) is None
    assert ram_mounts_under(ram_root) == []
    assert ram_dir.exists() == existing_ram_dir


def test_umount_says_what_stays_and_release(daemons):
    mp, ram_dir = daemons.paths("rel")
    data = os.urandom(3 << 20)
    r = daemons.mount(mp, ram_dir, "--data-path", "passthrough", "--ram-size", "256MiB")
    assert r.returncode == 0, r.stderr
    (mp / "only-here").write_bytes(data)
    r = mtcfs("umount", str(mp))
    assert r.returncode == 0, r.stderr
    assert f"tmpfs {ram_dir}/data stays mounted" in r.stdout and "--release" in r.stdout
    assert ram_mounts_under(ram_dir) == [f"{ram_dir}/data"]

    # Re-adopted by the next daemon; --release refuses while the file's only copy is here.
    r = daemons.mount(mp, ram_dir, "--data-path", "passthrough", "--ram-size", "256MiB")
    assert r.returncode == 0, r.stderr
    r = mtcfs("umount", "--release", str(mp))
    assert r.returncode == 1, r
    assert "only copy" in one_line(r.stderr) and "--force" in r.stderr
    assert (mp / "only-here").read_bytes() == data  # still mounted, nothing lost

    # The daemon gone: the records say the same.
    assert mtcfs("umount", str(mp)).returncode == 0
    r = mtcfs("umount", "--release", str(mp), "--ram-dir", str(ram_dir))
    assert r.returncode == 1, r
    assert "only copy" in one_line(r.stderr)
    assert ram_mounts_under(ram_dir) == [f"{ram_dir}/data"]
    r = mtcfs("umount", "--release", "--force", str(mp), "--ram-dir", str(ram_dir))
    assert r.returncode == 0, r.stderr
    assert "released" in r.stdout
    assert ram_mounts_under(ram_dir) == [] and not ram_dir.exists()


def test_umount_release_once_persisted(daemons, tmp_path):
    """Persisted, the data is safe elsewhere: --release gives the memory back without
    --force, the daemon running."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    mp, ram_dir = daemons.paths("persisted")
    r = daemons.mount(mp, ram_dir, "--data-path", "passthrough", "--ram-size", "256MiB",
                      "--bucket", f"file://{bucket}", "--persist", "on-close")
    assert r.returncode == 0, r.stderr
    (mp / "f").write_bytes(b"persist me")
    r = mtcfs("umount", "--wait", "--release", str(mp))
    assert r.returncode == 0, r.stderr
    assert "released" in r.stdout
    assert ram_mounts_under(ram_dir) == [] and not ram_dir.exists()
    assert mount_entry(str(mp)) is None
    assert b"persist me" in [p.read_bytes() for p in bucket.rglob("*") if p.is_file()]


def test_controller_bad_kubeconfig(tmp_path):
    r = mtcfs("controller", "--once", "--kubeconfig", str(tmp_path / "missing"))
    assert r.returncode == 2
    assert "not found" in one_line(r.stderr)
    for body in ("not: [a kubeconfig\n", "hello: 1\n", "\x00\x01binary"):
        bad = tmp_path / "bad"
        bad.write_text(body)
        r = mtcfs("controller", "--once", "--kubeconfig", str(bad))
        assert r.returncode == 2, (body, r)
        assert "Traceback" not in r.stderr
        line = one_line(r.stderr)
        assert "--kubeconfig" in line and "not a usable kubeconfig" in line, line


@pytest.mark.parametrize("auth", ["insecure", "token"])
def test_peer_auth_shown(daemons, tmp_path, auth):
    mp, ram_dir = daemons.paths(auth)
    token = tmp_path / "token"
    token.write_text("t" * 32)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    how = ("--insecure",) if auth == "insecure" else ("--token-file", str(token))
    r = daemons.mount(mp, ram_dir, "--listen", f"127.0.0.1:{port}",
                      "--data-listen", "127.0.0.1:0", *how)
    assert r.returncode == 0, r.stderr
    st = json.loads(mtcfs("status", str(mp), "--json", check=True).stdout)
    mode = "none" if auth == "insecure" else "token"
    assert st["peer_auth"] == {"mode": mode, "tls": False, "encryption": False}
    out = mtcfs("status", str(mp), check=True).stdout
    assert "peer auth" in out and ("none (--insecure)" if auth == "insecure" else "token") in out
    logged = (ram_dir / "mtcfs.log").read_text()
    assert ("WARNING" in logged and "--insecure" in logged) == (auth == "insecure")


@pytest.mark.parametrize("setting", ["always", "never", "auto"])
def test_huge_pages(daemons, tmp_path, setting):
    mp, ram_dir = daemons.paths(setting)
    cfg = tmp_path / "hp.toml"
    cfg.write_text(f'huge-pages = "{setting}"\n')
    args = ("--config", str(cfg)) if setting == "never" else ("--huge-pages", setting)
    r = daemons.mount(mp, ram_dir, "--data-path", "passthrough", "--ram-size", "256MiB", *args)
    assert r.returncode == 0, r.stderr
    (mp / "f").write_bytes(b"x" * (4 << 20))
    hp = json.loads(mtcfs("status", str(mp), "--json", check=True).stdout)["huge_pages"]
    opts = super_options(ram_dir / "data")
    assert hp["setting"] == setting and hp["in_use"] == ("huge=within_size" in opts)
    if setting == "always":
        assert "huge=within_size" in opts and hp["probe"] is None
    elif setting == "never":
        assert not any(o.startswith("huge=") for o in opts) and hp["probe"] is None
    else:
        probe = hp["probe"]
        assert probe["bytes"] == 64 << 20
        assert probe["huge_ms_per_mib"] > 0 and probe["small_ms_per_mib"] > 0
        assert probe["chosen"] == ("within_size" if hp["in_use"] else "never")
        # The choice and its figures, in the daemon's "mounted" line.
        assert "(--huge-pages auto; first touch " in (ram_dir / "mtcfs.log").read_text()
    assert (mp / "f").read_bytes() == b"x" * (4 << 20)
    assert mtcfs("umount", "--release", "--force", str(mp)).returncode == 0
    assert ram_mounts_under(ram_dir) == []


def test_bad_huge_pages(tmp_path, ram_root):
    assert_refused_before_mount(tmp_path, ram_root, ("--huge-pages", "sometimes"),
                                "'sometimes' is not one of")


def test_busy_metrics_port(tmp_path, ram_root):
    mp = tmp_path / "mp"
    mp.mkdir()
    ram_dir = ram_root / "ram"
    with listening_socket() as busy:
        port = busy.getsockname()[1]
        r = mtcfs("mount", str(mp), "--ram-dir", str(ram_dir), "--daemon",
                  "--metrics-port", str(port), "--metrics-address", "127.0.0.1")
    assert r.returncode == 2, r
    assert f"--metrics-port {port}: port {port} is already in use" in one_line(r.stderr)
    assert mount_entry(str(mp)) is None
    assert not ram_dir.exists() and ram_mounts_under(ram_root) == []
