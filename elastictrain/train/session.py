"""The training session: a plain DDP loop that survives joins, leaves and crashes.

:class:`Session` puts the pieces together in the order that makes a recovery
indistinguishable from an uninterrupted run:

1. form the process group of this generation from the agent's word (the launcher's
   environment, or under in-process recovery its control channel;
   :mod:`~elastictrain.train.recovery`);
2. move the model to the worker's device;
3. bring every rank to the newest state: received from a live peer that holds it
   (:mod:`~elastictrain.train.state_transfer`), or, when no rank holds any (the job
   starts or restarts as a whole), read from the newest committed checkpoint (model,
   optimizer, scheduler, GradScaler, sampler cursor, each rank's RNG states, user extras);
4. wrap the model in DDP over the group (:class:`~elastictrain.train.generation.Generation`
   holds what is built on one group): every rank starts identical;
5. yield optimizer steps from the :class:`~elastictrain.sampler.ElasticSampler`'s
   plans: a fixed global batch, split into micro-batches whose loss scales make
   the accumulated gradient the global-batch mean whatever the world size;
6. after each step: unscale, clip, optimizer and scheduler step, commit the
   sampler, hooks, a checkpoint every ``checkpoint_every`` steps;
7. on exit: a final checkpoint, and the process group destroyed on every path.

Under in-process recovery (the default under ``elastictrain run``) a fault or a
membership change re-forms the group in this process (steps 1, 3 and 4 again, the
committed state kept); in restart mode the agent starts a new process that runs all
of this again from the last checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence, Sized
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from elastictrain import events
from elastictrain.train import process_group as pg
from elastictrain._control import Assignment, WorkerState
from elastictrain.checkpoint import CheckpointManager, RestoreInfo
from elastictrain.checkpoint import _snapshot as snap
from elastictrain.errors import ConfigError, SessionError
from elastictrain.hooks import HookDispatcher
from elastictrain.precision import MixedPrecision
from elastictrain.progress import ProgressHook, progress_wanted
from elastictrain.rank_logging import RankLoggerAdapter, get_logger, setup_logging
from elastictrain.sampler import ElasticSampler
from elastictrain.train.control import WorkerControl
from elastictrain.train.generation import Generation
from elastictrain.train.recovery import (
    BoundaryFlag,
    context_for,
    describe,
    is_collective_failure,
    join_generation,
    wait_for_generation,
)
from elastictrain.train.session_config import SessionConfig
from elastictrain.train.state_transfer import agree, transfer
from elastictrain.train.steps import END, MicroStep, PlanFeed, Step, to_device
from elastictrain.worker import WorkerContext

__all__ = ["MicroStep", "Session", "SessionConfig", "Step"]

_SAVE_GRACE_S = 10.0
"""How long the ranks train on, when their agents want the group re-formed, while a checkpoint
save is in flight (re-forming would wait for it to be written)."""

_SKIPS_TO_WARN = 10
"""Steps in a row whose fp16 update was skipped before a warning says the model does not train (a
GradScaler skips a few as it finds its scale, from 2**16)."""

_RESERVED = ("model", "optimizer", "scheduler", "scaler", "sampler", "session")
_PROGRESS_VERSION = 1


def _rank_seed(seed: int, rank: int) -> int:
    digest = hashlib.sha256(f"elastictrain-session:{seed}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # < 2**63: every RNG accepts it


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)  # also every CUDA device
    random.seed(seed)
    np.random.seed(seed % 2**32)


def _check_trains(model: torch.nn.Module, optimizer: Any) -> None:
    """Refuse an optimizer that would not train ``model``: training would change nothing,
    silently (an optimizer over another model's parameters, or a model with none to train)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    if not trainable:
        raise ConfigError("the model has no parameter that requires grad: there is nothing to train")
    if not any(id(p) in trainable for group in optimizer.param_groups for p in group["params"]):
        raise ConfigError("the optimizer updates none of the model's trainable parameters (was it built over "
                          "another model, or a copy of this one?): training would change nothing")


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
        _check_trains(model, optimizer)
        extra = dict(extra_state or {})
        clash = sorted(set(extra) & set(_RESERVED))
        if clash:
            raise ConfigError(f"extra_state names {clash} are reserved ({', '.join(_RESERVED)})")
        # Now, not at the first save (checkpoint_every steps of training later).
        snap.check_state(extra)
        for name, obj in extra.items():
            snap.validate(obj if isinstance(obj, dict) else obj.state_dict(), where=f"extra_state[{name!r}]")
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
        self.sampler: ElasticSampler | None = None
        self.restored: RestoreInfo | None = None
        self._precision = MixedPrecision("fp32")
        self._generation: Generation | None = None
        self._control: WorkerControl | None = None
        self._assignment: Assignment | None = None
        self._due_since: float | None = None
        self._recoveries = 0
        self._progress: dict[str, int] = {"version": _PROGRESS_VERSION, "step": 0, "world_size": 1}
        self._step = 0
        self._saved_step: int | None = None
        self._forwards = 0
        self._skipped_in_a_row = 0
        self._entered = False
        self._closed = False
        self._clock = time.perf_counter()

    # --- properties ----------------------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """The model to run forward passes through: DDP-wrapped when distributed."""
        ddp = self._generation.ddp if self._generation is not None else None
        return ddp if ddp is not None else self.module

    @property
    def placement(self) -> pg.Placement | None:
        """Device, backend, rank and world of the group this session trains in (None before ``with``)."""
        return self._generation.placement if self._generation is not None else None

    @property
    def checkpoints(self) -> CheckpointManager | None:
        """The checkpoint manager of the current group (None without ``checkpoint_dir``)."""
        return self._generation.checkpoints if self._generation is not None else None

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
        if config.recovery == "in-process" and self._group is None:
            self._control = WorkerControl.from_env(self.context.local_rank, self.context.local_world_size)
            if self._control is not None and (current := self._control.current()) is not None:
                self._adopt(current)  # the agent's newest word, which may be newer than this process's env
        self._join_group()
        self.hooks.dispatch("on_rendezvous", rank=self.context.rank, world_size=self.context.world_size,
                            restart_count=self.context.restart_count)

        device = self.device
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
        failed = None
        try:
            received = self._form_generation(holds_state=False)
        except Exception as exc:
            if not (self.recovers_in_process and is_collective_failure(exc)):
                raise
            failed = f"the group failed to form ({describe(exc)})"
        if failed is not None:
            # A peer died while the state went round: no failure of this worker's. (Recovered
            # outside the handler: an error of the recovery must not pass for this one.)
            received = self._recover(failed, holds_state=False)
        if self._control is not None:
            self._control.set_state(WorkerState.TRAINING)
        if received:
            assert self._control is not None  # noqa: S101 - only in-process
            self.hooks.dispatch("on_recovery", step=self._step, cause="joined a live group and received its state",
                                generation=self._control.generation, world_size=self.context.world_size, seconds=0.0)
        self.log.info(
            "session started: world size %d, device %s, backend %s, precision %s, global batch %d "
            "(%d micro-batch(es) per step), %s, %s recovery",
            self.context.world_size, device, self.placement.backend or "none", self._precision.precision,
            config.global_batch_size, self._micro_count(),
            "state from a live peer at step %d" % self._step if received else (
                f"resumed at step {self._step}" if self.restored else "fresh start"),
            "in-process" if self.recovers_in_process else "restart",
        )

    @property
    def recovers_in_process(self) -> bool:
        """Whether faults and membership changes are handled in this process (see ``SessionConfig.recovery``)."""
        return self._generation is not None and self._generation.in_process

    def reform_due(self) -> bool:
        """Whether this worker's agent wants the group re-formed (in-process recovery): a loop that
        waits between steps of its own accord should stop waiting and let the next step run."""
        return self._control is not None and self._control.due() is not None

    def _join_group(self) -> None:
        """Join this generation's process group (or adopt the one given)."""
        config = self.config
        if self._group is not None:
            rank, world = dist.get_rank(self._group), dist.get_world_size(self._group)
            self.context = dataclasses.replace(self.context, rank=rank, world_size=world)
            self.log = get_logger(__name__, self.context)
            device = torch.device(config.device) if config.device else pg.device_for(
                self.context, dist.get_backend(self._group))
            placement = pg.Placement(device, dist.get_backend(self._group), pg.resolve_timeout(config.timeout),
                                     rank, world, owned=False)
            self._generation = Generation(placement, self._group, in_process=False)
            return
        placement, context, self._assignment = join_generation(
            self.context, self._control, self._assignment, backend=config.backend, timeout=config.timeout,
            device=config.device, recovery_timeout=config.recovery_timeout.total_seconds())
        if context is not self.context:
            self.context = context
            self.log = get_logger(__name__, self.context)
        if placement.distributed and (placement.rank, placement.world_size) != (
                self.context.rank, self.context.world_size):
            # An existing group (someone else's init) defines the world.
            self.context = dataclasses.replace(self.context, rank=placement.rank, world_size=placement.world_size)
            self.log = get_logger(__name__, self.context)
        self._generation = Generation(placement, None,
                                      in_process=self._control is not None and placement.distributed)

    def _adopt(self, assignment: Assignment) -> None:
        """Take this worker's rank, world and store address from the agent's ``assignment``."""
        self._assignment = assignment
        self.context = context_for(self.context, assignment)
        self.log = get_logger(__name__, self.context)

    def _form_generation(self, *, holds_state: bool) -> bool:
        """Make this generation's training state and wrappers; a collective.

        The ranks agree on the newest state any of them holds; ranks without it receive
        it from a live peer. When no rank holds state (the job starts or restarts as a
        whole), every rank reads the newest checkpoint instead.

        Returns:
            Whether this rank received the state from a peer.
        """
        config, generation = self.config, self._generation
        assert generation is not None and self.sampler is not None  # noqa: S101 - private invariant
        generation.check_same_settings({
            "the dataset's length": self.sampler.num_samples, "global_batch_size": config.global_batch_size,
            "micro_batch_size": config.micro_batch_size, "epochs": config.epochs, "max_steps": config.max_steps,
            "seed": config.seed, "shuffle": config.shuffle, "drop_last": config.drop_last})
        received = peer_state = False
        if generation.in_process:
            group = generation.cpu_group()
            agreement = agree(group, holds=holds_state, step=self._step)
            if agreement.source is not None:
                peer_state = True
                received = transfer(group, agreement, self._state(), step=self._step)
                if received:
                    self._step = agreement.step or 0
        self.sampler.set_world(self.context.rank, self.context.world_size)
        self._progress.update(step=self._step, world_size=self.context.world_size)
        if config.checkpoint_dir is not None:
            generation.open_checkpoints(config, self._control)
            if not peer_state:
                self._restore()
        if received:
            # Its peers' RNG streams are theirs: a worker that received the state seeds
            # streams of its own, from its rank and generation.
            assert self._control is not None  # noqa: S101 - only in-process
            _seed_everything(_rank_seed(config.seed ^ self._control.generation, self.context.rank))
        elif not holds_state and self.restored is None:
            # Distinct, reproducible streams per rank (dropout, augmentation); a restore
            # brings back the saved ones instead.
            _seed_everything(_rank_seed(config.seed, self.context.rank))
        generation.wrap(self.module, config.ddp_kwargs, identical=peer_state, on_forward=self._count_forward,
                        control=self._control)
        return received

    def _recover(self, cause: str, *, holds_state: bool = True) -> bool:
        """Re-form the group in place after ``cause``; the committed state is kept.

        Args:
            cause: What failed.
            holds_state: Whether this worker holds training state (not while its first group
                forms: a fresh worker's parameters are no step's). A worker without it trained
                in no world: its hooks hear of no recovery or world change, as at any start.

        Returns:
            Whether this rank received the state from a peer.

        Raises:
            JobEnded: The agent closed the group (the job is over).
            TimeoutError: The agent sent no new generation in ``recovery_timeout``.
        """
        assert self._control is not None  # noqa: S101 - only in-process
        started = time.perf_counter()
        old_world = self.context.world_size
        self._due_since = None
        while True:
            assert self._generation is not None  # noqa: S101 - private invariant
            # Said before leaving, which waits for a save in flight: the agent re-forms meanwhile.
            self._control.set_state(WorkerState.RECOVERING)
            self._generation.leave(self.log)
            self._adopt(wait_for_generation(self._control, self.config.recovery_timeout.total_seconds()))
            try:
                self._join_group()
                # The same order of collectives as a worker that starts in this generation
                # (Session._start): hooks' on_rendezvous, then the state agreement.
                self.hooks.dispatch("on_rendezvous", rank=self.context.rank, world_size=self.context.world_size,
                                    restart_count=self.context.restart_count)
                received = self._form_generation(holds_state=holds_state)
                break
            except Exception as exc:
                if not is_collective_failure(exc):
                    raise
                cause = f"{cause}; then the new group failed to form ({describe(exc)})"
        self._control.set_state(WorkerState.TRAINING)
        self._recoveries += 1
        seconds = time.perf_counter() - started
        self.log.info("recovered in %.2fs (%s): generation %d, world size %d -> %d, step %d", seconds, cause,
                      self._control.generation, old_world, self.context.world_size, self._step)
        if self.context.rank == 0:
            events.emit("recovery", cause=cause, generation=self._control.generation, seconds=round(seconds, 4),
                        old_world_size=old_world, world_size=self.context.world_size, step=self._step)
        if holds_state:
            self.hooks.dispatch("on_recovery", step=self._step, cause=cause, generation=self._control.generation,
                                world_size=self.context.world_size, seconds=seconds)
            if old_world != self.context.world_size:
                self.hooks.dispatch("on_world_change", old_world_size=old_world,
                                    new_world_size=self.context.world_size)
        return received

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
        if self._generation is not None:
            self._generation.end()
        if self._control is not None:
            self._control.close()

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
        return to_device(obj, device, non_blocking=self._pin_memory())

    def _pin_memory(self) -> bool:
        pin = self.config.pin_memory
        return self.device.type == "cuda" if pin is None else pin

    def _loader(self, feed: PlanFeed) -> DataLoader:  # type: ignore[type-arg]
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

        Under in-process recovery a step whose collective failed is discarded and
        planned again once the group has re-formed, and a membership change takes
        effect after the step every rank agreed on: the loop goes on, at the new
        world size, without the caller doing anything.

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
            feed = PlanFeed(sampler)
            batches = iter(self._loader(feed))
            while self.config.max_steps is None or self._step < self.config.max_steps:
                # Fetching a step's first micro-batch makes the feed hand over its plan.
                first = next(batches, END)
                if first is END:
                    break
                self.optimizer.zero_grad(set_to_none=True)
                if self._flag is not None:
                    self._flag.arm(self._votes_to_reform())
                step = Step(self, feed.plans.popleft(), itertools.chain((first,), batches), self._step + 1)
                yield step
                cause = self._finish_step(step)
                if cause is not None:
                    self._recover(cause)
                    self._clock = time.perf_counter()
                    break  # plan again from the committed cursor, at the new world size

    @property
    def _flag(self) -> BoundaryFlag | None:
        """The boundary flag of this generation (in-process recovery only)."""
        return self._generation.flag if self._generation is not None else None

    def _votes_to_reform(self) -> bool:
        """This rank's vote for the step about to run: stop after it and re-form the group,
        because the agent wants a new generation. While a checkpoint save is in flight the
        rank trains on instead (for up to ``_SAVE_GRACE_S``): re-forming would first wait for
        the save to be written, and the peers (a joining node's workers waiting for the
        group) would wait with it; once it is written the re-formation costs only itself."""
        assert self._control is not None  # noqa: S101 - set with the flag
        due = self._control.due()
        if due is None:
            self._due_since = None
            return False
        if due.closed or self.checkpoints is None or not self.checkpoints.saving:
            return True
        now = time.monotonic()
        if self._due_since is None:
            self._due_since = now
        return now - self._due_since > _SAVE_GRACE_S

    def _finish_step(self, step: Step) -> str | None:
        """Apply ``step`` unless a collective failed; returns why the group must re-form now, if it must."""
        if step.failure is not None:
            return f"a collective failed in step {step.number} ({describe(step.failure)}); the step was discarded"
        try:
            self._apply(step)
        except Exception as exc:
            if not (self.recovers_in_process and is_collective_failure(exc)):
                raise
            return f"a collective failed after step {step.number} was applied ({describe(exc)})"
        if self._flag is not None and self._flag.raised:
            due = self._control.due() if self._control is not None else None
            return (due.cause if due is not None and due.cause else "the agent re-forms the group") + \
                f" (at the boundary after step {step.number})"
        return None

    def _apply(self, step: Step) -> None:
        step._check_complete()
        config = self.config
        applied = self._precision.step(self.optimizer, self.module.parameters(), max_norm=config.grad_clip_norm)
        if self.scheduler is not None:
            self.scheduler.step()
        assert self.sampler is not None  # noqa: S101 - private invariant
        self.sampler.commit_step(step.plan)
        self._step = step.number
        self._say_if_skipped(applied.skipped)
        self._progress["step"] = self._step
        if self._control is not None:
            self._control.step_done(self._step)
        assert self._generation is not None  # noqa: S101 - private invariant
        self._generation.after_step(self.module)

        now = time.perf_counter()
        elapsed, self._clock = now - self._clock, now
        throughput = step.step_size / elapsed if elapsed > 0 else float("inf")
        logging_due = config.log_every is not None and self._step % config.log_every == 0
        if config.sync_loss or logging_due or self.hooks.wants("on_step_end"):
            distributed = self.placement is not None and self.placement.distributed
            step.loss = step.mean_loss(sync=config.sync_loss, all_reduce=config.sync_loss and distributed,
                                       group=self._group)
        if logging_due:
            self.log.info("step %d epoch %d %s %.5g %.1f samples/s", self._step, step.epoch,
                          "loss" if config.sync_loss else "rank-0 loss", step.loss, throughput)
        self.hooks.dispatch("on_step_end", step=self._step, loss=step.loss, throughput=throughput)
        if config.checkpoint_every is not None and self._step % config.checkpoint_every == 0:
            self.save()
            self._clock = time.perf_counter()  # a save's time is not a step's

    def _say_if_skipped(self, skipped: bool) -> None:
        """Say that fp16's GradScaler skipped this step's update (its gradients held inf or NaN),
        and warn once a run of skipped steps shows that the model no longer trains."""
        if not skipped:
            self._skipped_in_a_row = 0
            return
        self._skipped_in_a_row += 1
        assert self._precision.scaler is not None  # noqa: S101 - only a scaler skips
        scale = self._precision.scaler.get_scale()
        if self._skipped_in_a_row < _SKIPS_TO_WARN:
            self.log.info("step %d: update skipped, its fp16 gradients held inf or NaN; the GradScaler lowered "
                          "its scale to %g", self._step, scale)
        elif self._skipped_in_a_row == _SKIPS_TO_WARN:
            self.log.warning("the updates of the last %d steps (to step %d) were all skipped: their fp16 gradients "
                             "held inf or NaN, and the model does not train. The GradScaler's scale is now %g: a "
                             "loss or activations beyond fp16's range do this (bf16 has fp32's range), as does a "
                             "diverged model", _SKIPS_TO_WARN, self._step, scale)

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

