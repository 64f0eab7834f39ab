"""Every checksum mtcfs keeps, in one scheme: crc32c.

- A file's crc32c, and one crc32c per 4 MiB block (BLOCK), packed as
  little-endian uint32s: streamed while it is written (StreamingCrc), or one
  pass at seal time (block_crcs_of_fd). Copies between hosts are verified block
  by block as they arrive (BlockVerifier).
- An object in the durable tier carries, besides GCS's whole-object crc32c, one
  crc32c per chunk in its custom metadata (CHUNK_META_KEY), so a download can
  serve each chunk once verified. Chunks are whole numbers of blocks, so their
  crcs derive from the file's block crcs without reading the data again
  (chunk_crcs_from_blocks); crc32c_combine joins adjacent ranges.
- Data that does not match is an IntegrityError: never served, never counted.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import mmap
import os
import re
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import crc32c
import google_crc32c

BLOCK = 4 << 20  # block size of per-block checksums
CHUNK = BLOCK  # kept for old importers: read size of one pass

_POLY = 0x82F63B78  # Castagnoli, reflected

Tables = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]

# -- combine: zlib's crc32_combine, GF(2) matrix form ----------------------------------------------
#
# Appending n zero bytes to a (raw, unconditioned) crc register is a linear map on
# GF(2)^32, stored as 32 column vectors: column i is the image of bit i. Because
# crc32c pre- and post-inverts, crc(A+B) = shift(crc(A), len(B)) ^ crc(B).


def _times(mat: list[int], vec: int) -> int:
    """mat @ vec over GF(2)."""
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _compose(a: list[int], b: list[int]) -> list[int]:
    """The operator a after b."""
    return [_times(a, col) for col in b]


def _one_zero_byte() -> list[int]:
    # One zero bit: shift right, folding the polynomial in when bit 0 falls out.
    bit = [_POLY] + [1 << (i - 1) for i in range(1, 32)]
    two = _compose(bit, bit)
    four = _compose(two, two)
    return _compose(four, four)


# _ZERO_POW[k] appends 2**k zero bytes; squared on demand, shared by every length.
_ZERO_POW: list[list[int]] = [_one_zero_byte()]
_ZERO_POW_LOCK = threading.Lock()  # one-pass checksums run in worker threads


def _zero_pow(k: int) -> list[int]:
    if k >= len(_ZERO_POW):
        with _ZERO_POW_LOCK:
            while k >= len(_ZERO_POW):
                _ZERO_POW.append(_compose(_ZERO_POW[-1], _ZERO_POW[-1]))
    return _ZERO_POW[k]


def _shift(crc: int, n: int) -> int:
    """Append n zero bytes to crc directly: cheap for a length used once."""
    k = 0
    while n and crc:
        if n & 1:
            crc = _times(_zero_pow(k), crc)
        n >>= 1
        k += 1
    return crc


def _build_tables(n: int) -> Tables:
    """The operator for n zero bytes as four byte-indexed tables (4 lookups per apply)."""
    cols = [_shift(1 << i, n) for i in range(32)]
    tables = []
    for byte in range(4):
        c = cols[8 * byte:8 * byte + 8]
        t = [0] * 256
        for i in range(1, 256):
            low = i & -i  # linearity: t[i] = t[i without its lowest bit] ^ t[lowest bit]
            t[i] = t[i ^ low] ^ c[low.bit_length() - 1]
        tables.append(tuple(t))
    return tables[0], tables[1], tables[2], tables[3]


# Tables per length, built on a length's second use: a one-off length is cheaper to apply
# directly than to tabulate. Bounded; a race only builds a table twice.
_TABLES: dict[int, Tables] = {}
_SEEN: dict[int, None] = {}
_MAX_CACHED = 64


def _combine_tables(n: int) -> Tables:
    t = _TABLES.get(n)
    if t is None:
        if len(_TABLES) >= _MAX_CACHED:
            _TABLES.clear()
        t = _TABLES[n] = _build_tables(n)
    return t


def _apply(t: Tables, crc: int) -> int:
    return (t[0][crc & 0xFF] ^ t[1][(crc >> 8) & 0xFF]
            ^ t[2][(crc >> 16) & 0xFF] ^ t[3][crc >> 24])


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32c(A + B) from crc32c(A), crc32c(B) and len(B) (google_crc32c conventions)."""
    if len2 < 0:
        raise ValueError(f"negative length {len2}")
    if len2 == 0:
        return crc1  # crc2 must be crc32c(b"") == 0
    t = _TABLES.get(len2)
    if t is None:
        if len2 not in _SEEN:
            if len(_SEEN) >= 4 * _MAX_CACHED:
                _SEEN.clear()
            _SEEN[len2] = None
            return _shift(crc1, len2) ^ crc2
        t = _combine_tables(len2)
    return _apply(t, crc1) ^ crc2


