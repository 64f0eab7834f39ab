"""gs://bucket[/prefix] through google-cloud-storage.

- Endpoint: the `endpoint` argument, else STORAGE_EMULATOR_HOST, else Google.
  With an endpoint (an emulator such as fake-gcs-server) credentials are
  anonymous; otherwise application default credentials.
- Uploads: one multipart request up to 8 MiB; above that a resumable session
  whose data is streamed from the file in one PUT (optionally in
  `upload_chunk_size` pieces, a multiple of 256 KiB), so memory use stays flat
  whatever the file size. After a dropped connection the session's status is
  queried and the upload resumes where the server stopped. The file's crc32c
  goes in the object metadata, so GCS rejects data that does not match it; the
  crc32c and size GCS returns are compared with ours as well, and only then
  does the upload count.
- Custom metadata (put_file's `metadata`, e.g. per-chunk crc32cs) goes in the
  same object resource as the crc32c: in the multipart request, or when the
  resumable session is created. So it is atomic with the data: no reader ever
  sees the object without it. The stored metadata is compared with ours too.
- Retries: every request is retried with exponential backoff and full jitter on
  429, 408, 5xx, timeouts and dropped connections, for at most `retry_deadline`
  seconds per request (the longest outage tolerated). Uploads with a generation
  precondition are retried too. A resumable session the server forgot (restart,
  expiry), or finalized early (fake-gcs-server does so on a status query), is
  started again from the beginning.
- Generation preconditions are sent to the server, which enforces them
  atomically on GCS. Conditional puts and deletes also stat the object first:
  that fails fast before any data is sent, and is the only guard on
  fake-gcs-server, which ignores preconditions on resumable uploads and deletes.
- Every request has a (connect, read) timeout; check() is bounded by
  `check_timeout`.
- One storage.Client is shared by all threads: its requests session's urllib3
  pool is thread-safe and sized to `max_connections`; Blob objects (mutable)
  are never shared between calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping

import requests
import urllib3
from google.api_core import exceptions as gexc
from google.api_core.retry import Retry
from google.auth import exceptions as auth_exc
from google.auth.credentials import AnonymousCredentials, Credentials
from google.auth.transport.requests import AuthorizedSession
from google.cloud import storage
from google.cloud.storage.blob import Blob
from google.cloud.storage.exceptions import InvalidResponse

from mtcfs.core.checksums import crc_from_b64, crc_to_b64
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
    Unavailable,
    no_progress,
    validate_key,
    validate_metadata,
    validate_prefix,
    verified_download,
)

log = logging.getLogger(__name__)

SINGLE_SHOT_MAX = 16 * MiB

DEFAULT_RETRY_DEADLINE = 120.0
MULTIPART_MAX = 8 * MiB  # google-cloud-storage's own switch point to resumable uploads
SEND_BLOCK = 1 * MiB  # bytes per read() of a streamed upload body
GCS_CHUNK_MULTIPLE = 256 * 1024
CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 60.0
CHECK_TIMEOUT = 8.0
MAX_SESSION_RESTARTS = 3
OCTET_STREAM = "application/octet-stream"
_SCOPES = ("https://www.googleapis.com/auth/devstorage.read_write",)
_LIST_FIELDS = "items(name,size,crc32c,generation,updated,metadata),nextPageToken"
_TRANSIENT_CODES = frozenset({408, 429, 500, 502, 503, 504})
_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    ConnectionError,
    TimeoutError,
    requests.ConnectionError,
    requests.Timeout,
    requests.exceptions.ChunkedEncodingError,
    http.client.HTTPException,  # BadStatusLine, IncompleteRead, RemoteDisconnected...
    urllib3.exceptions.ProtocolError,
    urllib3.exceptions.TimeoutError,
    urllib3.exceptions.PoolError,
    urllib3.exceptions.SSLError,
)


def is_transient(exc: BaseException) -> bool:
    """Errors worth retrying: throttling, server errors, timeouts, dropped connections."""
    if isinstance(exc, _TRANSIENT_TYPES):
        return True
    if isinstance(exc, gexc.GoogleAPICallError):
        return exc.code in _TRANSIENT_CODES
    if isinstance(exc, InvalidResponse):
        return exc.response.status_code in _TRANSIENT_CODES
    if isinstance(exc, auth_exc.TransportError):
        # google-auth wraps the transport's exception (token refresh over the network).
        inner = exc.args[0] if exc.args else None
        return isinstance(inner, BaseException) and is_transient(inner)
    return False


def short_cause(exc: BaseException) -> str:
    """One line for an exception, preferring the innermost OS-level reason."""
    if isinstance(exc, gexc.RetryError) and exc.cause is not None:
        return short_cause(exc.cause)
    if isinstance(exc, requests.Timeout | urllib3.exceptions.TimeoutError | TimeoutError):
        return "timed out"
    text = str(exc)
    m = re.search(r"\[Errno (\d+)\] ([^'\")\]]+)", text)
    if m:
        return m.group(2).strip().lower()
    if isinstance(exc, gexc.GoogleAPICallError):
        return f"HTTP {exc.code}: {exc.message.splitlines()[0][:200] if exc.message else ''}"
    line = text.splitlines()[0] if text else type(exc).__name__
    return line[:300]


def normalize_endpoint(endpoint: str) -> str:
    endpoint = endpoint.strip().rstrip("/")
    if "://" not in endpoint:
        endpoint = "http://" + endpoint  # STORAGE_EMULATOR_HOST is often host:port
    return endpoint


class _SessionLost(Exception):
    """The resumable session is gone or was finalized with partial data: start over."""


class _SourceShrank(Exception):
    """The local file got shorter than it was when the upload started."""


class _FileRange:
    """An upload body streamed from fd[start:end] with pread (requests takes the
    Content-Length from len()). read() returns SEND_BLOCK bytes whatever urllib3
    asks for (16 KiB), which keeps the per-block Python overhead small."""

    def __init__(self, fd: int, start: int, end: int, progress: Progress | None) -> None:
        self._fd = fd
        self._pos = start
        self._start = start
        self._end = end
        self._progress: Progress = progress or no_progress

    def __len__(self) -> int:
        return self._end - self._start

    def read(self, n: int = -1) -> bytes:
        if self._pos >= self._end:
            return b""
        data = os.pread(self._fd, min(SEND_BLOCK, self._end - self._pos), self._pos)
        if not data:
            raise _SourceShrank()
        self._progress(self._pos, len(data))
        self._pos += len(data)
        return data


def _persisted_end(resp: requests.Response) -> int:
    """From a 308 answer: how many bytes the server has ("Range: bytes=0-N")."""
    rng = resp.headers.get("Range")
    if not rng:
        return 0
    m = re.fullmatch(r"bytes=0-(\d+)", rng.strip())
    if not m:
        raise DurableError(f"unexpected Range header in resumable upload reply: {rng!r}")
    return int(m.group(1)) + 1


def _ignore(msg: str) -> None:
    pass


class GcsTier(DurableTier):
    def __init__(self, bucket: str, prefix: str = "", *, endpoint: str | None = None,
                 retry_deadline: float = DEFAULT_RETRY_DEADLINE,
                 connect_timeout: float = CONNECT_TIMEOUT, read_timeout: float = READ_TIMEOUT,
                 check_timeout: float = CHECK_TIMEOUT, upload_chunk_size: int | None = None,
                 resumable_threshold: int = MULTIPART_MAX, max_connections: int = 32,
                 on_retry: Callable[[str], None] = _ignore) -> None:
        """`on_retry`: called (from worker threads, with one line naming the cause) each
        time a transient error is retried inside a call, so an outage is visible while
        the call keeps retrying."""
        if upload_chunk_size is not None and (
                upload_chunk_size <= 0 or upload_chunk_size % GCS_CHUNK_MULTIPLE):
            raise ValueError("upload_chunk_size must be a positive multiple of 256 KiB")
        if not 0 <= resumable_threshold <= MULTIPART_MAX:
            raise ValueError(f"resumable_threshold must be within 0..{MULTIPART_MAX}")
        self.bucket_name = bucket
        self.prefix = prefix  # "" or ends with "/"
        self.url = f"gs://{bucket}/{prefix}".rstrip("/")
        if endpoint is None:
            endpoint = os.environ.get("STORAGE_EMULATOR_HOST") or None
        self.endpoint = normalize_endpoint(endpoint) if endpoint else None
        self.retry_deadline = retry_deadline
        self.timeout = (connect_timeout, read_timeout)
        self.check_timeout = check_timeout
        self.upload_chunk_size = upload_chunk_size  # None: the whole file in one request
        self.resumable_threshold = resumable_threshold
        self.on_retry = on_retry
        self._client = self._make_client(max_connections)
        self._bucket = self._client.bucket(bucket)

    # -- set-up ----------------------------------------------------------------

    @property
    def _where(self) -> str:
        return self.endpoint or "https://storage.googleapis.com"

    def _make_client(self, max_connections: int) -> storage.Client:
        creds: Credentials
        project: str | None
        if self.endpoint:
            creds, project = AnonymousCredentials(), None
        else:
            try:
                import google.auth

                creds, project = google.auth.default(scopes=_SCOPES)
            except auth_exc.DefaultCredentialsError as e:
                raise DurableError(
                    f"{self.url}: no Google credentials (application default credentials): "
                    f"{short_cause(e)}; set GOOGLE_APPLICATION_CREDENTIALS, or give an "
                    f"endpoint for an emulator") from None
        session = AuthorizedSession(creds)
        # One pool shared by all worker threads: size it so parallel transfers
        # keep their connections instead of churning them.
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=max_connections)
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        options = {"api_endpoint": self.endpoint} if self.endpoint else None
        return storage.Client(project=project, credentials=creds, _http=session,
                              client_options=options)

    def _retry(self, deadline: float | None = None) -> Retry:
        return Retry(predicate=is_transient, initial=0.5, maximum=10.0, multiplier=2.0,
                     timeout=self.retry_deadline if deadline is None else deadline,
                     on_error=self._retrying)

    def _retrying(self, exc: BaseException) -> None:
        self.on_retry(f"{self.url}: GCS at {self._where} unavailable, retrying: "
                      f"{short_cause(exc)}")

    def _name(self, key: str) -> str:
        return self.prefix + validate_key(key)

    def _info(self, blob: Blob) -> ObjectInfo:
        updated = blob.updated
        return ObjectInfo(
            key=blob.name[len(self.prefix):],
            size=int(blob.size or 0),
            crc32c=crc_from_b64(blob.crc32c),
            generation=int(blob.generation or 0),
            updated=updated.timestamp() if updated is not None else 0.0,
            metadata=blob.metadata or {},
        )

    def _error(self, exc: BaseException, what: str) -> DurableError:
        """Translate a client-library exception into our one-line errors."""
        if isinstance(exc, DurableError):
            return exc
        prefix = f"{self.url}: {what}"
        if isinstance(exc, gexc.RetryError) or is_transient(exc):
            return Unavailable(f"{prefix}: GCS at {self._where} unavailable, gave up after "
                               f"retrying for up to {self.retry_deadline:g}s: {short_cause(exc)}")
        if isinstance(exc, gexc.Forbidden | gexc.Unauthorized):
            return DurableError(f"{prefix}: permission denied ({short_cause(exc)})")
        if isinstance(exc, gexc.NotFound):
            return ObjectNotFound(f"{prefix}: not found")
        if isinstance(exc, gexc.PreconditionFailed):
            return PreconditionFailed(f"{prefix}: generation precondition failed")
        if isinstance(exc, gexc.BadRequest) and "crc32c" in str(exc).lower():
            return IntegrityError(f"{prefix}: GCS rejected the data: it does not match the "
                                  f"crc32c sent (file changed or corrupted while uploading)")
        return DurableError(f"{prefix}: {short_cause(exc)}")

    # -- the interface ---------------------------------------------------------

    def check(self) -> None:
        """List at most one object under the prefix: needs only object-list permission
        (a bucket-get would fail for roles/storage.objectAdmin)."""
        deadline = time.monotonic() + self.check_timeout
        delay = 0.25
        while True:
            remaining = deadline - time.monotonic()
            timeout = (max(0.5, min(3.0, remaining)), max(0.5, min(5.0, remaining)))
            try:
                it = self._client.list_blobs(self.bucket_name, prefix=self.prefix or None,
                                             max_results=1, fields="items(name)",
                                             timeout=timeout, retry=None)
                for _ in it:
                    break
                return
            except gexc.NotFound:
                raise DurableError(f"{self.url}: bucket {self.bucket_name!r} does not exist "
                                   f"(at {self._where})") from None
            except (gexc.Forbidden, gexc.Unauthorized) as e:
                raise DurableError(f"{self.url}: permission denied listing bucket "
                                   f"{self.bucket_name!r}: {short_cause(e)}") from None
            except auth_exc.RefreshError as e:
                raise DurableError(f"{self.url}: cannot obtain Google credentials: "
                                   f"{short_cause(e)}") from None
            except Exception as e:
                if is_transient(e) and deadline - time.monotonic() > delay + 0.5:
                    time.sleep(delay)
                    delay *= 2
                    continue
                if is_transient(e):
                    raise DurableError(f"{self.url}: cannot reach GCS at {self._where}: "
                                       f"{short_cause(e)}") from None
                raise DurableError(f"{self.url}: bucket check failed at {self._where}: "
                                   f"{short_cause(e)}") from None

    def _bucket_exists(self) -> bool:
        try:
            self.check()
            return True
        except DurableError:
            return False

    def put_file(self, key: str, path: str, crc32c: int, *,
                 if_generation_match: int | None = None,
                 progress: Progress | None = None,
                 metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        name = self._name(key)
        meta = validate_metadata(metadata)
        if if_generation_match is not None:
            cur = self.stat(key)
            if (cur.generation if cur else 0) != if_generation_match:
                raise PreconditionFailed(
                    f"{self.url}: put {key}: generation precondition failed (live "
                    f"{cur.generation if cur else 'absent'}, expected {if_generation_match})")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise DurableError(f"{self.url}: put {key}: source {path}: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            restarts = 0
            while True:
                try:
                    return self._upload_once(key, name, fd, size, crc32c, meta,
                                             if_generation_match, progress)
                except _SessionLost as e:
                    why = str(e)
                except _SourceShrank:
                    raise IntegrityError(f"{self.url}: put {key}: source {path} got shorter "
                                         f"while it was being uploaded; not stored") from None
                except gexc.PreconditionFailed:
                    # A retried request whose first attempt did land reports 412 although
                    # our bytes are stored: accept an object that is exactly our data.
                    cur = self.stat(key)
                    if (cur is not None and cur.crc32c == crc32c and cur.size == size
                            and cur.metadata == meta):
                        return cur
                    raise PreconditionFailed(
                        f"{self.url}: put {key}: generation precondition failed (live "
                        f"{cur.generation if cur else 'absent'}, expected "
                        f"{if_generation_match})") from None
                except gexc.NotFound:
                    raise DurableError(f"{self.url}: put {key}: bucket {self.bucket_name!r} "
                                       f"not found at {self._where}") from None
                except Exception as e:
                    raise self._error(e, f"put {key}") from None
                if restarts >= MAX_SESSION_RESTARTS:
                    raise Unavailable(f"{self.url}: put {key}: upload session lost "
                                      f"{restarts + 1} times, giving up: {why}")
                if not self._bucket_exists():
                    raise DurableError(f"{self.url}: put {key}: bucket {self.bucket_name!r} "
                                       f"not found at {self._where}")
                restarts += 1
                log.warning("%s: upload of %s: %s; restarting the upload", self.url, key, why)
        finally:
            os.close(fd)

    def _upload_once(self, key: str, name: str, fd: int, size: int, crc32c: int,
                     meta: dict[str, str], if_generation_match: int | None,
                     progress: Progress | None) -> ObjectInfo:
        blob = self._bucket.blob(name)
        # In the object metadata of both the multipart and the resumable upload,
        # so the server verifies the bytes against our checksum, and the custom
        # metadata is created together with the data.
        blob.crc32c = crc_to_b64(crc32c)
        if meta:
            blob.metadata = meta
        if size <= self.resumable_threshold:
            data = os.pread(fd, size, 0) if size else b""
            blob.upload_from_string(
                data, content_type=OCTET_STREAM, if_generation_match=if_generation_match,
                checksum=None, retry=self._retry(), timeout=self.timeout)
            if progress is not None and size:
                progress(0, size)
            info = self._info(blob)
        else:
            url = blob.create_resumable_upload_session(
                content_type=OCTET_STREAM, size=size, timeout=self.timeout, checksum=None,
                if_generation_match=if_generation_match, retry=self._retry())
            resource = self._send_resumable(url, fd, size, progress)
            blob._set_properties(resource)
            info = self._info(blob)
            if info.size != size:
                # fake-gcs-server finalizes a session on a status query: what it holds
                # is a truncated object. Remove it and upload again.
                self._delete_generation(blob, info.generation)
                raise _SessionLost(f"server finalized the upload early at {info.size} of "
                                   f"{size} bytes")
        if info.crc32c != crc32c or info.size != size:
            # The server stored something else than we meant (GCS itself would have
            # refused it; emulators do not check): do not count it, remove it.
            self._delete_generation(blob, info.generation)
            got = f"{info.crc32c:08x}" if info.crc32c is not None else "none"
            raise IntegrityError(
                f"{self.url}: put {key}: server stored {info.size} bytes with crc32c {got}, "
                f"expected {size} bytes with {crc32c:08x} (file changed while uploading?)")
        if info.metadata != meta:
            # Chunk crcs that do not describe the data must not stay with it.
            self._delete_generation(blob, info.generation)
            raise DurableError(f"{self.url}: put {key}: server stored other custom metadata "
                               f"than sent ({sorted(info.metadata)} for {sorted(meta)})")
        return info

    def copy(self, src_key: str, dst_key: str, *, src_generation: int,
             if_generation_match: int | None = None) -> ObjectInfo:
        src = self._bucket.blob(self._name(src_key), generation=src_generation)
        dst = self._bucket.blob(self._name(dst_key))
        if if_generation_match is not None:
            # GCS checks this atomically; checked first too, as emulators ignore it.
            cur = self.stat(dst_key)
            if (cur.generation if cur is not None else 0) != if_generation_match:
                raise PreconditionFailed(f"{self.url}: copy to {dst_key}: generation "
                                         f"precondition failed")
        try:
            # rewrite() copies inside GCS (in several calls for large objects); the
            # custom metadata and the crc32c travel with the object.
            token = None
            while True:
                token, _done, _total = dst.rewrite(
                    src, token=token, if_generation_match=if_generation_match,
                    if_source_generation_match=src_generation, timeout=self.timeout,
                    retry=self._retry())
                if token is None:
                    break
        except gexc.NotFound:
            raise ObjectNotFound(f"{self.url}: copy {src_key}: generation {src_generation} "
                                 f"is gone") from None
        except gexc.PreconditionFailed:
            if self._stat_name(self._name(src_key), src_generation) is None:
                raise ObjectNotFound(f"{self.url}: copy {src_key}: generation "
                                     f"{src_generation} is gone") from None
            raise PreconditionFailed(f"{self.url}: copy to {dst_key}: generation "
                                     f"precondition failed") from None
        except Exception as e:
            raise self._error(e, f"copy {src_key} to {dst_key}") from None
        info = self._stat_name(self._name(dst_key))
        if info is None:
            raise DurableError(f"{self.url}: copy to {dst_key}: the copy is not there")
        return info

    def _delete_generation(self, blob: Blob, generation: int) -> None:
        with contextlib.suppress(gexc.GoogleAPIError, DurableError, *_TRANSIENT_TYPES):
            self._bucket.blob(blob.name).delete(if_generation_match=generation,
                                               timeout=self.timeout, retry=self._retry())

    def _send_resumable(self, url: str, fd: int, size: int,
                        progress: Progress | None) -> dict:
        """Stream fd[0:size] into the resumable session at `url`; the object resource.

        Each step is one request, retried by api_core's Retry on transient errors.
        After a failure the server's position is unknown, so the retried step asks
        for it (status query) before sending more. The deadline applies per step,
        so an upload that keeps making progress is never cut off.
        """
        session = self._client._http
        offset: int | None = 0  # None: unknown until the server tells us
        stalls = 0

        def step() -> dict | None:
            nonlocal offset
            if offset is None:
                resp = session.put(url, data=b"", headers={"Content-Range": f"bytes */{size}"},
                                   timeout=self.timeout)
            else:
                end = size if self.upload_chunk_size is None else min(
                    size, offset + self.upload_chunk_size)
                body = _FileRange(fd, offset, end, progress)
                rng = f"bytes {offset}-{end - 1}/{size}" if end > offset else f"bytes */{size}"
                offset = None  # should this request fail, the server's position is unknown
                resp = session.put(url, data=body, headers={"Content-Range": rng},
                                   timeout=self.timeout)
            if resp.status_code in (200, 201):
                return resp.json()
            if resp.status_code == 308:
                offset = _persisted_end(resp)
                return None
            if resp.status_code in (404, 410):
                raise _SessionLost(f"the server forgot the resumable session "
                                   f"(HTTP {resp.status_code})")
            raise gexc.from_http_response(resp)  # transient codes are retried

        last = -1
        while True:
            done = self._retry()(step)()
            if done is not None:
                return done
            assert offset is not None
            stalls = stalls + 1 if offset <= last else 0
            if stalls > 5:
                raise Unavailable(f"{self.url}: resumable upload makes no progress at byte "
                                  f"{offset} of {size}")
            last = offset

    def read_range(self, key: str, offset: int, length: int, *,
                   generation: int | None = None) -> bytes:
        name = self._name(key)
        if offset < 0 or length < 0:
            raise ValueError("offset and length must be >= 0")
        if length == 0:
            return b""
        blob = self._bucket.blob(name, generation=generation)
        try:
            return blob.download_as_bytes(start=offset, end=offset + length - 1,
                                          raw_download=True, checksum=None,
                                          timeout=self.timeout, retry=self._retry())
        except gexc.RequestRangeNotSatisfiable:
            return b""  # offset at or past the end, as pread() would
        except Exception as e:
            raise self._error(e, f"read {key}") from None

    def download(self, key: str, dest_fd: int, *, chunk_size: int = DEFAULT_DOWNLOAD_CHUNK,
                 parallel: int = 4, progress: Progress | None = None,
                 generation: int | None = None,
                 on_verified: OnVerified | None = None) -> ObjectInfo:
        name = self._name(key)
        info = self._stat_name(name, generation)
        if info is None:
            raise ObjectNotFound(f"{self.url}: download {key}: not found")

        def fetch(w: RangeWriter) -> None:
            # A Blob per chunk (Blob objects are not thread-safe), pinned to one
            # generation so an overwrite mid-download cannot mix versions.
            blob = self._bucket.blob(name, generation=info.generation)
            # Streaming hands the data over in 8 KiB pieces: ~130k rounds of Python
            # per GiB that starve the FUSE thread of the GIL. A chunk of up to
            # SINGLE_SHOT_MAX is read in one piece (bounded memory: parallel x that).
            blob.download_to_file(w, start=w.start, end=w.start + w.limit - 1,
                                  raw_download=True, checksum=None,
                                  single_shot_download=w.limit <= SINGLE_SHOT_MAX,
                                  timeout=self.timeout, retry=self._retry())

        try:
            crc = verified_download(self.url, key, dest_fd, info, chunk_size, parallel, fetch,
                                    progress, on_verified)
        except gexc.NotFound:
            raise ObjectNotFound(f"{self.url}: download {key}: generation {info.generation} "
                                 f"was replaced or deleted during the download") from None
        except Exception as e:
            raise self._error(e, f"download {key}") from None
        if info.crc32c is None:
            return dataclasses.replace(info, crc32c=crc)
        return info

    def _stat_name(self, name: str, generation: int | None = None) -> ObjectInfo | None:
        try:
            blob = self._bucket.get_blob(name, generation=generation, timeout=self.timeout,
                                         retry=self._retry())
        except Exception as e:
            raise self._error(e, f"stat {name[len(self.prefix):]}") from None
        return None if blob is None else self._info(blob)

    def stat(self, key: str) -> ObjectInfo | None:
        return self._stat_name(self._name(key))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        full = self.prefix + validate_prefix(prefix)
        try:
            for blob in self._client.list_blobs(self.bucket_name, prefix=full or None,
                                                fields=_LIST_FIELDS, timeout=self.timeout,
                                                retry=self._retry()):
                key = blob.name[len(self.prefix):]
                try:
                    validate_key(key)
                except ValueError:
                    # Folder placeholders ("dir/") and names no mount path can have.
                    log.debug("%s: skipping object %r", self.url, blob.name)
                    continue
                yield self._info(blob)
        except Exception as e:
            raise self._error(e, f"list {prefix!r}") from None

    def delete(self, key: str, *, if_generation_match: int | None = None) -> None:
        name = self._name(key)
        if if_generation_match is not None:
            cur = self.stat(key)
            if cur is None:
                return
            if cur.generation != if_generation_match:
                raise PreconditionFailed(
                    f"{self.url}: delete {key}: generation precondition failed (live "
                    f"{cur.generation}, expected {if_generation_match})")
        blob = self._bucket.blob(name)
        try:
            blob.delete(if_generation_match=if_generation_match, timeout=self.timeout,
                        retry=self._retry())
        except gexc.NotFound:
            return  # absent, or a retried delete whose first attempt landed
        except gexc.PreconditionFailed:
            if self.stat(key) is None:
                return
            raise PreconditionFailed(
                f"{self.url}: delete {key}: generation precondition failed") from None
        except Exception as e:
            raise self._error(e, f"delete {key}") from None

    def close(self) -> None:
        self._client.close()
