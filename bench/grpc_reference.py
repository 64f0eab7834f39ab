"""The reference of the peer-replication benchmark: a raw gRPC stream of the
same bytes between two processes, with nothing of mtcfs in it.

    .venv/bin/python bench/grpc_reference.py measure [--size 1GiB] [--chunk 1MiB,2MiB,4MiB]
                                                     [--repeat 3] [--json]
    .venv/bin/python bench/grpc_reference.py serve --port P --dir DIR

The server (`serve`, always a process of its own, as a peer would be) has one
generic handler, raw bytes and no .proto:

- Push (client streaming): the chunks of one file, written with pwrite() into
  DIR/NAME (NAME from the "x-name" call metadata), closed without fsync (DIR is
  on /dev/shm); the reply is the byte count, 8 bytes little-endian.
- Fetch (server streaming): the request is {"name": NAME, "chunk": BYTES} as
  JSON; the reply streams DIR/NAME in pread() chunks.
- Ping (unary): empty; the client connects with it before a timed transfer.

Client side, for other bench modules (`import grpc_reference`):
`GrpcServer(dir)` starts and stops a server process; `push_file(addr, path,
chunk)` and `fetch_file(addr, name, dest, chunk)` return the seconds one
transfer took, on a channel that is connected before the clock starts and
kept for the next call (a peer holds its channels open too).

`measure` starts a server on 127.0.0.1, pushes and fetches a file on
/dev/shm for each chunk size and prints the medians in MiB/s, with the CPU
time each side used; it removes everything it made, also after an error.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from types import FrameType
from typing import Any

import grpc

SERVICE = "mtcfs.bench.RawRef"
PUSH = f"/{SERVICE}/Push"
FETCH = f"/{SERVICE}/Fetch"
PING = f"/{SERVICE}/Ping"
MiB = 1 << 20
GiB = 1 << 30
MAX_MESSAGE = 16 * MiB
# Both ends: chunks up to 16 MiB (gRPC's default limit is 4 MiB on receive).
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]
CLK_TCK = os.sysconf("SC_CLK_TCK")


class GrpcRefError(RuntimeError):
    """The reference could not run (server down, short transfer)."""


# -- the server --------------------------------------------------------------------


def _valid_name(name: str) -> bool:
    # One plain file directly in DIR: the server must not write elsewhere.
    return 0 < len(name) <= 255 and name not in (".", "..") and "/" not in name and "\0" not in name


class _Handlers:
    def __init__(self, root: Path) -> None:
        self.root = root

    def push(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        name = dict(context.invocation_metadata()).get("x-name", "")
        if not isinstance(name, str) or not _valid_name(name):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad x-name {name!r}")
        fd = os.open(self.root / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        offset = 0
        try:
            for chunk in chunks:
                # pwrite at our own offset, as a replica store writes blocks in place.
                n = os.pwrite(fd, chunk, offset)
                if n != len(chunk):
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"short write at {offset}")
                offset += n
        finally:
            os.close(fd)  # no fsync: tmpfs, like the RAM tier
        return struct.pack("<Q", offset)

    def fetch(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        try:
            req = json.loads(request)
            name, chunk = str(req["name"]), int(req["chunk"])
        except (ValueError, KeyError, TypeError):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "want {name, chunk} as JSON")
        if not _valid_name(name) or not 0 < chunk <= MAX_MESSAGE:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad name {name!r} or chunk {chunk}")
        try:
            fd = os.open(self.root / name, os.O_RDONLY)
        except FileNotFoundError:
            context.abort(grpc.StatusCode.NOT_FOUND, name)
        try:
            offset = 0
            while True:
                data = os.pread(fd, chunk, offset)
                if not data:
                    return
                offset += len(data)
                yield data
        finally:
            os.close(fd)


def serve(root: Path, host: str, port: int, exit_on_eof: bool) -> int:
    """Run the server until SIGTERM/SIGINT/SIGHUP (or EOF on stdin with
    `exit_on_eof`). Prints "ready PORT" on stdout once it accepts calls."""
    h = _Handlers(root)
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            # No (de)serializers: the messages are the raw bytes.
            "Push": grpc.stream_unary_rpc_method_handler(h.push),
            "Fetch": grpc.unary_stream_rpc_method_handler(h.fetch),
            "Ping": grpc.unary_unary_rpc_method_handler(lambda req, ctx: b""),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        print(f"serve: cannot bind {host}:{port}", file=sys.stderr)
        return 1
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    if exit_on_eof:
        # The parent holds our stdin: its death (even a SIGKILL) closes it, and we follow.
        def watch() -> None:
            sys.stdin.read()
            stop.set()

        threading.Thread(target=watch, daemon=True).start()
    print(f"ready {bound}", flush=True)
    while not stop.wait(1.0):  # a timed wait, so that Python runs the signal handlers
        pass
    server.stop(grace=None).wait(5)
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far. (common.cpu_seconds's
    twin: this reference runs as a process of its own, without mtcfs or rich.)"""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class GrpcServer:
    """A `serve` process on `host`, port chosen by the kernel; `addr` is "host:port".
    A context manager; stop() is idempotent (fit for Scratch.defer)."""

    def __init__(self, root: Path, host: str = "127.0.0.1", timeout: float = 30) -> None:
        self.root = root
        cmd = [sys.executable, str(Path(__file__).resolve()), "serve"]
        cmd += ["--host", host, "--port", "0", "--dir", str(root), "--exit-on-eof"]
        self.proc: subprocess.Popen[str] | None = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.pid = self.proc.pid
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            line = self.proc.stdout.readline() if sel.select(timeout) else ""
        if not line.startswith("ready "):
            self.stop()
            raise GrpcRefError(f"the gRPC reference server did not start: {line!r}")
        self.port = int(line.split()[1])
        self.addr = f"{host}:{self.port}"

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; always reaps the process."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()

    def __enter__(self) -> GrpcServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- the client --------------------------------------------------------------------

