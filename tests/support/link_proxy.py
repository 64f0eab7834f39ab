"""A TCP proxy on 127.0.0.1 that plays a bad network link between a client and a
server: it can throttle the server-to-client direction to a shared byte rate (a
slow link, all connections together), the client-to-server direction likewise
(`up_rate`: a slow upload), and cut the first connection that carries
more than `drop_after` bytes upstream, mid-request.

When it cuts a connection it also wakes the other direction's blocked recv(),
so the server really sees the cut at once (a
single-threaded server such as gcp-storage-emulator would otherwise wait on the
half-dead connection forever). `drop` chooses what the server sees: "fin" (a
clean end of stream: the server reads a short request body) or "rst" (a
connection reset: the server's read fails).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

_LINGER_RST = b"\x01\0\0\0\0\0\0\0"  # SO_LINGER on, 0 s: close() sends RST


class LinkProxy:
    def __init__(self, target_port: int, *, rate: float | None = None,
                 up_rate: float | None = None, drop_after: int | None = None,
                 drop: str = "rst", drop_nth: int = 1, port: int | None = None) -> None:
        if drop not in ("fin", "rst"):
            raise ValueError("drop must be 'fin' or 'rst'")
        self.target_port = target_port
        self.rate = rate  # bytes per second downstream, shared by all connections
        self.up_rate = up_rate  # bytes per second upstream, likewise
        self.drop_after = drop_after
        self.drop_mode = drop
        self.drop_nth = drop_nth  # cut the n-th connection that goes past drop_after
        self._over = 0
        self.dropped = threading.Event()
        self.connections = 0
        self.upstream_bytes = 0
        self.downstream_bytes = 0
        self._listener = socket.create_server(("127.0.0.1", port or 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._next_slot = {True: 0.0, False: 0.0}  # upstream?: when that direction is free
        self._socks: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self.connections += 1
                self._socks += [client, upstream]
            pair = _Pair(client, upstream)
            threading.Thread(target=self._pump, args=(pair, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(pair, False), daemon=True).start()

    def _throttle(self, n: int, upstream: bool) -> None:
        rate = self.up_rate if upstream else self.rate
        if not rate:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_slot[upstream])
            wake = self._next_slot[upstream] = start + n / rate
        delay = wake - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def _pump(self, pair: _Pair, upstream: bool) -> None:
        src, dst = (pair.client, pair.upstream) if upstream else (pair.upstream, pair.client)
        carried = 0
        try:
            while not pair.cut and (data := src.recv(1 << 16)):
                carried += len(data)
                self._throttle(len(data), upstream)
                if upstream:
                    with self._lock:
                        self.upstream_bytes += len(data)
                    if (self.drop_after is not None and not self.dropped.is_set()
                            and carried > self.drop_after >= carried - len(data)):
                        # This connection just went past the limit: the n-th to do so is cut.
                        with self._lock:
                            self._over += 1
                            cut = self._over == self.drop_nth
                        if cut:
                            self.dropped.set()
                            # Forward up to the limit, then cut both sides.
                            keep = len(data) - (carried - self.drop_after)
                            if keep > 0:
                                dst.sendall(data[:keep])
                            pair.cut_now(self.drop_mode)
                            return
                else:
                    with self._lock:
                        self.downstream_bytes += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            pair.finish()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def __enter__(self) -> LinkProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Pair:
    """Both sockets of one proxied connection, closed once by whichever side ends."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.cut = False
        self._lock = threading.Lock()
        self._done = False

    def cut_now(self, mode: str) -> None:
        with self._lock:
            self.cut = True
            for s in (self.client, self.upstream):
                with contextlib.suppress(OSError):
                    if mode == "rst":
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
                        s.shutdown(socket.SHUT_RD)  # wakes the other pump, sends nothing
                    else:
                        s.shutdown(socket.SHUT_RDWR)  # FIN
            self._close()

    def finish(self) -> None:
        with self._lock:
            if self.cut:
                self._close()
                return
            for s in (self.client, self.upstream):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            self._close()

    def _close(self) -> None:
        if self._done:
            return
        self._done = True
        for s in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                s.close()
