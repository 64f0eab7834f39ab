"""Peer addresses: `host:port` strings, and the peers file (one address per line)."""

from __future__ import annotations

import re


class AddressError(ValueError):
    """A bad address or peers file (a usage error where it came from the user)."""


def parse_address(text: str, what: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host, port)."""
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)|([A-Za-z0-9.-]+):(\d+)", text.strip())
    if not m:
        raise AddressError(f"invalid {what} {text!r}: use HOST:PORT")
    host = m.group(1) or m.group(3)
    port = int(m.group(2) or m.group(4))
    if not 0 < port < 65536:
        raise AddressError(f"invalid {what} {text!r}: port must be 1-65535")
    return host, port


def read_peers_file(path: str) -> list[str]:
    """One address per line; blank lines and '#' comments are ignored."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise AddressError(f"peers file {path}: {e.strerror}") from None
    out = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            parse_address(line, f"peer address in {path}")
            out.append(line)
    return out
