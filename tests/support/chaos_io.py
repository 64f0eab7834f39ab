"""The chaos suite's I/O, run as short-lived subprocesses by tests/support/chaos.py.

A process blocked on a frozen FUSE daemon cannot be killed until the daemon is
resumed or killed, so every call on a mount is made here, in a child the
runner waits for with a timeout, never in the runner itself. Standard library
only (plus google-cloud-storage for the bucket commands), so it starts fast.

    chaos_io.py write  MOUNT SEED STEP HOST NSHARDS SHARD_BYTES [--no-fsync]
    chaos_io.py commit MOUNT SEED STEP HOSTS NSHARDS SHARD_BYTES
    chaos_io.py read   MOUNT SEED HOSTS NSHARDS SHARD_BYTES STEP...
    chaos_io.py bucket-list   ENDPOINT BUCKET PREFIX
    chaos_io.py bucket-verify ENDPOINT BUCKET PREFIX SEED HOSTS NSHARDS SHARD_BYTES STEP...

Every command prints JSON lines on stdout. Writes go through a descriptor of
the mount's root taken first and checked to be on another device than its
parent directory: a write never lands in the bare mountpoint directory of a
detached mount.

The data is a pure function of (seed, step, host, shard): a header naming it,
then bytes of random.Random seeded with it, and a size that varies per file
(not a multiple of any block size). A reader recomputes it and compares byte
for byte; wrong bytes are described by the header they carry (which step,
host and shard they were written for), so a stale or misplaced copy is named.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import sys
import time

MARKER = ".metadata"
TMP_MARKER = ".metadata.tmp"
WITHDRAWN = ".mtcfs-withdrawn"
HEADER = 64
CHUNK = 1 << 20


# -- what the writer writes -------------------------------------------------------------------


def step_dir(step: int) -> str:
    return f"step_{step}"


def shard_name(host: int, idx: int) -> str:
    return f"__{host}_{idx}.distcp"


def shard_size(seed: int, step: int, host: int, idx: int, base: int) -> int:
    """base +- 25%, odd-sized."""
    r = random.Random(f"size/{seed}/{step}/{host}/{idx}")
    return max(HEADER + 1, int(base * r.uniform(0.75, 1.25)) | 1)


def shard_bytes(seed: int, step: int, host: int, idx: int, base: int) -> bytes:
    size = shard_size(seed, step, host, idx, base)
    head = f"chaos seed={seed} step={step} host={host} shard={idx} size={size}\n".encode()
    head = head.ljust(HEADER, b"#")[:HEADER]
    body = random.Random(f"data/{seed}/{step}/{host}/{idx}").randbytes(size - HEADER)
    return head + body


def marker_bytes(seed: int, step: int, hosts: int, nshards: int, base: int) -> bytes:
    """The commit marker: the step's file list, the same whichever host commits."""
    files = {shard_name(h, i): shard_size(seed, step, h, i, base)
             for h in range(hosts) for i in range(nshards)}
    return (json.dumps({"chaos": True, "seed": seed, "step": step, "files": files},
                       sort_keys=True) + "\n").encode()


def expected_files(seed: int, step: int, hosts: int, nshards: int, base: int
                   ) -> dict[str, tuple[int, int, int]]:
    """name -> (host, shard, size) of every file of a step; the marker is (-1, -1, size)."""
    out = {shard_name(h, i): (h, i, shard_size(seed, step, h, i, base))
           for h in range(hosts) for i in range(nshards)}
    out[MARKER] = (-1, -1, len(marker_bytes(seed, step, hosts, nshards, base)))
    return out


def file_bytes(seed: int, step: int, name: str, hosts: int, nshards: int, base: int) -> bytes:
    if name == MARKER:
        return marker_bytes(seed, step, hosts, nshards, base)
    host, idx = (int(x) for x in name[2:].split(".")[0].split("_"))
    return shard_bytes(seed, step, host, idx, base)


def describe(data: bytes) -> str:
    """What wrong bytes are: the header they carry, or a short hex dump."""
    if data.startswith(b"chaos "):
        return data[:HEADER].split(b"\n")[0].decode(errors="replace")
    if data[:1] == b"{":
        return "marker-like: " + data[:120].decode(errors="replace")
    return "unknown bytes: " + data[:32].hex()


