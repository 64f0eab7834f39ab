"""The durable-tier interface: what mtcfs needs from GCS or a durable directory.

The API is blocking; callers run it in worker threads. Every method is safe to
call from several threads at once on one tier object.

Keys are paths relative to the tier's prefix (`gs://bucket/prefix` or
`file:///dir`), the same relative paths as in the mount, so a checkpoint in the
durable tier is readable with ordinary tools.
"""

from __future__ import annotations

import contextlib
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import google_crc32c

from mtcfs.tiers.durable.crc import crc32c_combine

MiB = 1 << 20
DEFAULT_DOWNLOAD_CHUNK = 16 * MiB
MAX_KEY_BYTES = 1024

# progress(offset, length): a byte range was transferred (upload: handed to the
# server; download: written into dest_fd). Called from worker threads; ranges may
# repeat when a transfer is restarted after an error.
Progress = Callable[[int, int], None]


class DurableError(Exception):
    """A durable-tier operation failed; str() is one line naming the URL and the cause."""


class PreconditionFailed(DurableError):
    """A generation precondition did not hold; nothing was changed."""


class IntegrityError(DurableError):
    """Data does not match its crc32c; the bad data was not kept or returned."""


class ObjectNotFound(DurableError):
    """The key (or the requested generation of it) does not exist."""


class Unavailable(DurableError):
    """The durable tier could not be reached within the retry deadline (transient)."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str  # relative to the tier's prefix
    size: int
    crc32c: int | None  # None only for foreign objects without a recorded checksum
    generation: int
    updated: float  # seconds since the epoch


def validate_key(key: str) -> str:
    """Return `key` if it is a valid relative object key, else raise ValueError.

    Keys are relative POSIX paths: no leading or trailing '/', no empty, '.' or
    '..' segments, no NUL/CR/LF (GCS forbids CR and LF), at most 1024 UTF-8 bytes.
    """
    if not isinstance(key, str):
        raise ValueError(f"invalid key {key!r}: not a string")
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"invalid key {key!r}: not valid UTF-8") from None
    if not raw:
        raise ValueError("invalid key '': empty")
    if len(raw) > MAX_KEY_BYTES:
        raise ValueError(f"invalid key {key[:40]!r}...: longer than {MAX_KEY_BYTES} bytes")
    if key.startswith("/"):
        raise ValueError(f"invalid key {key!r}: must be relative (no leading '/')")
    if any(c in key for c in "\0\r\n"):
        raise ValueError(f"invalid key {key!r}: contains NUL, CR or LF")
    for seg in key.split("/"):
        if seg in ("", ".", ".."):
            raise ValueError(f"invalid key {key!r}: empty, '.' or '..' path segment")
    return key


def validate_prefix(prefix: str) -> str:
    """A list() prefix: '' or a key-like string that may end with '/'."""
    if prefix == "":
        return prefix
    validate_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


class DurableTier(ABC):
    """One durable location: `gs://bucket[/prefix]` or `file:///dir`."""

    url: str

    @abstractmethod
    def check(self) -> None:
        """Verify the location exists and is reachable, within ~10 s.

        Raises DurableError naming the URL and the cause (missing, unreachable,
        permission denied).
        """

    @abstractmethod
    def put_file(self, key: str, path: str, crc32c: int, *,
                 if_generation_match: int | None = None,
                 progress: Progress | None = None) -> ObjectInfo:
        """Store the local file `path` as `key`; return the new object's info.

        `crc32c` is the file's checksum: the server verifies the data against it
        and the upload counts only once the server confirms. if_generation_match=0
        means "only if absent"; a failed precondition raises PreconditionFailed
        and leaves the object unchanged.
        """

    @abstractmethod
    def read_range(self, key: str, offset: int, length: int, *,
                   generation: int | None = None) -> bytes:
        """Up to `length` bytes at `offset` (fewer at the end of the object)."""

    @abstractmethod
    def download(self, key: str, dest_fd: int, *, chunk_size: int = DEFAULT_DOWNLOAD_CHUNK,
                 parallel: int = 4, progress: Progress | None = None,
                 generation: int | None = None) -> ObjectInfo:
        """Copy the whole object into `dest_fd` (pwrite, ranged chunks in parallel).

        dest_fd is truncated to the object's size first. The whole object's
        crc32c is verified against its recorded one; on a mismatch, or any other
        failure, dest_fd is truncated to 0 and an error raised, so bad data is
        never presented as good. All chunks come from one generation (the live
        one, or `generation` if given).
        """

    @abstractmethod
    def stat(self, key: str) -> ObjectInfo | None:
        """The object's info, or None if it does not exist."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with `prefix` (recursive), in key order."""

    @abstractmethod
    def delete(self, key: str, *, if_generation_match: int | None = None) -> None:
        """Delete `key`. Deleting an absent key is not an error.

        With if_generation_match, a different live generation raises
        PreconditionFailed and is left alone.
        """

    def close(self) -> None:  # noqa: B027 - optional hook, most tiers hold nothing
        """Release connections; the tier must not be used afterwards."""

    def __enter__(self) -> DurableTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"