# -- block helpers ---------------------------------------------------------------------------------


def block_count(size: int, block: int = BLOCK) -> int:
    """Number of blocks (the last one partial) covering `size` bytes."""
    return -(-size // block)


def pack_crcs(crcs: list[int]) -> bytes:
    return struct.pack(f"<{len(crcs)}I", *crcs)


def unpack_crcs(packed: bytes) -> list[int]:
    if len(packed) % 4:
        raise ValueError(f"packed block crcs of odd length {len(packed)}")
    return list(struct.unpack(f"<{len(packed) // 4}I", packed))


def _combine_blocks(crcs: list[int], size: int, block: int) -> int:
    """The whole-file crc of `size` bytes from its block crcs."""
    full = _combine_tables(block)
    crc = 0
    for c in crcs[:size // block]:
        crc = _apply(full, crc) ^ c
    tail = size % block
    if tail:
        crc = crc32c_combine(crc, crcs[-1], tail)
    return crc


# -- streaming -------------------------------------------------------------------------------------


class StreamingCrc:
    """Extends crc32cs as long as writes arrive in order from offset 0.

    Only per-block crcs are computed from the data; the whole-file crc is
    combined from them in result(). An out-of-order write, an overwrite or a
    truncate makes it invalid; the file is then checksummed in one pass when
    it is sealed.

    Resume a sealed file with StreamingCrc(crc, size, blocks=packed). Given
    only (crc, size), as old callers do, the whole crc still extends correctly
    but the block crcs are unknown (blocks() is None) until truncate(0).
    """

    __slots__ = ("next_off", "valid", "block", "_legacy", "_done", "_cur",
                 "_tables", "_prefix", "_folded", "_cached")

    def __init__(self, value: int | None = None, next_off: int = 0, valid: bool = True,
                 blocks: bytes | None = None, block: int = BLOCK) -> None:
        if block <= 0:
            raise ValueError(f"block size {block}")
        self.block = block
        self._tables = _combine_tables(block)
        self._reset()
        self.valid = valid
        if not valid:
            return
        if blocks is not None:
            crcs = unpack_crcs(blocks)
            if len(crcs) != block_count(next_off, block):
                raise ValueError(f"{len(crcs)} block crcs for {next_off} bytes")
            if next_off % block:
                self._cur = crcs.pop()  # the partial last block keeps growing
            self._done = crcs
            self.next_off = next_off
            if value is not None and self.value != value:
                raise ValueError("block crcs do not match the file crc")
        elif next_off:
            # Old-style resume: no block crcs, so extend the whole crc directly.
            self._legacy = True
            self._cur = value or 0
            self.next_off = next_off
        elif value:
            raise ValueError(f"crc {value:08x} for an empty file")

    def _reset(self) -> None:
        self.next_off = 0
        self.valid = True
        self._legacy = False
        self._done: list[int] = []  # crcs of the complete blocks
        self._cur = 0  # crc of the partial block (the whole crc when legacy)
        self._prefix = 0  # cache: crc of the first _folded complete blocks
        self._folded = 0
        self._cached: tuple[int, int] | None = None  # (next_off, whole crc)

    def update(self, off: int, buf: bytes) -> None:
        if not self.valid:
            return
        if off != self.next_off:
            self.valid = False
            return
        if type(buf) is not bytes:
            buf = bytes(buf)  # google_crc32c takes only bytes
        n = len(buf)
        if self._legacy:
            self._cur = google_crc32c.extend(self._cur, buf)
            self.next_off += n
            return
        room = self.block - off % self.block
        if n < room:  # fast path: stays inside the current block
            self._cur = google_crc32c.extend(self._cur, buf)
            self.next_off += n
            return
        # Crosses (or ends on) block boundaries: slice, since the crc takes only bytes.
        pos = 0
        while n - pos >= room:
            piece = buf if room == n else buf[pos:pos + room]
            self._done.append(google_crc32c.extend(self._cur, piece))
            self._cur = 0
            pos += room
            room = self.block
        if pos < n:
            self._cur = google_crc32c.extend(0, buf[pos:])
        self.next_off += n

    def truncate(self, size: int) -> None:
        if size == 0:
            self._reset()
        elif size != self.next_off:
            self.valid = False

    @property
    def value(self) -> int:
        """The crc of the bytes streamed so far (valid or not)."""
        if self._legacy:
            return self._cur
        if self._cached is not None and self._cached[0] == self.next_off:
            return self._cached[1]
        # Fold newly completed blocks into the cached prefix, then the partial block.
        crc, t = self._prefix, self._tables
        for c in self._done[self._folded:]:
            crc = _apply(t, crc) ^ c
        self._prefix, self._folded = crc, len(self._done)
        tail = self.next_off % self.block
        if tail:
            # Shifting 0 gives 0: a file under one block needs no combine (nor its tables).
            crc = crc32c_combine(crc, self._cur, tail) if crc else self._cur
        self._cached = (self.next_off, crc)
        return crc

    def result(self, size: int) -> int | None:
        """The crc if the stream covered exactly `size` bytes, else None."""
        return self.value if self.valid and self.next_off == size else None

    def blocks(self, size: int) -> bytes | None:
        """Packed block crcs if the stream covered exactly `size` bytes and they are known."""
        if not self.valid or self._legacy or self.next_off != size:
            return None
        crcs = self._done
        if size % self.block:
            crcs = crcs + [self._cur]
        return pack_crcs(crcs)


# -- one pass --------------------------------------------------------------------------------------


PARALLEL_SEAL_BLOCKS = 16  # from 64 MiB on, the seal's pass runs in two threads
_second_half: ThreadPoolExecutor | None = None
_second_half_lock = threading.Lock()


def block_crcs_of_fd(fd: int, size: int, block: int = BLOCK,
                     mapped: bool = False) -> tuple[int, bytes]:
    """One pass over the first `size` bytes of `fd`: (whole crc, packed block crcs).

    Runs in a worker thread. A file shorter than `size` is checksummed as far as it
    goes. Holes are never read: a block tmpfs holds no data for (lseek SEEK_DATA)
    gets the crc of zeros directly, so a sparse file costs what its data costs.
    A large file's two halves are read in two threads at once (preadv and crc32c
    release the GIL): the fsync of a file written through passthrough waits for
    this pass, and the trainer's thread that waits leaves the cores idle.

    `mapped`: blocks that are all data are checksummed where they lie, through a
    read-only mapping of the file, instead of being copied into a buffer first (on
    a tmpfs with huge pages, 0.07 CPU-s/GiB against 0.12). Only for a caller that
    guarantees nobody shrinks the file or punches a hole in it during the pass: a
    mapped page past the end is SIGBUS, and touching a hole allocates a page (the
    mtcfs.fs.sealer's pass; the file system waits for it before either). Blocks
    with a hole in them are read with preadv as without it.
    """
    fd = os.dup(fd)  # this file, whatever is put at `fd` during the pass (dup2)
    try:
        end = min(size, os.fstat(fd).st_size)
        view = map_read_only(fd, 0, end) if mapped else None
        try:
            blocks = -(-end // block)
            if blocks < PARALLEL_SEAL_BLOCKS:
                crcs, off = _crcs_between(fd, 0, end, block, view)
            else:
                mid = blocks // 2 * block
                second = _half_pool().submit(_crcs_between, fd, mid, end, block, view)
                crcs, off = _crcs_between(fd, 0, mid, block, view)
                more, last = second.result()
                if off == mid:  # else the file ended in the first half: as far as it goes
                    crcs, off = crcs + more, last
        finally:
            # (The other half may still hold a slice, its pass failed with ours.)
            unmap(view)
    finally:
        os.close(fd)
    return _combine_blocks(crcs, off, block), pack_crcs(crcs)


def map_read_only(fd: int, start: int, end: int) -> memoryview | None:
    """A read-only, shared view of bytes [start, end) of the file (start a multiple of
    the page size; None: empty, or not mappable here: the caller reads instead).
    Unmapped once the view and the slices taken from it are gone (unmap)."""
    if end <= start:
        return None
    try:
        return memoryview(mmap.mmap(fd, end - start, flags=mmap.MAP_SHARED,
                                    prot=mmap.PROT_READ, offset=start))
    except (OSError, ValueError):
        return None


def unmap(view: memoryview | None) -> None:
    """Let go of a view from map_read_only (the mapping goes with the last slice of it
    still held)."""
    if view is not None:
        with contextlib.suppress(BufferError):
            view.release()


def _half_pool() -> ThreadPoolExecutor:
    global _second_half
    with _second_half_lock:
        if _second_half is None:
            _second_half = ThreadPoolExecutor(2, "seal-pass")
        return _second_half


def _crcs_between(fd: int, start: int, end: int, block: int,
                  view: memoryview | None = None) -> tuple[list[int], int]:
    """The block crcs of bytes [start, end) (start on a block boundary), and the
    offset the pass reached (< end when the file is shorter). `view`: the file
    mapped up to `end` (block_crcs_of_fd's `mapped`)."""
    crcs: list[int] = []
    off = start
    data = _next_data(fd, start, end)  # the next offset >= off that may hold data
    # One buffer for the pass, read into (a new bytes object per block, as
    # google-crc32c needs, cost 15-25 % more).
    buf = memoryview(bytearray(min(block, max(end - start, 0))))
    hole = -1  # the next offset >= off that may be a hole, once asked (mapped only)
    while off < end:
        want = min(block, end - off)
        if data >= off + want:
            crcs.append(zeros_crc(want))
            off += want
            if data < off + block:
                data = _next_data(fd, off, end)
            continue
        if view is not None and data <= off:
            if hole < off:  # (asked again only past the last answer: each is a scan)
                hole = next_hole(fd, off, end)
            if hole >= off + want:
                crcs.append(crc32c.crc32c(view[off:off + want]))
                off += want
                continue
        got = 0
        while got < want:  # a short read: complete the block
            n = os.preadv(fd, [buf[got:want]], off + got)
            if not n:
                break
            got += n
        if not got:
            break
        crcs.append(crc32c.crc32c(buf[:got]))
        off += got
        if got < want:
            break  # EOF inside the block: it is the last, partial one
        if data < off:
            data = _next_data(fd, off, end)
    return crcs, off


def _next_data(fd: int, off: int, end: int) -> int:
    """The first offset >= off where the file may hold data (`end` if none)."""
    if off >= end:
        return end
    try:
        return os.lseek(fd, off, os.SEEK_DATA)
    except OSError as e:
        if e.errno == 6:  # ENXIO: only a hole from off to the end
            return end
        return off  # no SEEK_DATA here: read everything


def next_hole(fd: int, off: int, end: int) -> int:
    """The first offset >= off where the file may have a hole (`off` if unknown)."""
    try:
        return min(os.lseek(fd, off, os.SEEK_HOLE), end)
    except OSError:
        return off  # unknown: read the block rather than map it


_ZEROS: dict[int, int] = {}


def zeros_crc(n: int) -> int:
    """crc32c of n zero bytes (n <= a block; the common lengths are remembered)."""
    crc = _ZEROS.get(n)
    if crc is None:
        crc = google_crc32c.value(bytes(n))
        if len(_ZEROS) < 64:
            _ZEROS[n] = crc
    return crc


def crc32c_of_fd(fd: int, size: int) -> int:
    """One pass over the first `size` bytes of `fd` (runs in a worker thread)."""
    return block_crcs_of_fd(fd, size)[0]


def crc32c_of_path(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return crc32c_of_fd(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def format_crc(crc: int | None) -> str | None:
    return None if crc is None else f"{crc:08x}"


def verify_range(data: bytes, off: int, block_crcs: bytes, size: int,
                 block: int = BLOCK) -> bool:
    """True when every block `data` (read at `off` of a `size`-byte file) covers has its crc.

    `data` must start on a block boundary and cover whole blocks, or end at `size`;
    anything else is a caller error (ValueError), as are block crcs of the wrong count.
    """
    if off % block or off < 0:
        raise ValueError(f"offset {off} is not on a {block}-byte block boundary")
    end = off + len(data)
    if end > size or (end % block and end != size):
        raise ValueError(f"range [{off}, {end}) does not end on a block boundary or at {size}")
    if len(block_crcs) != 4 * block_count(size, block):
        raise ValueError(f"{len(block_crcs)} bytes of block crcs for {size} bytes")
    if type(data) is not bytes:
        data = bytes(data)
    first = off // block
    n = block_count(len(data), block)
    want = struct.unpack_from(f"<{n}I", block_crcs, 4 * first)
    if n == 1:
        return google_crc32c.value(data) == want[0]
    return all(google_crc32c.value(data[i * block:(i + 1) * block]) == w
               for i, w in enumerate(want))


# -- verifying a copy as it arrives ------------------------------------------------------


class IntegrityError(Exception):
    """Data that does not match its crc32c: never served, never counted, never kept.

    The durable tier's integrity errors are a subclass (also a DurableError)."""

    errno = errno.EIO
    # [start, end) of the one chunk or block found bad, when it is known.
    bad_range: tuple[int, int] | None = None


class BlockVerifier:
    """Checks a file's bytes arriving in order from `start` (a block boundary).

    With per-block crcs each block is verified as soon as it is complete and
    `feed` returns the verified (offset, length) ranges, so readers can use them
    before the whole file has arrived; the block list itself is checked against
    the whole-file crc first. Without them (files from before block crcs) only
    the whole file can be verified, from offset 0, at `finish`.
    """

    def __init__(self, size: int, crc: int, block_crcs: bytes | None, start: int = 0,
                 block: int = BLOCK) -> None:
        self.size = size
        self.crc = crc
        self.block = block
        self.blocks = unpack_crcs(block_crcs) if block_crcs is not None else None
        if self.blocks is not None:
            if (len(self.blocks) != block_count(size, block)
                    or _combine_blocks(self.blocks, size, block) != crc):
                raise IntegrityError("the block crc32cs do not match the file's crc32c")
            start -= start % block
        else:
            start = 0
        self.offset = start  # next byte expected
        self.good = start  # bytes from 0 verified
        self._cur = 0  # crc of the current block (or of the whole file without blocks)
        self._pending = 0  # bytes of the current block seen

    def feed(self, data: bytes) -> list[tuple[int, int]]:
        if self.offset + len(data) > self.size:
            raise IntegrityError(f"more data than the file's {self.size} bytes")
        out: list[tuple[int, int]] = []
        if self.blocks is None:
            self._cur = google_crc32c.extend(self._cur, data)
            self.offset += len(data)
            return out
        view = memoryview(data)
        whole = True  # google_crc32c takes bytes only: copy just the pieces of a split chunk
        while view:
            bsize = min(self.block, self.size - self.good)
            take = min(len(view), bsize - self._pending)
            if whole and take == len(view):
                piece = data
            else:
                piece, whole = bytes(view[:take]), False
            self._cur = google_crc32c.extend(self._cur, piece)
            self._pending += take
            self.offset += take
            view = view[take:]
            if self._pending == bsize:
                out.append(self._block_done(self._cur, bsize))
                self._cur = self._pending = 0
        return out

    def _block_done(self, crc: int, bsize: int) -> tuple[int, int]:
        """The block at `good` is whole and its crc32c is `crc`: checked and counted."""
        assert self.blocks is not None
        index = self.good // self.block
        if crc != self.blocks[index]:
            raise IntegrityError(f"block {index} (bytes {self.good}-{self.good + bsize}) "
                                 f"does not match its crc32c")
        self.good += bsize
        return self.good - bsize, bsize

    def feed_crc(self, length: int, crc: int) -> list[tuple[int, int]]:
        """The next whole block arrived and the caller computed its crc32c (over the
        bytes where they landed): checked like feed() would."""
        if self.blocks is None or self._pending or length != min(self.block,
                                                                 self.size - self.good):
            raise IntegrityError(f"{length} bytes at {self.offset} are not the next block")
        self.offset += length
        return [self._block_done(crc, length)]

    def finish(self) -> list[tuple[int, int]]:
        """All bytes arrived: the remaining verification. Returns the ranges it verified."""
        if self.offset != self.size:
            raise IntegrityError(f"{self.offset} of {self.size} bytes arrived")
        if self.blocks is not None:
            return []
        if self._cur != self.crc:
            raise IntegrityError("the file does not match its crc32c")
        self.good = self.size
        return [(0, self.size)] if self.size else []


# -- GCS's form of a crc32c ---------------------------------------------------------------


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


# -- per-chunk checksums in an object's metadata --------------------------------------------
#
# GCS records one crc32c per object, verifiable only once every byte has arrived.
# mtcfs records a crc32c per chunk as well, in custom metadata written with the
# data, so a download can hand out each chunk as soon as it is verified.
# Format: "v1:<chunk_size>:<crc32c of each chunk, 8 lowercase hex digits, no separator>".

CHUNK_META_KEY = "mtcfs-chunks"
MIN_META_CHUNK = 16 << 20  # a multiple of BLOCK: chunk crcs derive from block crcs
MAX_META_CHUNKS = 512  # 512 * 8 hex digits: the value stays near 4 KiB, under GCS's 8 KiB
CRC_READ_PIECE = 4 << 20
_CHUNK_META_RE = re.compile(r"v1:([1-9][0-9]{0,18}):((?:[0-9a-f]{8})*)")


def chunk_size_for(size: int) -> int:
    """The chunk size recorded for an object of `size` bytes: 16 MiB, doubled until
    there are at most 512 chunks."""
    if size < 0:
        raise ValueError("size must be >= 0")
    chunk = MIN_META_CHUNK
    while -(-size // chunk) > MAX_META_CHUNKS:
        chunk *= 2
    return chunk


def chunk_crcs_from_blocks(packed_blocks: bytes, size: int,
                           block: int = BLOCK) -> tuple[int, list[int]]:
    """(chunk_size, chunk crcs) of a `size`-byte file from its block crcs: no data read."""
    chunk = chunk_size_for(size)
    per = chunk // block
    blocks = unpack_crcs(packed_blocks)
    if len(blocks) != block_count(size, block):
        raise ValueError(f"{len(blocks)} block crcs for {size} bytes")
    out = []
    for i in range(0, len(blocks), per):
        start = i * block
        out.append(_combine_blocks(blocks[i:i + per], min(chunk, size - start), block))
    return chunk, out


def chunk_crcs_of_fd(fd: int, size: int, *,
                     chunk_size: int | None = None) -> tuple[int, list[int]]:
    """(chunk_size, crc32c of each chunk) of fd[0:size], in one pass of pread()s of
    at most 4 MiB. chunk_size defaults to chunk_size_for(size). The whole file's
    crc32c follows without another pass: crc_of_chunks(). Raises IntegrityError if
    the file is shorter than `size`."""
    chunk = chunk_size_for(size) if chunk_size is None else chunk_size
    if chunk <= 0:
        raise ValueError("chunk_size must be positive")
    crcs: list[int] = []
    off = 0
    while off < size:
        end = min(off + chunk, size)
        crc = 0
        while off < end:
            data = os.pread(fd, min(CRC_READ_PIECE, end - off), off)
            if not data:
                raise IntegrityError(f"file ended at byte {off}, expected {size} bytes")
            crc = google_crc32c.extend(crc, data)
            off += len(data)
        crcs.append(crc)
    return chunk, crcs


def crc_of_chunks(chunk_size: int, crcs: Sequence[int], size: int) -> int:
    """The whole object's crc32c from its chunks' crcs (chunks of chunk_size bytes,
    the last one shorter)."""
    crc = 0
    for i, c in enumerate(crcs):
        crc = crc32c_combine(crc, c, min(chunk_size, size - i * chunk_size))
    return crc


def encode_chunk_meta(chunk_size: int, crcs: Sequence[int]) -> str:
    """The CHUNK_META_KEY metadata value for these chunk crcs."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    if any(not 0 <= c <= 0xFFFFFFFF for c in crcs):
        raise ValueError("a crc32c is a 32-bit unsigned integer")
    return f"v1:{chunk_size}:" + "".join(f"{c:08x}" for c in crcs)


def decode_chunk_meta(value: str, size: int) -> tuple[int, list[int]] | None:
    """(chunk_size, crcs) from a CHUNK_META_KEY value for an object of `size` bytes;
    None if it is malformed in any way (it then protects nothing, and the object is
    verified as a whole, like one written by another tool)."""
    if not isinstance(value, str) or not isinstance(size, int) or size < 0:
        return None
    m = _CHUNK_META_RE.fullmatch(value)
    if m is None:
        return None
    chunk = int(m.group(1))
    hexes = m.group(2)
    if len(hexes) // 8 != -(-size // chunk):
        return None
    return chunk, [int(hexes[i:i + 8], 16) for i in range(0, len(hexes), 8)]
