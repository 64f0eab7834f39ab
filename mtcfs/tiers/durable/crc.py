"""crc32c helpers for the durable tier: combining the crcs of adjacent chunks
(mtcfs.integrity.crc32c_combine: parallel downloads checksum each chunk as it
arrives, and combining them gives the whole object's crc without a second
pass), and GCS's base64 form."""

from __future__ import annotations

import base64
import binascii

from mtcfs.integrity import crc32c_combine

# One implementation of the combine, shared with the RAM and peer tiers.
__all__ = ["crc32c_combine", "crc_from_b64", "crc_to_b64"]


def crc_to_b64(crc: int) -> str:
    """GCS's form: base64 of the big-endian 4 bytes."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


def crc_from_b64(value: str | None) -> int | None:
    if not value:
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return int.from_bytes(raw, "big") if len(raw) == 4 else None
