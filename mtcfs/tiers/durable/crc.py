"""crc32c helpers: combining the crcs of adjacent chunks, and GCS's base64 form.

Parallel downloads checksum each chunk as it arrives; combining the chunk crcs
gives the whole object's crc without a second pass over the data. The combine
is zlib's crc32_combine (GF(2) matrix arithmetic) with the Castagnoli
polynomial; the operator for a given chunk length is cached, so combining is a
32-step matrix-vector product per chunk.
"""

from __future__ import annotations

import base64
import binascii
from functools import lru_cache

_POLY = 0x82F63B78  # crc32c, reflected


def _times(mat: tuple[int, ...], vec: int) -> int:
    s = 0
    i = 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _square(mat: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(mat, mat[n]) for n in range(32))


def _compose(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """The operator applying b, then a."""
    return tuple(_times(a, b[n]) for n in range(32))


@lru_cache(maxsize=64)
def _shift_operator(nbytes: int) -> tuple[int, ...]:
    """The matrix that advances a crc register over `nbytes` zero bytes."""
    one_bit = (_POLY, *(1 << (n - 1) for n in range(1, 32)))
    op = _square(_square(_square(one_bit)))  # one zero byte = 8 zero bits
    result: tuple[int, ...] = tuple(1 << n for n in range(32))  # identity
    while nbytes:
        if nbytes & 1:
            result = _compose(op, result)
        nbytes >>= 1
        if nbytes:
            op = _square(op)
    return result


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32c(A + B) from crc1 = crc32c(A), crc2 = crc32c(B) and len2 = len(B)."""
    if len2 <= 0:
        return crc1
    return _times(_shift_operator(len2), crc1) ^ crc2


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
