"""The durable-tier interface: what mtcfs needs from GCS or a durable directory.

The API is blocking; callers run it in worker threads. Every method is safe to
call from several threads at once on one tier object.

Keys are paths relative to the tier's prefix (`gs://bucket/prefix` or
`file:///dir`), the same relative paths as in the mount, so a checkpoint in the
durable tier is readable with ordinary tools.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import google_crc32c

from mtcfs.core import checksums
from mtcfs.core.checksums import (
    CHUNK_META_KEY,
    crc32c_combine,
    crc_of_chunks,
    decode_chunk_meta,
)

log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_DOWNLOAD_CHUNK = 16 * MiB
MAX_KEY_BYTES = 1024
MAX_METADATA_BYTES = 8 * 1024  # GCS: all custom metadata keys + values of one object

# progress(offset, length): a byte range was transferred (upload: handed to the
# server; download: written into dest_fd). Called from worker threads, one call
# at a time; ranges may repeat when a transfer is restarted after an error or a
# chunk is fetched again after a checksum mismatch.
Progress = Callable[[int, int], None]

# on_verified(offset, length): dest_fd[offset:offset+length] holds bytes checked
# against a recorded crc32c and may be served. Called from worker threads, one
# call at a time, at most once per byte.
OnVerified = Callable[[int, int], None]


class DurableError(Exception):
    """A durable-tier operation failed; str() is one line naming the URL and the cause."""


class PreconditionFailed(DurableError):
    """A generation precondition did not hold; nothing was changed."""


class IntegrityError(DurableError, checksums.IntegrityError):
    """Data does not match its crc32c; the bad data was not kept or returned.
    bad_range: the one chunk found bad, when it is known (per-chunk crcs)."""


class ObjectNotFound(DurableError):
    """The key (or the requested generation of it) does not exist."""


class Unavailable(DurableError):
    """The durable tier could not be reached within the retry deadline (transient)."""


class Metadata(Mapping[str, str]):
    """An object's custom metadata: an immutable, hashable str -> str mapping, so
    ObjectInfo stays a frozen, hashable value. Compares equal to a dict with the
    same items."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, str] | Iterable[tuple[str, str]] = ()) -> None:
        self._items: dict[str, str] = dict(items)

    def __getitem__(self, key: str) -> str:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return f"Metadata({self._items!r})"


EMPTY_METADATA = Metadata()


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str  # relative to the tier's prefix
    size: int
    crc32c: int | None  # None only for foreign objects without a recorded checksum
    generation: int
    updated: float  # seconds since the epoch
    metadata: Mapping[str, str] = field(default=EMPTY_METADATA)  # custom metadata

    def __post_init__(self) -> None:
        if not isinstance(self.metadata, Metadata):  # a dict from a caller: freeze it
            object.__setattr__(self, "metadata", Metadata(self.metadata))


