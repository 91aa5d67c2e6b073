"""The on-disk format of a checkpoint: directory and file names, the manifest, verification.

Layout under the checkpoint directory::

    step_00000123/                  a committed checkpoint (the name is the commit)
        MANIFEST.json               written last, inside the staging dir
        replicated.pt               rank 0: state every rank shares (model, optimizer, ...)
        rank_00000.pt               each rank: its own part (RNG states)
        rank_00001.pt
    step_00000124.tmp-3f9a0c1e/     a save in progress, or left by a crash: never read

In an object store (no atomic rename) the files stay where the ranks wrote them, and the
manifest, written last and create-only, is the commit; its ``data`` names their prefix::

    step_00000123/MANIFEST.json     the commit: {"data": "step_00000123.data-3f9a0c1e", ...}
    step_00000123.data-3f9a0c1e/    replicated.pt, rank_00000.pt, ...: read only through a manifest

The manifest's ``files`` maps each file's name (relative to where the files are) to its size
and SHA-256, whichever rank wrote it. A sharded checkpoint (``format_version`` 2: the state held
DTensors) has each rank's ``shards_<rank>.bin`` among them, and a ``tensors`` index saying where
each DTensor's chunks are in them (:mod:`._index`); a DDP checkpoint is format 1, as it always was.

A checkpoint directory is trusted only if its manifest parses, names this step and
format, and every file it lists exists with the recorded size and SHA-256. Checking the
sizes is cheap (one ``stat`` per file); the SHA-256 reads every byte, so each rank checks
it on the files it loads (``verify_file``), and ``status`` only when asked.

A reader that is not the writer (an eval job, ``status``) races with retention: a
checkpoint listed a moment ago may be deleted before its files are read. That is
``VanishedCheckpointError``, never corruption: ``find`` lists again and moves on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from elastictrain.errors import CheckpointError, CorruptCheckpointError, NoCheckpointError

from ._index import parse_index
from .storage import ObjectStore, Storage

__all__ = [
    "FORMAT_VERSION",
    "SHARDED_FORMAT_VERSION",
    "MANIFEST",
    "REPLICATED",
    "FileEntry",
    "HashingWriter",
    "join",
    "rank_file",
    "step_dir",
    "staging_dir",
    "data_dir",
    "is_data_dir",
    "files_dir",
    "parse_step_dir",
    "is_staging_dir",
    "write_file",
    "write_manifest",
    "verify",
    "find_checkpoint",
    "verify_file",
    "newest_listed",
    "VanishedCheckpointError",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
SHARDED_FORMAT_VERSION = 2
"""The manifest of a checkpoint with a tensor index (DTensor state, written in shards by every rank)."""
MANIFEST = "MANIFEST.json"
REPLICATED = "replicated.pt"

_STEP_RE = re.compile(r"^step_(\d+)$")
_STAGING_RE = re.compile(r"^step_\d+\.tmp-.+$")
_DATA_RE = re.compile(r"^step_(\d+)\.data-[0-9a-z-]+$")
_CHUNK = 8 << 20
_RELISTS = 20
"""How many times ``find`` lists again when checkpoints vanish under it (each time, retention
deleted what it had listed; a writer retires at most one checkpoint per save)."""


class VanishedCheckpointError(CheckpointError):
    """A checkpoint was deleted (retired by its writer) while it was being read: not corruption."""


def join(*parts: str) -> str:
    """Join storage path parts with ``/``, skipping empty ones."""
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


def rank_file(rank: int) -> str:
    """Return the name of ``rank``'s rank-local file."""
    return f"rank_{rank:05d}.pt"


def step_dir(step: int) -> str:
    """Return the name of the committed checkpoint directory of ``step``."""
    return f"step_{step:08d}"


def staging_dir(step: int, nonce: str) -> str:
    """Return the name of a staging directory for ``step``; ``nonce`` tells attempts apart."""
    return f"{step_dir(step)}.tmp-{nonce}"


def data_dir(step: int, nonce: str) -> str:
    """Return the name of the prefix an object store's save of ``step`` writes its files under."""
    return f"{step_dir(step)}.data-{nonce}"


def is_data_dir(name: str) -> bool:
    """Return whether ``name`` is an object store's data prefix (committed if a manifest names it)."""
    return _DATA_RE.match(name) is not None


