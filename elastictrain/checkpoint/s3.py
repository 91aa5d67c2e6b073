"""Checkpoints in S3 and S3-compatible object stores (MinIO, Ceph RGW, R2, GCS's XML API): ``S3Storage``.

An object store has no directories and no atomic rename, so the manager commits a checkpoint
differently there (see :class:`~elastictrain.checkpoint.storage.ObjectStore`): each rank uploads
its files under a prefix of the save's own, and the checkpoint is committed by its manifest,
written last with a create-only conditional write (``If-None-Match: *``).

Every ``open_write`` is create-only (``If-None-Match: *``), and no write is a multipart upload: a
small file is one ``PutObject``; a file larger than ``part_size`` is stored in segments, objects
of ``part_size`` under ``<key>.seg-<nonce>/``, each one ``PutObject`` sent on a few threads as
soon as ``torch.save`` has streamed it into the file object (the bytes come straight from the
snapshot in memory, each copied once: no temporary file), then the file's index at the key
itself: JSON naming the segments' prefix and sizes, its size in the object's metadata. That
index, written create-only once every segment is stored, is the file's creation: of two writers
of one key exactly one succeeds, the other gets ``FileExistsError`` (S3's 412
``PreconditionFailed``, or 409 ``ConditionalRequestConflict`` while the two race). Why segments
and not a multipart upload: ``docs/checkpoint.md`` (a ``CompleteMultipartUpload`` makes the
server assemble the object again; segments need no such step, retry one at a time, and work on
stores whose multipart support is weak). The one replacement, a manifest of a step saved again,
is ``write_if_unchanged``: a ``PutObject`` with ``If-Match`` on the ETag read. A reader
downloads a file once (``read_hashed``): ranges of an object, or its segments, on a few
threads, hashed in order as they arrive. A file in segments reads back through this class
(``elastictrain checkpoint export`` writes a checkpoint's model as one safetensors file).

The client is boto3's: credentials, region and endpoint come from where the AWS SDKs look for
them (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and
``~/.aws/config``/``credentials``, instance and pod roles, ``AWS_ENDPOINT_URL`` or
``AWS_ENDPOINT_URL_S3`` for a compatible store; no CRC32 of the bodies unless
``AWS_REQUEST_CHECKSUM_CALCULATION``/``AWS_RESPONSE_CHECKSUM_VALIDATION`` ask for it: the
manifest's sha256 covers every byte). Throttling (503 ``SlowDown``), 5xx answers,
timeouts and broken connections are retried here, with exponential backoff and jitter (0.05 s
doubling to at most 5 s; ``AWS_MAX_ATTEMPTS`` attempts, default 10), not by botocore: its
backoff (doubling from 1 s to 20 s) would hold a save for minutes of a stall that the manager's
``save_timeout`` should judge. Nothing here logs or raises a credential: errors name the
bucket, the key and S3's error code.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import json
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO

__all__ = ["S3Storage", "S3Error", "parse_url", "is_url"]

logger = logging.getLogger(__name__)

SCHEME = "s3://"
_MIN_PART = 1 << 20
_DEFAULT_PART = 32 << 20
_SEGMENTS = ".seg-"
"""A large file's segments are the objects under ``<key>.seg-<nonce>/``."""
_SEGMENTED = "elastictrain-segmented"
"""User metadata (``x-amz-meta-``) of a file's index: the file's size in bytes."""
_INDEX_FORMAT = "elastictrain-segments-1"
_SEGMENT_DIR = re.compile(r".+\.seg-[0-9a-f]{16}")
_DEFAULT_CONCURRENCY = 8
_DEFAULT_ATTEMPTS = 10
_BACKOFF_BASE = 0.05
_BACKOFF_CAP = 5.0
_RETRIED_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                            "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequests"})
_DELETE_BATCH = 1000


class S3Error(OSError):
    """An S3 request failed for a reason that is not a missing key (the bucket, access, the network)."""


def is_url(directory: str | os.PathLike[str]) -> bool:
    """Return whether ``directory`` names an S3 location (``s3://bucket/prefix``)."""
    return isinstance(directory, str) and directory.startswith(SCHEME)


