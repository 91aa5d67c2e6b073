"""Deterministic elastic data order: which samples each rank reads at each optimizer step.

This module owns the data order of a run. Each epoch has one global permutation
of the dataset, drawn from ``(seed, epoch)`` alone. The only mutable state is a
global *cursor*: how many samples of the epoch committed optimizer steps have
consumed. Every step consumes the next ``global_batch_size`` samples of the
permutation whatever the world size, splits them across ranks in contiguous
balanced shares, and cuts each share into the same number of micro-batches on
every rank. What a rank reads is therefore a pure function of (seed, epoch,
cursor, rank, world size, global batch size, micro-batch size, dataset length),
so across any sequence of resizes and restarts every sample of an epoch is
trained on exactly once.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from elastictrain.errors import CheckpointMismatchError, ConfigError

__all__ = [
    "ElasticBatchSampler", "ElasticSampler", "MicroBatch", "StepPlan", "WorkerInitFn",
    "epoch_permutation", "seed_for", "share_bounds",
]

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_STATE_VERSION = 1


def _splitmix64(x: int) -> int:
    # A fixed, well-mixed 64-bit hash, so nearby (seed, epoch) pairs give unrelated streams.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    # bool is an int subclass; ``shuffle=True`` passed as a size is a bug, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"{name} must be {bound}, got {value}")
    return value


def _epoch_seed(seed: int, epoch: int) -> int:
    # Hashed rather than ``seed + epoch``, which would give (seed=1, epoch=0)
    # and (seed=0, epoch=1) the same order.
    return _splitmix64((_splitmix64(seed) + epoch) & _MASK64)


def epoch_permutation(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The global order of an epoch: identical on every rank, process and restart.

    ``torch.randperm`` on a CPU generator seeded with
    ``splitmix64((splitmix64(seed) + epoch) mod 2**64)``, so the order is stable
    for the pinned torch version; ``shuffle=False`` gives ``0..num_samples-1``.

    Returns:
        An int64 tensor holding each index in ``range(num_samples)`` once.
    """
    if not shuffle:
        return torch.arange(num_samples, dtype=torch.int64)
    generator = torch.Generator()
    generator.manual_seed(_epoch_seed(seed, epoch))
    return torch.randperm(num_samples, generator=generator)


def share_bounds(step_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous slice ``[start, stop)`` of a step's samples.

    Rank ``r`` gets ``step_size // world_size + (1 if r < step_size % world_size
    else 0)`` samples, so shares differ by at most one and may be empty.
    """
    base, extra = divmod(step_size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def seed_for(seed: int, epoch: int, rank: int, worker_id: int) -> int:
    """A DataLoader worker's RNG seed in ``[0, 2**64)``, from ``(seed, epoch, rank, worker_id)``.

    Torch's default worker seed comes from the main process's RNG, which a
    restart does not reproduce; this one is the same on every restart, differs
    per epoch, rank and worker, and differs from the permutation seed.
    """
    value = _epoch_seed(seed, epoch)
    for part in (rank, worker_id):
        value = _splitmix64((value + part) & _MASK64)
    return value


@dataclass(frozen=True, slots=True)
class WorkerInitFn:
    """A picklable ``worker_init_fn`` seeding ``torch``, ``random`` and ``numpy`` via :func:`seed_for`.

    It captures the epoch and rank when built, so build the DataLoader after
    ``set_epoch``/``set_world`` (e.g. once per epoch and after every resize).
    """

    seed: int
    epoch: int
    rank: int

    def __call__(self, worker_id: int) -> None:
        """Seeds this worker's RNGs."""
        value = seed_for(self.seed, self.epoch, self.rank, worker_id)
        torch.manual_seed(value)
        random.seed(value)
        np.random.seed(value % 2**32)  # numpy's legacy seeding accepts 32 bits only.


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One forward/backward pass of one rank.

    Attributes:
        indices: Dataset indices, in order; empty when the rank's share is too small.
        weight: ``len(indices) / step_size``, this micro-batch's share of the global batch.
            Without DDP averaging, ``sum(weight * mean_loss)`` over all ranks and
            micro-batches is the global-batch mean loss.
        loss_scale: Multiply this micro-batch's mean loss by this before backward
            under DDP's gradient averaging: ``world_size * len(indices) / step_size``.
            DDP divides the summed gradients by ``world_size``, which this undoes.
            ``0.0`` for an empty micro-batch.
    """

    indices: tuple[int, ...]
    weight: float
    loss_scale: float


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one rank reads for one optimizer step.

    Attributes:
        epoch: The epoch.
        step: ``cursor // global_batch_size``, the step's index within the epoch.
        cursor: Samples of the epoch consumed before this step.
        step_size: Samples this step consumes over all ranks (``global_batch_size``,
            or fewer for the last step of an epoch without ``drop_last``).
        rank: The rank this plan is for.
        world_size: The world size it was split for.
        micro_batches: This rank's micro-batches; the same count on every rank.
        pad_index: A valid index to read in place of an empty micro-batch so the rank
            can still run forward and backward; its ``loss_scale`` of 0 cancels it.
    """

    epoch: int
    step: int
    cursor: int
    step_size: int
    rank: int
    world_size: int
    micro_batches: tuple[MicroBatch, ...]
    pad_index: int

    @property
    def indices(self) -> list[int]:
        """This rank's indices for the step, micro-batches concatenated."""
        return [index for micro in self.micro_batches for index in micro.indices]

    @property
    def next_cursor(self) -> int:
        """The cursor once this step commits."""
        return self.cursor + self.step_size