# -- shared download machinery ----------------------------------------------------


class RangeWriter:
    """A write()-able sink that pwrite()s into fd from `offset` and checksums the bytes.

    Small writes (google-cloud-storage hands over 8 KiB pieces) are gathered into
    1 MiB pwrite()s. Byte order is the order of write() calls, so the crc covers
    exactly the range written.
    """

    FLUSH_AT = 1 * MiB

    def __init__(self, fd: int, offset: int, limit: int, progress: Progress | None) -> None:
        self.fd = fd
        self.start = offset
        self.limit = limit  # bytes expected; more would overrun the neighbour chunk
        self.written = 0  # bytes accepted (buffered or flushed)
        self.crc = 0
        self._parts: list[bytes] = []
        self._pending = 0
        self._flushed = 0
        self._progress = progress

    def write(self, data: bytes) -> int:
        n = len(data)
        if self.written + n > self.limit:
            raise IntegrityError(f"server sent more than the {self.limit} bytes requested")
        # google_crc32c only takes bytes (not memoryview/bytearray).
        self._parts.append(data if type(data) is bytes else bytes(data))
        self._pending += n
        self.written += n
        if self._pending >= self.FLUSH_AT:
            self.flush()
        return n

    def flush(self) -> None:
        if not self._parts:
            return
        buf = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
        self._parts.clear()
        self._pending = 0
        self.crc = google_crc32c.extend(self.crc, buf)
        off = self.start + self._flushed
        done = os.pwrite(self.fd, buf, off)
        if done < len(buf):
            view = memoryview(buf)
            while done < len(buf):
                done += os.pwrite(self.fd, view[done:], off + done)
        if self._progress is not None:
            self._progress(off, done)
        self._flushed += done

    # download_to_file() may probe these on its stream.
    def tell(self) -> int:
        return self.written

    def seekable(self) -> bool:
        return False


def parallel_download(dest_fd: int, size: int, chunk_size: int, parallel: int,
                      fetch: Callable[[RangeWriter], None],
                      progress: Progress | None) -> int:
    """Fill dest_fd[0:size] with `fetch` over ranged chunks, return the whole crc32c.

    fetch(writer) must write exactly writer.limit bytes starting at writer.start.
    Per-chunk crcs are combined in order, so there is no second pass over the data.
    """
    if chunk_size <= 0 or parallel <= 0:
        raise ValueError("chunk_size and parallel must be positive")
    os.ftruncate(dest_fd, size)
    if size == 0:
        return 0
    ranges = [(off, min(chunk_size, size - off)) for off in range(0, size, chunk_size)]
    lock = threading.Lock()
    safe_progress: Progress | None = None
    if progress is not None:
        def safe_progress(off: int, n: int) -> None:
            with lock:  # callers get one call at a time
                progress(off, n)

    def one(rng: tuple[int, int]) -> int:
        writer = RangeWriter(dest_fd, rng[0], rng[1], safe_progress)
        fetch(writer)
        writer.flush()
        if writer.written != rng[1]:
            raise IntegrityError(
                f"short read at offset {rng[0]}: got {writer.written} of {rng[1]} bytes")
        return writer.crc

    if len(ranges) == 1 or parallel == 1:
        crcs = [one(r) for r in ranges]
    else:
        with ThreadPoolExecutor(max_workers=min(parallel, len(ranges)),
                                thread_name_prefix="mtcfs-dl") as pool:
            futures = [pool.submit(one, r) for r in ranges]
            try:
                crcs = [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
    crc = crcs[0]
    for c, (_, n) in zip(crcs[1:], ranges[1:], strict=True):
        crc = crc32c_combine(crc, c, n)
    return crc


def verified_download(url: str, key: str, dest_fd: int, expected: int | None, size: int,
                      chunk_size: int, parallel: int, fetch: Callable[[RangeWriter], None],
                      progress: Progress | None) -> int:
    """parallel_download + the whole-object check; dest_fd is emptied on any failure."""
    try:
        crc = parallel_download(dest_fd, size, chunk_size, parallel, fetch, progress)
        if expected is not None and crc != expected:
            raise IntegrityError(
                f"{url}: {key}: downloaded data has crc32c {crc:08x}, object records "
                f"{expected:08x}; data discarded")
        return crc
    except BaseException:
        # Never leave partial or corrupt bytes that look like a complete copy.
        with contextlib.suppress(OSError):
            os.ftruncate(dest_fd, 0)
        raise
