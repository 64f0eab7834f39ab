"""Ports for in-process peers that must know each other's ports before they bind.

A port the kernel handed out for port 0 and that was let go may be handed to
another test (another xdist worker) before the peer binds it. These come from
below the kernel's ephemeral range (which port-0 binds draw from), a block per
xdist worker, so neither can take one of them in between."""

from __future__ import annotations

import itertools
import os
import socket

BASE = 20_000  # below /proc/sys/net/ipv4/ip_local_port_range (32768 here and by default)
PER_WORKER = 1_000

_worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
_first = BASE + (int(_worker) if _worker.isdigit() else 0) % 12 * PER_WORKER
_next = itertools.cycle(range(_first, _first + PER_WORKER))
# Handed out this round: one asked for and not bound yet (a daemon starting) is free
# to a bind check, so it is not handed out again before the block has gone round.
_handed: set[int] = set()


def free_port() -> int:
    """A port free for TCP and UDP on 127.0.0.1 now, one no port-0 bind is given."""
    for _ in range(2 * PER_WORKER):
        port = next(_next)
        if len(_handed) >= PER_WORKER - 10:
            _handed.clear()
        if port in _handed:
            continue
        try:
            for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
                with socket.socket(socket.AF_INET, kind) as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        _handed.add(port)
        return port
    raise OSError("no free port in this worker's block")