_channels: dict[str, grpc.Channel] = {}


def channel(addr: str, timeout: float = 10) -> grpc.Channel:
    """The cached, connected channel to `addr`: connecting is not part of a transfer."""
    ch = _channels.get(addr)
    if ch is None:
        ch = _channels[addr] = grpc.insecure_channel(addr, options=OPTIONS)
    # A ping rather than channel_ready_future, whose polling thread outlives close().
    ch.unary_unary(PING)(b"", wait_for_ready=True, timeout=timeout)
    return ch


def close_channels() -> None:
    while _channels:
        _channels.popitem()[1].close()


def _check_chunk(chunk: int) -> None:
    if not 0 < chunk <= MAX_MESSAGE:
        raise ValueError(f"chunk must be 1 B to {MAX_MESSAGE} B, not {chunk}")


def push_file(addr: str, path: str | Path, chunk: int = MiB, name: str | None = None) -> float:
    """Stream the local file `path` to the server at `addr` as DIR/`name` (default:
    its base name) in `chunk`-byte pread()s; seconds from open to the server's reply."""
    _check_chunk(chunk)
    call = channel(addr).stream_unary(PUSH)
    name = name or Path(path).name
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size

        def chunks() -> Iterator[bytes]:
            # Consumed by gRPC's sending thread as the stream drains.
            for offset in range(0, size, chunk):
                yield os.pread(fd, chunk, offset)

        reply = call(chunks(), metadata=(("x-name", name),))
    finally:
        os.close(fd)
    t = time.perf_counter() - t0
    (stored,) = struct.unpack("<Q", reply)
    if stored != size:
        raise GrpcRefError(f"push of {path}: the server stored {stored} of {size} bytes")
    return t


