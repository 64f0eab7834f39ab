"""file:///dir: the durable tier on a directory (one machine, or a shared filesystem).

Layout: the object for key `a/b/c` is the plain file `<dir>/a/b/c`, readable with
ordinary tools. Its crc32c and generation are extended attributes of the file
itself (so the filesystem must support `user.*` xattrs; check() verifies it):

    user.mtcfs.crc32c       8 lowercase hex digits
    user.mtcfs.generation   decimal; max(time_ns(), previous + 1), so it grows per key
    user.mtcfs.meta         custom metadata, if any: a JSON object of strings; zlib-
                            compressed JSON where the filesystem refuses the plain
                            value (ext4 keeps all of a file's xattrs in one 4 KiB
                            block; chunk crcs of a large object take ~4 KiB)

Keeping them on the inode makes a put atomic as a whole: data is written to a
temporary name `.mtcfs-tmp-*` in the target directory, checksummed while copied
(so a source that does not match the crc32c it was given is refused), fsynced,
given its xattrs, and renamed into place; the directory is fsynced. A reader
that opened the file sees one consistent (data, crc32c, generation).
Files placed by other tools have no xattrs: their crc32c is unknown (None) and
their generation is their mtime in nanoseconds.

Generation preconditions are decided under a per-key lock: a threading.Lock
(POSIX locks do not exclude threads of one process) plus fcntl.lockf on one of
LOCK_STRIPES lock files in `<dir>/.mtcfs-locks/` (excludes other processes and,
on NFS, other hosts). Keys hash to stripes with crc32, stable across hosts.

Reserved names: a top-level `.mtcfs-locks` and any path segment starting with
`.mtcfs-tmp-` are not valid keys here and are skipped by list().
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import stat as statmod
import threading
import time
import uuid
import zlib
from collections.abc import Iterator, Mapping

import google_crc32c

from mtcfs.tiers.durable.base import (
    DEFAULT_DOWNLOAD_CHUNK,
    DurableError,
    DurableTier,
    IntegrityError,
    MiB,
    ObjectInfo,
    ObjectNotFound,
    OnVerified,
    PreconditionFailed,
    Progress,
    RangeWriter,
    validate_key,
    validate_metadata,
    validate_prefix,
    verified_download,
)

log = logging.getLogger(__name__)

XATTR_CRC = "user.mtcfs.crc32c"
XATTR_GEN = "user.mtcfs.generation"
XATTR_META = "user.mtcfs.meta"
# setxattr errors meaning "value too large here" (ext4: ENOSPC; others: E2BIG, ERANGE).
_XATTR_TOO_BIG = frozenset({errno.ENOSPC, errno.E2BIG, errno.ERANGE})
LOCK_DIR = ".mtcfs-locks"
TMP_PREFIX = ".mtcfs-tmp-"
LOCK_STRIPES = 256
COPY_CHUNK = 4 * MiB
CHECK_TIMEOUT = 8.0
STALE_TMP_AGE = 15 * 60.0  # seconds without a write after which a temp file is garbage


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalDirTier(DurableTier):
    def __init__(self, root: str, *, check_timeout: float = CHECK_TIMEOUT) -> None:
        if not os.path.isabs(root):
            raise DurableError(f"file://{root}: the directory must be an absolute path")
        self.root = os.path.normpath(root)
        self.url = "file://" + self.root
        self.check_timeout = check_timeout
        self._stripes = [threading.Lock() for _ in range(LOCK_STRIPES)]

    # -- helpers ---------------------------------------------------------------

    def _path(self, key: str) -> str:
        validate_key(key)
        segs = key.split("/")
        if segs[0] == LOCK_DIR or any(s.startswith(TMP_PREFIX) for s in segs):
            raise ValueError(f"invalid key {key!r}: name reserved by the file:// tier")
        return os.path.join(self.root, key)

    def _fail(self, what: str, e: OSError) -> DurableError:
        if e.errno == errno.ENOENT and not os.path.isdir(self.root):
            return DurableError(f"{self.url}: {what}: directory does not exist")
        if e.errno in (errno.ENOTDIR, errno.EEXIST):
            return DurableError(f"{self.url}: {what}: a parent of the key is a file")
        if e.errno == errno.EISDIR:
            return DurableError(f"{self.url}: {what}: a directory exists at the key")
        return DurableError(f"{self.url}: {what}: {e.strerror or e}")

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        idx = zlib.crc32(key.encode()) % LOCK_STRIPES
        with self._stripes[idx]:
            lock_dir = os.path.join(self.root, LOCK_DIR)
            with contextlib.suppress(FileExistsError):
                os.mkdir(lock_dir)
            fd = os.open(os.path.join(lock_dir, f"{idx:03x}"),
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # drops the POSIX lock

    @staticmethod
    def _meta(fd: int, st: os.stat_result) -> tuple[int | None, int]:
        try:
            crc: int | None = int(os.getxattr(fd, XATTR_CRC), 16)
        except (OSError, ValueError):
            crc = None
        try:
            gen = int(os.getxattr(fd, XATTR_GEN))
        except (OSError, ValueError):
            gen = st.st_mtime_ns
        return crc, gen

    @staticmethod
    def _open(path: str) -> tuple[int, os.stat_result] | None:
        """An fd on the regular file at path (pins this version), or None."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None
        st = os.fstat(fd)
        if not statmod.S_ISREG(st.st_mode):
            os.close(fd)
            return None
        return fd, st

    def _info_of(self, key: str, fd: int, st: os.stat_result) -> ObjectInfo:
        crc, gen = self._meta(fd, st)
        return ObjectInfo(key, st.st_size, crc, gen, st.st_mtime, self._custom_meta(key, fd))

    def _custom_meta(self, key: str, fd: int) -> dict[str, str]:
        """The metadata xattr; {} if absent or unreadable (the object is then
        treated like a foreign one, which is safe: it is verified as a whole)."""
        try:
            raw = os.getxattr(fd, XATTR_META)
        except OSError:
            return {}
        try:
            if not raw.startswith(b"{"):
                raw = zlib.decompress(raw)
            meta = json.loads(raw)
        except (zlib.error, ValueError):
            meta = None
        if not isinstance(meta, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            log.warning("%s: %s: unreadable %s xattr, ignored", self.url, key, XATTR_META)
            return {}
        return meta

    def _set_custom_meta(self, key: str, fd: int, meta: dict[str, str]) -> None:
        raw = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
        try:
            os.setxattr(fd, XATTR_META, raw)
            return
        except OSError as e:
            if e.errno not in _XATTR_TOO_BIG:
                raise
        try:
            os.setxattr(fd, XATTR_META, zlib.compress(raw, 9))  # starts with 0x78, not "{"
        except OSError as e:
            if e.errno not in _XATTR_TOO_BIG:
                raise
            raise DurableError(f"{self.url}: put {key}: the filesystem cannot hold "
                               f"{len(raw)} bytes of metadata in an extended attribute: "
                               f"{e.strerror}") from None

    def _live_generation(self, path: str) -> int | None:
        opened = self._open(path)
        if opened is None:
            return None
        fd, st = opened
        try:
            return self._meta(fd, st)[1]
        finally:
            os.close(fd)

    def _make_dirs(self, rel_dir: str) -> None:
        """mkdir -p below the root, never creating the root itself (an unmounted
        shared filesystem must not be silently replaced by a local directory)."""
        path = self.root
        for seg in rel_dir.split("/") if rel_dir else ():
            path = os.path.join(path, seg)
            with contextlib.suppress(FileExistsError):
                os.mkdir(path)

    def _temp_in(self, key: str) -> tuple[int, str]:
        rel_dir = os.path.dirname(key)
        for attempt in range(5):
            self._make_dirs(rel_dir)
            tmp = os.path.join(self.root, rel_dir, TMP_PREFIX + uuid.uuid4().hex)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                return fd, tmp
            except FileNotFoundError:
                # A concurrent delete removed the (then empty) directory: make it again.
                if attempt == 4 or not os.path.isdir(self.root):
                    raise
        raise AssertionError("unreachable")

    # -- the interface ---------------------------------------------------------

    def check(self) -> None:
        """Runs in a helper thread so a hung shared filesystem cannot block the caller."""
        result: list[BaseException | None] = []

        def probe() -> None:
            try:
                self._check_sync()
                result.append(None)
            except BaseException as e:  # handed to the caller's thread
                result.append(e)

        t = threading.Thread(target=probe, name="mtcfs-durable-check", daemon=True)
        t.start()
        t.join(self.check_timeout)
        if not result:
            raise DurableError(f"{self.url}: no answer within {self.check_timeout:g}s "
                               f"(hung or unreachable filesystem?)")
        if result[0] is not None:
            raise result[0]

    def _check_sync(self) -> None:
        try:
            st = os.stat(self.root)
        except FileNotFoundError:
            raise DurableError(f"{self.url}: directory does not exist") from None
        except PermissionError:
            raise DurableError(f"{self.url}: permission denied") from None
        except OSError as e:
            raise DurableError(f"{self.url}: cannot access: {e.strerror}") from None
        if not statmod.S_ISDIR(st.st_mode):
            raise DurableError(f"{self.url}: not a directory")
        probe = os.path.join(self.root, TMP_PREFIX + "check-" + uuid.uuid4().hex)
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise DurableError(f"{self.url}: not writable: {e.strerror}") from None
        try:
            os.setxattr(fd, XATTR_GEN, b"0")
        except OSError as e:
            raise DurableError(f"{self.url}: the filesystem does not support user extended "
                               f"attributes ({XATTR_GEN}): {e.strerror}") from None
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(probe)

    def put_file(self, key: str, path: str, crc32c: int, *,
                 if_generation_match: int | None = None,
                 progress: Progress | None = None,
                 metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        dest = self._path(key)
        meta = validate_metadata(metadata)
        if if_generation_match is not None:
            self._precondition("put", key, dest, if_generation_match)  # fail before copying
        try:
            src = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise DurableError(f"{self.url}: put {key}: source {path}: {e.strerror}") from None
        tmp_fd = -1
        tmp = ""
        try:
            tmp_fd, tmp = self._temp_in(key)
            size, crc = self._copy(src, tmp_fd, progress)
            if crc != crc32c:
                raise IntegrityError(
                    f"{self.url}: put {key}: source data has crc32c {crc:08x}, expected "
                    f"{crc32c:08x} (file changed or corrupted while copying); not stored")
            os.setxattr(tmp_fd, XATTR_CRC, f"{crc:08x}".encode())
            if meta:  # on the temp file, so the rename publishes data and metadata at once
                self._set_custom_meta(key, tmp_fd, meta)
            os.fsync(tmp_fd)  # the data is durable before it gets its final name
            with self._locked(key):
                live = self._live_generation(dest)
                if if_generation_match is not None and (live or 0) != if_generation_match:
                    raise PreconditionFailed(
                        f"{self.url}: put {key}: generation precondition failed (live "
                        f"{live if live is not None else 'absent'}, expected "
                        f"{if_generation_match})")
                gen = max(time.time_ns(), (live or 0) + 1)
                os.setxattr(tmp_fd, XATTR_GEN, str(gen).encode())
                os.fsync(tmp_fd)
                os.rename(tmp, dest)
                tmp = ""
                _fsync_dir(os.path.dirname(dest))
            st = os.fstat(tmp_fd)
            return ObjectInfo(key, size, crc, gen, st.st_mtime, meta)
        except OSError as e:
            raise self._fail(f"put {key}", e) from None
        finally:
            os.close(src)
            if tmp_fd >= 0:
                os.close(tmp_fd)
            if tmp:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def copy(self, src_key: str, dst_key: str, *, src_generation: int,
             if_generation_match: int | None = None) -> ObjectInfo:
        opened = self._open(self._path(src_key))
        if opened is None:
            raise ObjectNotFound(f"{self.url}: copy {src_key}: no such object")
        fd, st = opened
        try:
            info = self._info_of(src_key, fd, st)
            if info.generation != src_generation:
                raise ObjectNotFound(f"{self.url}: copy {src_key}: generation "
                                     f"{src_generation} is gone (live {info.generation})")
            if info.crc32c is None:
                raise DurableError(f"{self.url}: copy {src_key}: no recorded crc32c")
            # Through /proc, so a rename of the source meanwhile cannot swap its data.
            return self.put_file(dst_key, f"/proc/self/fd/{fd}", info.crc32c,
                                 if_generation_match=if_generation_match,
                                 metadata=info.metadata)
        finally:
            os.close(fd)

    @staticmethod
    def _copy(src: int, dst: int, progress: Progress | None) -> tuple[int, int]:
        """Copy src to dst from offset 0, checksumming what is copied."""
        off = 0
        crc = 0
        while True:
            data = os.pread(src, COPY_CHUNK, off)
            if not data:
                return off, crc
            crc = google_crc32c.extend(crc, data)
            done = 0
            view = memoryview(data)
            while done < len(data):
                done += os.pwrite(dst, view[done:], off + done)
            if progress is not None:
                progress(off, len(data))
            off += len(data)

    def _precondition(self, op: str, key: str, path: str, expected: int) -> None:
        live = self._live_generation(path)
        if (live or 0) != expected:
            raise PreconditionFailed(
                f"{self.url}: {op} {key}: generation precondition failed (live "
                f"{live if live is not None else 'absent'}, expected {expected})")

    def read_range(self, key: str, offset: int, length: int, *,
                   generation: int | None = None) -> bytes:
        path = self._path(key)
        if offset < 0 or length < 0:
            raise ValueError("offset and length must be >= 0")
        opened = self._open(path)
        if opened is None:
            raise ObjectNotFound(f"{self.url}: read {key}: not found")
        fd, st = opened
        try:
            if generation is not None and self._meta(fd, st)[1] != generation:
                raise ObjectNotFound(f"{self.url}: read {key}: generation {generation} not live")
            parts = []
            while length > 0:
                data = os.pread(fd, min(length, 1 << 30), offset)
                if not data:
                    break
                parts.append(data)
                offset += len(data)
                length -= len(data)
            return b"".join(parts)
        except OSError as e:
            raise self._fail(f"read {key}", e) from None
        finally:
            os.close(fd)

    def download(self, key: str, dest_fd: int, *, chunk_size: int = DEFAULT_DOWNLOAD_CHUNK,
                 parallel: int = 4, progress: Progress | None = None,
                 generation: int | None = None,
                 on_verified: OnVerified | None = None) -> ObjectInfo:
        path = self._path(key)
        opened = self._open(path)  # the open fd pins this version against renames over it
        if opened is None:
            raise ObjectNotFound(f"{self.url}: download {key}: not found")
        fd, st = opened
        try:
            info = self._info_of(key, fd, st)
            if generation is not None and info.generation != generation:
                raise ObjectNotFound(
                    f"{self.url}: download {key}: generation {generation} not live")

            def fetch(w: RangeWriter) -> None:
                while w.written < w.limit:
                    want = min(COPY_CHUNK, w.limit - w.written)
                    data = os.pread(fd, want, w.start + w.written)
                    if not data:
                        return  # short: the file was truncated in place; caught as short read
                    w.write(data)

            crc = verified_download(self.url, key, dest_fd, info, chunk_size, parallel, fetch,
                                    progress, on_verified)
        except OSError as e:
            raise self._fail(f"download {key}", e) from None
        finally:
            os.close(fd)
        if info.crc32c is None:
            return dataclasses.replace(info, crc32c=crc)
        return info

    def stat(self, key: str) -> ObjectInfo | None:
        opened = self._open(self._path(key))
        if opened is None:
            return None
        fd, st = opened
        try:
            return self._info_of(key, fd, st)
        finally:
            os.close(fd)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        validate_prefix(prefix)
        if not os.path.isdir(self.root):
            raise DurableError(f"{self.url}: list: directory does not exist")
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = os.path.join(self.root, base) if base else self.root
        keys: list[str] = []
        for dirpath, dirnames, filenames in os.walk(start):
            rel = os.path.relpath(dirpath, self.root)
            rel = "" if rel == "." else rel
            keep = []
            for d in dirnames:
                sub = f"{rel}/{d}/" if rel else f"{d}/"
                if (not rel and d == LOCK_DIR) or d.startswith(TMP_PREFIX):
                    continue
                if sub.startswith(prefix) or prefix.startswith(sub):
                    keep.append(d)
            dirnames[:] = keep
            for name in filenames:
                if name.startswith(TMP_PREFIX):
                    self._remove_if_stale(os.path.join(dirpath, name))
                    continue
                key = f"{rel}/{name}" if rel else name
                if key.startswith(prefix):
                    keys.append(key)
        keys.sort(key=lambda k: k.encode("utf-8", "surrogateescape"))  # GCS order
        for key in keys:
            try:
                info = self.stat(key)
            except ValueError:
                continue  # a name no mount path can have
            except OSError as e:
                raise self._fail(f"list {prefix!r}", e) from None
            if info is not None:  # deleted since the walk
                yield info

    def _remove_if_stale(self, path: str) -> None:
        """A temporary file of a put whose writer died (kill -9, a lost host) would stay
        for good: remove it once nobody has written to it for STALE_TMP_AGE seconds (a
        live put writes continuously, and renames within moments of its last write)."""
        try:
            if time.time() - os.lstat(path).st_mtime > STALE_TMP_AGE:
                os.unlink(path)
                log.warning("%s: removed %s, left by an interrupted upload", self.url,
                            os.path.relpath(path, self.root))
        except OSError:
            pass

    def delete(self, key: str, *, if_generation_match: int | None = None) -> None:
        path = self._path(key)
        try:
            with self._locked(key):
                live = self._live_generation(path)
                if live is None:
                    return
                if if_generation_match is not None and live != if_generation_match:
                    raise PreconditionFailed(
                        f"{self.url}: delete {key}: generation precondition failed (live "
                        f"{live}, expected {if_generation_match})")
                os.unlink(path)
                _fsync_dir(os.path.dirname(path))
        except FileNotFoundError:
            return
        except OSError as e:
            raise self._fail(f"delete {key}", e) from None
        # GCS has no directories: drop the ones this delete emptied (best effort;
        # a concurrent put re-creates its directory if it loses this race).
        parent = os.path.dirname(path)
        while parent != self.root:
            try:
                os.rmdir(parent)
            except OSError:
                break
            parent = os.path.dirname(parent)
