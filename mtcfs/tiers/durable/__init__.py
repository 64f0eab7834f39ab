"""The durable tier: `gs://bucket[/prefix]` (GCS) or `file:///dir`, behind one interface.

    tier = open_durable("gs://bucket/run1", endpoint=None)
    tier.check()                      # at mount time: clear error, bounded time
    info = tier.put_file("step-100/shard-0", "/dev/shm/...", crc, if_generation_match=0)
    tier.download("step-100/shard-0", fd)

Chunk-verified reads: record per-chunk crc32cs in the object's metadata at upload,
and download() reports each chunk with on_verified(offset, length) once it checked:

    chunk, crcs = chunk_crcs_of_fd(src_fd, size)      # one pass; crc_of_chunks() = whole
    tier.put_file(key, path, crc_of_chunks(chunk, crcs, size),
                  metadata={CHUNK_META_KEY: encode_chunk_meta(chunk, crcs)})
    tier.download(key, fd, on_verified=lambda off, n: ...)

See base.DurableTier for the contract shared by both backends.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from urllib.parse import unquote, urlsplit

from mtcfs.core.checksums import (
    CHUNK_META_KEY,
    chunk_crcs_of_fd,
    chunk_size_for,
    crc_of_chunks,
    decode_chunk_meta,
    encode_chunk_meta,
)
from mtcfs.tiers.durable.base import (
    DurableError,
    DurableTier,
    IntegrityError,
    Metadata,
    ObjectInfo,
    ObjectNotFound,
    OnVerified,
    PreconditionFailed,
    Progress,
    Unavailable,
    validate_key,
    validate_metadata,
)

__all__ = [
    "CHUNK_META_KEY",
    "DurableError",
    "DurableTier",
    "IntegrityError",
    "Metadata",
    "ObjectInfo",
    "ObjectNotFound",
    "OnVerified",
    "PreconditionFailed",
    "Progress",
    "Unavailable",
    "chunk_crcs_of_fd",
    "chunk_size_for",
    "crc_of_chunks",
    "decode_chunk_meta",
    "encode_chunk_meta",
    "open_durable",
    "parse_url",
    "validate_key",
    "validate_metadata",
]

# GCS bucket names: 3-63 characters (up to 222 with dots), lowercase, digits, - _ .
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
_USAGE = "expected gs://bucket[/prefix] or file:///absolute/dir"


def parse_url(url: str) -> tuple[str, str, str]:
    """Validate a durable-tier URL without any I/O: ("gs", bucket, prefix) with
    prefix "" or ending in "/", or ("file", "", absolute path). DurableError if bad."""
    if url.startswith("gs://"):
        rest = url[len("gs://"):]
        bucket, _, prefix = rest.partition("/")
        if not _BUCKET_RE.fullmatch(bucket) or ".." in bucket:
            raise DurableError(f"invalid bucket name {bucket!r} in {url!r}: {_USAGE}")
        prefix = prefix.strip("/")
        if prefix:
            try:
                validate_key(prefix)
            except ValueError as e:
                raise DurableError(f"invalid prefix in {url!r}: {e}") from None
            prefix += "/"
        return "gs", bucket, prefix
    if url.startswith("file:"):
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise DurableError(f"invalid durable directory URL {url!r}: {_USAGE}")
        if parts.query or parts.fragment:
            raise DurableError(f"invalid durable directory URL {url!r}: no ?query or #fragment")
        path = os.path.normpath(unquote(parts.path))
        if path == "/":
            raise DurableError(f"refusing the root directory as durable tier: {url!r}")
        return "file", "", path
    raise DurableError(f"unsupported durable-tier URL {url!r}: {_USAGE}")


def open_durable(url: str, endpoint: str | None = None, *,
                 retry_deadline: float | None = None,
                 on_retry: Callable[[str], None] = lambda msg: None) -> DurableTier:
    """The durable tier for `url`. Does no I/O on file:// and no request on gs://
    (call check() for that); raises DurableError for a URL it cannot use.

    endpoint: a GCS endpoint such as an emulator (http://127.0.0.1:4443); default
    STORAGE_EMULATOR_HOST, else Google. retry_deadline: seconds one GCS request
    keeps retrying through an outage before Unavailable is raised. on_retry: told of
    each transient error a GCS call retries (a file:// tier does not retry).
    """
    kind, bucket, where = parse_url(url)
    if kind == "gs":
        from mtcfs.tiers.durable.gcs import DEFAULT_RETRY_DEADLINE, GcsTier

        return GcsTier(bucket, where, endpoint=endpoint,
                       retry_deadline=retry_deadline or DEFAULT_RETRY_DEADLINE, on_retry=on_retry)
    from mtcfs.tiers.durable.localdir import LocalDirTier

    return LocalDirTier(where)
