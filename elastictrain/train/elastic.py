"""In-process recovery for a training loop you keep (in the spirit of Horovod's ``hvd.elastic.run``).

Name the objects that make up the training state, mark each step's end with
:meth:`ElasticState.commit`, and run the loop through :func:`run_elastic`::

    state = elastictrain.ElasticState(model=model, optimizer=optimizer, sampler=sampler)

    def train(state):
        ddp = DistributedDataParallel(state.model)            # made again after each re-formation
        while state.step < total_steps:
            loss_fn(ddp(batch_for(state))).backward()
            state.optimizer.step(); state.optimizer.zero_grad()
            state.commit()                                      # right after the optimizer step

    elastictrain.run_elastic(train, state)

A collective that fails inside ``train`` (a peer died), or a membership change agreed at
a ``commit``, makes :func:`run_elastic` re-form the process group in place, give ranks without
the state (new and replacement workers) the newest one from a live peer, and call
``train(state)`` again. Only when no rank holds state (the whole job starts or
restarts) is ``restore`` called, to read a checkpoint.

The contract: ``commit()`` right after each ``optimizer.step()``, with no collective
in between (the step counter is what the ranks compare); build DDP (and anything else
holding the process group) inside ``train``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from elastictrain.train import peer_connections, process_group as pg
from elastictrain._control import Assignment, WorkerState
from elastictrain.errors import ConfigError, SessionError
from elastictrain.train.boundary import explicit_vote
from elastictrain.train.sampler import ElasticSampler
from elastictrain.train.control import WorkerControl
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
from elastictrain.train.state_transfer import agree, transfer
from elastictrain.train.worker import WorkerContext

logger = logging.getLogger(__name__)

__all__ = ["ElasticState", "run_elastic"]

_T = TypeVar("_T")


class _Reform(Exception):  # noqa: N818 - a signal, caught by run_elastic()
    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


class ElasticState:
    """The objects of a training loop's state, by name, and its step counter.

    Args:
        **objects: Objects with ``state_dict()``/``load_state_dict()`` (model, optimizer,
            scheduler, GradScaler, :class:`~elastictrain.train.sampler.ElasticSampler`) or dicts
            of plain data (updated in place). Each is also an attribute (``state.model``).
    """

    def __init__(self, **objects: Any) -> None:
        if "progress" in objects:
            raise ConfigError("'progress' is reserved: it holds the step counter")
        for name, obj in objects.items():
            if not isinstance(obj, dict) and not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ConfigError(f"state {name!r} must be a dict or have state_dict()/load_state_dict(), "
                                  f"got {type(obj).__name__}")
        self._objects = dict(objects)
        self._progress: dict[str, int] = {"step": 0}
        self._control: WorkerControl | None = None
        self._placement: pg.Placement | None = None  # of the group this rank trains in (set by run_elastic)
        self._training = False  # inside train(), run by run_elastic()
        self.context = WorkerContext()
        self.generation = 0
        """The generation of the group this rank trains in (1 at the first formation)."""

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(name)

    @property
    def step(self) -> int:
        """Steps committed so far (received from a peer after a re-formation)."""
        return self._progress["step"]

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def world_size(self) -> int:
        return self.context.world_size

    def objects(self) -> dict[str, Any]:
        """What is transferred between ranks: the named objects and the step counter."""
        return {**self._objects, "progress": self._progress}

    def commit(self) -> None:
        """Mark the end of a step (call it right after ``optimizer.step()``); a collective.

        Raises (caught by :func:`run_elastic`): a re-formation is due after this step, agreed by
        every rank through one small all-reduce.

        Raises:
            SessionError: Called outside the ``train`` function that :func:`run_elastic` runs
                (it would count a step that no group agreed on).
        """
        if not self._training:
            raise SessionError("commit() marks the end of a step of the train function that "
                               "run_elastic(train, state) runs; it was called outside it")
        self._progress["step"] += 1  # before any collective: this rank applied the step
        control = self._control
        if control is None:
            return
        control.step_done(self.step)
        placement = self._placement
        if placement is None or not placement.distributed:
            return
        # The boundary's one vote (a Session's strategy takes it the same way when it cannot carry
        # it on its gradients): no checkpoint save of the session's holds it back here.
        due = Due.of(control.due())
        if explicit_vote(vote_at_boundary(due, saving=False, due_since=None, now=0.0).wanted, placement) > 0:
            raise _Reform(boundary_cause(Due.of(control.due()), self.step))  # its word now, if it said any since


def run_elastic(train: Callable[[ElasticState], _T], state: ElasticState, *, restore: Callable[[], None] | None = None,
        backend: str | None = None, timeout: timedelta | float | None = None,
        recovery_timeout: timedelta = timedelta(seconds=600)) -> _T:
    """Form the process group, then run ``train(state)``, re-forming in place after faults.

    Args:
        train: The training loop; called again after each re-formation.
        state: The training state (see :class:`ElasticState`).
        restore: Called on every rank when no live rank holds state (the job starts or
            restarts as a whole): read a checkpoint into ``state`` here.
        backend: Process-group backend (default as :func:`elastictrain.init_process_group`).
        timeout: Collective timeout (a number is seconds, as :func:`elastictrain.init_process_group`
            takes it).
        recovery_timeout: How long to wait for the agent's next generation.

    Returns:
        What ``train`` returned.

    Raises:
        ConfigError: ``recovery_timeout`` is not a ``timedelta``.
        Whatever ``train`` raises that is not a failed collective.
    """
    if not isinstance(recovery_timeout, timedelta):
        raise ConfigError(f"recovery_timeout must be a datetime.timedelta, got {recovery_timeout!r} "
                          f"(for seconds: timedelta(seconds={recovery_timeout!r}))")
    state.context = WorkerContext.from_env()
    state._control = WorkerControl.from_env(state.context.local_rank, state.context.local_world_size)  # noqa: SLF001
    control = state._control  # noqa: SLF001
    assignment = control.current() if control is not None else None
    if assignment is not None:
        state.context = context_for(state.context, assignment)  # the agent's newest word
    holds = False  # restored, received or its own: not before a formation (a fresh rank's state is no step's)

    def join(next_assignment: Assignment | None) -> None:
        nonlocal assignment
        if next_assignment is not None:
            assignment, state.context = next_assignment, context_for(state.context, next_assignment)
        state._placement, state.context, assignment = join_generation(  # noqa: SLF001
            state.context, control, assignment, backend=backend, timeout=timeout, recovery_timeout=recovery_timeout)
        if assignment is not None:  # this process outlives the environment it was started with
            os.environ.update(torch_env(state.context, assignment))

    def form(phases: dict[str, float]) -> bool:
        nonlocal holds
        started = time.perf_counter()
        received = _form(state, holds=holds, restore=restore)
        holds = True
        phases["state_s"] += time.perf_counter() - started
        return received

    try:
        cause: str | None = None
        join(None)
        try:
            form(dict.fromkeys(RECOVERY_PHASES, 0.0))
        except Exception as exc:
            if control is None or not is_collective_failure(exc):
                raise
            cause = f"the group failed to form ({describe(exc)})"
        while True:
            if cause is not None:
                assert control is not None  # noqa: S101 - only in-process re-forms
                logger.info("re-forming the group in place: %s", cause)
                old_world = state.context.world_size
                reformed = reform_in_place(control, cause, leave=_leave, join=join, form=form,
                                           recovery_timeout=recovery_timeout)
                announce_recovery(logger, reformed, generation=control.generation, assignment=assignment,
                                  rank=state.context.rank, old_world_size=old_world,
                                  world_size=state.context.world_size, step=state.step)
            elif control is not None:
                control.set_state(WorkerState.TRAINING)
            state._training = True  # noqa: SLF001
            try:
                return train(state)
            except _Reform as reform:
                cause = reform.cause
            except Exception as exc:
                if control is None or not is_collective_failure(exc):
                    raise
                cause = f"a collective failed ({describe(exc)})"
            finally:
                state._training = False  # noqa: SLF001
    finally:
        if control is not None:
            control.close()
        pg.destroy_process_group()


def _leave(_cause: str) -> None:
    """Drop this rank's group, without a collective: a peer blocked on this rank fails now, not at
    its timeout. The loop's own wrappers (its DDP) go with its ``train`` call."""
    peer_connections.sever(None)
    pg.destroy_process_group()


