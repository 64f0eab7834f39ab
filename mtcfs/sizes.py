"""Sizes as people write them (`512MiB`, `8GiB`, `1.5G`, Kubernetes' `64Gi`) and as
mtcfs prints them."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

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
    """Parse `512MiB`, `8GiB`, `1.5G`, `4096` into bytes (K/M/G/T alone are binary);
    what that does not read as a size is read as a Kubernetes quantity (`64Gi`, `1e9`).
    The result must be a whole number of bytes greater than zero."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = Decimal(text)
    else:
        value = _parse_text(str(text))
    if value <= 0:
        raise SizeError(f"invalid size {text!r}: must be greater than zero")
    if value != value.to_integral_value():
        raise SizeError(f"invalid size {text!r}: not a whole number of bytes "
                        "(give a unit, e.g. 1536MiB or 1.5GiB)")
    return int(value)


def _parse_text(text: str) -> Decimal:
    m = _SIZE_RE.match(text)
    if m and m.group(2).lower() in _UNITS:
        return Decimal(m.group(1)) * _UNITS[m.group(2).lower()]
    from kubernetes.utils import parse_quantity  # Ki, Mi, Gi, Ti, Pi, Ei, exponents

    try:
        return Decimal(parse_quantity(text.strip()))
    except (ValueError, TypeError, InvalidOperation):
        raise SizeError(
            f"invalid size {text!r}: use a number of bytes or a unit such as 512MiB, 8GiB "
            "(or a Kubernetes quantity such as 64Gi)") from None


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if round(abs(n), 1) < 1024 or unit == "TiB":  # (not "1024.0 MiB")
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
