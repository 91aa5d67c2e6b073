"""Barrier-consistent checkpoints of a data-parallel job: ``CheckpointManager``.

One save, called by every rank with the same step:

1. Snapshot (training thread): ``state_dict()`` of every object; rank 0 keeps the
   replicated state, every rank its RNG states. Async saves copy tensors to CPU;
   overlapped saves leave that copy to the background thread (``_overlap``), and
   the next step waits for it only where it would change a tensor not yet copied.
2. Agree on a staging directory ``step_<N>.tmp-<nonce>`` (rank 0's nonce).
3. Each rank writes and fsyncs its files there (rank 0: ``replicated.pt`` too), then
   marks its part written (``.written-<rank>``). Ranks wait for each other's marks
   outside any collective, with a deadline that moves while the staging directory
   grows: a large checkpoint takes as long as it takes to write, a stalled writer
   still fails the save.
4. Barrier: every rank reports its files (name, size, sha256) or its failure.
5. Rank 0 checks the files and its fencing token (``_fence``), writes
   ``MANIFEST.json``, fsyncs, and commits by renaming the staging directory to
   ``step_<N>`` (then fsyncs the parent). The rename is the commit point: a crash
   before it leaves only a staging dir that is never read; a crash after it leaves a
   complete checkpoint.
6. Rank 0 broadcasts the outcome (every rank fails or succeeds together), then
   deletes checkpoints beyond ``keep_last`` and stale staging dirs.

In an object store (an ``ObjectStore``: no atomic rename) the ranks write into
``step_<N>.data-<nonce>`` instead, and rank 0 commits by writing ``step_<N>/MANIFEST.json``
last, create-only, naming that prefix: the create is the commit point (saving a step again
replaces its manifest only if it is still the one read: ``If-Match``). Retention then
deletes a retired checkpoint's manifest before its data, and every data prefix no
manifest names (a crashed or refused save's), and aborts unfinished uploads.

State that holds DTensors (FSDP2, HSDP) makes a sharded checkpoint (:mod:`._sharded`): each
rank also writes the local shards it holds into ``shards_<rank>.bin``, reports their chunks in
the barrier, and rank 0 puts the tensor index into the manifest; the commit is the same.

Restoring is :mod:`._reader`'s: the newest committed checkpoint that verifies on every rank,
resharded to the live state's placements (:mod:`._reshard`).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch

from elastictrain.errors import CheckpointError, CheckpointWriteError, ConfigError, NonFiniteStateError

from . import _fence
from . import _manifest as fmt
from . import _shared_directory as shared_directory
from . import _sharded as sharded
from . import _snapshot as snap
from ._bounded import BoundedCalls
from ._index import key_of
from ._overlap import Overlap, SnapshotCopy
from ._reader import CheckpointReader, RestoreInfo
from .coordinator import Coordinator, default_coordinator
from .storage import ObjectStore, Storage, delete_quietly, storage_for

__all__ = ["CheckpointManager", "RestoreInfo", "Stateful"]

logger = logging.getLogger(__name__)
_events = logging.getLogger("elastictrain.events")

FAULT_STAGES = ("before_write", "during_write", "before_barrier", "before_commit", "after_commit")
"""Where ``CheckpointManager._fault_hook`` is called during a save (a test seam for crash injection)."""
COPY_STAGE = "during_copy"
"""Where ``_fault_hook`` is also called in an overlapped save: on rank 0, before each storage's copy."""
_DEFAULT_STALL = timedelta(minutes=5)
"""Without ``save_timeout`` or ``timeout``: how long a save's storage call may go without progress,
and how long ranks wait for a peer's part while its files do not grow."""


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()``/``load_state_dict()``: modules, optimizers, schedulers, GradScaler, samplers."""

    def state_dict(self) -> dict[str, Any]:
        """Return the object's state."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> Any:
        """Replace the object's state."""
        ...


