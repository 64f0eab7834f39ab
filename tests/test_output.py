"""What the commands print, on a terminal and piped, what a step directory's
user.mtcfs.state and the traffic counters say, and how the metrics are served, on
real mounts."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import socket
import struct
import subprocess
import termios
import urllib.request
from pathlib import Path

import pytest

from mtcfs.fs.passthrough import unavailable

from support.mounts import MTCFS, blob, free_port, mtcfs, wait_until

MiB = 1 << 20
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
BOX = set("─━│┃┏┓┗┛┡┩└┘┌┐├┤┬┴┼╇╈╋…")


def save_step(root: Path, name: str, files: int = 2, size: int = 4096) -> Path:
    d = root / name
    d.mkdir()
    for i in range(files):
        (d / f"shard_{i}").write_bytes(blob(i, size))
    (d / "commit_success.txt").write_bytes(b"ok")
    return d


def on_terminal(args: list[str], columns: int = 80) -> str:
    """Run a command with stdout on a pseudo-terminal `columns` wide; its output."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["TERM"] = "xterm-256color"  # (rich takes a "dumb" terminal as 80 columns wide)
    p = subprocess.Popen(args, stdout=slave, stderr=subprocess.PIPE, env=env)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert p.wait(timeout=60) == 0, p.stderr.read() if p.stderr else ""
    return ANSI.sub("", out.decode().replace("\r\n", "\n"))


def test_piped_tables_are_plain_and_complete(mnt):
    tmp = save_step(mnt.path, "3.orbax-checkpoint-tmp-1723")
    (tmp / "commit_success.txt").unlink()
    save_step(mnt.path, "checkpoints_step_100_with_a_rather_long_name")
    for cmd in ("status", "steps"):
        r = mtcfs(cmd, str(mnt.path))
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert not BOX & set(r.stdout), r.stdout
        assert all(line == line.rstrip() for line in lines), r.stdout
    out = mtcfs("steps", str(mnt.path)).stdout
    lines = out.splitlines()
    assert lines[0] == f"steps in {mnt.path}"
    assert lines[1].split() == ["step", "path", "complete", "files", "size", "replicas",
                                "in", "RAM", "persisted", "safe"]
    tmp_row = next(ln for ln in lines if "3.orbax-checkpoint-tmp-1723" in ln)
    assert "no (temporary name)" in tmp_row
    row = next(ln for ln in lines if "checkpoints_step_100_with_a_rather_long_name" in ln)
    assert row.split()[:3] == ["100", "checkpoints_step_100_with_a_rather_long_name", "yes"]
    # No durable tier, no peers: nothing is safe, and the sentence says so in the singular
    assert lines[-1] == ("newest complete step safe: none (no peer copies and no durable "
                         "tier here)")
    st = mtcfs("status", str(mnt.path)).stdout.splitlines()
    assert st[0] == f"mtcfs {mnt.path}"
    assert "files 5 (5 closed) in 3 directories" in [" ".join(ln.split()) for ln in st]
    assert "newest safe step none" in [" ".join(ln.split()) for ln in st]


def test_steps_on_an_80_column_terminal_cuts_nothing(mnt):
    long = "llama3-70b.step-000100.orbax-checkpoint"
    save_step(mnt.path, long)
    tmp = save_step(mnt.path, "3.orbax-checkpoint-tmp-1723")
    (tmp / "commit_success.txt").unlink()
    out = on_terminal([*MTCFS, "steps", str(mnt.path)])
    assert "…" not in out, out
    flat = " ".join(out.split())
    for whole in (long, "3.orbax-checkpoint-tmp-1723", "no (temporary name)"):
        assert whole in flat, out
    # (one line per step, wrapped between words: the table would not fit)
    # (the heading names the mountpoint: as long as its path is)
    assert all(len(line) <= 80 for line in out.splitlines()[1:] if " " in line.strip()), out
    # A terminal wide enough gets the table, drawn
    wide = on_terminal([*MTCFS, "steps", str(mnt.path)], columns=160)
    assert "┃ step" in wide and long in wide and "no (temporary name)" in wide, wide
    # The status table on the same terminal: nothing cut either
    out = on_terminal([*MTCFS, "status", str(mnt.path)])
    assert "…" not in out and "health" in out


