"""The training session: a plain DDP loop that survives joins, leaves and crashes.

:class:`Session` puts the pieces together in the order that makes a restart
indistinguishable from an uninterrupted run:

1. form the process group from the launcher's environment (:mod:`~elastictrain.process_group`);
2. move the model to the worker's device;
3. restore the newest committed checkpoint (model, optimizer, scheduler,
   GradScaler, sampler cursor, each rank's RNG states, user extras);
4. wrap the model in DDP, which broadcasts rank 0's parameters and buffers:
   every rank starts identical, fresh or restored;
5. yield optimizer steps from the :class:`~elastictrain.sampler.ElasticSampler`'s
   plans: a fixed global batch, split into micro-batches whose loss scales make
   the accumulated gradient the global-batch mean whatever the world size;
6. after each step: unscale, clip, optimizer and scheduler step, commit the
   sampler, hooks, a checkpoint every ``checkpoint_every`` steps;
7. on exit: a final checkpoint, and the process group destroyed on every path.

A restart (a node joined or left, or a worker crashed) is a new process that
runs all of this again and carries on from the last checkpoint.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import logging
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from elastictrain import events
from elastictrain import process_group as pg
from elastictrain.accumulation import accumulate
from elastictrain.checkpoint import CheckpointManager, RestoreInfo, TorchDistributedCoordinator
from elastictrain.errors import ConfigError, SessionError
from elastictrain.hooks import HookDispatcher
from elastictrain.precision import PRECISIONS, MixedPrecision
from elastictrain.progress import ProgressHook, progress_wanted
from elastictrain.rank_logging import RankLoggerAdapter, get_logger, setup_logging
from elastictrain.sampler import ElasticBatchSampler, ElasticSampler, MicroBatch, StepPlan
from elastictrain.worker import WorkerContext

__all__ = ["MicroStep", "Session", "SessionConfig", "Step"]

_RESERVED = ("model", "optimizer", "scheduler", "scaler", "sampler", "session")
_PROGRESS_VERSION = 1


def _positive(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SessionConfig:
    """How a :class:`Session` trains. Every field can also be passed to ``Session(...)`` directly."""

    global_batch_size: int
    """Samples per optimizer step over all ranks; constant when the world size changes."""

    micro_batch_size: int | None = None
    """Most samples per forward pass on a rank; the rest is gradient accumulation.
    None: one micro-batch per rank per step (its share of the global batch)."""

    epochs: int = 1
    """Epochs to train; a restart continues the epoch it was in."""

    max_steps: int | None = None
    """Stop after this many optimizer steps in total (across restarts), even mid-epoch."""

    seed: int = 0
    """Seeds the data order, each rank's RNGs on a fresh start, and DataLoader workers."""

    shuffle: bool = True
    """Shuffle the dataset each epoch (a permutation drawn from ``seed`` and the epoch)."""

    drop_last: bool = False
    """Skip an epoch's last ``len % global_batch_size`` samples instead of a short last step."""

    checkpoint_dir: str | None = None
    """Where checkpoints go, on storage every node shares. None: no checkpoints (a restart starts over)."""

    checkpoint_every: int | None = None
    """Save after every this many optimizer steps; None: only at the end.
    A failure loses at most this many steps."""

    keep_last: int = 3
    """Committed checkpoints to keep."""

    async_save: bool = False
    """Write checkpoints on a background thread; training waits only for the copy to CPU memory."""

    overlap_save: bool = False
    """With ``async_save``: make that copy in the background too, while the next step computes; its
    optimizer step waits for the copy if it is not done. Training code must then not change
    parameters or buffers in place outside the optimizer and the model's forward (see
    ``CheckpointManager(overlap=True)``; ``session.checkpoints.wait_snapshot()`` makes it safe)."""

    precision: str = "auto"
    """``"auto"`` (bf16 or fp16 on GPU, fp32 on CPU), ``"fp32"``, ``"bf16"`` or ``"fp16"`` (with a GradScaler)."""

    grad_clip_norm: float | None = None
    """Clip the total gradient 2-norm to this (after unscaling); None: no clipping."""

    num_workers: int = 0
    """DataLoader worker processes per rank."""

    pin_memory: bool | None = None
    """DataLoader ``pin_memory``; None: on when training on CUDA."""

    backend: str | None = None
    """Process-group backend; None: ``ELASTICTRAIN_BACKEND``, else NCCL on GPU, gloo on CPU."""

    timeout: timedelta | None = None
    """Collective timeout (seconds are accepted); None: ``ELASTICTRAIN_PG_TIMEOUT``, else 60 s."""

    device: str | None = None
    """Overrides the device (default: this local rank's GPU, else the CPU)."""

    sync_loss: bool = False
    """All-reduce each step's loss so hooks and logs see the global-batch mean (one small
    collective per step); otherwise they see this rank's mean."""

    log_every: int | None = 10
    """Log loss and throughput on rank 0 every this many steps; None: never."""

    ddp_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of ``DistributedDataParallel`` (e.g. ``find_unused_parameters``)."""

    def __post_init__(self) -> None:
        _positive("global_batch_size", self.global_batch_size)
        _positive("micro_batch_size", self.micro_batch_size, allow_none=True)
        _positive("epochs", self.epochs)
        _positive("max_steps", self.max_steps, allow_none=True)
        _positive("checkpoint_every", self.checkpoint_every, allow_none=True)
        _positive("keep_last", self.keep_last)
        _positive("log_every", self.log_every, allow_none=True)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ConfigError(f"seed must be an int in [0, 2**64), got {self.seed!r}")
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise ConfigError(f"num_workers must be a non-negative int, got {self.num_workers!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.grad_clip_norm is not None and not (isinstance(self.grad_clip_norm, (int, float))
                                                    and self.grad_clip_norm > 0):
            raise ConfigError(f"grad_clip_norm must be a positive number or None, got {self.grad_clip_norm!r}")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ConfigError("checkpoint_every needs a checkpoint_dir")
        if self.overlap_save and not self.async_save:
            raise ConfigError("overlap_save needs async_save=True")
        if self.timeout is not None:
            object.__setattr__(self, "timeout", pg.resolve_timeout(self.timeout))
        if not isinstance(self.ddp_kwargs, Mapping):
            raise ConfigError(f"ddp_kwargs must be a mapping, got {type(self.ddp_kwargs).__name__}")


def _to_device(obj: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, dict):
        return type(obj)((k, _to_device(v, device, non_blocking)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_to_device(v, device, non_blocking) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device, non_blocking) for v in obj)
    return obj


def _rank_seed(seed: int, rank: int) -> int:
    digest = hashlib.sha256(f"elastictrain-session:{seed}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # < 2**63: every RNG accepts it


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)  # also every CUDA device
    random.seed(seed)
    np.random.seed(seed % 2**32)


_END = object()


class _PlanFeed(ElasticBatchSampler):
    """``ElasticBatchSampler`` that also queues each plan for the session, so it is computed once.

    The DataLoader pulls index lists from it (ahead of time with workers); the
    plan of a step is queued before its first micro-batch is handed out, so it
    is there once the session has fetched that micro-batch.
    """

    def __init__(self, sampler: ElasticSampler) -> None:
        super().__init__(sampler, pad_empty=True)
        self.plans: collections.deque[StepPlan] = collections.deque()

    def __iter__(self) -> Iterator[list[int]]:
        """See base class."""
        for plan in self.sampler.iter_steps():
            self.plans.append(plan)
            for micro in plan.micro_batches:
                yield list(micro.indices) if micro.indices else [plan.pad_index]


class MicroStep:
    """One micro-batch of a step on this rank: its data (on the device) and how to weight its loss.

    Attributes:
        batch: The collated micro-batch, already on the session's device.
        index: Position in the step, from 0.
        is_last: True for the micro-batch whose backward all-reduces the gradients.
        loss_scale: What :meth:`backward` multiplies the loss by (see :class:`~elastictrain.sampler.MicroBatch`).
        weight: This micro-batch's share of the global batch, ``len / step_size``.
        is_padding: True when this rank's share was empty and ``batch`` is a stand-in
            sample whose loss counts for nothing (``loss_scale == 0``).
    """

    __slots__ = ("_step", "batch", "index", "is_last", "is_padding", "loss_scale", "weight", "_micro")

    def __init__(self, step: Step, micro: MicroBatch, batch: Any, index: int, is_last: bool) -> None:
        self._step, self._micro = step, micro
        self.batch, self.index, self.is_last = batch, index, is_last
        self.loss_scale, self.weight = micro.loss_scale, micro.weight
        self.is_padding = not micro.indices

    @property
    def indices(self) -> tuple[int, ...]:
        """Dataset indices of this micro-batch (empty when padding)."""
        return self._micro.indices

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate this micro-batch's *mean* loss, scaled for the global batch.

        Multiplies by :attr:`loss_scale` (and the GradScaler's scale in fp16) and
        runs backward outside autocast. Call it once per micro-batch.

        Raises:
            ConfigError: ``loss`` is not a scalar tensor.
        """
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ConfigError("backward() takes the micro-batch's mean loss, a scalar tensor")
        # A scale of exactly 1 (even shares, one micro-batch) needs no extra op in the graph.
        scaled = loss if self.loss_scale == 1.0 else loss * self.loss_scale
        self._step._session._precision.backward(scaled)
        self._step._record(self, loss)