def validate_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """A plain dict copy of `metadata` if both backends can store it, else ValueError.

    Keys: non-empty strings without NUL/CR/LF; values: strings without NUL; keys and
    values together at most 8 KiB of UTF-8 (GCS's limit, applied to file:// as well
    so both backends accept the same objects).
    """
    if metadata is None:
        return {}
    out: dict[str, str] = {}
    total = 0
    for k, v in metadata.items():
        if not isinstance(k, str) or not k or any(c in k for c in "\0\r\n"):
            raise ValueError(f"invalid metadata key {k!r}")
        if not isinstance(v, str) or "\0" in v:
            raise ValueError(f"invalid metadata value for {k!r}: must be a string without NUL")
        try:
            total += len(k.encode("utf-8")) + len(v.encode("utf-8"))
        except UnicodeEncodeError:
            raise ValueError(f"metadata {k!r}: not valid UTF-8") from None
        out[k] = v
    if total > MAX_METADATA_BYTES:
        raise ValueError(f"custom metadata is {total} bytes, more than the "
                         f"{MAX_METADATA_BYTES} GCS allows")
    return out


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

    def may_hold(self, generation: int) -> bool:
        """An object of this generation may be here (0: the file was never persisted)."""
        return bool(generation)

    @abstractmethod
    def check(self) -> None:
        """Verify the location exists and is reachable, within ~10 s.

        Raises DurableError naming the URL and the cause (missing, unreachable,
        permission denied).
        """

    @abstractmethod
    def put_file(self, key: str, path: str, crc32c: int, *,
                 if_generation_match: int | None = None,
                 progress: Progress | None = None,
                 metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        """Store the local file `path` as `key`; return the new object's info.

        `crc32c` is the file's checksum: the server verifies the data against it
        and the upload counts only once the server confirms. if_generation_match=0
        means "only if absent"; a failed precondition raises PreconditionFailed
        and leaves the object unchanged.

        `metadata` (see validate_metadata; ValueError if unusable) is stored with
        the object atomically with its data, and replaces any earlier version's.
        Put encode_chunk_meta() under CHUNK_META_KEY for chunk-verified downloads.
        """

    @abstractmethod
    def copy(self, src_key: str, dst_key: str, *, src_generation: int,
             if_generation_match: int | None = None) -> ObjectInfo:
        """Copy the object `src_key` (exactly generation `src_generation`) to `dst_key`
        inside the tier, data, crc32c and custom metadata alike, without moving the
        data through this host (a server-side copy). ObjectNotFound when that
        generation is gone; the destination precondition as in put_file."""

    @abstractmethod
    def read_range(self, key: str, offset: int, length: int, *,
                   generation: int | None = None) -> bytes:
        """Up to `length` bytes at `offset` (fewer at the end of the object)."""

    @abstractmethod
    def download(self, key: str, dest_fd: int, *, chunk_size: int = DEFAULT_DOWNLOAD_CHUNK,
                 parallel: int = 4, progress: Progress | None = None,
                 generation: int | None = None,
                 on_verified: OnVerified | None = None) -> ObjectInfo:
        """Copy the whole object into `dest_fd` (pwrite, ranged chunks in parallel).

        dest_fd is truncated to the object's size first. The whole object's
        crc32c is verified against its recorded one; on a mismatch, or any other
        failure, dest_fd is truncated to 0 and an error raised, so bad data is
        never presented as good. All chunks come from one generation (the live
        one, or `generation` if given).

        If the object's metadata has valid chunk crcs (CHUNK_META_KEY, consistent
        with the object's crc32c), it is fetched in exactly those chunks and
        `chunk_size` is ignored: each chunk is checked once complete, fetched once
        more on a mismatch (then IntegrityError), and reported with
        on_verified(offset, length) as soon as it matches. Otherwise
        on_verified(0, size) is called once, after the whole object matched its
        crc32c. A zero-size object gets on_verified(0, 0). An object without any
        recorded crc32c (a file:// file placed by another tool) cannot be
        verified; it is reported with on_verified(0, size) once complete.
        Verified ranges stay valid unless download() raises, in which case
        dest_fd is emptied as above.
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


class _Aborted(DurableError):
    """Another chunk of the same download failed: stop this one early."""


def no_progress(offset: int, length: int) -> None:
    """The progress callback of a transfer nobody follows."""


class RangeWriter:
    """A write()-able sink that pwrite()s into fd from `offset` and checksums the bytes.

    Small writes (google-cloud-storage hands over 8 KiB pieces) are gathered into
    1 MiB pwrite()s. Byte order is the order of write() calls, so the crc covers
    exactly the range written. Setting `abort` makes the next write() raise, so a
    download that already failed stops transferring its other chunks.
    """

    FLUSH_AT = 1 * MiB

    def __init__(self, fd: int, offset: int, limit: int, progress: Progress | None,
                 abort: threading.Event | None = None) -> None:
        self.fd = fd
        self.start = offset
        self.limit = limit  # bytes expected; more would overrun the neighbour chunk
        self.written = 0  # bytes accepted (buffered or flushed)
        self.crc = 0
        self._parts: list[bytes] = []
        self._pending = 0
        self._flushed = 0
        self._progress: Progress = progress or no_progress
        self._abort = abort or threading.Event()  # (never set: nobody abandons it)

    def write(self, data: bytes) -> int:
        if self._abort.is_set():
            raise _Aborted("download abandoned: another chunk failed")
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
        self._progress(off, done)
        self._flushed += done

    # download_to_file() may probe these on its stream.
    def tell(self) -> int:
        return self.written

    def seekable(self) -> bool:
        return False


def _one_at_a_time(callback: Callable[[int, int], None] | None,
                   lock: threading.Lock) -> Callable[[int, int], None] | None:
    """callback, serialized: callers get one call at a time from the worker threads."""
    if callback is None:
        return None

    def call(off: int, n: int) -> None:
        with lock:
            callback(off, n)

    return call


def parallel_download(dest_fd: int, size: int, chunk_size: int, parallel: int,
                      fetch: Callable[[RangeWriter], None],
                      progress: Progress | None, *,
                      chunk_crcs: Sequence[int] | None = None,
                      on_verified: OnVerified | None = None,
                      what: str = "download") -> int:
    """Fill dest_fd[0:size] with `fetch` over ranged chunks, return the whole crc32c.

    fetch(writer) must write exactly writer.limit bytes starting at writer.start.
    Per-chunk crcs are combined in order, so there is no second pass over the data.
    With chunk_crcs (one per chunk of chunk_size), each chunk is checked once it is
    complete: a mismatch is fetched once more (the bytes may have been damaged on
    the way), then raises IntegrityError; a match is reported to on_verified.
    The first failure stops the other chunks; it is raised only once no worker
    writes into dest_fd any more.
    """
    if chunk_size <= 0 or parallel <= 0:
        raise ValueError("chunk_size and parallel must be positive")
    os.ftruncate(dest_fd, size)
    if size == 0:
        return 0
    ranges = [(off, min(chunk_size, size - off)) for off in range(0, size, chunk_size)]
    if chunk_crcs is not None and len(chunk_crcs) != len(ranges):
        raise ValueError(f"{len(chunk_crcs)} chunk crcs for {len(ranges)} chunks")
    abort = threading.Event()
    safe_progress = _one_at_a_time(progress, threading.Lock())
    safe_verified = _one_at_a_time(on_verified, threading.Lock())

    def fetch_range(off: int, n: int) -> int:
        writer = RangeWriter(dest_fd, off, n, safe_progress, abort)
        fetch(writer)
        writer.flush()
        if writer.written != n:
            raise IntegrityError(f"short read at offset {off}: got {writer.written} of {n} bytes")
        return writer.crc

    def one(i: int) -> int:
        off, n = ranges[i]
        if abort.is_set():
            raise _Aborted("download abandoned: another chunk failed")
        crc = fetch_range(off, n)
        if chunk_crcs is None:
            return crc
        want = chunk_crcs[i]
        if crc != want:
            log.warning("%s: bytes %d-%d arrived with crc32c %08x, recorded %08x; fetching "
                        "them again", what, off, off + n - 1, crc, want)
            crc = fetch_range(off, n)
            if crc != want:
                err = IntegrityError(
                    f"{what}: bytes {off}-{off + n - 1} have crc32c {crc:08x} (fetched twice), "
                    f"the object's metadata records {want:08x}; data discarded")
                err.bad_range = (off, off + n)
                raise err
        if safe_verified is not None and not abort.is_set():
            safe_verified(off, n)
        return crc

    if len(ranges) == 1 or parallel == 1:
        crcs = [one(i) for i in range(len(ranges))]
    else:
        pool = ThreadPoolExecutor(max_workers=min(parallel, len(ranges)),
                                  thread_name_prefix="mtcfs-dl")
        futures: list[Future[int]] = []
        try:
            futures = [pool.submit(one, i) for i in range(len(ranges))]
            wait(futures, return_when=FIRST_EXCEPTION)
        finally:
            # wait() returned early on a failure (or was interrupted): stop the rest.
            # shutdown() waits for the running workers, so none writes into dest_fd
            # after we return and the caller truncates it.
            if not all(f.done() for f in futures):
                abort.set()
            pool.shutdown(wait=True, cancel_futures=abort.is_set())
        errors = [e for f in futures if not f.cancelled() and (e := f.exception()) is not None]
        if errors:
            # The cause, not a sibling that merely stopped because of it.
            raise next((e for e in errors if not isinstance(e, _Aborted)), errors[0])
        crcs = [f.result() for f in futures]
    crc = crcs[0]
    for c, (_, n) in zip(crcs[1:], ranges[1:], strict=True):
        crc = crc32c_combine(crc, c, n)
    return crc


def chunk_plan(what: str, info: ObjectInfo) -> tuple[int, list[int]] | None:
    """The object's recorded chunk crcs if they can be trusted, else None.

    Besides being well-formed they must combine to the object's crc32c: chunks
    verified against them then make up exactly the object GCS vouches for.
    """
    value = info.metadata.get(CHUNK_META_KEY)
    if value is None:
        return None
    plan = decode_chunk_meta(value, info.size)
    if plan is None:
        log.warning("%s: malformed %s metadata; verifying the object as a whole",
                    what, CHUNK_META_KEY)
        return None
    if info.crc32c is None or crc_of_chunks(plan[0], plan[1], info.size) != info.crc32c:
        log.warning("%s: %s metadata does not match the object's crc32c; verifying the "
                    "object as a whole", what, CHUNK_META_KEY)
        return None
    return plan


def verified_download(url: str, key: str, dest_fd: int, info: ObjectInfo,
                      chunk_size: int, parallel: int, fetch: Callable[[RangeWriter], None],
                      progress: Progress | None, on_verified: OnVerified | None) -> int:
    """parallel_download + the checks of DurableTier.download; returns the whole crc32c.
    dest_fd is emptied on any failure."""
    if chunk_size <= 0 or parallel <= 0:
        raise ValueError("chunk_size and parallel must be positive")
    what = f"{url}: {key}"
    plan = chunk_plan(what, info)
    try:
        if plan is not None:
            crc = parallel_download(dest_fd, info.size, plan[0], parallel, fetch, progress,
                                    chunk_crcs=plan[1], on_verified=on_verified, what=what)
        else:
            crc = parallel_download(dest_fd, info.size, chunk_size, parallel, fetch, progress,
                                    what=what)
        if info.crc32c is not None and crc != info.crc32c:
            raise IntegrityError(
                f"{what}: downloaded data has crc32c {crc:08x}, object records "
                f"{info.crc32c:08x}; data discarded")
        if on_verified is not None and (plan is None or info.size == 0):
            on_verified(0, info.size)
        return crc
    except BaseException:
        # Never leave partial or corrupt bytes that look like a complete copy.
        with contextlib.suppress(OSError):
            os.ftruncate(dest_fd, 0)
        raise
