"""The optimizer steps of a :class:`~elastictrain.train.session.Session`: :class:`StepLoop`.

It plans each step from the :class:`~elastictrain.train.sampler.ElasticSampler` (a fixed
global batch split into micro-batches, :mod:`~elastictrain.train.steps`), feeds its
micro-batches through a DataLoader, and applies it at the boundary: unscale, clip,
optimizer and scheduler step, sampler commit, hooks, a checkpoint every
``checkpoint_every`` steps. Under in-process recovery it votes at each boundary on
re-forming the group, discards a step whose collective failed, has the
:class:`~elastictrain.train.group_keeper.GroupKeeper` re-form the group, and plans
again from the committed cursor at the new world size.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import time
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from elastictrain import events
from elastictrain._fault import node_label
from elastictrain._control import Section
from elastictrain.train.hooks import HookDispatcher
from elastictrain.train.injector import FaultInjector
from elastictrain.train.precision import MixedPrecision
from elastictrain.train.rank_logging import RankLoggerAdapter
from elastictrain.train.group_keeper import GroupKeeper
from elastictrain.train.recovery import describe, is_collective_failure
from elastictrain.train.session_config import SessionConfig
from elastictrain.train.steps import END, PlanFeed, Step, to_device
from elastictrain.train.stragglers import StragglerWatch
from elastictrain.train.training_state import TrainingState, rank_seed

__all__ = ["StepLoop"]

_SKIPS_TO_WARN = 10
"""Steps in a row whose fp16 update was skipped before a warning says the model does not train (a
GradScaler skips a few as it finds its scale, from 2**16)."""


class StepLoop:
    """The steps of a started session, from its committed position to the end of the run.

    Args:
        config: The session's configuration.
        dataset: The map-style dataset the sampler plans over.
        state: What the session trains (its sampler is set once the session has started).
        keeper: Forms and re-forms the group the steps run in.
        hooks: The session's hooks (``on_step_end`` after each applied step).
        collate_fn: The DataLoader's ``collate_fn``.
        group: The caller's process group (the loss is all-reduced over it), or None.
        save: Checkpoints the committed state (every ``checkpoint_every`` steps).
        log: The session's logger, as of now (its rank prefix follows the group).
    """

    def __init__(self, config: SessionConfig, dataset: Sized, state: TrainingState, keeper: GroupKeeper,
                 hooks: HookDispatcher, *, collate_fn: Callable[[list[Any]], Any] | None, group: Any,
                 save: Callable[[], None], log: Callable[[], RankLoggerAdapter]) -> None:
        self._config, self._dataset, self._state, self._keeper = config, dataset, state, keeper
        self._hooks, self._collate_fn, self._group = hooks, collate_fn, group
        self._save, self._log = save, log
        self._skipped_in_a_row = 0
        self._clock = time.perf_counter()
        self._stragglers = StragglerWatch()
        self._step_at: float | None = None
        self._waited = 0.0  # in the step's collectives before its gradient collective (a sharded forward's)
        self._injector = FaultInjector.from_env()

    # --- what a step uses ----------------------------------------------------------------------

    @property
    def module(self) -> torch.nn.Module:
        """The model, unwrapped."""
        return self._state.module

    @property
    def model(self) -> torch.nn.Module:
        """The model to run forward passes through: wrapped by the strategy when distributed."""
        generation = self._keeper.generation
        wrapped = generation.model if generation is not None else None
        return wrapped if wrapped is not None else self.module

    @property
    def wrapped(self) -> bool:
        """Whether the strategy wrapped the model (the group is distributed): the last
        micro-batch's backward then synchronizes the gradients."""
        generation = self._keeper.generation
        return generation is not None and generation.model is not None

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Accumulate gradients without synchronizing them (the strategy's; a no-op unwrapped)."""
        return self._keeper.strategy.no_sync() if self.wrapped else contextlib.nullcontext()

    @property
    def precision(self) -> MixedPrecision:
        """The autocast/GradScaler helper in use."""
        return self._state.precision

    @property
    def device(self) -> torch.device:
        """Where the model and batches live."""
        generation = self._keeper.generation
        assert generation is not None  # noqa: S101 - the session has started
        return generation.placement.device

    @property
    def recovers_in_process(self) -> bool:
        """Whether a failed collective discards the step instead of raising."""
        return self._keeper.in_process

    @property
    def forwards(self) -> int:
        """Forward passes through the wrapped model since :meth:`count_forwards` (0 unwrapped)."""
        generation = self._keeper.generation
        return generation.forwards if generation is not None else 0

    def count_forwards(self) -> None:
        """Start counting :attr:`forwards` from 0."""
        if self._keeper.generation is not None:
            self._keeper.generation.forwards = 0

    def collective(self) -> contextlib.AbstractContextManager[None]:
        """Marks a step's own collectives (see :meth:`GroupKeeper.collective`)."""
        return self._keeper.collective()

    def swallowing(self) -> contextlib.AbstractContextManager[Any]:
        """Around a micro-batch's forward and backward: under in-process recovery the strategy
        records a collective failure inside instead of raising it in the user's code
        (:meth:`~elastictrain.train.strategy.ParallelStrategy.swallowing`); in either mode it
        marks the waits for its forward's collectives."""
        if not self.wrapped:
            return contextlib.nullcontext()
        # A wait for the forward's all-gather is a step's own collective: a rank waiting there
        # for a hung peer is not hung itself (WorkerControl.collective), nor computing.
        return self._keeper.strategy.swallowing(self._waiting_for_peers)

    @contextlib.contextmanager
    def _waiting_for_peers(self) -> Iterator[None]:
        """Around a wait for a collective inside the step (a sharded unit's all-gather): marked as
        the step's own collective, and its time is no compute (:meth:`reach_collective`)."""
        started = time.perf_counter()
        try:
            with self.collective():
                yield
        finally:
            self._waited += time.perf_counter() - started

    def abandoning(self) -> contextlib.AbstractContextManager[Any]:
        """Around a micro-batch's backward, inside :meth:`swallowing`: the strategy may stop a
        backward whose step a collective failure has doomed, raising a collective failure
        (:meth:`~elastictrain.train.strategy.ParallelStrategy.abandoning`)."""
        if not (self.wrapped and self.recovers_in_process):
            return contextlib.nullcontext()
        return self._keeper.strategy.abandoning()

    def swallowed(self) -> BaseException | None:
        """The collective failure the strategy recorded inside :meth:`swallowing`, if one was: the
        step is discarded."""
        return self._keeper.strategy.swallowed() if self.wrapped else None

    def before_forward(self) -> BaseException | None:
        """The strategy's collectives due before a micro-batch's forward
        (:meth:`~elastictrain.train.strategy.ParallelStrategy.before_forward`); under in-process
        recovery a collective failure is returned (the step is discarded), not raised."""
        if not self.wrapped:
            return None
        try:
            with self.collective():
                self._keeper.strategy.before_forward()
        except Exception as exc:
            if self.recovers_in_process and is_collective_failure(exc):
                return exc
            raise
        return None

    def inject(self, step: int) -> None:
        """Apply this rank's faults of ``ELASTICTRAIN_INJECT`` in ``step`` (see :mod:`~elastictrain.train.injector`)."""
        if self._injector is not None:
            self._injector.at_step(self._keeper.context.rank, step)

    def enter(self, section: int) -> None:
        """Say where this rank is in its step loop (see :meth:`WorkerControl.enter`)."""
        control = self._keeper.control
        if control is not None:
            control.enter(section)
        if section == Section.STEP:
            self._step_at, self._waited = time.perf_counter(), 0.0

    def reach_collective(self) -> None:
        """This rank reached the step's gradient collective: the step's compute (from its start,
        data loading included, less its waits for peers in the forward's collectives: a straggler's
        peers wait for it in a sharded forward) counts for the straggler watch."""
        self.enter(Section.NONE)
        if self._step_at is not None:
            self._stragglers.record(time.perf_counter() - self._step_at - self._waited)
            self._step_at = None

    def to_device(self, obj: Any) -> Any:
        """``obj`` (a tensor, or lists/tuples/dicts of them) moved to :attr:`device`."""
        device = self.device
        if device.type == "cpu":
            return obj
        return to_device(obj, device, non_blocking=self._pin_memory())

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> Iterator[Step]:
        """Yield the remaining optimizer steps of the run; see :meth:`Session.steps`."""
        config, state, keeper = self._config, self._state, self._keeper
        sampler = state.sampler
        assert sampler is not None  # noqa: S101 - the session has started
        self._clock = time.perf_counter()
        while not self._stopped():
            if sampler.epoch_done:
                self._log().info("epoch %d done at step %d", sampler.epoch, state.step)
                sampler.set_epoch(sampler.epoch + 1)
                continue
            feed = PlanFeed(sampler)
            batches = iter(self._loader(feed))
            while config.max_steps is None or state.step < config.max_steps:
                # From here this rank owes its peers the step's collective: its data loading counts.
                self.enter(Section.STEP)
                # Fetching a step's first micro-batch makes the feed hand over its plan.
                first = next(batches, END)
                if first is END:
                    break
                state.optimizer.zero_grad(set_to_none=True)
                if keeper.in_process:
                    keeper.strategy.arm_vote(keeper.votes_to_reform())
                step = Step(self, feed.plans.popleft(), itertools.chain((first,), batches), state.step + 1)
                yield step
                self.enter(Section.NONE)
                cause = self._finish(step)
                if cause is not None:
                    keeper.recover(cause)
                    self._stragglers.restart()
                    self._clock = time.perf_counter()
                    break  # plan again from the committed cursor, at the new world size
            self.enter(Section.NONE)

    def _pin_memory(self) -> bool:
        pin = self._config.pin_memory
        return self.device.type == "cuda" if pin is None else pin

    def _loader(self, feed: PlanFeed) -> DataLoader:
        sampler = self._state.sampler
        assert sampler is not None  # noqa: S101 - private invariant
        workers = self._config.num_workers
        return DataLoader(
            self._dataset,  # type: ignore[arg-type]
            batch_sampler=feed,
            num_workers=workers,
            collate_fn=self._collate_fn,
            pin_memory=self._pin_memory(),
            worker_init_fn=sampler.worker_init_fn() if workers else None,
            # Its own generator: otherwise each iter() draws from the global RNG,
            # and a run resumed mid-epoch would draw at another point than an
            # uninterrupted one, shifting every later dropout mask.
            generator=torch.Generator().manual_seed(rank_seed(self._config.seed, self._keeper.context.rank)),
        )

    def _stopped(self) -> bool:
        config, sampler = self._config, self._state.sampler
        assert sampler is not None  # noqa: S101 - private invariant
        if config.max_steps is not None and self._state.step >= config.max_steps:
            return True
        return sampler.epoch >= config.epochs or (sampler.epoch_done and sampler.epoch + 1 >= config.epochs)

    def _finish(self, step: Step) -> str | None:
        """Apply ``step`` unless a collective failed; returns why the group must re-form now, if it must."""
        if step.failure is not None:
            return f"a collective failed in step {step.number} ({describe(step.failure)}); the step was discarded"
        try:
            self._apply(step)
            raised = self._keeper.votes()
        except Exception as exc:
            if not (self.recovers_in_process and is_collective_failure(exc)):
                raise
            return f"a collective failed after step {step.number} was applied ({describe(exc)})"
        if raised:
            return self._keeper.boundary_cause(step.number)
        return None

    def _apply(self, step: Step) -> None:
        step._check_complete()
        config, state, keeper = self._config, self._state, self._keeper
        generation = keeper.generation
        assert generation is not None  # noqa: S101 - private invariant
        if generation.model is not None:
            keeper.strategy.before_apply(step.number)
        applied = state.precision.step(state.optimizer, state.module.parameters(), max_norm=config.grad_clip_norm,
                                       clip=keeper.clip_grad_norm)
        if state.scheduler is not None:
            state.scheduler.step()
        assert state.sampler is not None  # noqa: S101 - private invariant
        state.sampler.commit_step(step.plan)
        state.step = step.number
        self._say_if_skipped(applied.skipped)
        if keeper.control is not None:
            keeper.control.step_done(state.step)
        if generation.model is not None:
            with keeper.collective():  # e.g. DDP's bucket order, the buffers' broadcast
                keeper.strategy.after_step(state.step)

        now = time.perf_counter()
        elapsed, self._clock = now - self._clock, now
        throughput = step.step_size / elapsed if elapsed > 0 else float("inf")
        logging_due = config.log_every is not None and state.step % config.log_every == 0
        if config.sync_loss or logging_due or self._hooks.wants("on_step_end"):
            with keeper.collective():
                step.loss = step.mean_loss(sync=config.sync_loss,
                                           all_reduce=config.sync_loss and generation.placement.distributed,
                                           group=self._group)
        if logging_due:
            self._log().info("step %d epoch %d %s %.5g %.1f samples/s", state.step, step.epoch,
                             "loss" if config.sync_loss else "rank-0 loss", step.loss, throughput)
        self._hooks.dispatch("on_step_end", step=state.step, loss=step.loss, throughput=throughput)
        if generation.placement.distributed and self._stragglers.due(state.step):
            with keeper.collective():
                self._judge_stragglers(generation.cpu_group())
        if config.checkpoint_every is not None and state.step % config.checkpoint_every == 0:
            self.enter(Section.SAVE)
            self._save()
            self.enter(Section.NONE)
            self._clock = time.perf_counter()  # a save's time is not a step's

    def _judge_stragglers(self, group: Any) -> None:
        """Exchange the ranks' compute times of the last window (a collective) and say whether this
        rank started or stopped straggling (see :mod:`~elastictrain.train.stragglers`)."""
        watch, context = self._stragglers, self._keeper.context
        mine = torch.tensor(watch.times(), dtype=torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(context.world_size)]
        dist.all_gather(gathered, mine, group=group)
        verdict = watch.judge(context.rank, [t.tolist() for t in gathered])
        if verdict is None:
            return
        if self._keeper.control is not None:
            self._keeper.control.set_straggle(verdict.factor)
        if verdict.change is None:
            return
        node = os.environ.get(events.NODE_ENV) or socket.gethostname()
        first = self._state.step - watch.window + 1
        if verdict.change == "started":
            self._log().warning("rank %d on %s is a straggler: its steps %d-%d computed %.1fx as long as its "
                                "peers' (%.3f s a step against %.3f s); the job trains at its pace",
                                context.rank, node_label(node, context.node_rank), first, self._state.step,
                                verdict.factor, verdict.compute_s, verdict.peers_s)
        else:
            self._log().warning("rank %d on %s no longer straggles: %.1fx its peers' compute time over steps "
                                "%d-%d", context.rank, node_label(node, context.node_rank), verdict.factor, first,
                                self._state.step)
        events.emit("straggler" if verdict.change == "started" else "straggler_recovered", rank=context.rank,
                    node=node, node_rank=context.node_rank, first_step=first, step=self._state.step,
                    factor=round(verdict.factor, 3), compute_s=round(verdict.compute_s, 4),
                    peers_s=round(verdict.peers_s, 4))

    def _say_if_skipped(self, skipped: bool) -> None:
        """Say that fp16's GradScaler skipped this step's update (its gradients held inf or NaN),
        and warn once a run of skipped steps shows that the model no longer trains."""
        if not skipped:
            self._skipped_in_a_row = 0
            return
        self._skipped_in_a_row += 1
        scaler = self._state.precision.scaler
        assert scaler is not None  # noqa: S101 - only a scaler skips
        scale = scaler.get_scale()
        step = self._state.step
        if self._skipped_in_a_row < _SKIPS_TO_WARN:
            self._log().info("step %d: update skipped, its fp16 gradients held inf or NaN; the GradScaler lowered "
                             "its scale to %g", step, scale)
        elif self._skipped_in_a_row == _SKIPS_TO_WARN:
            self._log().warning("the updates of the last %d steps (to step %d) were all skipped: their fp16 "
                                "gradients held inf or NaN, and the model does not train. The GradScaler's scale is "
                                "now %g: a loss or activations beyond fp16's range do this (bf16 has fp32's range), "
                                "as does a diverged model", _SKIPS_TO_WARN, step, scale)
