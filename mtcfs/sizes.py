"""Sizes as people write them (`512MiB`, `8GiB`, `1.5G`) and as mtcfs prints them."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class SizeError(ValueError):
    """A size that cannot be parsed (a usage error where it came from the user)."""


def parse_size(text: str | int) -> int:
    """Parse `512MiB`, `8GiB`, `1.5G`, `4096` into bytes (K/M/G/T alone are binary)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE_RE.match(str(text))
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise SizeError(
                f"invalid size {text!r}: use a number of bytes or a unit such as 512MiB, 8GiB"
            )
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise SizeError(f"invalid size {text!r}: must be greater than zero")
    return value


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
