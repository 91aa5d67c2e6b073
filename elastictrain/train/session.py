"""The training session: a plain DDP loop that survives joins, leaves and crashes.

:class:`Session` puts the pieces together in the order that makes a recovery
indistinguishable from an uninterrupted run:

1. form the process group of this generation from the agent's word (the launcher's
   environment, or under in-process recovery its control channel;
   :class:`~elastictrain.train.group_keeper.GroupKeeper`, :mod:`~elastictrain.train.recovery`);
2. move the model to the worker's device;
3. bring every rank to the newest state (:class:`~elastictrain.train.training_state.TrainingState`):
   received from a live peer that holds it (:mod:`~elastictrain.train.state_transfer`),
   or, when no rank holds any (the job starts or restarts as a whole), read from the
   newest committed checkpoint (model, optimizer, scheduler, GradScaler, sampler
   cursor, each rank's RNG states, user extras);
4. wrap the model over the group with the parallelism strategy that ``sharding`` names
   (:mod:`~elastictrain.train.strategy`; DDP by default, :mod:`~elastictrain.train.ddp`;
   :class:`~elastictrain.train.generation.Generation` holds what is built on one group):
   every rank starts identical;
5. yield optimizer steps from the :class:`~elastictrain.train.sampler.ElasticSampler`'s
   plans: a fixed global batch, split into micro-batches whose loss scales make
   the accumulated gradient the global-batch mean whatever the world size
   (:class:`~elastictrain.train.step_loop.StepLoop`, :mod:`~elastictrain.train.steps`);
6. after each step: unscale, clip, optimizer and scheduler step, commit the
   sampler, hooks, a checkpoint every ``checkpoint_every`` steps (the step loop);
7. on exit: a final checkpoint, and the process group destroyed on every path.

Under in-process recovery (the default under ``elastictrain run``) a fault or a
membership change re-forms the group in this process (steps 1, 3 and 4 again, the
committed state kept); in restart mode the agent starts a new process that runs all
of this again from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence, Sized
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastictrain import events
from elastictrain._durations import parse_duration
from elastictrain.checkpoint import CheckpointManager, RestoreInfo
from elastictrain.errors import CheckpointWriteError, ConfigError, SessionError
from elastictrain.train.hooks import HookDispatcher
from elastictrain.train.precision import MixedPrecision
from elastictrain.train.progress import ProgressHook, progress_wanted
from elastictrain.train.rank_logging import RankLoggerAdapter, get_logger, setup_logging, terminal_is_prefixed
from elastictrain.train.sampler import ElasticSampler
from elastictrain.train import process_group as pg
from elastictrain.train.control import JobEnded
from elastictrain.train.group_keeper import GroupKeeper
from elastictrain.train.session_config import SessionConfig
from elastictrain.train.step_loop import StepLoop
from elastictrain.train.steps import MicroStep, Step
from elastictrain.train.meta_init import built_on_meta, on_meta_device
from elastictrain.train.training_state import TrainingState
from elastictrain.train.worker import WorkerContext

__all__ = ["MicroStep", "Session", "SessionConfig", "Step"]

_STALL_TO_SKIP = 2.0
"""Seconds the storage of an async save still in flight may go without answering (on any rank)
before a save due is skipped rather than waited for: training must not wait out
``checkpoint_timeout`` for a hung NFS server. A save that makes progress is waited for."""


def _check_meta(model: torch.nn.Module, config: SessionConfig) -> None:
    """Refuse a model built on the meta device that the session could not give values to (one line).

    Raises:
        ConfigError: It is under DDP (which holds the whole model: build it for real), without
            ``init_weights``, or only partly on the meta device.
    """
    if config.sharding == "ddp":
        if on_meta_device(model):
            raise ConfigError("the model is on the meta device: DDP trains a model with values; build it on a "
                              "real device, or shard it (sharding='fsdp' or 'hsdp', with init_weights)")
        return
    if built_on_meta(model) and config.init_weights is None:
        raise ConfigError(f"the model is on the meta device: sharding={config.sharding!r} needs init_weights "
                          "(a Module.apply function that sets each module's parameters) to give it values")


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

    ``session.model`` is the model as the strategy wrapped it (DDP by default): run the
    forward through it.

    Args:
        model: The model (unwrapped); moved to the worker's device.
        optimizer: Its optimizer, built on ``model``'s parameters.
        dataset: A map-style dataset (``len`` and ``__getitem__``).
        config: A :class:`SessionConfig`; or pass its fields as keyword arguments.
        scheduler: A learning-rate scheduler, stepped after every optimizer step.
        hooks: :class:`~elastictrain.train.hooks.Hooks` objects, called in order.
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
        _check_meta(model, config)
        self._state = TrainingState(model, optimizer, scheduler, extra_state)
        if process_group is not None and config.async_save and config.checkpoint_dir:
            raise ConfigError("async_save with an explicit process_group is not supported")
        self.config = config
        self.dataset = dataset
        self.hooks = HookDispatcher(hooks)
        self._group = process_group
        self._keeper = GroupKeeper(config, self.hooks, context or WorkerContext.from_env(), process_group,
                                   state=self._state, restore=self._restore, on_write_failure=self._write_failed)
        self._loop = StepLoop(config, dataset, self._state, self._keeper, self.hooks, collate_fn=collate_fn,
                              group=process_group, save=self._save_due, log=lambda: self.log)
        self._final_save = False
        self._log = get_logger(__name__, self.context)
        self._entered = False
        self._closed = False
        self._in_flight: int | None = None
        """The number of the step the caller's code is in, if it is in one."""

    # --- properties ----------------------------------------------------------------------------

    @property
    def context(self) -> WorkerContext:
        """This worker's context: its rank and world in the current group."""
        return self._keeper.context

    @property
    def log(self) -> RankLoggerAdapter:
        """The session's logger, prefixed with this worker's rank in the current group."""
        if self._log.context is not self.context:
            self._log = get_logger(__name__, self.context)
        return self._log

    @property
    def module(self) -> torch.nn.Module:
        """The model, unwrapped (what the optimizer trains and a checkpoint saves); under
        sharding, the module of the current generation (see :attr:`model`)."""
        return self._state.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer."""
        return self._state.optimizer

    @property
    def scheduler(self) -> Any | None:
        """The learning-rate scheduler, if any."""
        return self._state.scheduler

    @property
    def sampler(self) -> ElasticSampler | None:
        """The elastic sampler (None before ``with``)."""
        return self._state.sampler

    @property
    def restored(self) -> RestoreInfo | None:
        """The checkpoint this session restored, if it restored one."""
        return self._state.restored

    @property
    def model(self) -> torch.nn.Module:
        """The model to run forward passes through: wrapped by the strategy (DDP by default) when
        distributed. Read it at each step: a sharded session re-formed in place trains a module
        rebuilt from the first (FSDP2 shards a module once), so the script's own ``model``
        variable is not the one trained after a re-formation."""
        return self._loop.model

    def full_state_dict(self) -> dict[str, Any]:
        """The model's full tensors by name (for export or evaluation); a collective under a sharded
        strategy, which gathers them on rank 0 (call it on every rank). DDP: the module's own
        ``state_dict()``, whole on every rank.

        Raises:
            SessionError: Used outside ``with``.
        """
        self._require_entered()
        generation = self._keeper.generation
        if generation is None or generation.model is None:
            return dict(self.module.state_dict())
        with self._keeper.collective():
            return self._keeper.strategy.full_state_dict(self.module)

    @property
    def placement(self) -> pg.Placement | None:
        """Device, backend, rank and world of the group this session trains in (None before ``with``)."""
        generation = self._keeper.generation
        return generation.placement if generation is not None else None

    @property
    def checkpoints(self) -> CheckpointManager | None:
        """The checkpoint manager of the current group (None without ``checkpoint_dir``)."""
        generation = self._keeper.generation
        return generation.checkpoints if generation is not None else None

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
        return self._state.step

    @property
    def epoch(self) -> int:
        """The current epoch."""
        if self.sampler is None:
            raise SessionError("the epoch is known once the session has started (`with Session(...)`)")
        return self.sampler.epoch

    @property
    def precision(self) -> MixedPrecision:
        """The autocast/GradScaler helper in use."""
        return self._state.precision

    @property
    def recovers_in_process(self) -> bool:
        """Whether faults and membership changes are handled in this process (see ``SessionConfig.recovery``)."""
        return self._keeper.in_process

    def reform_due(self) -> bool:
        """Whether this worker's agent wants the group re-formed (in-process recovery): a loop that
        waits between steps of its own accord should stop waiting and let the next step run."""
        return self._keeper.reform_due()

    def long_call(self, timeout: timedelta) -> contextlib.AbstractContextManager[None]:
        """Widen this rank's hang bound by ``timeout`` around a long call of the script's own
        inside a step (a slow data fetch, an evaluation before the step's micro-batches): under
        in-process recovery a rank that takes longer than its bound to reach the step's collective
        is taken for hung and replaced (see ``SessionConfig.hang_bounds``). The call teaches the
        bound nothing, and the step's clock starts again when it returns.

        ::

            for step in session.steps():
                with session.long_call(timedelta(minutes=5)):
                    batch = fetch_from_a_slow_store()

        Raises:
            ConfigError: ``timeout`` is not a positive duration.
        """
        seconds = parse_duration("timeout", timeout, minimum=0.001).total_seconds()
        control = self._keeper.control
        return control.long_call(seconds) if control is not None else contextlib.nullcontext()

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
        config, state, keeper = self.config, self._state, self._keeper
        if not logging.getLogger().handlers and not logging.getLogger("elastictrain").handlers:
            # Nobody configured logging in this worker: show ours (prefixed, rank 0's info only).
            setup_logging(self.context, logger="elastictrain", brief=terminal_is_prefixed())
            logging.getLogger("elastictrain").propagate = False
        self.hooks.dispatch("on_start", context=self.context)
        keeper.open()
        self.hooks.dispatch("on_rendezvous", rank=self.context.rank, world_size=self.context.world_size,
                            restart_count=self.context.restart_count)

        device = self.device
        if not on_meta_device(self.module):  # else the strategy allocates the shards on the device
            self.module.to(device)
        state.precision = MixedPrecision(config.precision, device)
        state.sampler = ElasticSampler(
            self.dataset, global_batch_size=config.global_batch_size, micro_batch_size=config.micro_batch_size,
            seed=config.seed, shuffle=config.shuffle, drop_last=config.drop_last,
            rank=self.context.rank, world_size=self.context.world_size,
        )
        if progress_wanted(self.context.rank):
            total = config.max_steps or config.epochs * state.sampler.steps_per_epoch
            progress = ProgressHook(total)
            progress.on_rendezvous(rank=self.context.rank, world_size=self.context.world_size,
                                   restart_count=self.context.restart_count)
            self.hooks.add(progress)
        received = keeper.start()
        if received:
            assert keeper.control is not None  # noqa: S101 - only in-process
            self.hooks.dispatch("on_recovery", step=state.step, cause="joined a live group and received its state",
                                generation=keeper.control.generation, world_size=self.context.world_size,
                                seconds=0.0)
        self.log.info(
            "session started: run %r, world size %d, device %s, backend %s, precision %s, global batch %d "
            "(%d micro-batch(es) per step), %s, %s recovery",
            self.context.run_id, self.context.world_size, device, self.placement.backend or "none", state.precision.precision,
            config.global_batch_size, self._micro_count(),
            "state from a live peer at step %d" % state.step if received else (
                f"resumed at step {state.step}" if state.restored else "fresh start"),
            "in-process" if self.recovers_in_process else "restart",
        )

    def _micro_count(self) -> int:
        sampler = self.sampler
        if sampler is None or sampler.epoch_done:
            return 0
        return len(sampler.plan_step().micro_batches)

    def _restore(self) -> None:
        """Restore the newest checkpoint, if there is one (every rank; a collective)."""
        assert self.checkpoints is not None  # noqa: S101 - private invariant
        state = self._state
        info = self.checkpoints.restore(self._keeper.objects())
        if info is None:
            return
        state.restored = info
        state.step = state.saved_step = info.step
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
            self._wait_for_save_in_flight()
            self._final_save = True  # its failure fails the run: the last steps would be lost
            if self._state.saved_step != self._state.step:
                self.save()
            self.checkpoints.close()
        self.log.info("training finished after %d steps", self.step)
        if self.context.rank == 0:
            events.emit("session_end", step=self.step)  # the run summary's step count
        self.hooks.dispatch("on_end", step=self.step)

    def _fail(self, error: BaseException) -> None:
        if self._closed:
            return
        if isinstance(error, JobEnded):  # the agent ended the group (stopped, or the job ended): no failure
            self.log.info("left the job at step %d: %s", self.step, error)
        else:
            where = (f"in step {self._in_flight} ({self.step} committed)" if self._in_flight is not None
                     else f"after step {self.step}")
            self.log.error("training failed %s: %s: %s", where, type(error).__name__, error)
            # Every rank that lives to say it: the steps a restart from a checkpoint trains again
            # are those past the checkpoint up to the newest step any rank had committed.
            events.emit("session_failed", rank=self.context.rank, step=self.step, in_step=self._in_flight,
                        error=type(error).__name__)
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
        self._keeper.close()

    def _require_entered(self) -> None:
        if not self._entered or self.placement is None:
            raise SessionError("use the Session inside `with Session(...) as session:`")
        if self._closed:
            raise SessionError("the session is closed")

    # --- training ------------------------------------------------------------------------------

    def to_device(self, obj: Any) -> Any:
        """``obj`` (a tensor, or lists/tuples/dicts of them) moved to :attr:`device`."""
        _ = self.device  # SessionError before the session has started
        return self._loop.to_device(obj)

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
        steps = self._loop.run()
        try:
            for step in steps:
                self._in_flight = step.number  # what a failure names: the step the caller's code saw
                yield step
                self._in_flight = None
        finally:
            steps.close()

    def _save_due(self) -> None:
        """The save every ``checkpoint_every`` steps. One that cannot write (a full disk, an I/O
        error, a storage that blocks) is said in one line and an event, and training goes on;
        under ``async_save``, a save due while a rank's save in flight gets no answer from its
        storage is skipped (every rank agrees), and said so."""
        assert self.checkpoints is not None  # noqa: S101 - only with a checkpoint_dir
        state = self._state
        if self.config.async_save:
            stalled = self._agreed_max(self.checkpoints.stalled.total_seconds())
            if stalled >= _STALL_TO_SKIP:
                if self.context.rank == 0:
                    reason = f"the save in flight has had no answer from the storage for {stalled:.0f}s"
                    self.log.warning("checkpoint of step %d skipped: %s; training continues, the next save is %s",
                                     state.step, reason, self._next_save(state.step))
                    events.emit("checkpoint_skipped", step=state.step, reason=reason,
                                directory=self.checkpoints.location)
                return
            self._wait_for_save_in_flight()
        try:
            self.save()
        except CheckpointWriteError:
            pass  # said when it failed (_write_failed); nothing committed, the next save tries again

    def _wait_for_save_in_flight(self) -> None:
        assert self.checkpoints is not None  # noqa: S101 - only with a checkpoint_dir
        try:
            self.checkpoints.wait()
        except CheckpointWriteError:  # said when it failed (_write_failed)
            self._state.saved_step = None  # not saved after all: the run's end saves again

    def _agreed_max(self, value: float) -> float:
        """The largest ``value`` of all ranks (a collective over the training group)."""
        if self.placement is None or not self.placement.distributed:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        with self._keeper.collective():
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._group)
        return float(tensor.item())

    def _next_save(self, step: int) -> str:
        due = self.config.next_save(step)
        return "at the end of the run" if due is None else f"at step {due}"

    def _write_failed(self, step: int, error: CheckpointWriteError) -> None:
        """Say that the save of ``step`` could not write (``on_write_failure``; maybe on the save's
        thread): rank 0 in one line and an event. A failed final save is the run's failure instead."""
        if self._final_save or self.context.rank != 0:
            self.log.debug("save of step %d could not write: %s", step, error)
            return
        self.log.warning("%s; training continues, the next save is %s", error, self._next_save(step))
        events.emit("checkpoint_abandoned", step=step, reason=str(error), next_step=self.config.next_save(step),
                    directory=self.checkpoints.location if self.checkpoints is not None else None)

    def save(self) -> None:
        """Checkpoint the current state as step :attr:`step`; a collective (every rank calls it).

        Raises:
            SessionError: No ``checkpoint_dir`` was configured.
            CheckpointWriteError: The save could not write (a full disk, an I/O error, a
                storage that blocks); nothing was committed. The periodic saves of
                ``checkpoint_every`` say so and train on.
            CheckpointError: The save failed; nothing was committed.
        """
        self._require_entered()
        if self.checkpoints is None:
            raise SessionError("save() needs a checkpoint_dir")
        state = self._state
        self.hooks.dispatch("before_save", step=state.step)
        started = time.perf_counter()
        self.checkpoints.save(state.step, self._keeper.objects())
        state.saved_step = state.step
        seconds = time.perf_counter() - started
        if self.context.rank == 0:
            # Synchronous: committed now. Async: copied now, committed in the background
            # (a failure is raised by the next save).
            events.emit("checkpoint_save" if self.config.async_save else "checkpoint_commit",
                        step=state.step, directory=self.checkpoints.location, seconds=round(seconds, 4))
        self.hooks.dispatch("after_save", step=state.step, directory=self.checkpoints.location,
                            seconds=seconds)