def _form(state: ElasticState, *, holds: bool, restore: Callable[[], None] | None) -> bool:
    """Bring ``state`` to the group's newest step: received from a live peer, or restored when no
    rank holds any (:func:`~elastictrain.train.recovery_decisions.state_source`); a collective.
    Returns whether this rank received it."""
    control, placement = state._control, state._placement  # noqa: SLF001
    assert placement is not None  # noqa: S101 - set by the join
    if control is not None:
        state.generation = control.generation
    agreement = group = None
    if placement.distributed and control is not None:
        group = None if placement.backend == "gloo" else pg.new_gloo_group(placement.timeout)
        agreement = agree(group, holds=holds, step=state.step)
    # The loop's objects are replicas (its DDP's), whatever it trains: a live peer's are the state.
    source = state_source(holds=holds, someone_holds=None if agreement is None else agreement.source is not None,
                          live_transfer=True)
    received = False
    if source is StateSource.PEERS:
        assert agreement is not None  # noqa: S101 - PEERS only from an agreement
        received = transfer(group, agreement, state.objects(), step=state.step)
    elif source is StateSource.CHECKPOINT and restore is not None:
        restore()
    for obj in state.objects().values():
        if isinstance(obj, ElasticSampler):
            obj.set_world(state.context.rank, state.context.world_size)
    return received
