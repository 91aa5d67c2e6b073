"""Barrier-consistent checkpoints of a data-parallel job: ``CheckpointManager``.

One save, called by every rank with the same step:

1. Snapshot (here, on the training thread): ``state_dict()`` of every object; rank 0 keeps the
   replicated state, every rank its RNG states and, of state that holds DTensors (FSDP2, HSDP),
   the local shards it holds (:mod:`._sharded`). Async saves copy tensors to CPU; overlapped saves
   leave that copy to the background thread (``_overlap``), and the next step waits for it only
   where it would change a tensor not yet copied.
2. Write and commit (:mod:`._writer`, on the background thread of an async save): every rank
   writes its files into a staging directory, a barrier, and rank 0 commits atomically (a rename,
   or in an object store a create-only manifest), then applies retention (:mod:`._retention`).

Restoring is :mod:`._reader`'s: the newest committed checkpoint that verifies on every rank,
resharded to the live state's placements (:mod:`._reshard`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch

from elastictrain.errors import CheckpointError, CheckpointWriteError, ConfigError, NonFiniteStateError

from . import _manifest as fmt
from . import _shared_directory as shared_directory
from . import _sharded as sharded
from . import _snapshot as snap
from ._bounded import BoundedCalls
from ._overlap import Overlap
from ._reader import CheckpointReader, RestoreInfo
from ._writer import CheckpointWriter, Payload
from .coordinator import Coordinator, default_coordinator
from .storage import Storage, storage_for

__all__ = ["CheckpointManager", "RestoreInfo", "Stateful"]

logger = logging.getLogger(__name__)

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
                storage, prefix = storage_for(directory)
            except (ValueError, ImportError) as exc:
                raise ConfigError(f"checkpoint directory {os.fspath(directory)!r}: {exc}") from exc
        else:
            prefix = fmt.join(os.fspath(directory))
        self._async = async_save
        self._coord = coordinator if coordinator is not None else default_coordinator(timeout)
        self._worker: ThreadPoolExecutor | None = None  # the async saves' thread, from the first on
        self._inflight: Future[None] | None = None  # the async save on it
        self._pool = snap.CopyPool()
        self._planner = sharded.ChunkPlanner()  # which local shards a save writes, kept between saves
        self._error: tuple[int, Exception] | None = None
        self._closed = False
        # Test seam: called with each FAULT_STAGES name during a save, on every rank.
        self._fault_hook: Callable[[str], None] | None = None
        stall = (save_timeout or timeout or _DEFAULT_STALL).total_seconds()
        self._calls = BoundedCalls(stall)
        self._on_write_failure = on_write_failure
        host = socket.gethostname()
        try:
            claimed = shared_directory.check(storage, prefix, self._coord, host=host, claim=fence)
        except BaseException:
            self._coord.close()  # every rank raises: none keeps the group it will never use
            raise
        self._reader = CheckpointReader(storage, prefix, self._coord, host=host)
        self._writer = CheckpointWriter(
            storage, prefix, self._coord, calls=self._calls, stall=stall,
            # The other ranks wait for rank 0's commit in a collective (the broadcast of its outcome):
            # a commit that blocks is abandoned well before that collective's timeout ends their wait.
            commit_bound=min(stall, timeout.total_seconds() / 2) if timeout else stall,
            keep_last=keep_last, fence=claimed, superseded=superseded, fault=self._fault)
        # Rank 0 copies the replicated state, every rank the shards it writes of sharded state.
        self._overlap = Overlap(self._pool, replicated=self._coord.rank == 0) if overlap else None

    @property
    def saving(self) -> bool:
        """Whether an asynchronous save is in flight (its background work has not ended)."""
        inflight = self._inflight
        return inflight is not None and not inflight.done()

    @property
    def location(self) -> str:
        """Where the checkpoints live, for humans."""
        return self._reader.location

    @property
    def fence(self) -> int | None:
        """This world's fencing token in the directory (None until claimed: see ``fence=``)."""
        return self._writer.fence

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
        try:
            if self._worker is None:
                # One thread for every async save: handing it a save does not wait until a new
                # thread is scheduled, as Thread.start() does (on busy cores, milliseconds of stall).
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastictrain-checkpoint")
            self._inflight = self._worker.submit(self._save_in_background, payload)
        except BaseException:
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
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.result()  # _save_in_background keeps its failure for below
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
            if self._worker is not None:
                self._worker.shutdown()
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

    def _collect(self, step: int, state: Mapping[str, Stateful | dict[str, Any]]) -> Payload:
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
        local = {"rng": snap.capture_rng()}  # plain data and fresh CPU tensors: nothing to check or copy
        payload = Payload(step=step, replicated=content if rank0 else None, local=local)
        if leaves:
            payload.tensors, payload.shards = self._planner.local_chunks(leaves)
            # One walk over every local shard, by tensor key (a rank holds one box of each tensor).
            shards = {chunk.key: chunk.tensor for chunk in payload.shards}
            where = "the local shards"
            if self._overlap is not None:
                shards, found = snap.capture(shards, pool=self._pool, where=where)
                references += found
            else:
                shards = snap.snapshot(shards, copy=self._async, pool=self._pool, where=where)
            for chunk in payload.shards:
                chunk.tensor = shards[chunk.key]
        if rank0 or payload.shards:  # checked for NaN and infinity before the write (see _diverged)
            payload.parameters = {name: [key for key, _ in obj.named_parameters()]
                                  for name, obj in state.items() if isinstance(obj, torch.nn.Module)}
        if references and self._overlap is not None:
            payload.copy = self._overlap.start(references, state)
        return payload

    def _save_in_background(self, payload: Payload) -> None:
        threading.current_thread().name = f"elastictrain-checkpoint-{payload.step}"  # in stack dumps
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

    def _write_and_commit(self, payload: Payload) -> None:
        started = time.monotonic()
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
        self._writer.save(payload, started=started, failure=copy_error)
