"""Request handling shared by the CSI services: one log line per request and
errors turned into gRPC status codes."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

log = logging.getLogger("mtcfs.csi")

F = TypeVar("F", bound=Callable[..., Any])

POD_NAME = "csi.storage.k8s.io/pod.name"
POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"


class RpcError(Exception):
    """Answer the request with `code` and `message` (INVALID_ARGUMENT, ...)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def describe(request: Any) -> str:
    """The request's identifying fields for the log; never secrets or mount flags."""
    parts = []
    for field in ("volume_id", "target_path"):
        value = getattr(request, field, "")
        if value:
            parts.append(f"{field}={value}")
    if getattr(request, "readonly", False):
        parts.append("readonly")
    context = getattr(request, "volume_context", None)
    if context:
        pod = f"{context.get(POD_NAMESPACE, '?')}/{context.get(POD_NAME, '?')}"
        parts.append(f"pod={pod}")
        if "job" in context:
            parts.append(f"job={context['job']}")
    return "".join(f" {p}" for p in parts)


def handler(level: int = logging.INFO) -> Callable[[F], F]:
    """Wrap a servicer method: log `Method fields -> CODE (ms)` once per request;
    RpcError becomes its status, any other exception INTERNAL with its message."""

    def wrap(fn: F) -> F:
        name = fn.__name__

        @functools.wraps(fn)
        def run(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            started = time.monotonic()

            def took() -> str:
                return f"{(time.monotonic() - started) * 1000:.1f} ms"

            try:
                reply = fn(self, request, context)
            except RpcError as e:
                log.warning("%s%s -> %s: %s (%s)", name, describe(request), e.code.name,
                            e.message, took())
                context.abort(e.code, e.message)
            except Exception as e:
                log.exception("%s%s -> INTERNAL (%s)", name, describe(request), took())
                context.abort(grpc.StatusCode.INTERNAL, f"{name}: {e}")
            log.log(level, "%s%s -> OK (%s)", name, describe(request), took())
            return reply

        return run  # type: ignore[return-value]

    return wrap
