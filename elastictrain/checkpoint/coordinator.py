"""Agreement among ranks for checkpointing: the ``Coordinator`` seam and its implementations.

A checkpoint is committed only after every rank has written its part, and all ranks
restore the same step; both need a handful of small collectives. They run behind
this interface so the manager does not care whether it is alone
(``SingleProcessCoordinator``) or one of many (``TorchDistributedCoordinator``).

Why a dedicated gloo group rather than the default group or the c10d store: an
async save runs its collectives on a background thread while the training thread
issues DDP collectives. Two threads issuing collectives on one group can interleave
in a different order on different ranks and deadlock or mix up payloads. A group of
its own has its own sequence numbers and connections, so the two streams never
meet. Gloo works from any thread on CPU objects whatever the training backend
(NCCL included), and unlike the store it needs no private torch API and no
hand-rolled key cleanup.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from elastictrain.errors import CheckpointError

__all__ = ["Coordinator", "SingleProcessCoordinator", "TorchDistributedCoordinator", "default_coordinator"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Coordinator(ABC):
    """Collectives among the ranks that share one checkpoint directory.

    Every method except the properties is a collective: each rank calls it, in the
    same order, with a picklable object. Calls must not be made from two threads at
    once. A failure (a peer died, a timeout) raises ``CheckpointError``.
    """

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's rank, in ``[0, world_size)``."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """The number of ranks."""

    @abstractmethod
    def broadcast(self, obj: T) -> T:
        """Return rank 0's ``obj`` on every rank (other ranks' ``obj`` is ignored).

        Raises:
            CheckpointError: The collective failed.
        """

    @abstractmethod
    def all_gather(self, obj: T) -> list[T]:
        """Return every rank's ``obj``, indexed by rank, on every rank.

        Raises:
            CheckpointError: The collective failed.
        """

    def close(self) -> None:  # noqa: B027 - a no-op default is the point
        """Release what the coordinator holds. Idempotent."""


class SingleProcessCoordinator(Coordinator):
    """The coordinator of a run that is not distributed: rank 0 of 1."""

    @property
    def rank(self) -> int:
        """See base class."""
        return 0

    @property
    def world_size(self) -> int:
        """See base class."""
        return 1

    def broadcast(self, obj: T) -> T:
        """See base class."""
        return obj

    def all_gather(self, obj: T) -> list[T]:
        """See base class."""
        return [obj]


class TorchDistributedCoordinator(Coordinator):
    """Collectives over a ``torch.distributed`` process group.

    Args:
        group: The group to use. It must be usable from the thread that saves
            (gloo is) and must not be used by anyone else while the manager is
            alive. ``None`` creates a dedicated gloo group over all ranks of the
            default group, which is itself a collective: every rank must
            construct the coordinator.
        timeout: Timeout of each collective of a created group; ``None`` keeps
            torch's default. It must cover the slowest rank's file write, because
            the other ranks wait for it at the commit barrier.

    Raises:
        CheckpointError: ``torch.distributed`` is not initialized, or the group
            cannot be created.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, timeout: timedelta | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise CheckpointError("TorchDistributedCoordinator needs an initialized torch.distributed")
        self._owns_group = group is None
        if group is None:
            try:
                group = dist.new_group(backend="gloo", timeout=timeout)
            except (RuntimeError, ValueError) as exc:
                raise CheckpointError("could not create the checkpoint gloo group") from exc
        self._group: dist.ProcessGroup | None = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        """See base class."""
        return self._rank

    @property
    def world_size(self) -> int:
        """See base class."""
        return self._world_size

    def _live_group(self) -> dist.ProcessGroup:
        if self._group is None:
            raise CheckpointError("the checkpoint coordinator is closed")
        return self._group

    def broadcast(self, obj: T) -> T:
        """See base class."""
        group = self._live_group()
        box: list[Any] = [obj]
        try:
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        except (RuntimeError, ValueError) as exc:  # DistBackendError subclasses RuntimeError
            raise CheckpointError(f"checkpoint broadcast failed on rank {self._rank}") from exc
        return box[0]

    def all_gather(self, obj: T) -> list[T]:
        """See base class."""
        group = self._live_group()
        out: list[Any] = [None] * self._world_size
        try:
            dist.all_gather_object(out, obj, group=group)
        except (RuntimeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint all_gather failed on rank {self._rank}") from exc
        return out

    def close(self) -> None:
        """See base class."""
        group, self._group = self._group, None
        # Destroying a group after the default group is gone raises; by then torch
        # has torn it down anyway.
        if group is not None and self._owns_group and dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError) as exc:
                logger.warning("could not destroy the checkpoint gloo group: %s", exc)


def default_coordinator(timeout: timedelta | None = None) -> Coordinator:
    """Return a ``TorchDistributedCoordinator`` if ``torch.distributed`` is initialized, else a single-process one.

    Args:
        timeout: See ``TorchDistributedCoordinator``.
    """
    if dist.is_available() and dist.is_initialized():
        return TorchDistributedCoordinator(timeout=timeout)
    return SingleProcessCoordinator()
