"""The save side of :class:`~elastictrain.checkpoint.manager.CheckpointManager`: from the
snapshot of one step (a :class:`Payload`, collected on the training thread) to its commit.

1. Agree on a staging directory ``step_<N>.tmp-<nonce>`` (rank 0's nonce), and that no rank's
   state diverged (NaN or infinity in a parameter) and no rank's storage still blocks in a call
   of an abandoned save.
2. Each rank writes and fsyncs its files there (rank 0: ``replicated.pt`` too; every rank of a
   sharded save: ``shards_<rank>.bin``), then marks its part written (``.written-<rank>``). Ranks
   wait for each other's marks outside any collective, with a deadline that moves while the
   staging directory grows: a large checkpoint takes as long as it takes to write, a stalled
   writer still fails the save.
3. Barrier: every rank reports its files (name, size, sha256) and chunks, or its failure.
4. Rank 0 checks the files and its fencing token (``_fence``), writes ``MANIFEST.json``, fsyncs,
   and commits by renaming the staging directory to ``step_<N>`` (then fsyncs the parent). The
   rename is the commit point: a crash before it leaves only a staging dir that is never read; a
   crash after it leaves a complete checkpoint.
5. Rank 0 broadcasts the outcome (every rank fails or succeeds together), then applies retention
   (:mod:`._retention`).

In an object store (an ``ObjectStore``: no atomic rename) the ranks write into
``step_<N>.data-<nonce>`` instead, and rank 0 commits by writing ``step_<N>/MANIFEST.json`` last,
create-only, naming that prefix: the create is the commit point (saving a step again replaces its
manifest only if it is still the one read: ``If-Match``).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastictrain.errors import CheckpointError, CheckpointWriteError, NonFiniteStateError

from . import _fence
from . import _manifest as fmt
from . import _sharded as sharded
from . import _snapshot as snap
from ._bounded import BoundedCalls
from ._index import key_of
from ._overlap import SnapshotCopy
from ._retention import retain
from .coordinator import Coordinator
from .storage import ObjectStore, Storage, delete_quietly

__all__ = ["CheckpointWriter", "Payload"]

logger = logging.getLogger(__name__)
_events = logging.getLogger("elastictrain.events")


@dataclass(slots=True)
class Payload:
    """What a rank saves of one step, collected by ``CheckpointManager`` on the training thread."""

    step: int
    replicated: dict[str, Any] | None  # rank 0 only: {"stateful": {...}, "extras": {...}}
    local: dict[str, Any]  # {"rng": {...}}
    copy: SnapshotCopy | None = None  # overlapped: makes ``replicated``'s and ``shards``' tensors CPU copies
    parameters: dict[str, list[str]] = field(default_factory=dict)  # each module's parameter keys
    tensors: list[sharded.TensorInfo] | None = None  # the state's DTensors (None: a DDP checkpoint)
    shards: list[sharded.LocalChunk] = field(default_factory=list)  # the local shards this rank writes


@dataclass(frozen=True, slots=True)
class Written:
    """What a rank wrote of a save: its files and, of a sharded save, its chunks (crosses ranks pickled)."""

    files: list[tuple[str, int, str]] = field(default_factory=list)
    chunks: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


class CheckpointWriter:
    """Writes and commits one step's checkpoint with the other ranks (``save`` is a collective).

    Args:
        storage: Where the checkpoints' bytes go.
        prefix: The checkpoints' directory in ``storage``.
        coordinator: How the ranks agree.
        calls: Runs each storage call with a bound on how long it may go without progress.
        stall: How long ranks wait for a peer's part while the staging directory does not grow (seconds).
        commit_bound: How long rank 0's commit may block before it is abandoned (seconds).
        keep_last: How many committed checkpoints retention keeps.
        fence: This world's fencing token, if claimed already; else it is claimed at the first commit.
        superseded: Whether this rank's group is being replaced or has lost a peer: a rank waiting
            for another's part stops waiting then.
        fault: Called with each stage name of a save (``CheckpointManager._fault_hook``'s seam).
    """

    def __init__(self, storage: Storage, prefix: str, coordinator: Coordinator, *, calls: BoundedCalls,
                 stall: float, commit_bound: float, keep_last: int, fence: int | None,
                 superseded: Callable[[], bool] | None, fault: Callable[[str], None]) -> None:
        self._storage = storage
        self._prefix = prefix
        self._coord = coordinator
        self._calls = calls
        self._stall = stall
        self._commit_bound = commit_bound
        self._keep_last = keep_last
        self._fence = fence
        self._superseded = superseded
        self._fault = fault
        self._object_store = isinstance(storage, ObjectStore)

    @property
    def location(self) -> str:
        """Where the checkpoints live, for humans."""
        return self._storage.location(self._prefix)

    @property
    def fence(self) -> int | None:
        """This world's fencing token in the directory (None until claimed)."""
        return self._fence

    def save(self, payload: Payload, *, started: float, failure: Exception | None = None) -> None:
        """Write ``payload`` with the other ranks and commit it; a collective.

        Args:
            payload: This rank's part of the step, its tensors on the CPU.
            started: When the save began (``time.monotonic()``), for the commit's log line.
            failure: Why this rank cannot write its part (its copy of the state failed): reported at
                the barrier like a failed write, so every rank fails the save together.

        Raises:
            CheckpointWriteError: Some rank could not write (storage), or a rank's storage still blocks.
            NonFiniteStateError: A rank's parameters hold NaN or infinity; nothing was written.
            CheckpointError: The save failed otherwise; nothing was committed.
        """
        step, rank = payload.step, self._coord.rank
        diverged = _diverged(payload) if failure is None else None
        # A rank whose storage still blocks in a call of an abandoned save says so: then no rank
        # starts a second write (it would block too), and all skip this save together.
        proposals = self._coord.all_gather((step, secrets.token_hex(4), diverged, self._calls.stuck()))
        if len({p[0] for p in proposals}) != 1:
            raise CheckpointError(f"ranks disagree on the step to save: {[p[0] for p in proposals]}")
        nonce = proposals[0][1]
        # Before anything is written: a diverged step committed would push good checkpoints out.
        diverged = next((p[2] for p in proposals if p[2] is not None), None)
        if diverged is not None:
            raise NonFiniteStateError(
                f"step {step}: {diverged} holds NaN or infinity (training diverged); the step is not checkpointed, "
                f"and the checkpoints committed before it are kept in {self.location}")
        stuck = [f"rank {r}: {p[3]}" for r, p in enumerate(proposals) if p[3] is not None]
        if stuck:
            raise CheckpointWriteError(f"the save of step {step} was skipped, so that no second write blocks: "
                                       + "; ".join(stuck))
        staging = fmt.join(self._prefix, (fmt.data_dir if self._object_store else fmt.staging_dir)(step, nonce))

        written = Written()
        error: str | None = None
        storage_failed = False
        try:
            if failure is not None:
                raise failure
            self._fault("before_write")
            # A write that blocks while the group re-forms must not hold up the re-formation.
            written = self._calls.run(f"the write of step {step}", lambda: self._write_part(staging, payload),
                                      cancelled=self._superseded)
            self._fault("before_barrier")
        except Exception as exc:  # noqa: BLE001 - any failure must reach the barrier, or the others hang
            # Said once, by whoever reports the save's failure: it names every rank's error.
            logger.debug("rank %d could not write its part of step %d: %s", rank, step, exc)
            storage_failed = isinstance(exc, OSError)
            error = f"rank {rank}: {exc}" if storage_failed else f"rank {rank}: {exc!r}"

        # Wait for the slowest writer outside the collective, whose timeout is fixed.
        self._await_writers(staging)
        # The barrier: nobody commits until every rank's files are durable.
        reports = self._coord.all_gather((written, error, storage_failed))
        outcome: tuple[bool, str] | None = None  # (whether the storage failed, why)
        if rank == 0:
            errors = [e for _, e, _ in reports if e is not None]
            try:
                if errors:
                    outcome = (any(failed for _, _, failed in reports), "; ".join(errors))
                else:
                    files = [f for part, _, _ in reports for f in part.files]
                    tensors = None if payload.tensors is None else sharded.build_index(
                        payload.tensors, [c for part, _, _ in reports for c in part.chunks])
                    self._calls.run(f"the commit of step {step}",
                                    lambda: self._commit(step, staging, nonce, files, tensors),
                                    timeout=self._commit_bound)
            except OSError as exc:  # ENOSPC writing the manifest, say, or a blocked rename
                outcome = (True, str(exc))
            except Exception as exc:  # noqa: BLE001 - the outcome carries it to the other ranks
                outcome = (False, str(exc))
            if outcome is not None:
                self._delete_quietly(staging)  # the torn staging directory goes at once
        outcome = self._coord.broadcast(outcome)
        if outcome is not None:
            storage, why = outcome
            raise (CheckpointWriteError if storage else CheckpointError)(
                f"checkpoint of step {step} was not committed: {why}")
        if rank == 0:
            self._retain(step)
            elapsed = time.monotonic() - started
            logger.info("committed step %d to %s in %.2fs", step, self.location, elapsed)
            _events.info("checkpoint_commit", extra={"elastictrain_event": {"step": step, "seconds": elapsed}})

    def _write_part(self, staging: str, payload: Payload) -> Written:
        """Write and sync this rank's files of ``payload`` into ``staging`` (on a helper thread:
        see ``BoundedCalls``)."""
        self._storage.make_dir(staging)
        written = Written()
        if payload.shards:
            entry, chunks = sharded.write_shards(self._storage, staging, sharded.shard_file(self._coord.rank),
                                                 payload.shards, on_write=self._on_write)
            written.files.append((entry.name, entry.size, entry.sha256))
            written.chunks.extend(chunks)
        if payload.replicated is not None:
            written.files.append(self._write(staging, fmt.REPLICATED, payload.replicated))
        written.files.append(self._write(staging, fmt.rank_file(self._coord.rank), payload.local))
        self._storage.sync_dir(staging)
        return written

    def _delete_quietly(self, path: str) -> None:
        try:
            self._calls.run(f"deleting {self._storage.location(path)}", lambda: delete_quietly(self._storage, path))
        except OSError as exc:  # blocked: the next commit's retention deletes it
            logger.info("could not delete %s: %s", self._storage.location(path), exc)

    def _await_writers(self, staging: str) -> None:
        """Mark this rank's part of ``staging`` written, then wait until every rank has.

        No collective: the deadline is ``_stall`` seconds without the staging
        directory's files growing, so rank 0 writing many GB keeps the others
        waiting as long as it makes progress. On a stall, a storage error, a rank
        that could not write its mark, or the group being superseded, stop waiting:
        the barrier collective that follows reports the failure (or times out).
        """
        world = self._coord.world_size
        if world == 1:
            return
        def mark() -> None:
            self._storage.make_dir(staging)
            with self._storage.open_write(fmt.join(staging, _written_mark(self._coord.rank))):
                pass

        def look() -> tuple[set[str], int]:
            if isinstance(self._storage, ObjectStore):  # one listing, no request per file
                sizes = self._storage.list_sizes(staging)
                return set(sizes), sum(size for name, size in sizes.items() if not name.startswith("."))
            names = set(self._storage.list_dir(staging))
            return names, sum(self._storage.size(fmt.join(staging, n)) for n in names if not n.startswith("."))

        try:
            # Also after a failure (even before this rank made the directory): the others
            # stop waiting for this rank, and the barrier reports its error.
            self._calls.run("marking this rank's part written", mark)
        except OSError as exc:
            logger.info("could not mark rank %d's part written: %s", self._coord.rank, exc)
            return
        wanted = {_written_mark(r) for r in range(world)}
        deadline = time.monotonic() + self._stall
        progress: int | None = None
        delay = 0.005
        while True:
            try:
                names, grown = self._calls.run(f"listing {self._storage.location(staging)}", look)
                if wanted <= names:
                    return
            except OSError as exc:
                logger.info("stopped waiting for the other ranks' files in %s: %s",
                            self._storage.location(staging), exc)
                return
            if self._superseded is not None and self._superseded():
                logger.info("stopped waiting for ranks %s's part of %s: a rank is gone, or the group re-forms",
                               sorted(int(n.rsplit("-", 1)[1]) for n in wanted - names),
                               self._storage.location(staging))
                return
            now = time.monotonic()
            if grown != progress:
                progress, deadline = grown, now + self._stall
            elif now > deadline:
                logger.info("ranks %s have not written their part of %s, which has not grown for %.0fs",
                               sorted(int(n.rsplit("-", 1)[1]) for n in wanted - names),
                               self._storage.location(staging), self._stall)
                return
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _on_write(self) -> None:
        self._calls.progress()
        self._fault("during_write")

    def _write(self, directory: str, name: str, obj: Any) -> tuple[str, int, str]:
        entry = fmt.write_file(self._storage, directory, name, obj, on_write=self._on_write)
        return entry.name, entry.size, entry.sha256  # a tuple: it crosses ranks pickled

    def _commit(self, step: int, staging: str, nonce: str, written: list[tuple[str, int, str]],
                tensors: dict[str, Any] | None) -> None:
        if self._fence is None:
            self._fence = _fence.claim(self._storage, self._prefix)
        entries = [fmt.FileEntry(name, size, sha) for name, size, sha in written]
        for entry in entries:
            path = fmt.join(staging, entry.name)
            # A rank that wrote to a disk rank 0 cannot see must fail the save,
            # not produce a checkpoint without its part.
            size = self._storage.size(path) if self._storage.exists(path) else None
            if size != entry.size:
                raise CheckpointError(
                    f"{self._storage.location(path)} has {size} bytes where {entry.size} were written; "
                    "is the checkpoint directory on a filesystem shared by all ranks?"
                )
        if self._coord.world_size > 1:
            for rank in range(self._coord.world_size):
                self._storage.delete(fmt.join(staging, _written_mark(rank)))
        if self._object_store:
            self._commit_manifest(step, staging, entries, tensors)
            return
        fmt.write_manifest(
            self._storage, staging, step=step, world_size=self._coord.world_size, saved_at=time.time(), files=entries,
            fence=self._fence, tensors=tensors,
        )
        self._storage.sync_dir(staging)
        self._fault("before_commit")
        assert self._fence is not None  # noqa: S101 - claimed before the commit
        _fence.check(self._storage, self._prefix, self._fence, what=f"the commit of step {step}")
        final = fmt.join(self._prefix, fmt.step_dir(step))
        if self._storage.exists(final):
            # Saving a step again (after restoring to it): park the old one under a
            # staging name, which retention deletes. A crash between the two
            # renames leaves the older checkpoints, never a half-written one.
            logger.warning("replacing the existing checkpoint of step %d", step)
            self._storage.rename(final, fmt.join(self._prefix, fmt.staging_dir(step, f"{nonce}-replaced")))
        self._storage.rename(staging, final)
        self._fault("after_commit")

    def _commit_manifest(self, step: int, data: str, entries: list[fmt.FileEntry],
                         tensors: dict[str, Any] | None) -> None:
        """Commit in an object store: the manifest, written last and create-only, names ``data``."""
        assert self._fence is not None  # noqa: S101 - claimed before the commit
        assert isinstance(self._storage, ObjectStore)  # noqa: S101 - only called for one
        _fence.check(self._storage, self._prefix, self._fence, what=f"the commit of step {step}")
        final = fmt.join(self._prefix, fmt.step_dir(step))
        replacing: str | None = None
        try:
            raw, replacing = self._storage.read_tagged(fmt.join(final, fmt.MANIFEST))
        except FileNotFoundError:
            pass
        else:
            try:
                existing = json.loads(raw).get("fence")
            except (ValueError, AttributeError):  # a torn manifest: not a checkpoint, replace it
                existing = None
            if isinstance(existing, int) and existing > self._fence:
                raise _fence.FencedError(
                    f"the commit of step {step} refused: another writer committed {self._storage.location(final)} "
                    f"first, a newer world (fencing token {existing}; this world's is {self._fence})")
            # Saving a step again (after restoring to it): the new manifest replaces the one just
            # read, in one conditional request (If-Match), never one committed since by another
            # world; the old one's data is then garbage that retention deletes.
            logger.warning("replacing the existing checkpoint of step %d", step)
        # The commit point: the create-only (or replace-if-unchanged) write refuses to replace a
        # manifest that another world wrote after the checks above.
        self._fault("before_commit")
        try:
            fmt.write_manifest(self._storage, final, step=step, world_size=self._coord.world_size,
                               saved_at=time.time(), files=entries, fence=self._fence,
                               data=data.rpartition("/")[2], tensors=tensors, replacing=replacing)
        except (FileExistsError, FileNotFoundError) as exc:
            raise _fence.FencedError(
                f"the commit of step {step} refused: another writer committed {self._storage.location(final)} "
                f"first (its manifest is written only if unchanged since this world read it); this world (token "
                f"{self._fence}) is likely stale") from exc
        self._fault("after_commit")

    def _retain(self, committed: int) -> None:
        try:
            self._calls.run(f"retention after step {committed}",
                            lambda: retain(self._storage, self._prefix, committed=committed,
                                           keep_last=self._keep_last, fence=self._fence))
        except OSError as exc:  # blocked: the next commit tries again
            logger.warning("retention skipped: %s", exc)


def _diverged(payload: Payload) -> str | None:
    """Which model parameter of the state to write holds NaN or infinity, if one does (rank 0
    in the replicated state, every rank in the shards it writes). Parameters only: a buffer
    may hold infinity on purpose (an attention mask)."""
    for name, keys in payload.parameters.items():
        saved = payload.replicated["stateful"].get(name) if payload.replicated is not None else None
        if isinstance(saved, dict):
            found = snap.first_non_finite((key, saved.get(key)) for key in keys)
            if found is not None:
                return f"parameter {found!r} of state[{name!r}]"
        mine = {key_of((name, key)) for key in keys}
        found = snap.first_non_finite((c.key, c.tensor) for c in payload.shards if c.key in mine)
        if found is not None:
            return f"parameter {found.partition('/')[2]!r} of state[{name!r}] (a local shard)"
    return None

def _written_mark(rank: int) -> str:
    """The empty file that says ``rank``'s part of a staging directory is written and durable."""
    return f".written-{rank:05d}"