def test_step_directory_state_xattr(make_mount, tmp_path):
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    m = make_mount(extra=("--bucket", f"file://{bucket}", "--persist", "on-close"))
    save_step(m.path, "step_5", files=3)
    (m.path / "step_6").mkdir()
    (m.path / "step_6" / "shard_0").write_bytes(b"x")  # no marker: not complete
    (m.path / "plain").mkdir()

    def state(rel: str) -> dict:
        return json.loads(os.getxattr(m.path / rel, "user.mtcfs.state"))

    st = wait_until(lambda: (s := state("step_5"))["persisted"] and s, timeout=30,
                    what="step_5 persisted")
    assert st["type"] == "directory" and st["path"] == "step_5" and st["step"] == 5
    assert st["complete"] and st["safe"] and not st["withdrawn"]
    assert st["files"] == 4 and st["files_persisted"] == 4  # 3 shards and the marker
    assert "file_list" not in st
    listed = json.loads(mtcfs("steps", str(m.path), "--json").stdout)
    entry = next(e for e in listed["steps"] if e["path"] == "step_5")
    assert {k: v for k, v in entry.items() if k != "file_list"} == \
        {k: v for k, v in st.items() if k != "type"}
    six = state("step_6")
    assert six["complete"] is False and six["safe"] is False and six["files"] == 1
    assert state("plain") == {"type": "directory", "path": "plain"}
    assert listed["newest_complete_safe"] == "step_5"
    assert m.status()["newest_safe_step"] == {"path": "step_5", "step": 5}


@pytest.mark.skipif(unavailable() is not None, reason=f"no FUSE passthrough: {unavailable()}")
def test_passthrough_writes_are_counted_at_seal(make_mount):
    mnt = make_mount(extra=("--data-path", "passthrough"))
    st = mnt.status()
    assert st["data_path"] == "passthrough"
    (mnt.path / "a").write_bytes(blob(1, 3 * MiB))
    with open(mnt.path / "b", "wb") as f:
        f.write(blob(2, MiB))
        f.flush()
        os.fsync(f.fileno())  # the version sealed here...
    # ... and not counted again at close (unchanged since)
    st = mnt.status()
    assert st["bytes_written"] == 0  # the daemon saw none of it
    assert st["bytes_written_passthrough"] == 4 * MiB
    out = mtcfs("status", str(mnt.path)).stdout
    assert "4.0 MiB written (4.0 MiB through passthrough" in out, out


def test_persist_and_prefetch_json(make_mount, tmp_path):
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    m = make_mount(extra=("--bucket", f"file://{bucket}", "--persist", "manual"))
    (m.path / "d").mkdir()
    (m.path / "d" / "f").write_bytes(blob(3, MiB))
    m.status()
    r = mtcfs("persist", str(m.path), "d", "--wait", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out == {"queued_files": 1, "queued_bytes": MiB, "skipped_open_files": 0,
                   "persisted_files": 1, "bytes": MiB, "failed": {}}
    r = mtcfs("persist", str(m.path), "d")
    assert r.stdout == "" and r.stderr.startswith("queued 1 file, 1.0 MiB"), r.stderr
    r = mtcfs("prefetch", str(m.path), "d", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["files"] == 1 and out["bytes"] == MiB and out["fetched_files"] == 0
    assert out["failed"] == {}


def test_metrics_server_is_threaded_with_process_metrics(make_mount):
    port = free_port()
    m = make_mount(extra=("--metrics-port", str(port), "--metrics-address", "127.0.0.1"))
    url = f"http://127.0.0.1:{port}"
    # A client that sent half a request and stalls holds a thread of its own, not
    # the server (the single-threaded server it replaced answered nobody meanwhile).
    with socket.create_connection(("127.0.0.1", port)) as stalled:
        stalled.sendall(b"GET /metrics HTTP/1.1\r\n")
        text = wait_until(lambda: "mtcfs_build_info" in (t := urllib.request.urlopen(
            f"{url}/metrics", timeout=5).read().decode()) and t, timeout=10)
        with urllib.request.urlopen(f"{url}/healthz", timeout=5) as r:
            assert r.status == 200 and json.loads(r.read())["ok"] is True
    # prometheus_client's default collectors: the daemon's own RSS and CPU
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "python_info"):
        assert f"\n{name}" in text, name
    pid = m.status()["pid"]
    rss = next(float(ln.split()[1]) for ln in text.splitlines()
               if ln.startswith("process_resident_memory_bytes "))
    with open(f"/proc/{pid}/status") as f:
        vmrss = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))
    assert 0.5 * vmrss < rss < 2 * vmrss  # the daemon's, not the scraper's
    assert 'mtcfs_health{state="ok"} 1.0' in text


def test_umount_json(make_mount):
    m = make_mount(extra=("--data-path", "passthrough"))
    (m.path / "f").write_bytes(blob(4, MiB))
    m.status()
    r = mtcfs("umount", str(m.path), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["unmounted"] == str(m.path)
    stays = out["stays"]
    assert stays["ram_dir"] == str(m.ram_dir) and stays["tmpfs"] == f"{m.ram_dir}/data"
    assert stays["used_bytes"] >= MiB and stays["tmpfs_size_bytes"] >= 2 << 30
    m.proc.wait(timeout=30)
    r = mtcfs("umount", str(m.path), "--release", "--force", "--ram-dir", str(m.ram_dir),
              "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["released"]["ram_dir"] == str(m.ram_dir) and out["released"]["freed_bytes"] >= MiB
    assert not m.ram_dir.exists()