# -- mount access ------------------------------------------------------------------------------


class NotMounted(OSError):
    pass


def open_root(mount: str) -> int:
    """A descriptor of the mount's root; NotMounted if nothing is mounted there."""
    fd = os.open(mount, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if os.fstat(fd).st_dev == os.stat(os.path.dirname(os.path.abspath(mount))).st_dev:
            raise NotMounted(errno.ENOTCONN, "nothing mounted (bare mountpoint directory)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_file(dfd: int, name: str, data: bytes, sync: bool) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=dfd)
    try:
        view = memoryview(data)
        for off in range(0, len(data), CHUNK):
            chunk = view[off:off + CHUNK]
            while chunk:
                chunk = chunk[os.write(fd, chunk):]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _fail(op: str, e: OSError, t0: float) -> dict:
    code = e.errno or 0
    return {"ok": False, "op": op, "errno": code,
            "errname": "NOTMOUNTED" if isinstance(e, NotMounted)
            else errno.errorcode.get(code, str(code)),
            "error": str(e), "elapsed": round(time.monotonic() - t0, 3)}


def cmd_write(mount: str, seed: int, step: int, host: int, nshards: int, base: int,
              sync: bool) -> dict:
    """One host's part of a step: its shards under their final names, each fsync'd."""
    t0 = time.monotonic()
    op = "open root"
    try:
        root = open_root(mount)
        try:
            op = "mkdir"
            with contextlib.suppress(FileExistsError):
                os.mkdir(step_dir(step), 0o755, dir_fd=root)
            op = "open step dir"
            dfd = os.open(step_dir(step), os.O_RDONLY | os.O_DIRECTORY, dir_fd=root)
            try:
                for idx in range(nshards):
                    op = f"write {shard_name(host, idx)}"
                    write_file(dfd, shard_name(host, idx),
                               shard_bytes(seed, step, host, idx, base), sync)
            finally:
                os.close(dfd)
        finally:
            os.close(root)
    except OSError as e:
        return _fail(op, e, t0)
    return {"ok": True, "elapsed": round(time.monotonic() - t0, 3)}


def cmd_commit(mount: str, seed: int, step: int, hosts: int, nshards: int, base: int) -> dict:
    """The DCP commit: .metadata.tmp written and fsync'd, renamed to .metadata."""
    t0 = time.monotonic()
    op = "open root"
    try:
        root = open_root(mount)
        try:
            op = "open step dir"
            dfd = os.open(step_dir(step), os.O_RDONLY | os.O_DIRECTORY, dir_fd=root)
            try:
                op = "write .metadata.tmp"
                write_file(dfd, TMP_MARKER, marker_bytes(seed, step, hosts, nshards, base), True)
                op = "rename"
                t_rename = time.monotonic()
                os.rename(TMP_MARKER, MARKER, src_dir_fd=dfd, dst_dir_fd=dfd)
                rename_s = time.monotonic() - t_rename
            finally:
                os.close(dfd)
        finally:
            os.close(root)
    except OSError as e:
        return _fail(op, e, t0)
    return {"ok": True, "elapsed": round(time.monotonic() - t0, 3),
            "rename_s": round(rename_s, 3)}


def read_file(root: int, path: str, want: bytes) -> dict:
    """Read one file whole and compare it: result ok | corrupt | missing | error."""
    t0 = time.monotonic()
    try:
        fd = os.open(path, os.O_RDONLY, dir_fd=root)
    except FileNotFoundError:
        return {"result": "missing"}
    except OSError as e:
        return {"result": "error", **_fail("open", e, t0)}
    out: dict = {"result": "ok"}
    try:
        got = bytearray()
        while chunk := os.read(fd, 4 * CHUNK):
            got += chunk
        if bytes(got) != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False))
                          if a != b), min(len(got), len(want)))
            out = {"result": "corrupt", "size": len(got), "want_size": len(want),
                   "first_diff": first, "got": describe(bytes(got))}
    except OSError as e:
        out = {"result": "error", **_fail("read", e, t0)}
    finally:
        os.close(fd)
    out["elapsed"] = round(time.monotonic() - t0, 3)
    return out