class Step:
    """One optimizer step: iterate over it to get its :class:`MicroStep` s.

    Each micro-batch but the last runs inside DDP's ``no_sync()`` and all of
    them inside autocast; the optimizer step, sampler commit, hooks and
    checkpointing happen when the session's ``steps()`` loop moves on.

    Attributes:
        number: This step's number, from 1 (the first step of the run).
        epoch: The epoch it belongs to.
        plan: This rank's :class:`~elastictrain.sampler.StepPlan`.
        loss: The step's mean loss once it is applied, if hooks, logging or
            ``sync_loss`` asked for it (see ``SessionConfig.sync_loss``); else None.
    """

    def __init__(self, session: Session, plan: StepPlan, batches: Iterator[Any], number: int) -> None:
        self._session, self._batches = session, batches
        self.plan, self.number, self.epoch = plan, number, plan.epoch
        self._iterated = False
        self._done = 0  # micro-batches whose backward ran
        self._last_backward = False
        self._losses: list[tuple[torch.Tensor, float]] = []  # (detached mean loss, weight); summed only if needed
        self.loss: float | None = None

    def __len__(self) -> int:
        """Micro-batches in this step (the same on every rank)."""
        return len(self.plan.micro_batches)

    @property
    def step_size(self) -> int:
        """Samples this step consumes over all ranks."""
        return self.plan.step_size

    def __iter__(self) -> Iterator[MicroStep]:
        """The micro-batches, each with its DDP sync and autocast context active while it is current."""
        if self._iterated:
            raise SessionError(f"step {self.number}'s micro-batches can be iterated only once")
        self._iterated = True
        session = self._session
        count = len(self.plan.micro_batches)
        for index, micro in enumerate(accumulate(session.model, self.plan.micro_batches)):
            try:
                batch = next(self._batches)
            except StopIteration:
                raise SessionError(f"the DataLoader ran out in step {self.number}") from None
            session._forwards = 0
            with session._precision.autocast():
                yield MicroStep(self, micro, session.to_device(batch), index, index == count - 1)
            if index == count - 1 and session._ddp is not None and session._forwards == 0:
                raise SessionError(
                    f"step {self.number}: the last micro-batch ran no forward pass through session.model, "
                    "so DDP did not synchronize gradients; call session.model, not the unwrapped module"
                )

    def _record(self, micro: MicroStep, loss: torch.Tensor) -> None:
        self._done += 1
        if micro.is_last:
            self._last_backward = True
        if micro.weight:
            self._losses.append((loss.detach(), micro.weight))

    def _check_complete(self) -> None:
        if not self._last_backward:
            raise SessionError(
                f"step {self.number}: {self._done} of {len(self)} micro-batches ran backward(); iterate over "
                "every micro-batch of a step and call micro.backward(loss) (the last one synchronizes gradients)"
            )


