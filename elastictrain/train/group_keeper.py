"""The group a :class:`~elastictrain.train.session.Session` trains in, generation after
generation: :class:`GroupKeeper`.

It forms the session's first group, from the launcher's environment or, under
in-process recovery, from the agent's word on the control channel; and after a
fault or a membership change it leaves that group and forms the next one in this
process (:mod:`~elastictrain.train.recovery` has the protocol). Each time, the
ranks agree on the newest state one of them holds and bring the others to it
(:mod:`~elastictrain.train.state_transfer`), or read the newest checkpoint when none
holds any (or when the parallelism strategy holds no replicated state to send); then the
strategy wraps the model over the group (:class:`~elastictrain.train.generation.Generation`,
:mod:`~elastictrain.train.strategy`). A sharded strategy wraps before the checkpoint is read
(:attr:`~elastictrain.train.strategy.ParallelStrategy.restores_wrapped`): each rank then reads
only its own shards' regions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elastictrain import events
from elastictrain._control import Assignment, WorkerState
from elastictrain.errors import CheckpointError, CheckpointWriteError, SessionError
from elastictrain.train.hooks import HookDispatcher
from elastictrain.train.rank_logging import RankLoggerAdapter, follow_context, get_logger
from elastictrain.train import process_group as pg
from elastictrain.train.control import WorkerControl
from elastictrain.train.generation import Generation
from elastictrain.train.recovery import (
    RECOVERY_PHASES,
    announce_recovery,
    context_for,
    describe,
    is_collective_failure,
    join_generation,
    reform_in_place,
    torch_env,
)
from elastictrain.train.recovery_decisions import Due, StateSource, boundary_cause, state_source, vote_at_boundary
from elastictrain.train.session_config import SessionConfig
from elastictrain.train.state_transfer import agree
from elastictrain.train.strategy import ParallelStrategy, create_strategy
from elastictrain.train.meta_init import materialize, on_meta_device
from elastictrain.train.training_state import TrainingState, rank_seed, seed_everything
from elastictrain.train.worker import WorkerContext

__all__ = ["RECOVERY_PHASES", "GroupKeeper"]
# RECOVERY_PHASES is defined in elastictrain.train.recovery, with the one re-formation path that
# measures them; the session's re-formations are this module's.

class GroupKeeper:
    """Forms a session's group and, under in-process recovery, re-forms it in place.

    Args:
        config: The session's configuration.
        hooks: The session's hooks (they hear of each rendezvous and recovery).
        context: This worker's context, as the launcher started it.
        group: The caller's process group (``Session(process_group=...)``), or None to form
            the default group from the environment or the agent's word.
        state: What the session trains; each formation brings it to the group's newest step.
        restore: Restores ``state`` from the newest checkpoint (when no rank holds any).

    Raises:
        ConfigError: ``config.sharding`` names no available strategy.
    """

    def __init__(self, config: SessionConfig, hooks: HookDispatcher, context: WorkerContext,
                 group: dist.ProcessGroup | None, *, state: TrainingState, restore: Callable[[], None],
                 on_write_failure: Callable[[int, CheckpointWriteError], None] | None = None) -> None:
        self.config = config
        self.strategy: ParallelStrategy = create_strategy(config)
        """How the model trains over each generation's group (``config.sharding``)."""
        self.strategy.keep_state(self.objects)
        self.hooks = hooks
        self.context = context
        self.log: RankLoggerAdapter = get_logger(__name__, context)
        self.generation: Generation | None = None
        """The group the session trains in now (None before :meth:`open`)."""
        self.control: WorkerControl | None = None
        """The agent's control channel (in-process recovery only)."""
        self.recoveries = 0
        self._group = group
        self._state = state
        self._restore = restore
        self._on_write_failure = on_write_failure
        self._assignment: Assignment | None = None
        self._due_since: float | None = None
        self._formed: tuple[StateSource, int | None] | None = None
        """Where the last formation's state came from, and the newest step the ranks held then."""

    @property
    def in_process(self) -> bool:
        """Whether faults and membership changes are handled in this process."""
        return self.generation is not None and self.generation.in_process

    def votes(self) -> int:
        """How many ranks voted to re-form after the step just applied (the strategy's vote: maybe
        a collective of its own); 0 without in-process recovery."""
        if not self.in_process:
            return 0
        with self.collective():
            return self.strategy.votes()

    def collective(self) -> contextlib.AbstractContextManager[None]:
        """Marks a step's own collectives (see :meth:`WorkerControl.collective`)."""
        return self.control.collective() if self.control is not None else contextlib.nullcontext()

    def reform_due(self) -> bool:
        """Whether the agent wants the group re-formed."""
        return self.control is not None and self.control.due() is not None

    def open(self) -> None:
        """Open the agent's control channel (in-process recovery, when the launcher opened one)
        and join the first group; no collective yet."""
        if self.config.recovery == "in-process" and self._group is None:
            self.control = WorkerControl.from_env(self.context.local_rank, self.context.local_world_size,
                                                  hang_bounds=self.config.hang_bounds)
            if self.control is not None and (current := self.control.current()) is not None:
                self._adopt(current)  # the agent's newest word, which may be newer than this process's env
        self._join()

    def start(self) -> bool:
        """Form the first generation's state and wrappers (:meth:`form`); a collective. In-process,
        a peer lost meanwhile makes it re-form (:meth:`recover`), as no failure of this worker's.

        Returns:
            Whether this rank received the state from a peer.
        """
        failed = None
        try:
            received = self.form(holds_state=False)
        except Exception as exc:
            if not (self.in_process and is_collective_failure(exc)):
                raise
            failed = f"the group failed to form ({describe(exc)})"
        if failed is not None:
            # Recovered outside the handler: an error of the recovery must not pass for this one.
            received = self.recover(failed, holds_state=False)
        if self.control is not None:
            self.control.set_state(WorkerState.TRAINING)
        return received

    def votes_to_reform(self) -> bool:
        """This rank's vote for the step about to run: stop after it and re-form the group,
        because the agent wants a new generation, unless a checkpoint save in flight holds it back
        for a while (:func:`~elastictrain.train.recovery_decisions.vote_at_boundary`)."""
        assert self.control is not None  # noqa: S101 - only in-process
        checkpoints = self.generation.checkpoints if self.generation is not None else None
        vote = vote_at_boundary(self._due(), saving=checkpoints is not None and checkpoints.saving,
                                due_since=self._due_since, now=time.monotonic())
        self._due_since = vote.due_since
        return vote.wanted

    def _due(self) -> Due:
        """The agent's word now, as the boundary's decisions take it."""
        return Due.of(self.control.due() if self.control is not None else None)

    def clip_grad_norm(self, parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """The strategy's clipping of the global gradient norm (a sharded one's is a collective)."""
        with self.collective():
            return self.strategy.clip_grad_norm(parameters, max_norm)

    def objects(self) -> dict[str, Any]:
        """The training state by name, as a checkpoint writes it and a live peer sends it (the
        strategy names what stands for the model and the optimizer)."""
        return self._state.objects(self.context.world_size, self.strategy)

    def boundary_cause(self, step: int) -> str:
        """Why the group stops after ``step``, once the vote said so."""
        return boundary_cause(self._due(), step)

    def _join(self) -> None:
        """Join this generation's process group (or adopt the one given)."""
        config = self.config
        if self._group is not None:
            rank, world = dist.get_rank(self._group), dist.get_world_size(self._group)
            self._set_context(dataclasses.replace(self.context, rank=rank, world_size=world))
            device = torch.device(config.device) if config.device else pg.device_for(
                self.context, dist.get_backend(self._group))
            placement = pg.Placement(device, dist.get_backend(self._group), pg.resolve_timeout(config.timeout),
                                     rank, world, owned=False)
            self.generation = Generation(placement, self._group, in_process=False, strategy=self.strategy,
                                         local_world_size=self.context.local_world_size)
            return
        placement, context, self._assignment = join_generation(
            self.context, self.control, self._assignment, backend=config.backend, timeout=config.timeout,
            device=config.device, recovery_timeout=config.recovery_timeout)
        self._set_context(context)
        if placement.distributed and (placement.rank, placement.world_size) != (
                self.context.rank, self.context.world_size):
            # An existing group (someone else's init) defines the world.
            self._set_context(dataclasses.replace(self.context, rank=placement.rank,
                                                  world_size=placement.world_size))
        self.generation = Generation(placement, None, in_process=self.control is not None and placement.distributed,
                                     strategy=self.strategy, local_world_size=self.context.local_world_size)

    def _adopt(self, assignment: Assignment) -> None:
        """Take this worker's rank, world and store address from the agent's ``assignment``."""
        self._assignment = assignment
        self._set_context(context_for(self.context, assignment))

    def _set_context(self, context: WorkerContext) -> None:
        if self._assignment is not None:
            # In-process, this process outlives the environment the agent started it with.
            os.environ.update(torch_env(context, self._assignment))
        if context is not self.context:
            self.context = context
            self.log = get_logger(__name__, context)
            follow_context(context)  # the module loggers' prefix (sampler, checkpoints) too

    def form(self, *, holds_state: bool, phases: dict[str, float] | None = None) -> bool:
        """Make this generation's training state and wrappers; a collective.

        The ranks agree on the newest state any of them holds; ranks without it receive
        it from a live peer. When no rank holds state (the job starts or restarts as a
        whole), or the strategy's state is no replica a peer could send
        (:attr:`~elastictrain.train.strategy.ParallelStrategy.live_transfer`), every rank reads
        the newest checkpoint instead.

        Args:
            holds_state: Whether this worker holds training state.
            phases: Seconds are added to its ``state_s`` (agreeing, receiving or restoring
                the state) and ``ddp_s`` (wrapping the model by the strategy), if given.

        Returns:
            Whether this rank received the state from a peer.
        """
        started = time.perf_counter()
        config, generation, state = self.config, self.generation, self._state
        sampler = state.sampler
        assert generation is not None and sampler is not None  # noqa: S101 - private invariant
        generation.check_same_settings({
            "the dataset's length": sampler.num_samples, "global_batch_size": config.global_batch_size,
            "micro_batch_size": config.micro_batch_size, "epochs": config.epochs, "max_steps": config.max_steps,
            "seed": config.seed, "shuffle": config.shuffle, "drop_last": config.drop_last})
        agreement = agree(generation.cpu_group(), holds=holds_state, step=state.step) if generation.in_process else None
        someone_holds = None if agreement is None else agreement.source is not None
        live = self.strategy.live_transfer
        if live and agreement is not None and agreement.step is not None:
            # Every rank asks (the inputs are agreed): a sharded strategy's live holders may lack a region.
            live = self.strategy.covers(generation.cpu_group(), agreement, state.module, state.optimizer,
                                        step=state.step, local_world_size=self.context.local_world_size)
        source = state_source(holds=holds_state, someone_holds=someone_holds, live_transfer=live)
        kept = state.module
        # The user's model built on the meta device: the strategy gives it values (initialize())
        # unless the state comes from a peer or a checkpoint; as every rank gives it the same
        # values, nothing is broadcast.
        on_meta = config.init_weights is not None and on_meta_device(kept)
        if on_meta and not generation.placement.distributed:
            # One process trains the whole model (no group shards it): allocated and set here,
            # before a restore reads into it, the values the shards would hold together.
            assert config.init_weights is not None  # noqa: S101 - on_meta says so
            materialize(kept, config.init_weights, seed=config.seed, device=generation.placement.device)
            on_meta = False
        state.module = self.strategy.unwrapped(state.module, state.optimizer)
        received = False
        if source is StateSource.PEERS:
            assert agreement is not None  # noqa: S101 - PEERS only from an agreement
            received = self.strategy.transfer_state(generation.cpu_group(), agreement, self.objects(), step=state.step)
            # The newest step, or an older one the live ranks hold whole (a sharded strategy's copies).
            state.step = self.strategy.rebuild_step(agreement) or 0
        self._formed = (source, agreement.step if agreement is not None else None)
        sampler.set_world(self.context.rank, self.context.world_size)
        restoring = config.checkpoint_dir is not None and source is StateSource.CHECKPOINT
        # A sharded strategy wraps first and restores into its shards: each rank reads its own regions.
        after_wrap = restoring and self.strategy.restores_wrapped and generation.placement.distributed
        rebuilt = state.module is not kept  # a fresh module (unwrapped()): its values are unset
        if after_wrap:
            # Agreed: a rank whose module was rebuilt (a survivor) has no values to broadcast, so no
            # rank broadcasts before the restore, a newcomer's own model included.
            rebuilt = _any_rank(generation.cpu_group(), rebuilt)
        if config.checkpoint_dir is not None:
            generation.open_checkpoints(config, self.control, on_write_failure=self._on_write_failure)
        filled = self._restore_newest() if restoring and not after_wrap else False
        if rebuilt and source is not StateSource.PEERS and not filled and not after_wrap:
            raise _unheld(state.step)
        if received:
            # Its peers' RNG streams are theirs: a worker that received the state seeds
            # streams of its own, from its rank and generation.
            assert self.control is not None  # noqa: S101 - only in-process
            seed_everything(rank_seed(config.seed ^ self.control.generation, self.context.rank))
        elif not holds_state and state.restored is None:
            # Distinct, reproducible streams per rank (dropout, augmentation); a restore
            # brings back the saved ones instead.
            seed_everything(rank_seed(config.seed, self.context.rank))
        wrapping = time.perf_counter()
        # A rebuilt module restored after the wrap needs no broadcast: the restore sets every value.
        identical = source is StateSource.PEERS or (after_wrap and rebuilt) or on_meta
        generation.wrap(state.module, state.optimizer, identical=identical, control=self.control)
        if on_meta and source is not StateSource.PEERS:
            self.strategy.initialize(state.module, seed=config.seed)  # a restore then sets what it holds
        wrapped = time.perf_counter()
        if after_wrap and not self._restore_newest() and rebuilt:
            raise _unheld(state.step)
        if phases is not None:
            phases["state_s"] += wrapping - started + time.perf_counter() - wrapped
            phases["ddp_s"] += wrapped - wrapping
        return received

    def _restore_newest(self) -> bool:
        """Restore the newest checkpoint (a collective); whether one was restored."""
        before = self._state.restored
        self._restore()
        return self._state.restored is not before

    def recover(self, cause: str, *, holds_state: bool = True) -> bool:
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
        control = self.control
        assert control is not None  # noqa: S101 - only in-process
        old_world, old_step = self.context.world_size, self._state.step
        self._due_since = None
        abandoned: tuple[int, str] | None = None

        def leave(why: str) -> None:
            nonlocal abandoned
            assert self.generation is not None  # noqa: S101 - private invariant
            abandoned = self._abandoned_save(self.generation.leave(), why) or abandoned

        def join(assignment: Assignment) -> None:
            self._adopt(assignment)
            self._join()
            # The same order of collectives as a worker that starts in this generation
            # (Session._start): hooks' on_rendezvous, then the state agreement.
            self.hooks.dispatch("on_rendezvous", rank=self.context.rank, world_size=self.context.world_size,
                                restart_count=self.context.restart_count)

        reformed = reform_in_place(control, cause, leave=leave, join=join,
                                   form=lambda phases: self.form(holds_state=holds_state, phases=phases),
                                   recovery_timeout=self.config.recovery_timeout)
        self.recoveries += 1
        step, cause, seconds = self._state.step, reformed.cause, reformed.seconds
        source, newest = self._formed or (None, None)
        # The committed steps the group does again: from the newest any live rank held to the step
        # its state came from (a checkpoint's, or an older step the ranks held whole in memory).
        newest = max(newest or 0, old_step if holds_state else 0)
        announce_recovery(self.log, reformed, generation=control.generation, assignment=self._assignment,
                          rank=self.context.rank, old_world_size=old_world, world_size=self.context.world_size,
                          step=step, steps_redone=max(0, newest - step),
                          state_from=source.value if source is not None else None)
        if abandoned is not None and self.context.rank == 0:
            self._say_abandoned(*abandoned)
        if holds_state:
            self.hooks.dispatch("on_recovery", step=step, cause=cause, generation=control.generation,
                                world_size=self.context.world_size, seconds=seconds)
            if old_world != self.context.world_size:
                self.hooks.dispatch("on_world_change", old_world_size=old_world,
                                    new_world_size=self.context.world_size)
        return reformed.received

    def _abandoned_save(self, in_flight: CheckpointError | None, cause: str) -> tuple[int, str] | None:
        """The step and reason of a checkpoint the re-formation after ``cause`` abandoned: an
        asynchronous save that was in flight (``in_flight``: why it failed), or the save due at the
        committed step, which did not commit (a peer died during it, or before it began)."""
        state, every = self._state, self.config.checkpoint_every
        if in_flight is not None and state.saved_step is not None:
            return state.saved_step, describe(in_flight)
        if every and state.step > 0 and state.step % every == 0 and state.saved_step != state.step:
            return state.step, cause
        return None

    def _say_abandoned(self, step: int, reason: str) -> None:
        """One line and a ``checkpoint_abandoned`` event (rank 0): a checkpoint that was not
        committed, why, and when the next one is due (an abandoned save is not retried)."""
        next_step = self.config.next_save(self._state.step)
        self.log.warning("the checkpoint of step %d was abandoned, nothing of it committed (%s); the next is due %s",
                         step, reason, "at the end of the run" if next_step is None else f"at step {next_step}")
        events.emit("checkpoint_abandoned", step=step, reason=reason, next_step=next_step)

    def close(self) -> None:
        """Drop the group (destroyed if the session formed it) and the control channel."""
        if self.generation is not None:
            self.generation.end()
        if self.control is not None:
            self.control.close()


def _any_rank(group: Any, flag: bool) -> bool:
    """Whether ``flag`` holds on any rank of ``group`` (a collective)."""
    tensor = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return bool(tensor.item())


def _unheld(step: int) -> SessionError:
    return SessionError(f"the sharded state of step {step} is not held by the live ranks "
                        "(a rank was lost with its shards) and there is no checkpoint to restore")