def _steps_left(num_samples: int, cursor: int, global_batch_size: int, drop_last: bool) -> int:
    left = num_samples - cursor
    return left // global_batch_size if drop_last else -(-left // global_batch_size)


def _micro_count(step_size: int, world_size: int, micro_batch_size: int | None) -> int:
    # Every rank derives the count from the *largest* share, so all ranks run
    # the same number of backward passes, as DDP's collectives require.
    largest = -(-step_size // world_size)
    return 1 if micro_batch_size is None else max(1, -(-largest // micro_batch_size))


def _plan(perm: torch.Tensor, epoch: int, cursor: int, global_batch_size: int,
          micro_batch_size: int | None, rank: int, world_size: int) -> StepPlan:
    step_size = min(global_batch_size, perm.numel() - cursor)
    start, stop = share_bounds(step_size, rank, world_size)
    share = perm[cursor + start:cursor + stop].tolist()
    count = _micro_count(step_size, world_size, micro_batch_size)
    micro_batches = []
    for j in range(count):
        # Balanced rather than greedy cuts: a smaller share gets smaller
        # micro-batches, and empty ones only when it has fewer samples than count.
        lo, hi = share_bounds(len(share), j, count)
        size = hi - lo
        micro_batches.append(MicroBatch(indices=tuple(share[lo:hi]), weight=size / step_size,
                                        loss_scale=world_size * size / step_size))
    return StepPlan(epoch=epoch, step=cursor // global_batch_size, cursor=cursor,
                    step_size=step_size, rank=rank, world_size=world_size,
                    micro_batches=tuple(micro_batches), pad_index=int(perm[cursor]))


def _plans(perm: torch.Tensor, epoch: int, cursor: int, steps: int, global_batch_size: int,
           micro_batch_size: int | None, rank: int, world_size: int) -> Iterator[StepPlan]:
    # Everything arrives as arguments, bound when the generator is created: the
    # body runs lazily, after commits or resizes that must not leak into it.
    for _ in range(steps):
        plan = _plan(perm, epoch, cursor, global_batch_size, micro_batch_size, rank, world_size)
        cursor = plan.next_cursor
        yield plan


def _default_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    values = []
    for name, default in (("RANK", 0), ("WORLD_SIZE", 1)):
        raw = os.environ.get(name)
        try:
            values.append(default if raw is None else int(raw))
        except ValueError as exc:
            raise ConfigError(f"environment variable {name}={raw!r} is not an int") from exc
    return values[0], values[1]


class ElasticSampler(Sampler[int]):
    """Yields this rank's indices, step by step, from the committed cursor.

    The cursor advances only on :meth:`commit_step`, never by iterating, so a
    DataLoader prefetching ahead (``num_workers > 0``) loses nothing if the
    step fails. Each ``iter()`` snapshots the cursor, epoch and world: commits
    made while an iterator is live do not change what it yields.

    Args:
        dataset: The dataset (only its ``len`` is used) or its length.
        global_batch_size: Samples per optimizer step over all ranks, ``G``.
        micro_batch_size: Most samples per forward pass; None means one
            micro-batch per step per rank.
        seed: Run seed, in ``[0, 2**64)``.
        shuffle: If False, every epoch reads the dataset in index order.
        drop_last: If True, an epoch ends before its final ``len % G`` samples;
            if False, its last step consumes them (a step smaller than ``G``).
        rank: This rank; default from ``torch.distributed`` if initialized, else env ``RANK``, else 0.
        world_size: Default from ``torch.distributed``, else env ``WORLD_SIZE``, else 1.

    Raises:
        ConfigError: An argument (or ``RANK``/``WORLD_SIZE``) has a bad value.
    """

    def __init__(self, dataset: Sized | int, *, global_batch_size: int,
                 micro_batch_size: int | None = None, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False, rank: int | None = None,
                 world_size: int | None = None) -> None:
        super().__init__()
        try:
            length = dataset if isinstance(dataset, int) else len(dataset)
        except TypeError as exc:
            raise ConfigError(f"dataset must be Sized or an int, got {type(dataset).__name__}") from exc
        # Configuration: public for reading; changing it mid-run breaks exactly-once.
        self.num_samples: int = _check_int("dataset length", length, 1)
        self.global_batch_size: int = _check_int("global_batch_size", global_batch_size, 1)
        if micro_batch_size is not None:
            _check_int("micro_batch_size", micro_batch_size, 1)
        self.micro_batch_size: int | None = micro_batch_size
        self.shuffle: bool = bool(shuffle)
        self.drop_last: bool = bool(drop_last)
        if self.drop_last and self.global_batch_size > self.num_samples:
            raise ConfigError(f"with drop_last, a global batch of {self.global_batch_size} is more than the "
                              f"dataset's {self.num_samples} samples: no step would ever run")
        self._seed = _check_int("seed", seed, 0, _MASK64)
        self._epoch, self._cursor = 0, 0
        self._perm_cache: tuple[tuple[int, int, int, bool], torch.Tensor] | None = None
        self._rank, self._world_size = 0, 1
        self.set_world(rank, world_size)

    # State: read-only here, changed only through the methods below.
    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._epoch

    @property
    def cursor(self) -> int:
        """Samples of this epoch consumed by committed optimizer steps."""
        return self._cursor

    @property
    def seed(self) -> int:
        """The run seed (a checkpoint's seed replaces the constructor's)."""
        return self._seed

    @property
    def rank(self) -> int:
        """This rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The world size the remaining steps are split for."""
        return self._world_size

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in a whole epoch."""
        return _steps_left(self.num_samples, 0, self.global_batch_size, self.drop_last)

    @property
    def remaining_steps(self) -> int:
        """Optimizer steps left in this epoch from the committed cursor."""
        return _steps_left(self.num_samples, self._cursor, self.global_batch_size, self.drop_last)

    @property
    def epoch_done(self) -> bool:
        """True once the committed cursor has reached the end of the epoch."""
        return self.remaining_steps == 0

    def _perm(self) -> torch.Tensor:
        # A memo of a pure function, not state: it is keyed by everything it depends on.
        key = (self.num_samples, self._seed, self._epoch, self.shuffle)
        if self._perm_cache is None or self._perm_cache[0] != key:
            self._perm_cache = (key, epoch_permutation(*key))
        return self._perm_cache[1]

    def set_epoch(self, epoch: int) -> None:
        """Moves to ``epoch`` with the cursor at 0.

        Calling it with the current epoch keeps the cursor, so the usual
        ``for epoch in range(start, n): sampler.set_epoch(epoch)`` loop resumes
        mid-epoch after :meth:`load_state_dict` instead of repeating samples.

        Raises:
            ConfigError: ``epoch`` is not an int ``>= 0``.
        """
        _check_int("epoch", epoch, 0)
        if epoch != self._epoch:
            self._epoch, self._cursor = epoch, 0

    def set_world(self, rank: int | None = None, world_size: int | None = None) -> None:
        """Reshards the rest of the epoch for a new rank and world size (after a resize).

        None re-detects a value, as the constructor does.

        Raises:
            ConfigError: ``world_size < 1`` or ``rank`` outside ``[0, world_size)``.
        """
        if rank is None or world_size is None:
            default_rank, default_world = _default_world()
            rank = default_rank if rank is None else rank
            world_size = default_world if world_size is None else world_size
        _check_int("world_size", world_size, 1)
        _check_int("rank", rank, 0, world_size - 1)
        if (rank, world_size) != (self._rank, self._world_size):
            logger.info("sampler resharded to rank %s of %s at epoch %s cursor %s",
                        rank, world_size, self._epoch, self._cursor)
        self._rank, self._world_size = rank, world_size

    def plan_step(self, cursor: int | None = None) -> StepPlan:
        """This rank's plan for the step that starts at ``cursor`` (default: the committed one).

        Raises:
            ConfigError: ``cursor`` is out of range or at the end of the epoch.
        """
        cursor = self._cursor if cursor is None else _check_int("cursor", cursor, 0, self.num_samples)
        if _steps_left(self.num_samples, cursor, self.global_batch_size, self.drop_last) == 0:
            raise ConfigError(f"cursor={cursor} is at the end of epoch {self._epoch}; call set_epoch()")
        return _plan(self._perm(), self._epoch, cursor, self.global_batch_size,
                     self.micro_batch_size, self._rank, self._world_size)

    def iter_steps(self) -> Iterator[StepPlan]:
        """Plans of the remaining steps of this epoch, from the committed cursor.

        Snapshots the state when called; it does not advance the cursor.
        """
        return _plans(self._perm(), self._epoch, self._cursor, self.remaining_steps,
                      self.global_batch_size, self.micro_batch_size, self._rank, self._world_size)

    def commit_step(self, plan: StepPlan | None = None) -> int:
        """Advances the cursor past the step at it; call after ``optimizer.step()``, on every rank.

        Args:
            plan: If given, the plan that was trained; checked to start at the
                committed cursor, which catches a step committed twice.

        Returns:
            The new cursor.

        Raises:
            ConfigError: The epoch is done, or ``plan`` is not the step at the cursor.
        """
        if self.epoch_done:
            raise ConfigError(f"commit_step() at cursor={self._cursor}, but epoch {self._epoch} "
                              "is done; call set_epoch()")
        if plan is not None and (plan.epoch, plan.cursor) != (self._epoch, self._cursor):
            raise ConfigError(f"plan is for epoch {plan.epoch} cursor {plan.cursor}, but the committed "
                              f"state is epoch {self._epoch} cursor {self._cursor}")
        self._cursor += min(self.global_batch_size, self.num_samples - self._cursor)
        return self._cursor

    def state_dict(self) -> dict[str, int]:
        """The resumable state as plain ints (safe for ``torch.load(weights_only=True)``)."""
        return {"version": _STATE_VERSION, "seed": self._seed, "epoch": self._epoch,
                "cursor": self._cursor, "num_samples": self.num_samples,
                "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores epoch, cursor and seed from :meth:`state_dict`; keeps rank and world.

        The checkpoint's seed wins over the constructor's, since the cursor
        only means something in the permutation it was counted in.

        Raises:
            ConfigError: ``state`` is malformed.
            CheckpointMismatchError: It was saved for another dataset length or shuffle setting.
        """
        missing = {"version", "seed", "epoch", "cursor", "num_samples", "shuffle"} - set(state)
        if missing:
            raise ConfigError(f"sampler state is missing {sorted(missing)}")
        _check_int("state version", state["version"], _STATE_VERSION, _STATE_VERSION)
        num_samples = _check_int("state num_samples", state["num_samples"], 1)
        if num_samples != self.num_samples:
            raise CheckpointMismatchError(f"sampler state is for a dataset of {num_samples} samples, "
                                          f"but this one has {self.num_samples}")
        if _check_int("state shuffle", state["shuffle"], 0, 1) != int(self.shuffle):
            raise CheckpointMismatchError(f"sampler state has shuffle={bool(state['shuffle'])}, "
                                          f"but this sampler has shuffle={self.shuffle}")
        seed = _check_int("state seed", state["seed"], 0, _MASK64)
        epoch = _check_int("state epoch", state["epoch"], 0)
        cursor = _check_int("state cursor", state["cursor"], 0, num_samples)
        if seed != self._seed:
            logger.warning("sampler seed %s replaced by the checkpoint's seed %s", self._seed, seed)
        self._seed, self._epoch, self._cursor = seed, epoch, cursor

    def worker_init_fn(self) -> WorkerInitFn:
        """A DataLoader ``worker_init_fn`` for the current seed, epoch and rank."""
        return WorkerInitFn(seed=self._seed, epoch=self._epoch, rank=self._rank)

    def __iter__(self) -> Iterator[int]:
        """This rank's indices for the rest of the epoch, in step order (no padding)."""
        plans = self.iter_steps()
        return (index for plan in plans for micro in plan.micro_batches for index in micro.indices)

    def __len__(self) -> int:
        """How many indices ``iter()`` yields from the committed cursor."""
        full, tail = divmod(self.num_samples - self._cursor, self.global_batch_size)
        tail = 0 if self.drop_last else tail
        start, stop = share_bounds(self.global_batch_size, self._rank, self._world_size)
        tail_start, tail_stop = share_bounds(tail, self._rank, self._world_size)
        return full * (stop - start) + tail_stop - tail_start


class ElasticBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches in order, for ``DataLoader(batch_sampler=...)``.

    It shares ``sampler``'s state: commit steps and set epochs on the sampler.
    The k-th batch it yields is the k-th micro-batch of ``sampler.iter_steps()``
    started at the same cursor, so a loop can zip the two to get loss scales.

    Args:
        sampler: The sampler that holds the cursor.
        pad_empty: If True (default), an empty micro-batch is yielded as
            ``[plan.pad_index]``, to train on with its ``loss_scale`` of 0:
            ``default_collate`` cannot collate an empty list, and under DDP the
            rank must still run forward and backward. If False, it is ``[]``.
    """

    def __init__(self, sampler: ElasticSampler, *, pad_empty: bool = True) -> None:
        super().__init__()
        if not isinstance(sampler, ElasticSampler):
            raise ConfigError(f"sampler must be an ElasticSampler, got {type(sampler).__name__}")
        self.sampler = sampler
        self.pad_empty = pad_empty

    def __iter__(self) -> Iterator[list[int]]:
        """See base class."""
        plans = self.sampler.iter_steps()
        return (list(micro.indices) if micro.indices or not self.pad_empty else [plan.pad_index]
                for plan in plans for micro in plan.micro_batches)

    def __len__(self) -> int:
        """Micro-batches left in this epoch from the committed cursor."""
        s = self.sampler
        full, tail = divmod(s.num_samples - s.cursor, s.global_batch_size)
        total = full * _micro_count(s.global_batch_size, s.world_size, s.micro_batch_size)
        if tail and not s.drop_last:
            total += _micro_count(tail, s.world_size, s.micro_batch_size)
        return total