def files_dir(directory: str, manifest: dict[str, Any]) -> str:
    """Where the files of the checkpoint whose manifest is in ``directory`` are: ``directory``
    itself, or (an object store's) the data prefix beside it that the manifest names.

    Raises:
        CorruptCheckpointError: ``data`` is not the data prefix of the manifest's step.
    """
    data = manifest.get("data")
    if data is None:
        return directory
    match = _DATA_RE.match(data) if isinstance(data, str) else None
    if match is None or int(match.group(1)) != manifest.get("step"):
        raise CorruptCheckpointError(f"checkpoint {directory} has a malformed {MANIFEST}: data={data!r}")
    parent = directory.rpartition("/")[0] if "/" in directory else ""
    return join(parent, data)


def parse_step_dir(name: str) -> int | None:
    """Return the step of a committed checkpoint directory name, or None for any other name."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def is_staging_dir(name: str) -> bool:
    """Return whether ``name`` is a staging directory (in progress, or left by a crash)."""
    return _STAGING_RE.match(name) is not None


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of a checkpoint as the manifest records it."""

    name: str
    size: int
    sha256: str


_CHUNK = 64 << 20
"""Bytes a :class:`HashingWriter` hands to the file at a time."""


class HashingWriter:
    """A write-only file object that hashes and counts what passes through it.

    ``torch.save`` streams into it, so a checksum costs no second read of the file.

    Args:
        raw: The file to write to.
        on_write: Called after each chunk written (progress, and a test hook to crash mid-file).
    """

    def __init__(self, raw: BinaryIO, on_write: Callable[[], None] | None = None) -> None:
        self._raw = raw
        self._hash = hashlib.sha256()
        self._size = 0
        self._on_write = on_write
        self.error: OSError | None = None
        """The first error the file raised: torch's writer reports it as a RuntimeError of its own
        ("unexpected pos"), which says nothing of a full disk."""

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Write ``data`` and fold it into the checksum, in chunks of at most 64 MiB (each one
        calls ``on_write``: a large tensor's bytes show progress while they go out)."""
        view = memoryview(data).cast("B")
        for start in range(0, max(len(view), 1), _CHUNK):
            chunk = view[start:start + _CHUNK]
            self._hash.update(chunk)
            try:
                self._raw.write(chunk)
            except OSError as exc:
                self.error = self.error or exc
                raise
            self._size += len(chunk)
            if self._on_write is not None:
                self._on_write()
        return len(view)

    def flush(self) -> None:
        """Flush the underlying file."""
        self._raw.flush()

    def entry(self, name: str) -> FileEntry:
        """Return the manifest entry of what was written so far, under ``name``."""
        return FileEntry(name=name, size=self._size, sha256=self._hash.hexdigest())


def write_file(
    storage: Storage, directory: str, name: str, obj: Any, *, on_write: Callable[[], None] | None = None
) -> FileEntry:
    """``torch.save`` ``obj`` durably into ``directory/name``; return its manifest entry.

    Raises:
        OSError: Writing failed (the partial file is removed).
    """
    with storage.open_write(join(directory, name)) as raw:
        writer = HashingWriter(raw, on_write)
        # A file object, not a path: torch names the archive after a path's file
        # name, and identical state should give identical bytes.
        try:
            torch.save(obj, writer)
        except RuntimeError as exc:
            if writer.error is None:
                raise
            raise writer.error from exc  # ENOSPC or EIO, not torch's "unexpected pos"
    return writer.entry(name)


def write_manifest(
    storage: Storage, directory: str, *, step: int, world_size: int, saved_at: float, files: list[FileEntry],
    fence: int | None = None, data: str | None = None, tensors: dict[str, Any] | None = None,
    replacing: str | None = None,
) -> None:
    """Write the manifest of a checkpoint into ``directory`` (durably; create-only).

    Args:
        data: The data prefix beside ``directory`` that holds the files (an object store's
            commit); ``None``: they are in ``directory``.
        tensors: The tensor index of a sharded checkpoint (format 2); ``None``: a DDP one (format 1).
        replacing: In an object store, replace the manifest there instead, if it is still the
            version this tag names (``ObjectStore.write_if_unchanged``).

    Raises:
        FileExistsError: ``directory`` has a manifest already (with ``replacing``: another one).
        FileNotFoundError: With ``replacing``: the manifest is gone.
        OSError: Writing failed.
    """
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION if tensors is None else SHARDED_FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "time": saved_at,
        "torch_version": torch.__version__,
        "fence": fence,
        "files": {f.name: {"size": f.size, "sha256": f.sha256} for f in sorted(files, key=lambda f: f.name)},
    }
    if data is not None:
        manifest["data"] = data
    if tensors is not None:
        manifest["tensors"] = tensors
    body = json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n"
    if replacing is not None:
        if not isinstance(storage, ObjectStore):
            raise ValueError(f"replacing a manifest needs an object store, not {storage!r}")
        storage.write_if_unchanged(join(directory, MANIFEST), body, tag=replacing)
        return
    with storage.open_write(join(directory, MANIFEST)) as f:
        f.write(body)