class Session:
    """Train a model elastically: a context manager yielding optimizer steps.

    Example::

        with elastictrain.Session(model, optimizer, dataset, global_batch_size=64,
                                  micro_batch_size=16, checkpoint_dir="/shared/ckpt",
                                  checkpoint_every=50, epochs=3) as session:
            for step in session.steps():
                for micro in step:
                    x, y = micro.batch
                    micro.backward(loss_fn(session.model(x), y))

    ``session.model`` is the DDP-wrapped model: run the forward through it.

    Args:
        model: The model (unwrapped); moved to the worker's device.
        optimizer: Its optimizer, built on ``model``'s parameters.
        dataset: A map-style dataset (``len`` and ``__getitem__``).
        config: A :class:`SessionConfig`; or pass its fields as keyword arguments.
        scheduler: A learning-rate scheduler, stepped after every optimizer step.
        hooks: :class:`~elastictrain.hooks.Hooks` objects, called in order.
        extra_state: More objects to checkpoint by name: anything with
            ``state_dict()``/``load_state_dict()``, or dicts of plain data
            (updated in place on restore).
        collate_fn: The DataLoader's ``collate_fn``.
        process_group: Train over this existing group instead of forming one
            from the environment (it is not destroyed). Checkpoints then
            coordinate over it too, so ``async_save`` is refused.
        context: This worker's context; default :meth:`WorkerContext.from_env`.
        **options: Fields of :class:`SessionConfig`.

    Raises:
        ConfigError: A bad option, or both ``config`` and options.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Sized,
        config: SessionConfig | None = None,
        /,
        *,
        scheduler: Any | None = None,
        hooks: Sequence[object] = (),
        extra_state: Mapping[str, Any] | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        process_group: dist.ProcessGroup | None = None,
        context: WorkerContext | None = None,
        **options: Any,
    ) -> None:
        if config is not None and options:
            raise ConfigError(f"pass a SessionConfig or options, not both (got {sorted(options)})")
        if config is None:
            try:
                config = SessionConfig(**options)
            except TypeError as exc:
                raise ConfigError(f"bad Session option: {exc}") from None
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(model, DistributedDataParallel):
            raise ConfigError("pass the unwrapped model; the session wraps it in DDP itself")
        extra = dict(extra_state or {})
        clash = sorted(set(extra) & set(_RESERVED))
        if clash:
            raise ConfigError(f"extra_state names {clash} are reserved ({', '.join(_RESERVED)})")
        if process_group is not None and config.async_save and config.checkpoint_dir:
            raise ConfigError("async_save with an explicit process_group is not supported")
        self.config = config
        self.module = model
        self.optimizer = optimizer
        self.dataset = dataset
        self.scheduler = scheduler
        self.hooks = HookDispatcher(hooks)
        self._extra = extra
        self._collate_fn = collate_fn
        self._group = process_group

        self.context: WorkerContext = context or WorkerContext.from_env()
        self.log: RankLoggerAdapter = get_logger(__name__, self.context)
        self.placement: pg.Placement | None = None
        self.sampler: ElasticSampler | None = None
        self.checkpoints: CheckpointManager | None = None
        self.restored: RestoreInfo | None = None
        self._precision = MixedPrecision("fp32")
        self._ddp: DistributedDataParallel | None = None
        self._progress: dict[str, int] = {"version": _PROGRESS_VERSION, "step": 0, "world_size": 1}
        self._step = 0
        self._saved_step: int | None = None
        self._forwards = 0
        self._entered = False
        self._closed = False
        self._clock = time.perf_counter()

    # --- properties ----------------------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """The model to run forward passes through: DDP-wrapped when distributed."""
        return self._ddp if self._ddp is not None else self.module

    @property
    def device(self) -> torch.device:
        """Where the model and batches live."""
        if self.placement is None:
            raise SessionError("the device is known once the session has started (`with Session(...)`)")
        return self.placement.device

    @property
    def rank(self) -> int:
        """This worker's rank in the training group."""
        return self.context.rank

    @property
    def world_size(self) -> int:
        """Workers in the training group."""
        return self.context.world_size

    @property
    def step(self) -> int:
        """Optimizer steps completed since the run began (a restored checkpoint's included)."""
        return self._step

    @property
    def epoch(self) -> int:
        """The current epoch."""
        if self.sampler is None:
            raise SessionError("the epoch is known once the session has started (`with Session(...)`)")
        return self.sampler.epoch

    @property
    def precision(self) -> MixedPrecision:
        """The autocast/GradScaler helper in use."""
        return self._precision

    # --- life cycle ----------------------------------------------------------------------------

    def __enter__(self) -> Session:
        if self._entered:
            raise SessionError("a Session can be entered only once")
        self._entered = True
        try:
            self._start()
        except BaseException as error:
            self._fail(error)
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc is not None:
            self._fail(exc)
            return
        try:
            self._finish_run()
        except BaseException as error:
            self._fail(error)
            raise
        self._teardown()

    def _start(self) -> None:
        config = self.config
        if not logging.getLogger().handlers and not logging.getLogger("elastictrain").handlers:
            # Nobody configured logging in this worker: show ours (prefixed, rank 0's info only).
            setup_logging(self.context, logger="elastictrain")
            logging.getLogger("elastictrain").propagate = False
        self.hooks.dispatch("on_start", context=self.context)

        if self._group is not None:
            rank, world = dist.get_rank(self._group), dist.get_world_size(self._group)
            self.context = dataclasses.replace(self.context, rank=rank, world_size=world)
            self.log = get_logger(__name__, self.context)
            device = torch.device(config.device) if config.device else pg.device_for(
                self.context, dist.get_backend(self._group))
            self.placement = pg.Placement(device, dist.get_backend(self._group), pg.resolve_timeout(config.timeout),
                                          rank, world, owned=False)
        else:
            self.placement = pg.init_process_group(self.context, backend=config.backend, timeout=config.timeout,
                                                   device=config.device)
            if self.placement.distributed and (self.placement.rank, self.placement.world_size) != (
                    self.context.rank, self.context.world_size):
                # An existing group (someone else's init) defines the world.
                self.context = dataclasses.replace(self.context, rank=self.placement.rank,
                                                   world_size=self.placement.world_size)
                self.log = get_logger(__name__, self.context)
        self.hooks.dispatch("on_rendezvous", rank=self.context.rank, world_size=self.context.world_size,
                            restart_count=self.context.restart_count)

        device = self.placement.device
        self.module.to(device)
        self._precision = MixedPrecision(config.precision, device)
        self.sampler = ElasticSampler(
            self.dataset, global_batch_size=config.global_batch_size, micro_batch_size=config.micro_batch_size,
            seed=config.seed, shuffle=config.shuffle, drop_last=config.drop_last,
            rank=self.context.rank, world_size=self.context.world_size,
        )
        if progress_wanted(self.context.rank):
            total = config.max_steps or config.epochs * self.sampler.steps_per_epoch
            progress = ProgressHook(total)
            progress.on_rendezvous(rank=self.context.rank, world_size=self.context.world_size,
                                   restart_count=self.context.restart_count)
            self.hooks.add(progress)
        self._progress["world_size"] = self.context.world_size
        if config.checkpoint_dir is not None:
            coordinator = TorchDistributedCoordinator(self._group) if self._group is not None else None
            self.checkpoints = CheckpointManager(
                config.checkpoint_dir, keep_last=config.keep_last, async_save=config.async_save,
                overlap=config.overlap_save, coordinator=coordinator, timeout=self.placement.timeout,
            )
            self._restore()
        if self.restored is None:
            # Distinct, reproducible streams per rank (dropout, augmentation); a
            # restore brings back the saved ones instead.
            _seed_everything(_rank_seed(config.seed, self.context.rank))

        if self.placement.distributed:
            kwargs = dict(config.ddp_kwargs)
            if device.type == "cuda":
                kwargs.setdefault("device_ids", [device.index])
                kwargs.setdefault("output_device", device.index)
            if self._group is not None:
                kwargs["process_group"] = self._group
            # DDP broadcasts rank 0's parameters and buffers here: identical
            # replicas whether they were initialized or restored.
            self._ddp = DistributedDataParallel(self.module, **kwargs)
            self._ddp.register_forward_pre_hook(self._count_forward)
        self.log.info(
            "session started: world size %d, device %s, backend %s, precision %s, global batch %d "
            "(%d micro-batch(es) per step), %s",
            self.context.world_size, device, self.placement.backend or "none", self._precision.precision,
            config.global_batch_size, self._micro_count(),
            f"resumed at step {self._step}" if self.restored else "fresh start",
        )

    def _count_forward(self, *_: Any) -> None:
        self._forwards += 1

    def _micro_count(self) -> int:
        sampler = self.sampler
        if sampler is None or sampler.epoch_done:
            return 0
        return len(sampler.plan_step().micro_batches)

    def _state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self.module, "optimizer": self.optimizer, "sampler": self.sampler,
                                 "session": self._progress}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler
        if self._precision.scaler is not None:
            state["scaler"] = self._precision.scaler
        state.update(self._extra)
        return state

    def _restore(self) -> None:
        assert self.checkpoints is not None  # noqa: S101 - private invariant
        info = self.checkpoints.restore(self._state())
        if info is None:
            return
        self.restored = info
        self._step = self._saved_step = info.step
        self._progress["world_size"] = self.context.world_size
        self.hooks.dispatch("on_restore", step=info.step, path=info.path)
        if self.context.rank == 0:
            events.emit("restore", step=info.step, path=info.path, saved_world_size=info.world_size,
                        world_size=self.context.world_size)
        if info.world_size != self.context.world_size:
            self.log.info("world size changed %d -> %d; global batch stays %d", info.world_size,
                          self.context.world_size, self.config.global_batch_size)
            self.hooks.dispatch("on_world_change", old_world_size=info.world_size,
                                new_world_size=self.context.world_size)

    def _finish_run(self) -> None:
        if self.checkpoints is not None:
            if self._saved_step != self._step:
                self.save()
            self.checkpoints.close()
        self.log.info("training finished after %d steps", self._step)
        self.hooks.dispatch("on_end", step=self._step)

    def _fail(self, error: BaseException) -> None:
        if self._closed:
            return
        self.log.error("training failed at step %d: %s: %s", self._step, type(error).__name__, error)
        self.hooks.dispatch("on_failure", error=error)
        if self.checkpoints is not None:
            try:
                self.checkpoints.close()
            except Exception as exc:  # noqa: BLE001 - the original error is what matters
                self.log.warning("closing the checkpoint manager after a failure: %s", exc)
        self._teardown()

    def _teardown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ddp = None
        if self.placement is not None and self.placement.owned:
            pg.destroy_process_group()

    def _require_entered(self) -> None:
        if not self._entered or self.placement is None:
            raise SessionError("use the Session inside `with Session(...) as session:`")
        if self._closed:
            raise SessionError("the session is closed")

    # --- training ------------------------------------------------------------------------------

    def to_device(self, obj: Any) -> Any:
        """``obj`` (a tensor, or lists/tuples/dicts of them) moved to :attr:`device`."""
        device = self.device
        if device.type == "cpu":
            return obj
        return _to_device(obj, device, non_blocking=self._pin_memory())

    def _pin_memory(self) -> bool:
        pin = self.config.pin_memory
        return self.device.type == "cuda" if pin is None else pin

    def _loader(self, feed: _PlanFeed) -> DataLoader:  # type: ignore[type-arg]
        sampler = self.sampler
        assert sampler is not None  # noqa: S101 - private invariant
        workers = self.config.num_workers
        return DataLoader(
            self.dataset,  # type: ignore[arg-type]
            batch_sampler=feed,
            num_workers=workers,
            collate_fn=self._collate_fn,
            pin_memory=self._pin_memory(),
            worker_init_fn=sampler.worker_init_fn() if workers else None,
            # Its own generator: otherwise each iter() draws from the global RNG,
            # and a run resumed mid-epoch would draw at another point than an
            # uninterrupted one, shifting every later dropout mask.
            generator=torch.Generator().manual_seed(_rank_seed(self.config.seed, self.context.rank)),
        )

    def _stopped(self) -> bool:
        sampler = self.sampler
        assert sampler is not None  # noqa: S101 - private invariant
        if self.config.max_steps is not None and self._step >= self.config.max_steps:
            return True
        return sampler.epoch >= self.config.epochs or (sampler.epoch_done and sampler.epoch + 1 >= self.config.epochs)

    def steps(self) -> Iterator[Step]:
        """Yield the remaining optimizer steps of the run, from the restored position.

        Each step is applied (optimizer step, sampler commit, hooks, periodic
        checkpoint) when the loop asks for the next one, or when it ends.
        Leaving the loop early (``break``) abandons the current step: it is not
        applied, and the final checkpoint holds the steps before it.

        Raises:
            SessionError: Used outside ``with``, or a step left incomplete.
        """
        self._require_entered()
        sampler = self.sampler
        assert sampler is not None  # noqa: S101 - private invariant
        self._clock = time.perf_counter()
        while not self._stopped():
            if sampler.epoch_done:
                self.log.info("epoch %d done at step %d", sampler.epoch, self._step)
                sampler.set_epoch(sampler.epoch + 1)
                continue
            feed = _PlanFeed(sampler)
            batches = iter(self._loader(feed))
            while self.config.max_steps is None or self._step < self.config.max_steps:
                # Fetching a step's first micro-batch makes the feed hand over its plan.
                first = next(batches, _END)
                if first is _END:
                    break
                self.optimizer.zero_grad(set_to_none=True)
                step = Step(self, feed.plans.popleft(), itertools.chain((first,), batches), self._step + 1)
                yield step
                self._apply(step)

    def _apply(self, step: Step) -> None:
        step._check_complete()
        config = self.config
        self._precision.step(self.optimizer, self.module.parameters(), max_norm=config.grad_clip_norm)
        if self.scheduler is not None:
            self.scheduler.step()
        assert self.sampler is not None  # noqa: S101 - private invariant
        self.sampler.commit_step(step.plan)
        self._step = step.number
        self._progress["step"] = self._step

        now = time.perf_counter()
        elapsed, self._clock = now - self._clock, now
        throughput = step.step_size / elapsed if elapsed > 0 else float("inf")
        logging_due = config.log_every is not None and self._step % config.log_every == 0
        if config.sync_loss or logging_due or self.hooks.wants("on_step_end"):
            step.loss = self._step_loss(step)
        if logging_due:
            self.log.info("step %d epoch %d %s %.5g %.1f samples/s", self._step, step.epoch,
                          "loss" if config.sync_loss else "rank-0 loss", step.loss, throughput)
        self.hooks.dispatch("on_step_end", step=self._step, loss=step.loss, throughput=throughput)
        if config.checkpoint_every is not None and self._step % config.checkpoint_every == 0:
            self.save()
            self._clock = time.perf_counter()  # a save's time is not a step's

    def _step_loss(self, step: Step) -> float:
        # sum(weight * mean loss) over this rank's micro-batches is its share of
        # the global-batch mean; over all ranks it is the global-batch mean.
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        for loss, weight in step._losses:
            total += loss.double() * weight
        if self.config.sync_loss and self.placement is not None and self.placement.distributed:
            dist.all_reduce(total, group=self._group)
            return float(total)
        if self.config.sync_loss:
            return float(total)
        weight = sum(w for _, w in step._losses)
        return float(total) / weight if weight else float("nan")

    def save(self) -> None:
        """Checkpoint the current state as step :attr:`step`; a collective (every rank calls it).

        Raises:
            SessionError: No ``checkpoint_dir`` was configured.
            CheckpointError: The save failed; nothing was committed.
        """
        self._require_entered()
        if self.checkpoints is None:
            raise SessionError("save() needs a checkpoint_dir")
        self.hooks.dispatch("before_save", step=self._step)
        started = time.perf_counter()
        self._progress.update(step=self._step, world_size=self.context.world_size)
        self.checkpoints.save(self._step, self._state())
        self._saved_step = self._step
        seconds = time.perf_counter() - started
        if self.context.rank == 0:
            # Synchronous: committed now. Async: copied now, committed in the background
            # (a failure is raised by the next save).
            events.emit("checkpoint_save" if self.config.async_save else "checkpoint_commit",
                        step=self._step, directory=self.checkpoints.location, seconds=round(seconds, 4))
        self.hooks.dispatch("after_save", step=self._step, directory=self.checkpoints.location,
                            seconds=seconds)