def fetch_file(addr: str, name: str, dest_path: str | Path, chunk: int = MiB) -> float:
    """Stream DIR/`name` from the server at `addr` into `dest_path` (created or
    truncated, pwrite()s, no fsync); seconds from the request to close."""
    _check_chunk(chunk)
    call = channel(addr).unary_stream(FETCH)
    request = json.dumps({"name": name, "chunk": chunk}).encode()
    t0 = time.perf_counter()
    fd = os.open(dest_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        offset = 0
        for data in call(request):
            offset += os.pwrite(fd, data, offset)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


# -- measure -----------------------------------------------------------------------
# bench/common.py (rich, mtcfs) is imported where used: the server process needs neither.


def _series(values: list[float]) -> dict[str, Any]:
    from common import median

    return {"median": median(values), "min": min(values), "max": max(values), "values": values}


def _make_source(path: Path, size: int) -> None:
    # Incompressible bytes, so that nothing on the way can take a shortcut.
    block = os.urandom(MiB)
    with open(path, "wb") as f:
        for offset in range(0, size, MiB):
            f.write(block[: min(MiB, size - offset)])


def measure(size: int, chunks: list[int], repeat: int) -> list[dict[str, Any]]:
    """Push and fetch `size` bytes `repeat` times per chunk size (after one untimed
    warm-up of each), chunk sizes in alternating order; per chunk size: MiB/s of
    each direction and CPU seconds per GiB of the client and the server process."""
    from common import err, fmt

    keys = ("push", "fetch", "push_client", "push_server", "fetch_client", "fetch_server")
    rates: dict[int, dict[str, list[float]]] = {c: {k: [] for k in keys} for c in chunks}
    work = Path(tempfile.mkdtemp(prefix="mtcfs-grpcref-", dir="/dev/shm"))
    try:
        store = work / "server"
        store.mkdir()
        src, dest = work / "src.bin", work / "dest.bin"
        _make_source(src, size)
        with GrpcServer(store) as srv:
            err.print(f"  gRPC reference server at {srv.addr} (pid {srv.pid})", style="dim")

            def one(c: int, timed: bool) -> None:
                (store / src.name).unlink(missing_ok=True)  # no truncate in the timed push
                cc0, cs0 = time.process_time(), srv.cpu_seconds()
                tp = push_file(srv.addr, src, c)
                cc1, cs1 = time.process_time(), srv.cpu_seconds()
                tf = fetch_file(srv.addr, src.name, dest, c)
                cc2, cs2 = time.process_time(), srv.cpu_seconds()
                got = dest.stat().st_size
                dest.unlink()
                if got != size:
                    raise GrpcRefError(f"fetched {got} bytes, expected {size}")
                if not timed:
                    return
                r = rates[c]
                r["push"].append(size / MiB / tp)
                r["fetch"].append(size / MiB / tf)
                # process_time() covers all our threads, gRPC's own included.
                r["push_client"].append((cc1 - cc0) * GiB / size)
                r["push_server"].append((cs1 - cs0) * GiB / size)
                r["fetch_client"].append((cc2 - cc1) * GiB / size)
                r["fetch_server"].append((cs2 - cs1) * GiB / size)
                err.print(
                    f"  chunk {c / MiB:g} MiB: push {fmt(r['push'][-1])} MiB/s, "
                    f"fetch {fmt(r['fetch'][-1])} MiB/s",
                    style="dim",
                )

            for c in chunks:
                one(c, timed=False)
            for i in range(repeat):
                # Alternate the order, so that drifting noise does not favour one size.
                for c in chunks if i % 2 == 0 else chunks[::-1]:
                    one(c, timed=True)
            close_channels()  # before the server goes: no GOAWAY noise in the log
    finally:
        close_channels()
        shutil.rmtree(work, ignore_errors=True)

    return [
        {
            "chunk": c,
            "size": size,
            "push_mib_s": _series(r["push"]),
            "fetch_mib_s": _series(r["fetch"]),
            "push_cpu_s_per_gib": {
                "client": _series(r["push_client"]),
                "server": _series(r["push_server"]),
            },
            "fetch_cpu_s_per_gib": {
                "client": _series(r["fetch_client"]),
                "server": _series(r["fetch_server"]),
            },
        }
        for c, r in rates.items()
    ]


def _table(results: list[dict[str, Any]], repeat: int) -> Any:
    from common import fmt, spread
    from rich.table import Table

    t = Table(
        title=f"raw gRPC stream between two processes, {results[0]['size'] / MiB:,.0f} MiB, "
        f"median of {repeat} (CPU: s per GiB, client/server)",
        title_justify="left",
    )
    for col in ("chunk", "push MiB/s", "fetch MiB/s", "push CPU", "fetch CPU"):
        t.add_column(col, justify="right")

    def rate(s: dict[str, Any]) -> str:
        return f"{fmt(s['median'])} [dim]{spread(s['values'])}[/]"

    def cpu(s: dict[str, Any]) -> str:
        return f"{fmt(s['client']['median'])}/{fmt(s['server']['median'])}"

    for r in results:
        t.add_row(
            f"{r['chunk'] / MiB:g} MiB",
            rate(r["push_mib_s"]),
            rate(r["fetch_mib_s"]),
            cpu(r["push_cpu_s_per_gib"]),
            cpu(r["fetch_cpu_s_per_gib"]),
        )
    return t


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/grpc_reference.py",
        description="A raw gRPC stream of a file between two processes (the peer reference).",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the raw-bytes gRPC server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, required=True, help="0: any free port (printed)")
    s.add_argument("--dir", type=Path, required=True, help="where pushed files go")
    s.add_argument("--exit-on-eof", action="store_true", help="stop when stdin closes")
    m = sub.add_parser("measure", help="push/fetch MiB/s through a local server")
    m.add_argument("--size", default="1GiB", help="bytes per transfer [1GiB]")
    m.add_argument(
        "--chunk", default="1MiB,2MiB,4MiB", help="chunk sizes, comma-separated [1MiB,2MiB,4MiB]"
    )
    m.add_argument("--repeat", type=int, default=3, help="timed repeats per chunk size [3]")
    m.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)

    if args.cmd == "serve":
        if not args.dir.is_dir():
            p.error(f"--dir {args.dir}: not a directory")
        return serve(args.dir, args.host, args.port, args.exit_on_eof)

    from common import err
    from rich.console import Console

    from mtcfs.config import ConfigError, parse_size

    try:
        size = parse_size(args.size)
        chunks = [parse_size(c.strip()) for c in args.chunk.split(",") if c.strip()]
    except ConfigError as e:
        p.error(str(e))
    if size < 1 or args.repeat < 1 or not chunks:
        p.error("--size, --repeat and --chunk must be positive")
    if any(not 0 < c <= MAX_MESSAGE for c in chunks):
        p.error(f"a chunk must be at most {MAX_MESSAGE // MiB} MiB (the message size limit)")
    if shutil.disk_usage("/dev/shm").free < 3 * size + MiB:
        p.error("/dev/shm needs 3 x --size free (source, server copy, fetched copy)")

    # Also SIGTERM/SIGHUP: the finally blocks of measure() then stop the server.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    try:
        results = measure(size, list(dict.fromkeys(chunks)), args.repeat)
    except KeyboardInterrupt:
        err.print("[red]grpc_reference: interrupted, cleaned up[/]")
        return 130
    except (GrpcRefError, grpc.RpcError, OSError) as e:
        err.print(f"[red]grpc_reference: error: {e}[/]")
        return 1
    if args.json:
        print(json.dumps({"repeat": args.repeat, "results": results}, indent=2))
    else:
        Console(highlight=False).print(_table(results, args.repeat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