def verify(storage: Storage, directory: str, step: int, *, checksums: bool = True) -> dict[str, Any]:
    """Check a committed checkpoint against its manifest and return the manifest.

    Args:
        checksums: Also read every file to recompute its SHA-256; otherwise only the
            manifest and each file's size are checked (one ``stat`` per file).

    Raises:
        VanishedCheckpointError: The checkpoint directory was deleted meanwhile.
        CorruptCheckpointError: The manifest is missing or malformed, or a file is
            missing, has the wrong size or the wrong checksum.
        OSError: The storage failed in a way that is not the checkpoint's fault.
    """
    where = storage.location(directory)
    try:
        with storage.open_read(join(directory, MANIFEST)) as f:
            raw = f.read()
    except FileNotFoundError as exc:
        _raise_if_vanished(storage, directory, exc)
        raise CorruptCheckpointError(f"checkpoint {where} has no {MANIFEST}") from exc
    try:
        manifest = json.loads(raw)
        version, saved_step, world_size = manifest["format_version"], manifest["step"], manifest["world_size"]
        files = manifest["files"]
        entries = [FileEntry(name, int(v["size"]), str(v["sha256"])) for name, v in files.items()]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(f"checkpoint {where} has a malformed {MANIFEST}: {exc}") from exc
    if version not in (FORMAT_VERSION, SHARDED_FORMAT_VERSION) or type(version) is not int:
        raise CorruptCheckpointError(f"checkpoint {where} has format version {version!r}, expected "
                                     f"{FORMAT_VERSION} or {SHARDED_FORMAT_VERSION}")
    if saved_step != step:
        raise CorruptCheckpointError(f"checkpoint {where} is named for step {step} but its manifest says {saved_step}")
    if type(world_size) is not int or world_size < 1:
        raise CorruptCheckpointError(f"checkpoint {where} has a malformed {MANIFEST}: world_size={world_size!r}")
    required = {REPLICATED} | {rank_file(r) for r in range(world_size)}
    if version == SHARDED_FORMAT_VERSION:
        index = parse_index(manifest.get("tensors"), where)
        required |= {chunk.file for meta in index.values() for chunk in meta.chunks}
    missing = required - files.keys()
    if missing:
        raise CorruptCheckpointError(f"checkpoint {where}: manifest does not list {sorted(missing)}")
    files_at = files_dir(directory, manifest)
    for entry in entries:
        _verify_file(storage, directory, entry, where, checksums=checksums, files_at=files_at)
    return manifest


def _raise_if_vanished(storage: Storage, directory: str, exc: BaseException) -> None:
    if not storage.exists(directory):
        raise VanishedCheckpointError(f"checkpoint {storage.location(directory)} was deleted while it was read") \
            from exc


def newest_listed(storage: Storage, prefix: str) -> int | None:
    """The highest step with a committed directory name under ``prefix`` (no verification).

    Raises:
        OSError: ``prefix`` exists but cannot be listed.
    """
    try:
        names = storage.list_dir(prefix)
    except FileNotFoundError:
        return None
    return max((s for n in names if (s := parse_step_dir(n)) is not None), default=None)