def parse_url(url: str) -> tuple[str, str]:
    """Split ``s3://bucket/prefix`` into (bucket, prefix without slashes at either end).

    Raises:
        ValueError: ``url`` is not an ``s3://`` URL with a bucket name.
    """
    if not is_url(url):
        raise ValueError(f"not an s3:// URL: {url!r}")
    bucket, _, prefix = url[len(SCHEME):].partition("/")
    parts = [p for p in prefix.split("/") if p]
    if not bucket or any(p in (".", "..") for p in parts):
        raise ValueError(f"an S3 checkpoint location is s3://BUCKET/PREFIX, got {url!r}")
    return bucket, "/".join(parts)


def _client() -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:
        raise ImportError("checkpoints in s3:// need boto3: pip install 'elastictrain[s3]'") from exc
    # One attempt per botocore call: S3Storage retries (see the module docstring).
    options: dict[str, Any] = {"retries": {"mode": "standard", "total_max_attempts": 1},
                               "max_pool_connections": 2 * _DEFAULT_CONCURRENCY + 4, "connect_timeout": 10,
                               "read_timeout": 60}
    # No CRC32 of every body sent and received (botocore's default since 1.36) unless the
    # environment asks for it: the manifest's sha256 already checks every byte end to end, the
    # signature (plain HTTP) or TLS guards the wire, and several S3 compatibles refuse the
    # checksum headers. It is a pass over each byte on the trainer's cores.
    for option in ("request_checksum_calculation", "response_checksum_validation"):
        if f"AWS_{option.upper()}" not in os.environ:
            options[option] = "when_required"
    return boto3.session.Session().client("s3", config=Config(**options))


def _code(exc: BaseException) -> tuple[str, int]:
    response = getattr(exc, "response", None) or {}  # botocore's ClientError carries one
    error = response.get("Error", {})
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return str(error.get("Code", "")), int(status or 0)


def _attempts() -> int:
    try:
        return max(1, int(os.environ.get("AWS_MAX_ATTEMPTS", _DEFAULT_ATTEMPTS)))
    except ValueError:
        return _DEFAULT_ATTEMPTS


def _retryable(exc: BaseException) -> bool:
    """Throttling, a server error, a timeout or a broken connection: worth another attempt."""
    if hasattr(exc, "response"):
        code, status = _code(exc)
        return code in _RETRIED_CODES or status in (500, 502, 503, 504)
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError
    except ImportError:
        return False
    return isinstance(exc, (BotoConnectionError, HTTPClientError))