def cmd_read(mount: str, seed: int, hosts: int, nshards: int, base: int,
             steps: list[int]) -> None:
    """Read every file of these steps back; one JSON line per step (its directories'
    listings) and per file: where it was found (its final path first, then under the
    withdrawn names) and whether its bytes are right."""
    try:
        root = open_root(mount)
    except OSError as e:
        print(json.dumps({"fatal": True, **_fail("open root", e, time.monotonic())}), flush=True)
        return
    for step in steps:
        names = {}
        for d in (step_dir(step), step_dir(step) + WITHDRAWN):
            try:
                dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY, dir_fd=root)
                try:
                    names[d] = sorted(os.listdir(dfd))
                finally:
                    os.close(dfd)
            except OSError as e:
                names[d] = {"errno": e.errno, "errname": errno.errorcode.get(e.errno, "")}
        print(json.dumps({"step": step, "dirs": names}), flush=True)
        for name in expected_files(seed, step, hosts, nshards, base):
            want = file_bytes(seed, step, name, hosts, nshards, base)
            out: dict = {"step": step, "file": name, "result": "missing", "at": None}
            for d in (step_dir(step), step_dir(step) + WITHDRAWN):
                for cand in (name, name + WITHDRAWN) if name == MARKER else (name,):
                    r = read_file(root, f"{d}/{cand}", want)
                    if r["result"] != "missing":
                        out.update(r, at=f"{d}/{cand}")
                        break
                if out["at"]:
                    break
            print(json.dumps(out), flush=True)
    os.close(root)


# -- the bucket -------------------------------------------------------------------------------


def _bucket(endpoint: str, bucket: str):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(project="chaos", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": endpoint})
    return client.bucket(bucket)


def cmd_bucket_list(endpoint: str, bucket: str, prefix: str) -> None:
    objs = []
    for b in _bucket(endpoint, bucket).list_blobs(prefix=prefix + "/", timeout=20):
        objs.append({"name": b.name[len(prefix) + 1:], "size": b.size, "crc32c": b.crc32c,
                     "generation": b.generation})
    print(json.dumps({"objects": objs}), flush=True)


def cmd_bucket_verify(endpoint: str, bucket: str, prefix: str, seed: int, hosts: int,
                      nshards: int, base: int, steps: list[int]) -> None:
    """Download every file of these steps from the bucket and compare byte for byte."""
    from google.api_core import exceptions as gexc

    bkt = _bucket(endpoint, bucket)
    for step in steps:
        for name in expected_files(seed, step, hosts, nshards, base):
            want = file_bytes(seed, step, name, hosts, nshards, base)
            obj = f"{prefix}/{step_dir(step)}/{name}"
            out = {"step": step, "file": name}
            t0 = time.monotonic()
            try:
                got = bkt.blob(obj).download_as_bytes(timeout=60)
                if got == want:
                    out.update(result="ok")
                else:
                    out.update(result="corrupt", size=len(got), want_size=len(want),
                               got=describe(got))
            except gexc.NotFound:
                out.update(result="missing")
            except Exception as e:  # reported, not raised
                out.update(result="error", error=f"{type(e).__name__}: {e}"[:300])
            out["elapsed"] = round(time.monotonic() - t0, 3)
            print(json.dumps(out), flush=True)


def main(argv: list[str]) -> int:
    cmd, args = argv[0], argv[1:]
    if cmd == "write":
        sync = "--no-fsync" not in args
        args = [a for a in args if a != "--no-fsync"]
        print(json.dumps(cmd_write(args[0], *map(int, args[1:6]), sync)), flush=True)
    elif cmd == "commit":
        print(json.dumps(cmd_commit(args[0], *map(int, args[1:6]))), flush=True)
    elif cmd == "read":
        cmd_read(args[0], *map(int, args[1:5]), [int(s) for s in args[5:]])
    elif cmd == "bucket-list":
        cmd_bucket_list(*args[:3])
    elif cmd == "bucket-verify":
        cmd_bucket_verify(*args[:3], *map(int, args[3:7]), [int(s) for s in args[7:]])
    else:
        print(f"unknown command {cmd}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
