"""Checkpoints in S3 and S3-compatible object stores (MinIO, Ceph RGW, R2, GCS's XML API): ``S3Storage``.

An object store has no directories and no atomic rename, so the manager commits a checkpoint
differently there (see :class:`~elastictrain.checkpoint.storage.ObjectStore`): each rank uploads
its files under a prefix of the save's own, and the checkpoint is committed by its manifest,
written last with a create-only conditional write (``If-None-Match: *``).

Every ``open_write`` is create-only: a small file is one ``PutObject``, a large one a multipart
upload whose parts go out on a few threads while ``torch.save`` streams into the file object
(the bytes come straight from the snapshot in memory: no temporary file); the
``CompleteMultipartUpload`` carries the condition. Of two writers of one key exactly one
succeeds, the other gets ``FileExistsError`` (S3's 412 ``PreconditionFailed``, or 409
``ConditionalRequestConflict`` while the two race). The one replacement, a manifest of a step
saved again, is ``write_if_unchanged``: a ``PutObject`` with ``If-Match`` on the ETag read.
A reader downloads a file once (``read_hashed``): ranges on a few threads, hashed in order as
they arrive.

The client is boto3's: credentials, region and endpoint come from where the AWS SDKs look for
them (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and
``~/.aws/config``/``credentials``, instance and pod roles, ``AWS_ENDPOINT_URL`` or
``AWS_ENDPOINT_URL_S3`` for a compatible store). Throttling (503 ``SlowDown``), 5xx answers,
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
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO

__all__ = ["S3Storage", "S3Error", "parse_url", "is_url"]

logger = logging.getLogger(__name__)

SCHEME = "s3://"
_MIN_PART = 5 << 20
"""S3's smallest part of a multipart upload (all but the last)."""
_DEFAULT_PART = 32 << 20
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
    config = Config(retries={"mode": "standard", "total_max_attempts": 1},
                    max_pool_connections=2 * _DEFAULT_CONCURRENCY + 4, connect_timeout=10, read_timeout=60)
    return boto3.session.Session().client("s3", config=config)


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
        part_size: Bytes per part of a multipart upload (at least 5 MiB); a file smaller than
            this is one ``PutObject``.
        concurrency: Parts uploaded (and ranges downloaded) at once, per file.
        attempts: Tries of each request that meets throttling, a server error, a timeout or a
            broken connection; ``None``: ``AWS_MAX_ATTEMPTS``, else 10.
    """

    def __init__(self, bucket: str, prefix: str = "", *, client: Any = None, part_size: int = _DEFAULT_PART,
                 concurrency: int = _DEFAULT_CONCURRENCY, attempts: int | None = None) -> None:
        if part_size < _MIN_PART:
            raise ValueError(f"part_size must be at least {_MIN_PART} bytes (S3's minimum), got {part_size}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be positive, got {concurrency}")
        self._bucket = bucket
        self._prefix = "/".join(p for p in prefix.split("/") if p)
        self._client = client if client is not None else _client()
        self._part_size = part_size
        self._concurrency = concurrency
        self._bucket_checked = False
        self._attempts = attempts if attempts is not None else _attempts()

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
        """See base class. A prefix without objects "does not exist" (``FileNotFoundError``)."""
        prefix = self._dir(path)
        names: set[str] = set()
        for page in self._list(prefix, delimiter=True):
            names.update(o["Key"][len(prefix):] for o in page.get("Contents", []))
            names.update(p["Prefix"][len(prefix):].rstrip("/") for p in page.get("CommonPrefixes", []))
        names.discard("")
        if not names:
            raise FileNotFoundError(f"no objects under {self.location_of_key(prefix)}")
        return sorted(names)

    def list_sizes(self, path: str) -> dict[str, int]:
        """See :class:`~elastictrain.checkpoint.storage.ObjectStore`."""
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
        upload = _Upload(self, key)
        try:
            yield upload  # type: ignore[misc]  # a write-only file object
            upload.finish()
        except BaseException:
            upload.abort()
            raise

    def _put(self, key: str, body: bytes | bytearray | memoryview) -> None:
        self._call("writing", key, "put_object", Key=key, Body=bytes(body), IfNoneMatch="*")

    def write_if_unchanged(self, path: str, data: bytes, *, tag: str) -> None:
        """See :class:`~elastictrain.checkpoint.storage.ObjectStore`: one ``PutObject`` with
        ``If-Match: <ETag>``."""
        key = self._key(path)
        self._call("replacing", key, "put_object", Key=key, Body=bytes(data), IfMatch=tag)

    def read_tagged(self, path: str) -> tuple[bytes, str]:
        """See :class:`~elastictrain.checkpoint.storage.ObjectStore`: one ``GetObject``; the tag is the ETag."""
        key = self._key(path)
        response = self._call("reading", key, "get_object", Key=key)
        return self._body(key, response), str(response["ETag"])

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        """See base class. Reads the whole object into memory (in ranges, on a few threads):
        ``torch.load`` needs a seekable file."""
        yield io.BytesIO(self._download(self._key(path), None))

    def read_hashed(self, path: str) -> tuple[bytes, str]:
        """See :class:`~elastictrain.checkpoint.storage.ObjectStore`: ranges download on a few
        threads while the bytes already here are hashed, in order."""
        digest = hashlib.sha256()
        return self._download(self._key(path), digest.update), digest.hexdigest()

    def _download(self, key: str, on_chunk: Callable[[bytes], None] | None) -> bytes:
        """The whole object ``key``, in ranges of ``part_size`` with at most ``concurrency`` in
        flight; ``on_chunk`` sees each range in order as it arrives."""
        size = self._size(key)
        ranges = [(start, min(start + self._part_size, size) - 1) for start in range(0, size, self._part_size)]
        if len(ranges) <= 1:
            chunks = [self._get(key, None)]
            if on_chunk is not None:
                on_chunk(chunks[0])
        else:
            chunks = []
            with ThreadPoolExecutor(min(self._concurrency, len(ranges)), thread_name_prefix="elastictrain-s3") as pool:
                pending: collections.deque[Future[bytes]] = collections.deque()
                for byte_range in ranges:
                    pending.append(pool.submit(self._get, key, byte_range))
                    if len(pending) >= self._concurrency:  # bounded memory: consume the oldest first
                        chunks.append(self._consume(pending.popleft(), on_chunk))
                while pending:
                    chunks.append(self._consume(pending.popleft(), on_chunk))
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        del chunks
        if len(data) != size:  # replaced while read: the checksum would fail anyway
            raise S3Error(f"reading {self.location_of_key(key)}: got {len(data)} bytes of {size}")
        return data

    @staticmethod
    def _consume(future: Future[bytes], on_chunk: Callable[[bytes], None] | None) -> bytes:
        chunk = future.result()
        if on_chunk is not None:
            on_chunk(chunk)  # hashlib releases the GIL: the other ranges keep downloading
        return chunk

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        kwargs: dict[str, Any] = {"Key": key}
        if byte_range is not None:
            kwargs["Range"] = f"bytes={byte_range[0]}-{byte_range[1]}"
        return self._body(key, self._call("reading", key, "get_object", **kwargs))

    def _body(self, key: str, response: dict[str, Any]) -> bytes:
        try:
            return bytes(response["Body"].read())
        except Exception as exc:  # the connection broke mid-body
            raise S3Error(f"reading {self.location_of_key(key)}: {exc}") from exc

    def _size(self, key: str) -> int:
        return int(self._call("reading the size of", key, "head_object", Key=key)["ContentLength"])

    def size(self, path: str) -> int:
        """See base class."""
        return self._size(self._key(path))

    def exists(self, path: str) -> bool:
        """See base class: an object, or a prefix with objects under it."""
        key = self._key(path)
        if key:
            try:
                self._size(key)
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
        """See base class: the object ``path`` and every object under ``path/``."""
        key = self._key(path)
        keys = [key] if key else []
        keys += [o["Key"] for page in self._list(self._dir(path), delimiter=False) for o in page.get("Contents", [])]
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = keys[start:start + _DELETE_BATCH]
            reply = self._call("deleting", key, "delete_objects",
                               Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            failed = [e for e in reply.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if failed:
                raise S3Error(f"deleting {self.location(path)}: {len(failed)} object(s) not deleted "
                              f"({failed[0].get('Code')})")

    def abort_uploads(self, path: str, *, started_before: float) -> int:
        """See :class:`~elastictrain.checkpoint.storage.ObjectStore`."""
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


class _Upload:
    """The write-only file ``S3Storage.open_write`` yields: a ``PutObject`` if the bytes fit one
    part, else a multipart upload whose parts go out on a few threads as they fill.

    At most ``concurrency`` parts are in flight: ``write`` waits for the oldest beyond that, so
    memory stays bounded and a stalled upload stops the writer (the manager's bound sees no
    progress)."""

    def __init__(self, storage: S3Storage, key: str) -> None:
        self._storage = storage
        self._key = key
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[Future[dict[str, Any]]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        # One copy of each byte: a part is sliced straight out of ``data`` where it can be (the
        # caller may reuse its buffer once this returns, so the part cannot be a view of it).
        view = memoryview(data).cast("B")
        size = len(view)
        part = self._storage._part_size  # noqa: SLF001 - one module
        start = 0
        if self._buffer:
            start = min(part - len(self._buffer), size)
            self._buffer += view[:start]
            if len(self._buffer) == part:
                self._submit(self._buffer)
                self._buffer = bytearray()
        while size - start >= part:
            self._submit(bytes(view[start:start + part]))
            start += part
        if start < size:
            self._buffer += view[start:]
        self._size += size
        return size

    def flush(self) -> None:
        pass

    def _submit(self, chunk: bytes | bytearray) -> None:
        storage = self._storage
        if self._upload_id is None:
            reply = storage._call("starting an upload of", self._key, "create_multipart_upload",  # noqa: SLF001
                                  Key=self._key)
            self._upload_id = reply["UploadId"]
            self._pool = ThreadPoolExecutor(storage._concurrency, thread_name_prefix="elastictrain-s3")  # noqa: SLF001
        assert self._pool is not None  # noqa: S101 - made with the upload
        in_flight = [f for f in self._parts if not f.done()]
        if len(in_flight) >= storage._concurrency:  # noqa: SLF001
            in_flight[0].result()  # backpressure (raises the part's error at once)
        number = len(self._parts) + 1
        self._parts.append(self._pool.submit(self._upload_part, number, chunk))

    def _upload_part(self, number: int, chunk: bytes | bytearray) -> dict[str, Any]:
        reply = self._storage._call("uploading part of", self._key, "upload_part",  # noqa: SLF001
                                    Key=self._key, UploadId=self._upload_id, PartNumber=number, Body=chunk)
        return {"PartNumber": number, "ETag": reply["ETag"]}

    def finish(self) -> None:
        storage = self._storage
        if self._upload_id is None:
            storage._put(self._key, self._buffer)  # noqa: SLF001
            return
        if self._buffer or not self._parts:
            self._submit(self._buffer)
            self._buffer = bytearray()
        parts = [f.result() for f in self._parts]
        storage._call("completing the upload of", self._key, "complete_multipart_upload",  # noqa: SLF001
                      Key=self._key, UploadId=self._upload_id, MultipartUpload={"Parts": parts}, IfNoneMatch="*")
        self._close_pool()

    def abort(self) -> None:
        """Give the parts up (best effort: a crash leaves them to ``abort_uploads``)."""
        for future in self._parts:
            future.cancel()
        self._close_pool()
        if self._upload_id is not None:
            try:
                self._storage._call("aborting the upload of", self._key, "abort_multipart_upload",  # noqa: SLF001
                                    Key=self._key, UploadId=self._upload_id)
            except OSError as exc:
                logger.info("could not abort the upload of %s: %s", self._storage.location_of_key(self._key), exc)

    def _close_pool(self) -> None:
        if self._pool is not None:
            # Not waiting: a part blocked on a stalled connection must not hold the caller.
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
