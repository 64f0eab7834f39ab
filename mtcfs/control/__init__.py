"""The control channel between the CLI and a running daemon (this module), and the
requests the daemon answers on it (`handlers`).

A unix socket in the RAM dir (mode 0600 dir, so only root/the owner reaches
it). One JSON request per connection, one JSON reply:
    {"op": "status"}   -> {"ok": true, "status": {...}}
    {"op": "shutdown"} -> {"ok": true} and the daemon unmounts
The CLI finds the socket from the mountpoint through the virtual extended
attribute `user.mtcfs.control` on the mount's root.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import trio

log = logging.getLogger(__name__)

MAX_REQUEST = 1 << 16
CONTROL_XATTR = "user.mtcfs.control"

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class ControlError(RuntimeError):
    pass


async def serve(path: str, handler: Handler, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(16)
    listener = trio.SocketListener(sock)

    async def on_connection(stream: trio.SocketStream) -> None:
        async with stream:
            try:
                with trio.fail_after(10):
                    buf = b""
                    while b"\n" not in buf and len(buf) < MAX_REQUEST:
                        chunk = await stream.receive_some(4096)
                        if not chunk:
                            break
                        buf += chunk
                request = json.loads(buf.split(b"\n", 1)[0] or b"{}")
                if not isinstance(request, dict):
                    raise ValueError("request must be a JSON object")
                reply = await handler(request)
            except (ValueError, trio.TooSlowError) as e:
                reply = {"ok": False, "error": f"bad request: {e}"}
            except Exception as e:  # a failing request must not take the daemon down
                log.exception("control request failed")
                reply = {"ok": False, "error": str(e)}
            with contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(json.dumps(reply).encode() + b"\n")

    task_status.started()
    await trio.serve_listeners(on_connection, [listener])


def socket_for(mountpoint: str) -> str:
    try:
        return os.getxattr(mountpoint, CONTROL_XATTR).decode()
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise ControlError(
                f"{mountpoint}: the mtcfs daemon is not running (dead mount); "
                f"run 'mtcfs umount {mountpoint}' to clean it up"
            ) from None
        if e.errno in (errno.ENODATA, errno.ENOTSUP):
            raise ControlError(f"{mountpoint} is not an mtcfs mount") from None
        raise ControlError(f"{mountpoint}: {e.strerror}") from None


def request(mountpoint: str, op: str, timeout: float = 30.0, **args: Any) -> dict[str, Any]:
    return request_socket(socket_for(mountpoint), op, timeout, **args)


def request_socket(path: str, op: str, timeout: float = 30.0, **args: Any) -> dict[str, Any]:
    """One request to the daemon listening at the control socket `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(path)
            s.sendall(json.dumps({"op": op, **args}).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(1 << 16)
                if not chunk:
                    break
                buf += chunk
        except OSError as e:
            raise ControlError(f"cannot reach the mtcfs daemon at {path}: {e}") from None
    try:
        reply = json.loads(buf)
    except ValueError:
        raise ControlError("the mtcfs daemon sent an unreadable reply") from None
    if not reply.get("ok"):
        raise ControlError(reply.get("error", "request failed"))
    return reply