class S3Storage:
    """``Storage`` in an S3 bucket (an :class:`~elastictrain.checkpoint.storage.ObjectStore`).

    Paths are keys relative to ``prefix``; a "directory" is a key prefix ending in ``/``.

    Args:
        bucket: The bucket; it must exist.
        prefix: The key prefix every path is under (``""``: the bucket's root).
        client: A boto3 S3 client; ``None`` makes one the standard way (see the module).
        part_size: Bytes per segment of a file written (and per range read), at least 1 MiB; a
            file of at most this many bytes is one object.
        concurrency: Segments uploaded (and downloaded) at once, per file. The storage keeps up
            to ``concurrency + 1`` segment buffers (``part_size`` each: 288 MiB by default) from
            one file to the next, so that the copy into them does not page-fault.
        attempts: Tries of each request that meets throttling, a server error, a timeout or a
            broken connection; ``None``: ``AWS_MAX_ATTEMPTS``, else 10.
    """

    def __init__(self, bucket: str, prefix: str = "", *, client: Any = None, part_size: int = _DEFAULT_PART,
                 concurrency: int = _DEFAULT_CONCURRENCY, attempts: int | None = None) -> None:
        if part_size < _MIN_PART:
            raise ValueError(f"part_size must be at least {_MIN_PART} bytes, got {part_size}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be positive, got {concurrency}")
        self._bucket = bucket
        self._prefix = "/".join(p for p in prefix.split("/") if p)
        self._client = client if client is not None else _client()
        self._part_size = part_size
        self._concurrency = concurrency
        self._bucket_checked = False
        self._attempts = attempts if attempts is not None else _attempts()
        self._spare: list[bytearray] = []  # segment buffers, warm: see _take_buffer
        self._spare_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> S3Storage:
        """``S3Storage`` of ``s3://bucket/prefix``.

        Raises:
            ValueError: ``url`` is not such a URL.
        """
        bucket, prefix = parse_url(url)
        return cls(bucket, prefix, **kwargs)

    @property
    def client(self) -> Any:
        """The boto3 client."""
        return self._client

    @property
    def bucket(self) -> str:
        """The bucket's name."""
        return self._bucket

    def _key(self, path: str) -> str:
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if path.startswith("/") or ".." in parts:
            raise ValueError(f"storage path must be relative and stay under the root: {path!r}")
        return "/".join(([self._prefix] if self._prefix else []) + parts)

    def _dir(self, path: str) -> str:
        key = self._key(path)
        return f"{key}/" if key else ""

    def _error(self, exc: Exception, what: str, key: str | None = None) -> OSError:
        """An ``OSError`` for a failed request (the caller raises it ``from exc``)."""
        code, status = _code(exc)
        where = self.location_of_key(key) if key is not None else f"s3://{self._bucket}"
        if code in ("NoSuchKey", "404", "NotFound") or (status == 404 and code != "NoSuchBucket"):
            return FileNotFoundError(f"{what}: {where} does not exist")
        if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
            return FileExistsError(f"{what}: {where} exists already (a create-only write lost)")
        if code == "NoSuchBucket":
            return S3Error(f"bucket {self._bucket!r} does not exist")
        if code in ("AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch") \
                or status == 403:
            return PermissionError(f"{what}: access to {where} denied ({code or status}); check the "
                                   "AWS credentials and the bucket's policy")
        detail = f"{code} (HTTP {status})" if code else f"{type(exc).__name__}: {exc}"
        return S3Error(f"{what}: {where}: {detail}")

    def _retried(self, what: str, key: str | None, method: str, **kwargs: Any) -> Any:
        """``client.method(Bucket=..., **kwargs)``, retried with backoff while it fails in a way worth
        retrying; raises the last attempt's exception as it is."""
        attempt = 1
        while True:
            try:
                return getattr(self._client, method)(Bucket=self._bucket, **kwargs)
            except Exception as exc:  # botocore's ClientError, connection and timeout errors
                if attempt >= self._attempts or not _retryable(exc):
                    raise
                delay = min(_BACKOFF_CAP, _BACKOFF_BASE * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
                logger.debug("%s %s: %s; attempt %d of %d in %.2fs", what, self.location_of_key(key or ""),
                             _code(exc)[0] or type(exc).__name__, attempt + 1, self._attempts, delay)
                time.sleep(delay)
                attempt += 1

    def _call(self, what: str, key: str | None, method: str, **kwargs: Any) -> Any:
        try:
            return self._retried(what, key, method, **kwargs)
        except Exception as exc:
            if not hasattr(exc, "response"):  # no answer: a timeout, a refused or broken connection
                raise S3Error(f"{what}: {self.location_of_key(key or '')}: {type(exc).__name__}: {exc}") from exc
            raise self._error(exc, what, key) from exc

    def location_of_key(self, key: str) -> str:
        """``s3://bucket/key``."""
        return f"s3://{self._bucket}/{key}"

    def location(self, path: str) -> str:
        """See base class."""
        return self.location_of_key(self._key(path))

    def check_bucket(self) -> None:
        """Check that the bucket exists and these credentials may use it (one ``HeadBucket``).

        Raises:
            OSError: It does not exist (``S3Error``), access is denied (``PermissionError``), or
                the endpoint cannot be reached.
        """
        try:
            self._retried("checking", None, "head_bucket")
        except Exception as exc:
            code, status = _code(exc)
            if code in ("404", "NotFound", "NoSuchBucket") or status == 404:
                raise S3Error(f"bucket {self._bucket!r} does not exist") from exc
            if not hasattr(exc, "response"):
                raise S3Error(f"cannot reach the S3 endpoint of bucket {self._bucket!r}: {exc}") from exc
            raise self._error(exc, "checking the bucket") from exc
        self._bucket_checked = True

    def _list(self, prefix: str, delimiter: bool) -> Iterator[dict[str, Any]]:
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Prefix": prefix}
            if delimiter:
                kwargs["Delimiter"] = "/"
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call("listing", prefix, "list_objects_v2", **kwargs)
            yield page
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

    def list_dir(self, path: str) -> list[str]:
        """See base class. A prefix without objects "does not exist" (``FileNotFoundError``); a
        file stored in segments is one name (its segments' prefix is not listed)."""
        prefix = self._dir(path)
        names: set[str] = set()
        for page in self._list(prefix, delimiter=True):
            names.update(o["Key"][len(prefix):] for o in page.get("Contents", []))
            names.update(p["Prefix"][len(prefix):].rstrip("/") for p in page.get("CommonPrefixes", []))
        names.discard("")
        if any(_SEGMENT_DIR.fullmatch(n) for n in names):
            # Segments whose index was never written (a crashed writer) stay hidden too: garbage
            # under a data prefix that retention deletes, never a file.
            names = {n for n in names if not _SEGMENT_DIR.fullmatch(n)}
        if not names:
            raise FileNotFoundError(f"no objects under {self.location_of_key(prefix)}")
        return sorted(names)

    def list_sizes(self, path: str) -> dict[str, int]:
        """See :class:`~elastictrain.checkpoint.storage.ObjectStore`. Every object: the segments
        of a file being written too (``<name>.seg-<nonce>/<n>``), so the bytes stored so far
        grow as it is written."""
        prefix = self._dir(path)
        return {o["Key"][len(prefix):]: int(o["Size"]) for page in self._list(prefix, delimiter=False)
                for o in page.get("Contents", [])}

    def make_dir(self, path: str) -> None:
        """See base class. There are no directories; the first call checks the bucket instead."""
        self._key(path)
        if not self._bucket_checked:
            self.check_bucket()

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        """See base class. Create-only (``If-None-Match: *``); durable once S3 answered."""
        key = self._key(path)
        writer = _Writer(self, key)
        try:
            yield writer  # type: ignore[misc]  # a write-only file object
            writer.finish()
        except BaseException:
            writer.abort()
            raise

    def _put(self, key: str, body: bytes | bytearray, *, metadata: dict[str, str] | None = None) -> None:
        """One create-only ``PutObject`` (``body`` is sent as it is: no copy)."""
        self._call("writing", key, "put_object", Key=key, Body=body, IfNoneMatch="*", **(
            {"Metadata": metadata} if metadata else {}))

    def _take_buffer(self) -> bytearray:
        """A buffer of ``part_size`` bytes for a segment, one a segment used before if there is.

        Kept for the next segment and the next file (up to ``concurrency + 1`` of them, as many as
        one file has in use): the first touch of fresh memory page-faults, which makes a copy into
        it several times slower than into memory written before.
        """
        with self._spare_lock:
            if self._spare:
                return self._spare.pop()
        return bytearray(self._part_size)

    def _give_buffer(self, buffer: bytearray) -> None:
        """Keep ``buffer`` (no longer read) for ``_take_buffer``, if it is a whole segment's."""
        with self._spare_lock:
            if len(buffer) == self._part_size and len(self._spare) <= self._concurrency:
                self._spare.append(buffer)

    def write_if_unchanged(self, path: str, data: bytes, *, tag: str) -> None:
        """See :class:`~elastictrain.checkpoint.storage.ObjectStore`: one ``PutObject`` with
        ``If-Match: <ETag>``."""
        key = self._key(path)
        self._call("replacing", key, "put_object", Key=key, Body=bytes(data), IfMatch=tag)

    def read_tagged(self, path: str) -> tuple[bytes, str]:
        """See :class:`~elastictrain.checkpoint.storage.ObjectStore`: one ``GetObject``; the tag is the ETag.

        Raises:
            S3Error: ``path`` is a file stored in segments (a large one, not a manifest).
        """
        key = self._key(path)
        response = self._call("reading", key, "get_object", Key=key)
        if _SEGMENTED in (response.get("Metadata") or {}):
            raise S3Error(f"reading {self.location_of_key(key)}: a file of segments has no single version to replace")
        return self._body(key, response), str(response["ETag"])

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        """See base class. Reads the whole file into memory (in ranges or segments, on a few
        threads): ``torch.load`` needs a seekable file."""
        yield io.BytesIO(self._download(self._key(path), None))

    def read_hashed(self, path: str) -> tuple[bytes, str]:
        """See :class:`~elastictrain.checkpoint.storage.ObjectStore`: ranges or segments download
        on a few threads while the bytes already here are hashed, in order."""
        digest = hashlib.sha256()
        return self._download(self._key(path), digest.update), digest.hexdigest()

    def _download(self, key: str, on_chunk: Callable[[bytes], None] | None) -> bytes:
        """The whole file ``key``, at most ``concurrency`` requests in flight (see ``_pieces``);
        ``on_chunk`` sees each piece in order as it arrives."""
        pieces = self._pieces(key)
        if len(pieces) == 1:
            chunks = [self._get(*pieces[0])]
            if on_chunk is not None:
                on_chunk(chunks[0])
        else:
            chunks = []
            with ThreadPoolExecutor(min(self._concurrency, len(pieces)), thread_name_prefix="elastictrain-s3") as pool:
                pending: collections.deque[Future[bytes]] = collections.deque()
                for piece in pieces:
                    pending.append(pool.submit(self._get, *piece))
                    if len(pending) >= self._concurrency:  # bounded memory: consume the oldest first
                        chunks.append(self._consume(pending.popleft(), on_chunk))
                while pending:
                    chunks.append(self._consume(pending.popleft(), on_chunk))
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        del chunks
        return data

    def _pieces(self, key: str) -> list[tuple[str, tuple[int, int] | None, int]]:
        """The GETs that read file ``key``, in order, as (key, byte range or ``None``, size): ranges
        of ``part_size`` of one object, or the segments its index lists."""
        head = self._call("reading the size of", key, "head_object", Key=key)
        size = self._file_size(key, head)
        if _SEGMENTED not in (head.get("Metadata") or {}):
            if size <= self._part_size:
                return [(key, None, size)]
            ends = [(start, min(start + self._part_size, size)) for start in range(0, size, self._part_size)]
            return [(key, (start, end - 1), end - start) for start, end in ends]
        raw = self._body(key, self._call("reading", key, "get_object", Key=key))
        directory, _, name = key.rpartition("/")
        try:
            prefix, sizes = _parse_index(raw, name, size)
        except ValueError as exc:  # data, not code: a damaged index is a file that cannot be read
            raise S3Error(f"reading {self.location_of_key(key)}: a damaged index of segments ({exc})") from exc
        base = f"{directory}/{prefix}" if directory else prefix
        return [(f"{base}/{n:06d}", None, s) for n, s in enumerate(sizes, 1)]

    @staticmethod
    def _consume(future: Future[bytes], on_chunk: Callable[[bytes], None] | None) -> bytes:
        chunk = future.result()
        if on_chunk is not None:
            on_chunk(chunk)  # hashlib releases the GIL: the other pieces keep downloading
        return chunk

    def _get(self, key: str, byte_range: tuple[int, int] | None, size: int) -> bytes:
        kwargs: dict[str, Any] = {"Key": key}
        if byte_range is not None:
            kwargs["Range"] = f"bytes={byte_range[0]}-{byte_range[1]}"
        data = self._body(key, self._call("reading", key, "get_object", **kwargs))
        if len(data) != size:  # replaced while read: the checksum would fail anyway
            raise S3Error(f"reading {self.location_of_key(key)}: got {len(data)} bytes of {size}")
        return data

    def _body(self, key: str, response: dict[str, Any]) -> bytes:
        try:
            return bytes(response["Body"].read())
        except Exception as exc:  # the connection broke mid-body
            raise S3Error(f"reading {self.location_of_key(key)}: {exc}") from exc

    def _file_size(self, key: str, head: dict[str, Any]) -> int:
        """The size of file ``key`` from its ``HeadObject``: the object's, or the one its index records."""
        recorded = (head.get("Metadata") or {}).get(_SEGMENTED)
        if recorded is None:
            return int(head["ContentLength"])
        try:
            return int(recorded)
        except ValueError as exc:
            raise S3Error(f"reading {self.location_of_key(key)}: a damaged index of segments") from exc

    def _size(self, key: str) -> int:
        return self._file_size(key, self._call("reading the size of", key, "head_object", Key=key))

    def size(self, path: str) -> int:
        """See base class."""
        return self._size(self._key(path))

    def exists(self, path: str) -> bool:
        """See base class: an object (a file, or a file's index), or a prefix with objects under it."""
        key = self._key(path)
        if key:
            try:
                self._call("reading the size of", key, "head_object", Key=key)
                return True
            except FileNotFoundError:
                pass
        page = self._call("listing", key, "list_objects_v2", Prefix=self._dir(path), MaxKeys=1)
        return bool(page.get("Contents"))

    def sync_dir(self, path: str) -> None:
        """See base class: nothing to do (an object is durable once S3 acknowledged it)."""

    def rename(self, src: str, dst: str) -> None:
        """Not possible atomically: the manager commits by manifest on an ``ObjectStore``.

        Raises:
            OSError: Always.
        """
        raise S3Error(f"an object store cannot rename {self.location(src)} atomically")

    def delete(self, path: str) -> None:
        """See base class: the object ``path``, the segments of a file there, and every object
        under ``path/``."""
        key = self._key(path)
        if not key:
            prefixes, keys = [""], []
        else:
            # One listing finds the object and the prefixes that belong to it: ``path/`` and its
            # segments' (``path.seg-<nonce>/``: one per writer, a crashed one's too).
            prefixes, keys = [], [key]
            for page in self._list(key, delimiter=True):
                prefixes += [p["Prefix"] for p in page.get("CommonPrefixes", [])
                             if p["Prefix"] == f"{key}/" or (p["Prefix"].startswith(key + _SEGMENTS)
                                                             and _SEGMENT_DIR.fullmatch(p["Prefix"][:-1]))]
        keys += [o["Key"] for prefix in prefixes for page in self._list(prefix, delimiter=False)
                 for o in page.get("Contents", [])]
        self._delete_keys(keys, key)

    def _delete_keys(self, keys: list[str], key: str) -> None:
        """Delete ``keys`` (those of file or directory ``key``), a batch per request."""
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = keys[start:start + _DELETE_BATCH]
            reply = self._call("deleting", key, "delete_objects",
                               Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            failed = [e for e in reply.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if failed:
                raise S3Error(f"deleting {self.location_of_key(key)}: {len(failed)} object(s) not deleted "
                              f"({failed[0].get('Code')})")

    def abort_uploads(self, path: str, *, started_before: float) -> int:
        """See :class:`~elastictrain.checkpoint.storage.ObjectStore`. This class starts no
        multipart upload; an earlier version of it did, and a crash left them open."""
        prefix = self._dir(path)
        aborted = 0
        kwargs: dict[str, Any] = {"Prefix": prefix}
        while True:
            page = self._call("listing the uploads under", prefix, "list_multipart_uploads", **kwargs)
            for upload in page.get("Uploads", []):
                initiated = upload.get("Initiated")
                if initiated is not None and initiated.timestamp() >= started_before:
                    continue
                with contextlib.suppress(FileNotFoundError):  # finished or aborted meanwhile
                    self._call("aborting an upload of", upload["Key"], "abort_multipart_upload",
                               Key=upload["Key"], UploadId=upload["UploadId"])
                aborted += 1
            if not page.get("IsTruncated"):
                return aborted
            kwargs.update(KeyMarker=page.get("NextKeyMarker"), UploadIdMarker=page.get("NextUploadIdMarker"))

    def __repr__(self) -> str:
        return f"S3Storage({self.location_of_key(self._prefix)!r})"


class _Writer:
    """The write-only file ``S3Storage.open_write`` yields.

    Bytes gather into a segment of ``part_size``; a file that ends within its first segment is
    one create-only ``PutObject`` at its key. Once more bytes follow a full first segment, the
    file is stored in segments: each full segment goes out at once, as its own create-only ``PutObject`` on a
    few threads, under ``<key>.seg-<nonce>/`` (the nonce keeps two writers of one key apart:
    of the two, the one whose index lands first wins, as for a single object); ``finish``
    waits for them all, then writes the file's index at the key itself, create-only: the
    segments' sizes, in order (see ``_index_body``). Until that index exists, the file does not.

    At most ``concurrency`` segments are in flight: ``write`` waits for the oldest beyond that,
    so memory stays bounded and a stalled upload stops the writer (the manager's bound sees no
    progress). Each byte is copied once, into its segment (the caller may reuse its buffer once
    ``write`` returns, so a segment cannot be a view of it), and but for a file's first and last
    segment into memory a segment used before (``S3Storage._take_buffer``).
    """

    def __init__(self, storage: S3Storage, key: str) -> None:
        self._storage = storage
        self._key = key
        # The first segment grows as it fills (a small file never takes a segment's memory); the
        # next ones are buffers of part_size, reused (S3Storage._take_buffer), filled in place.
        self._buffer = bytearray()
        self._fill = 0
        self._segments: list[Future[None]] = []
        self._sizes: list[int] = []
        self._nonce: str | None = None
        self._pool: ThreadPoolExecutor | None = None

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        part = self._storage._part_size  # noqa: SLF001 - one module
        start = 0
        while start < size:
            if self._fill == part:  # a full segment, and more bytes follow it
                self._submit()
                self._buffer, self._fill = self._storage._take_buffer(), 0  # noqa: SLF001
            taken = min(part - self._fill, size - start)
            if len(self._buffer) > self._fill:  # a segment buffer: filled in place
                # Through a memoryview: a bytearray's own slice assignment copies the source first.
                with memoryview(self._buffer) as target:
                    target[self._fill:self._fill + taken] = view[start:start + taken]
            else:
                self._buffer += view[start:start + taken]
            self._fill += taken
            start += taken
        return size

    def flush(self) -> None:
        pass

    def _segment_key(self, number: int) -> str:
        return f"{self._key}{_SEGMENTS}{self._nonce}/{number:06d}"

    def _submit(self) -> None:
        """Send the buffer's bytes as the next segment (the buffer is the segment's until it is stored)."""
        storage = self._storage
        if self._pool is None:
            self._nonce = os.urandom(8).hex()
            self._pool = ThreadPoolExecutor(storage._concurrency, thread_name_prefix="elastictrain-s3")  # noqa: SLF001
        in_flight = [f for f in self._segments if not f.done()]
        if len(in_flight) >= storage._concurrency:  # noqa: SLF001
            in_flight[0].result()  # backpressure (raises the segment's error at once)
        buffer = self._buffer
        del buffer[self._fill:]  # the last segment: only what was written
        self._sizes.append(len(buffer))
        self._segments.append(self._pool.submit(self._send, self._segment_key(len(self._segments) + 1), buffer))
        self._buffer, self._fill = bytearray(), 0

    def _send(self, key: str, buffer: bytearray) -> None:
        try:
            self._storage._put(key, buffer)  # noqa: SLF001
        finally:
            self._storage._give_buffer(buffer)  # noqa: SLF001

    def finish(self) -> None:
        storage = self._storage
        if self._pool is None:
            storage._put(self._key, self._buffer)  # noqa: SLF001
            return
        if self._fill:
            self._submit()
        for future in self._segments:
            future.result()
        self._close_pool()
        # The file's commit: create-only, so of two writers of this key exactly one succeeds.
        storage._put(self._key, _index_body(f"{self._key.rpartition('/')[2]}{_SEGMENTS}{self._nonce}", self._sizes),  # noqa: SLF001
                     metadata={_SEGMENTED: str(sum(self._sizes))})

    def abort(self) -> None:
        """Give the segments up (best effort: what a crash or a stalled request leaves is under
        the save's data prefix, which retention deletes)."""
        for future in self._segments:
            future.cancel()
        self._close_pool()
        done = [self._segment_key(n) for n, f in enumerate(self._segments, 1)
                if f.done() and not f.cancelled() and f.exception() is None]
        if done:
            try:
                self._storage._delete_keys(done, self._key)  # noqa: SLF001
            except OSError as exc:
                logger.info("could not delete the segments of %s: %s", self._storage.location_of_key(self._key), exc)

    def _close_pool(self) -> None:
        if self._pool is not None:
            # Not waiting: a segment blocked on a stalled connection must not hold the caller.
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _index_body(prefix: str, sizes: list[int]) -> bytes:
    """The index of a file stored in segments: JSON, read back as data only (``_parse_index``)."""
    return json.dumps({"format": _INDEX_FORMAT, "segments": prefix, "sizes": sizes}).encode()


def _parse_index(raw: bytes, name: str, size: int) -> tuple[str, list[int]]:
    """The segment prefix (relative to the file's directory) and sizes of an index; ``ValueError``
    when it is not one of a file ``name`` of ``size`` bytes."""
    index = json.loads(raw)
    if not isinstance(index, dict) or index.get("format") != _INDEX_FORMAT:
        raise ValueError("not an index of segments")
    prefix, sizes = index.get("segments"), index.get("sizes")
    if not isinstance(prefix, str) or not re.fullmatch(re.escape(name + _SEGMENTS) + "[0-9a-f]{16}", prefix):
        raise ValueError(f"bad segment prefix {prefix!r}")
    if not isinstance(sizes, list) or not all(type(s) is int and s > 0 for s in sizes) or sum(sizes) != size:
        raise ValueError(f"segment sizes do not add up to {size} bytes")
    return prefix, sizes
