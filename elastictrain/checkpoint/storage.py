"""Where checkpoint bytes live: the ``Storage`` Protocol and a local-filesystem implementation.

The checkpoint manager only ever talks to a ``Storage``, so an object store can be
added without touching the commit protocol. Paths are relative to the storage's
root and use ``/`` as the separator.

The one property the manager relies on is that ``rename`` publishes a staging
directory atomically: an observer listing the parent sees either the staging name
or the final name, never a half-populated final directory. A POSIX filesystem
gives this for free. An object store has no atomic rename: an :class:`ObjectStore`
tells the manager to commit by writing the manifest last, create-only, instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Protocol, runtime_checkable

__all__ = ["Storage", "ObjectStore", "LocalStorage", "delete_quietly", "storage_for"]

logger = logging.getLogger(__name__)


@runtime_checkable
class Storage(Protocol):
    """The file operations a checkpoint needs.

    Every method may raise ``OSError`` (or a subclass) when the underlying storage
    fails; the manager wraps those into ``CheckpointError``.
    """

    def location(self, path: str) -> str:
        """Return a human-readable location of ``path`` (a filesystem path or URL) for logs."""
        ...

    def list_dir(self, path: str) -> list[str]:
        """Return the names of the entries directly under directory ``path``.

        Raises:
            FileNotFoundError: ``path`` does not exist.
        """
        ...

    def make_dir(self, path: str) -> None:
        """Create directory ``path`` and its parents; an existing directory is fine."""
        ...

    def open_write(self, path: str) -> contextlib.AbstractContextManager[BinaryIO]:
        """Open a new file for writing.

        When the context exits without an exception the bytes are durable (flushed
        and fsynced). When it exits with one, the partial file is removed.

        Raises:
            FileExistsError: ``path`` exists. Creation is exclusive: of two writers
                of one name exactly one succeeds (fencing tokens rely on it).
        """
        ...

    def open_read(self, path: str) -> contextlib.AbstractContextManager[BinaryIO]:
        """Open an existing file for reading.

        Raises:
            FileNotFoundError: ``path`` does not exist.
        """
        ...

    def size(self, path: str) -> int:
        """Return the size of file ``path`` in bytes.

        Raises:
            FileNotFoundError: ``path`` does not exist.
        """
        ...

    def exists(self, path: str) -> bool:
        """Return whether a file or directory exists at ``path``."""
        ...

    def sync_dir(self, path: str) -> None:
        """Make the entries of directory ``path`` (the files created in it) durable."""
        ...

    def rename(self, src: str, dst: str) -> None:
        """Atomically move directory ``src`` to ``dst`` and make the move durable.

        Raises:
            FileExistsError: ``dst`` already exists.
        """
        ...

    def delete(self, path: str) -> None:
        """Remove file or directory ``path`` recursively; a missing path is fine."""
        ...


@runtime_checkable
class ObjectStore(Storage, Protocol):
    """A ``Storage`` without atomic rename (S3 and compatibles), whose ``open_write`` is a
    create-only conditional write.

    The manager commits a checkpoint there without ``rename``: each rank writes its files under
    a prefix of that save's own (``step_N.data-<nonce>/``), and the manifest, written last and
    create-only at ``step_N/MANIFEST.json``, is the commit; it names the prefix its files are in.
    Saving a step again replaces its manifest with ``write_if_unchanged``, so that a writer never
    replaces or deletes a manifest it has not read (another world's, committed meanwhile).
    ``rename`` may raise.
    """

    def list_sizes(self, path: str) -> dict[str, int]:
        """Return every object under directory ``path`` (recursively, by path relative to it) with
        its size, in one listing; ``{}`` when there is none. A store may keep a large file as
        several objects (``S3Storage``'s segments): their sizes add up to the bytes stored so
        far, which grow while a file is written (the manager's progress)."""
        ...

    def abort_uploads(self, path: str, *, started_before: float) -> int:
        """Abort the unfinished uploads under directory ``path`` started before ``started_before``
        (a ``time.time()``), left by a writer that crashed; return how many."""
        ...

    def read_hashed(self, path: str) -> tuple[bytes, str]:
        """Return the bytes of file ``path`` and their SHA-256 (hex), hashed as they arrive: a
        reader checks a file and loads it from one download.

        Raises:
            FileNotFoundError: ``path`` does not exist.
        """
        ...

    def read_tagged(self, path: str) -> tuple[bytes, str]:
        """Return the bytes of file ``path`` and a tag of this version of it (S3's ETag), for
        ``write_if_unchanged``.

        Raises:
            FileNotFoundError: ``path`` does not exist.
        """
        ...

    def write_if_unchanged(self, path: str, data: bytes, *, tag: str) -> None:
        """Replace file ``path`` with ``data`` in one request, only if it is still the version
        ``tag`` names (a compare-and-swap: S3's ``If-Match``).

        Raises:
            FileExistsError: ``path`` was replaced since (another version is there).
            FileNotFoundError: ``path`` was deleted since.
        """
        ...


def storage_for(directory: str | os.PathLike[str]) -> tuple[Storage, str]:
    """The storage a checkpoint location names, and the path of the checkpoints in it.

    ``s3://bucket/prefix``: an :class:`~elastictrain.checkpoint.s3.S3Storage` (needs the
    ``[s3]`` extra); anything else a local directory.

    Raises:
        ValueError: An ``s3://`` URL without a bucket.
        ImportError: ``s3://`` without boto3 installed.
    """
    from . import s3  # boto3 is imported only for an s3:// location

    if s3.is_url(directory):
        return s3.S3Storage.from_url(str(directory)), ""
    return LocalStorage(directory), ""


class LocalStorage:
    """``Storage`` on a local or shared (NFS, Lustre, ...) POSIX filesystem.

    Args:
        root: The directory every path is relative to. It need not exist yet.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self._root = Path(root).absolute()

    @property
    def root(self) -> Path:
        """The absolute directory every path is relative to."""
        return self._root

    def _abs(self, path: str) -> Path:
        parts = [p for p in path.split("/") if p not in ("", ".")]
        # A relative path that climbs out of the root would let a caller's bad
        # input delete or overwrite files elsewhere.
        if path.startswith("/") or ".." in parts:
            raise ValueError(f"storage path must be relative and stay under the root: {path!r}")
        return self._root.joinpath(*parts)

    def location(self, path: str) -> str:
        """See base class."""
        return str(self._abs(path))

    def list_dir(self, path: str) -> list[str]:
        """See base class."""
        return sorted(os.listdir(self._abs(path)))

    def make_dir(self, path: str) -> None:
        """See base class."""
        self._abs(path).mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        """See base class."""
        target = self._abs(path)
        # "xb": two writers racing for one name is a bug we want to see, not a silent overwrite.
        with open(target, "xb") as f:
            try:
                yield f
                f.flush()
                os.fsync(f.fileno())
            except BaseException:
                with contextlib.suppress(OSError):
                    target.unlink()
                raise

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        """See base class."""
        with open(self._abs(path), "rb") as f:
            yield f

    def size(self, path: str) -> int:
        """See base class."""
        return self._abs(path).stat().st_size

    def exists(self, path: str) -> bool:
        """See base class."""
        return self._abs(path).exists()

    def sync_dir(self, path: str) -> None:
        """See base class."""
        _fsync_dir(self._abs(path))

    def rename(self, src: str, dst: str) -> None:
        """See base class."""
        source, target = self._abs(src), self._abs(dst)
        # os.rename silently replaces an empty target directory; refusing keeps a
        # commit from ever clobbering something it did not expect.
        if target.exists():
            raise FileExistsError(f"rename target already exists: {target}")
        os.rename(source, target)
        # The rename is only durable once the parent directory's entry is on disk.
        _fsync_dir(target.parent)

    def delete(self, path: str) -> None:
        """See base class."""
        target = self._abs(path)
        # Only rank 0 deletes, so a FileNotFoundError means "already gone", which is fine.
        with contextlib.suppress(FileNotFoundError):
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink()

    def __repr__(self) -> str:
        return f"LocalStorage({str(self._root)!r})"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def delete_quietly(storage: Storage, path: str) -> None:
    """Delete ``path``, and only warn if that fails: a failed deletion (a probe, a stale staging
    directory, a checkpoint past ``keep_last``) costs disk space, not correctness."""
    try:
        storage.delete(path)
    except OSError as exc:
        logger.warning("could not delete %s: %s", storage.location(path), exc)