def verify_file(storage: Storage, directory: str, entry: FileEntry, files_at: str | None = None) -> None:
    """Check one file of a checkpoint: its size and SHA-256 against ``entry`` (reads it once).

    Args:
        files_at: Where the checkpoint's files are (``files_dir``); ``None``: ``directory``.

    Raises:
        VanishedCheckpointError: The checkpoint directory was deleted meanwhile.
        CorruptCheckpointError: The file is missing, or its size or checksum differ.
        OSError: The storage failed.
    """
    _verify_file(storage, directory, entry, storage.location(directory), checksums=True, files_at=files_at)


def find_checkpoint(
    storage: Storage, prefix: str, step: int | None, *, checksums: bool = True, skip: frozenset[int] = frozenset()
) -> tuple[int, dict[str, Any]] | None:
    """Return (step, manifest) of the checkpoint to restore: ``step``, or the newest that verifies.

    Checkpoints that do not verify are skipped with a warning naming them. A checkpoint
    deleted while it is read (its writer retired it) is not corrupt: the directory is
    listed again, and the newest checkpoint then present is tried.

    Args:
        checksums: See ``verify``.
        skip: Steps not to consider (found corrupt by a rank that read them).

    Returns:
        None if ``step`` is None and there are no checkpoints at all.

    Raises:
        CheckpointError: ``prefix`` exists but cannot be listed.
        NoCheckpointError: ``step`` has no committed checkpoint.
        CorruptCheckpointError: ``step`` does not verify, or checkpoints exist and none verifies.
    """
    for _ in range(_RELISTS):
        steps = [s for s in _list_steps(storage, prefix) if s not in skip]
        if step is not None:
            if step not in steps:
                raise NoCheckpointError(f"no committed checkpoint of step {step} in {storage.location(prefix)}")
            try:
                return step, _verify_readable(storage, prefix, step, checksums)
            except VanishedCheckpointError as exc:
                raise NoCheckpointError(f"the checkpoint of step {step} was deleted while it was read") from exc
        vanished = corrupt = 0
        for candidate in steps:
            try:
                return candidate, _verify_readable(storage, prefix, candidate, checksums)
            except VanishedCheckpointError:
                logger.debug("checkpoint of step %d was retired while it was read", candidate)
                vanished += 1
                break  # the older ones are likely gone too: list again
            except CorruptCheckpointError as exc:
                logger.warning("skipping checkpoint of step %d: %s", candidate, exc)
                corrupt += 1
        if not vanished:
            if corrupt or skip:
                raise CorruptCheckpointError(
                    f"none of the {corrupt + len(skip)} checkpoints in {storage.location(prefix)} verifies")
            return None
    raise CheckpointError(f"checkpoints in {storage.location(prefix)} kept vanishing while they were read "
                          f"({_RELISTS} listings): is another job deleting them?")


def _list_steps(storage: Storage, prefix: str) -> list[int]:
    try:
        names = storage.list_dir(prefix)
    except FileNotFoundError:
        names = []
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint directory {storage.location(prefix)}: {exc}") from exc
    return sorted((s for n in names if (s := parse_step_dir(n)) is not None), reverse=True)


def _verify_readable(storage: Storage, prefix: str, step: int, checksums: bool) -> dict[str, Any]:
    directory = join(prefix, step_dir(step))
    try:
        return verify(storage, directory, step, checksums=checksums)
    except OSError as exc:
        _raise_if_vanished(storage, directory, exc)
        # An unreadable checkpoint is as unusable as a corrupt one; the one before may be fine.
        raise CorruptCheckpointError(f"checkpoint {storage.location(directory)} cannot be read: {exc}") from exc


def _verify_file(storage: Storage, directory: str, entry: FileEntry, where: str, *, checksums: bool,
                 files_at: str | None = None) -> None:
    path = join(files_at if files_at is not None else directory, entry.name)
    try:
        size = storage.size(path)
        if size != entry.size:
            raise CorruptCheckpointError(
                f"checkpoint {where}: {entry.name} has {size} bytes, manifest says {entry.size}"
            )
        if not checksums:
            return
        digest = hashlib.sha256()
        with storage.open_read(path) as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    except FileNotFoundError as exc:
        _raise_if_vanished(storage, directory, exc)
        raise CorruptCheckpointError(f"checkpoint {where}: {entry.name} is missing") from exc
    if digest.hexdigest() != entry.sha256:
        raise CorruptCheckpointError(f"checkpoint {where}: {entry.name} does not match its sha256 checksum")