@dataclass(slots=True)
class _Payload:
    step: int
    replicated: dict[str, Any] | None  # rank 0 only: {"stateful": {...}, "extras": {...}}
    local: dict[str, Any]  # {"rng": {...}}
    copy: SnapshotCopy | None = None  # overlapped: makes ``replicated``'s and ``shards``' tensors CPU copies
    parameters: dict[str, list[str]] = field(default_factory=dict)  # each module's parameter keys
    tensors: list[sharded.TensorInfo] | None = None  # the state's DTensors (None: a DDP checkpoint)
    shards: list[sharded.LocalChunk] = field(default_factory=list)  # the local shards this rank writes


@dataclass(frozen=True, slots=True)
class _Written:
    """What a rank wrote of a save: its files and, of a sharded save, its chunks (crosses ranks pickled)."""

    files: list[tuple[str, int, str]] = field(default_factory=list)
    chunks: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


class CheckpointManager:
    """Saves and restores consistent checkpoints of a (possibly distributed) training job.

    Every rank must construct the manager, and call ``save``, ``restore``,
    ``latest_step`` and ``close`` in the same order with the same arguments: they
    are collectives. Call them from one thread (the training loop).

    Args:
        directory: Where checkpoints live. With ``storage``, a path inside it.
        keep_last: How many committed checkpoints to keep; older ones are deleted
            only after a newer one has committed.
        async_save: Return from ``save`` once the state is copied to CPU memory,
            writing and committing on a background thread. The copy's memory
            (one checkpoint's worth, on rank 0) is kept and reused by the next save.
        overlap: With ``async_save``, return from ``save`` at once and copy the
            state on the background thread too (CUDA tensors on a side stream
            into pinned memory), while the next step computes. The next
            ``torch.optim`` optimizer step over saved parameters waits for the
            copy, and a saved module's forward waits for its buffers' copies;
            anything else that changes a saved tensor in place must call
            ``wait_snapshot()`` first. ``restore`` allocates the copy memory in
            the background once every saved optimizer has stepped, so that the
            first save copies into warm memory too.
        storage: Where bytes go; ``None``: an ``S3Storage`` for ``directory="s3://bucket/prefix"``
            (the ``[s3]`` extra), else ``LocalStorage(directory)``. With
            more than one rank it must be shared by all of them: the constructor
            checks that every rank sees a file rank 0 writes there.
        coordinator: How ranks agree; ``None`` uses a dedicated gloo group when
            ``torch.distributed`` is initialized (creating it is a collective),
            else a single process.
        timeout: Timeout of each collective of the created gloo group; ``None``
            keeps torch's default. Also the default of ``save_timeout``.
        save_timeout: How long a save's storage call may go without progress (a chunk
            written, the call returning) before the save is abandoned as failed (a hung
            NFS server), and how long ranks wait for a peer's files while they do not
            grow; a large checkpoint is never cut short by it. ``None``: ``timeout``,
            else 5 minutes. While an abandoned call has not returned, later saves are
            skipped on every rank (they fail with ``CheckpointWriteError`` at once).
        on_write_failure: Called with the step and the error when a save fails with
            ``CheckpointWriteError``, from the thread that ran the save, instead of the
            error line the manager logs then (``Session`` says it in its own line, with
            the step of the next save). The error is still raised (a synchronous save),
            or kept for ``wait`` (an async one).
        fence: Claim this world's fencing token now, before restoring (a training
            job: ``Session`` does). Otherwise the token is claimed at the first
            save, so a reader that only restores (an eval job) never fences off
            the writer. A commit is refused once a newer world claimed the directory.
        superseded: Whether this rank's group is being replaced or has lost a peer
            (``Session`` passes its control channel's, and a check of its checkpoint
            group's connections). A save that waits for another rank's files stops
            waiting then, and fails at its barrier, instead of waiting out the stall
            deadline for a rank that is gone.

    Raises:
        ConfigError: ``keep_last`` is not a positive integer, or ``overlap``
            without ``async_save``.
        CheckpointError: The directory cannot be created or written (checked on
            rank 0), or some rank cannot see it (it is not on a shared filesystem);
            raised on every rank.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep_last: int = 3,
        async_save: bool = False,
        overlap: bool = False,
        storage: Storage | None = None,
        coordinator: Coordinator | None = None,
        timeout: timedelta | None = None,
        fence: bool = False,
        superseded: Callable[[], bool] | None = None,
        save_timeout: timedelta | None = None,
        on_write_failure: Callable[[int, CheckpointWriteError], None] | None = None,
    ) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ConfigError(f"keep_last must be a positive integer, got {keep_last!r}")
        if overlap and not async_save:
            raise ConfigError("overlap=True needs async_save=True: a synchronous save has nothing to overlap")
        if storage is None:
            try:
                storage, self._prefix = storage_for(directory)
            except (ValueError, ImportError) as exc:
                raise ConfigError(f"checkpoint directory {os.fspath(directory)!r}: {exc}") from exc
        else:
            self._prefix = fmt.join(os.fspath(directory))
        self._storage = storage
        self._keep_last = keep_last
        self._async = async_save
        self._coord = coordinator if coordinator is not None else default_coordinator(timeout)
        self._thread: threading.Thread | None = None
        self._pool = snap.CopyPool()
        self._error: tuple[int, Exception] | None = None
        self._closed = False
        # Test seam: called with each FAULT_STAGES name during a save, on every rank.
        self._fault_hook: Callable[[str], None] | None = None
        self._stall = (save_timeout or timeout or _DEFAULT_STALL).total_seconds()
        self._calls = BoundedCalls(self._stall)
        # The other ranks wait for rank 0's commit in a collective (the broadcast of its outcome):
        # a commit that blocks is abandoned well before that collective's timeout ends their wait.
        self._commit_bound = min(self._stall, timeout.total_seconds() / 2) if timeout else self._stall
        self._on_write_failure = on_write_failure
        self._superseded = superseded
        self._host = socket.gethostname()
        self._object_store = isinstance(storage, ObjectStore)
        self._fence: int | None = None
        try:
            self._fence = shared_directory.check(self._storage, self._prefix, self._coord, host=self._host,
                                                 claim=fence)
        except BaseException:
            self._coord.close()  # every rank raises: none keeps the group it will never use
            raise
        self._reader = CheckpointReader(self._storage, self._prefix, self._coord, host=self._host)
        # Rank 0 copies the replicated state, every rank the shards it writes of sharded state.
        self._overlap = Overlap(self._pool, replicated=self._coord.rank == 0) if overlap else None

    @property
    def saving(self) -> bool:
        """Whether an asynchronous save is in flight (its background thread has not ended)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    @property
    def location(self) -> str:
        """Where the checkpoints live, for humans."""
        return self._reader.location

    @property
    def fence(self) -> int | None:
        """This world's fencing token in the directory (None until claimed: see ``fence=``)."""
        return self._fence

    def save(self, step: int, state: Mapping[str, Stateful | dict[str, Any]]) -> None:
        """Save ``state`` as the checkpoint of ``step``; a collective.

        Waits for a save still in flight first. Synchronously, returns once the
        checkpoint is committed on every rank; with ``async_save``, once the state
        is copied, so the caller may change it right away; with ``overlap`` too,
        at once: the copy goes on in the background, and until ``wait_snapshot``
        returns only optimizer steps and forwards of saved modules may change the
        saved tensors (they wait for their copies).

        Args:
            step: The training step, a non-negative int; every rank passes the same.
            state: Objects with ``state_dict()`` and plain dicts of extras (epoch,
                metrics, ...), by name. Every value must be tensors and plain Python
                data. Plain tensors are replicated state (rank 0 writes them); the
                DTensors (FSDP2, HSDP: ``Shard`` and ``Replicate`` placements) make a
                sharded checkpoint, where each rank writes the local shards it holds
                (one replica of each) and ``restore`` reshards them.

        Raises:
            ConfigError: ``step`` or ``state`` is invalid.
            CheckpointWriteError: This save could not write (a full disk, an I/O
                error, storage blocked past ``save_timeout``, or an earlier blocked
                call has not returned: the save was skipped) on some rank; nothing
                was committed, and the checkpoints committed before are intact.
            CheckpointError: This save failed otherwise (nothing was committed), or
                a previous async save failed (and this one was not started).
            NonFiniteStateError: A parameter of a module in ``state`` holds NaN or
                infinity (training diverged); the step was not committed.
        """
        self._ensure_open()
        snap.check_step(step)
        snap.check_state(state)
        self.wait()
        payload = self._collect(step, state)
        if not self._async:
            try:
                self._write_and_commit(payload)
            except CheckpointWriteError as exc:
                self._say_write_failure(step, exc)
                raise
            return
        self._thread = threading.Thread(
            target=self._save_in_background, args=(payload,), name=f"elastictrain-checkpoint-{step}"
        )
        try:
            self._thread.start()
        except BaseException:
            self._thread = None
            if payload.copy is not None:
                payload.copy.abandon()  # nothing will copy: release the guards
            self.wait_snapshot()
            raise

    def wait_snapshot(self) -> None:
        """Block until the state of the overlapped save in flight is copied; then it may change.

        Call it before changing a saved tensor in place other than by an
        optimizer step or a saved module's forward (which wait by themselves):
        e.g. ``p.mul_(0.5)`` under ``no_grad``, a manual SGD update, loading new
        weights. On CUDA it returns once the copy is queued and the current
        stream ordered after it: changes queued afterwards on that stream are
        safe. Does nothing without ``overlap`` (``save`` copied already), when
        no save is in flight, or when the copy failed (the save's error is
        raised by ``wait`` or the next ``save``).
        """
        if self._overlap is not None:
            self._overlap.wait()

    def wait(self) -> None:
        """Block until the async save in flight (if any) has committed or failed.

        Raises:
            CheckpointError: The background save failed; it was not committed.
                The failure is raised once.
        """
        self.wait_snapshot()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        failure, self._error = self._error, None
        if failure is not None:
            step, exc = failure
            kind = next((k for k in (NonFiniteStateError, CheckpointWriteError) if isinstance(exc, k)),
                        CheckpointError)
            raise kind(f"the background save of step {step} failed and was not committed: {exc}") from exc

    @property
    def stalled(self) -> timedelta:
        """How long the async save in flight has waited on a storage call that makes no progress
        (zero when none is in flight, or its storage answers). ``Session`` skips a save due while
        a rank's is stalled, rather than wait for it (a hung NFS server)."""
        return timedelta(seconds=self._calls.stalled_for() if self.saving else 0.0)

    def latest_step(self) -> int | None:
        """Return the newest step whose checkpoint verifies, agreed by all ranks; a collective.

        Checks each candidate's manifest and file sizes (cheap); checksums are checked
        by the ranks that load it (``restore``).

        Raises:
            CheckpointError: The directory cannot be read, or a failed async save.
            CorruptCheckpointError: Checkpoints exist but none verifies.
        """
        self._ensure_open()
        self.wait()
        found = self._reader.agree(None)
        return None if found is None else found[0]

    def restore(self, state: Mapping[str, Stateful | dict[str, Any]], step: int | None = None) -> RestoreInfo | None:
        """Load a checkpoint into ``state``'s objects; a collective.

        Rank 0 picks the newest checkpoint whose manifest and file sizes check out;
        every rank checks the checksums of the files it loads, and if one does not
        match on any rank, every rank skips that checkpoint (with a warning) and
        tries the one before. A checkpoint deleted while it is read (a separate
        reader racing its writer's retention) is not corrupt: the ranks agree again. Dict
        entries are updated in place. Each object's ``state_dict()`` is the template of
        what it loads: where it holds a DTensor, this rank reads only the stored chunks
        that overlap its shard at the template's placements (any world size and mesh;
        each chunk checked against its sha256); where it holds a plain tensor, the full
        tensor is assembled. A DDP checkpoint is sliced for DTensor templates. Rank ``r`` restores its own saved RNG
        states; a rank the saved job did not have (the world grew) seeds its RNGs
        with ``fallback_seed`` instead, which is deterministic and distinct per rank.

        Args:
            state: The objects to load into, by the names they were saved under.
            step: Load this step instead of the newest.

        Returns:
            What was loaded, or None if there is no checkpoint yet.

        Raises:
            CheckpointError: The directory cannot be read.
            NoCheckpointError: ``step`` was given and has no committed checkpoint.
            CorruptCheckpointError: ``step`` (or, with ``step=None``, every
                checkpoint) fails verification, or a file is not plain data.
            CheckpointMismatchError: The checkpoint does not fit ``state`` (a
                missing entry, a shape differing; the message names both shapes).
        """
        self._ensure_open()
        snap.check_state(state)
        if step is not None:
            snap.check_step(step)
        self.wait()
        info = self._reader.restore(state, step)
        if self._overlap is not None:
            self._overlap.plan_reservation(state)
        return info

    def close(self) -> None:
        """Wait for the save in flight and release the coordinator; a collective. Idempotent.

        Raises:
            CheckpointError: The background save failed.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            if self._overlap is not None:
                self._overlap.close()
            self._pool.clear()
            self._coord.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _ensure_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the checkpoint manager of {self.location} is closed")

    def _fault(self, stage: str) -> None:
        if self._fault_hook is not None:
            self._fault_hook(stage)

    def _collect(self, step: int, state: Mapping[str, Stateful | dict[str, Any]]) -> _Payload:
        # Every rank checks the replicated state (cheap, no copies) so that bad
        # input fails on all ranks before any collective, not on rank 0 alone.
        rank0 = self._coord.rank == 0
        content: dict[str, Any] = {"stateful": {}, "extras": {}}
        references: list[torch.Tensor] = []
        self._pool.begin()  # the previous save is done (save() waited): its copies are free
        leaves: list[tuple[tuple[Any, ...], Any]] = []
        for name, obj in state.items():
            kind, value = ("extras", obj) if isinstance(obj, dict) else ("stateful", obj.state_dict())
            where = f"state[{name!r}]"
            value, found_here = sharded.split(value, (name,))  # DTensors: written in shards (below)
            leaves += found_here
            if not rank0:
                snap.validate_state(value, where=where)
            elif self._overlap is not None:
                content[kind][name], found = snap.capture(value, pool=self._pool, where=where)
                references += found
            else:
                content[kind][name] = snap.snapshot(value, copy=self._async, pool=self._pool, where=where)
        local = snap.snapshot({"rng": snap.capture_rng()}, copy=False, pool=self._pool)  # fresh tensors already
        payload = _Payload(step=step, replicated=content if rank0 else None, local=local)
        if leaves:
            payload.tensors, payload.shards = sharded.local_chunks(leaves)
            for chunk in payload.shards:
                where = f"the local shard of {chunk.key!r}"
                if self._overlap is not None:
                    chunk.tensor, found = snap.capture(chunk.tensor, pool=self._pool, where=where)
                    references += found
                else:
                    chunk.tensor = snap.snapshot(chunk.tensor, copy=self._async, pool=self._pool, where=where)
        if rank0 or payload.shards:  # checked for NaN and infinity before the write (see _diverged)
            payload.parameters = {name: [key for key, _ in obj.named_parameters()]
                                  for name, obj in state.items() if isinstance(obj, torch.nn.Module)}
        if references and self._overlap is not None:
            payload.copy = self._overlap.start(references, state)
        return payload

    def _save_in_background(self, payload: _Payload) -> None:
        try:
            self._write_and_commit(payload)
        except Exception as exc:  # noqa: BLE001 - reported by wait(): nothing may escape a thread silently
            if isinstance(exc, CheckpointWriteError):
                self._say_write_failure(payload.step, exc)
            else:
                logger.error("background save of step %d failed; not committed: %s", payload.step, exc)
            self._error = (payload.step, exc)

    def _say_write_failure(self, step: int, exc: CheckpointWriteError) -> None:
        if self._on_write_failure is None:
            logger.error("save of step %d failed; not committed: %s", step, exc)
            return
        try:
            self._on_write_failure(step, exc)
        except Exception:
            logger.exception("on_write_failure failed")

    def _write_and_commit(self, payload: _Payload) -> None:
        started = time.monotonic()
        step, rank = payload.step, self._coord.rank
        # Copy first, before any collective: the others wait for it anyway, and a
        # failure is reported at the barrier like a failed write.
        copy_error: Exception | None = None
        if payload.copy is not None:
            try:
                payload.copy.run(lambda: self._fault(COPY_STAGE))
                payload.replicated = snap.materialize(payload.replicated, self._pool)
                for chunk in payload.shards:
                    chunk.tensor = snap.materialize(chunk.tensor, self._pool)
            except Exception as exc:  # noqa: BLE001 - reported at the barrier below
                copy_error = CheckpointError(f"copying the state to CPU memory failed: {exc!r}")
            payload.copy = None
        diverged = self._diverged(payload) if copy_error is None else None
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

        written = _Written()
        error: str | None = None
        storage_failed = False
        try:
            if copy_error is not None:
                raise copy_error
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

    @staticmethod
    def _diverged(payload: _Payload) -> str | None:
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

    def _write_part(self, staging: str, payload: _Payload) -> _Written:
        """Write and sync this rank's files of ``payload`` into ``staging`` (on a helper thread:
        see ``BoundedCalls``)."""
        self._storage.make_dir(staging)
        written = _Written()
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
            self._calls.run(f"retention after step {committed}", lambda: self._retain_now(committed))
        except OSError as exc:  # blocked: the next commit tries again
            logger.warning("retention skipped: %s", exc)

    def _retain_now(self, committed: int) -> None:
        try:
            if self._fence is not None:
                # A newer world that claimed the directory since our commit owns what is in it.
                _fence.check(self._storage, self._prefix, self._fence, what="retention")
            names = self._storage.list_dir(self._prefix)
        except _fence.FencedError as exc:
            logger.warning("%s", exc)
            return
        except OSError as exc:
            logger.warning("retention skipped: cannot list %s: %s", self.location, exc)
            return
        # Only directories holding a manifest are checkpoints this manager committed (a commit
        # renames a staging directory that holds one): another ``step_N`` is not ours to delete.
        others = sorted((s for n in names if (s := fmt.parse_step_dir(n)) is not None and s != committed
                         and self._storage.exists(fmt.join(self._prefix, n, fmt.MANIFEST))), reverse=True)
        if others and others[0] > committed:
            logger.warning("checkpoints of later steps exist (%s); restore prefers the highest step", others[0])
        # Every staging dir is stale here: at most one save is in flight, and it just committed.
        doomed = [fmt.step_dir(s) for s in others[self._keep_last - 1 :]] + [n for n in names if fmt.is_staging_dir(n)]
        if isinstance(self._storage, ObjectStore):
            self._retain_objects(self._storage, names, [committed] + others[: self._keep_last - 1], doomed)
            return
        for name in doomed:
            delete_quietly(self._storage, fmt.join(self._prefix, name))

    def _retain_objects(self, storage: ObjectStore, names: list[str], kept: list[int], doomed: list[str]) -> None:
        """Retention in an object store: a retired checkpoint's manifest goes first (a reader then
        finds it gone, not torn), then every data prefix that no kept manifest names (retired,
        replaced, or left by a crashed or refused save), then unfinished uploads (a crash mid-file)."""
        for name in doomed:
            delete_quietly(storage, fmt.join(self._prefix, name))
        referenced: set[str] = set()
        for step in kept:
            try:
                with storage.open_read(fmt.join(self._prefix, fmt.step_dir(step), fmt.MANIFEST)) as f:
                    data = json.loads(f.read()).get("data")
            except (OSError, ValueError, AttributeError) as exc:
                # Without every kept checkpoint's data prefix, none is safe to call garbage.
                logger.warning("retention kept unreferenced data: cannot read the manifest of step %d: %s", step, exc)
                return
            if isinstance(data, str):
                referenced.add(data)
        for name in names:
            if fmt.is_data_dir(name) and name not in referenced:
                delete_quietly(storage, fmt.join(self._prefix, name))
        try:
            # Every upload of this writer has finished: one still open was left by a crash.
            aborted = storage.abort_uploads(self._prefix, started_before=time.time())
        except OSError as exc:
            logger.warning("could not abort unfinished uploads in %s: %s", self.location, exc)
            return
        if aborted:
            logger.info("aborted %d unfinished upload(s) in %s (left by a crashed save)", aborted, self.location)


def _written_mark(rank: int) -> str:
    """The empty file that says ``rank``'s part of a staging directory is written and durable."""
    return f".written-{rank:05d}"
