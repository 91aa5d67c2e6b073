"""In-process recovery of one worker: agree on a step boundary, then re-form the group in place.

The worker keeps its process, its CUDA context and its training state through a
fault; only the process group is rebuilt:

1. **When.** A membership change (a node joins, leaves, or a peer was replaced) takes
   effect at a step boundary every rank agrees on: each rank votes when its agent
   says a new generation is due, and the parallelism strategy carries the vote (DDP on the
   step's own gradient all-reduce, :class:`~elastictrain.train.ddp.BoundaryFlag`; otherwise one
   small all-reduce at the boundary), so after step *k* every rank knows the same count and
   stops after step *k*. A collective that fails (a peer
   died) stops this rank at once; the step in flight is discarded (its optimizer step
   never ran here).
2. **Where.** The agent re-rendezvouses and publishes the next generation: this
   worker's rank, the world size and rank 0's store address. The worker destroys its
   process group and forms the new one.
3. **What.** The ranks agree on the newest step any of them holds and the ranks
   without it receive it from one that has it (:mod:`~elastictrain.train.state_transfer`).

One path does 2 and 3 for a ``Session`` and for ``run_elastic`` alike
(:func:`reform_in_place`: leave, wait for the agent's generation, join, agree on the state,
transfer or restore, rebuild), with the decisions apart (:mod:`~elastictrain.train.recovery_decisions`).

On NCCL a collective that waits for a dead peer can be aborted: when the agent
publishes a new generation while this worker trains, the liveness thread aborts the
communicator so that the stuck collective fails now. gloo cannot abort a blocked
collective (pytorch/pytorch#130345); there the agent kills a hung peer instead, and
the collectives waiting for it fail at once.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from elastictrain import events
from elastictrain.train import process_group as pg
from elastictrain._control import Assignment, WorkerState
from elastictrain._fault import Fault
from elastictrain._torch_compat import is_collective_failure
from elastictrain.errors import SessionError
from elastictrain.train.control import WorkerControl
from elastictrain.train.worker import WorkerContext

logger = logging.getLogger(__name__)

__all__ = [
    "RECOVERY_PHASES", "Reformed", "abort_default_group", "announce_recovery", "context_for", "describe",
    "describe_phases", "is_collective_failure", "join_generation", "reform_in_place", "torch_env",
    "wait_for_generation",
]
# is_collective_failure is defined in elastictrain._torch_compat, with torch's exception types it
# reads; the train side imports it from here.


def describe(error: BaseException) -> str:
    """One line of ``error``: its type and the first line that says something (gloo's message
    is followed by a C++ backtrace, whose frames are not the reason)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    said = next((line for line in lines if not line.startswith(("Exception raised from", "frame #", "/"))), "")
    return f"{type(error).__name__}: {said[:200]}"


def abort_default_group() -> None:
    """Abort the NCCL communicators of the default group: a collective stuck on a peer that is
    gone fails at once, and the worker re-forms (called from the liveness thread)."""
    group = dist.group.WORLD
    if group is not None and dist.is_initialized():
        logger.warning("a collective is stuck on a peer that is gone: aborting NCCL")
        group.abort()


def wait_for_generation(control: WorkerControl, timeout: timedelta) -> Assignment:
    """Say this worker is recovering and wait for its agent's next generation.

    Raises:
        JobEnded: The agent closed the group.
        TimeoutError: No generation came within ``timeout``.
    """
    control.set_state(WorkerState.RECOVERING)
    return control.wait_for_next(timeout.total_seconds())


def context_for(context: WorkerContext, assignment: Assignment) -> WorkerContext:
    """``context`` with the rank, world and store address the agent's ``assignment`` gives it.

    Raises:
        SessionError: The assignment has no rank for this worker's local rank.
    """
    rank = assignment.rank_of(context.local_rank)
    if rank is None:
        raise SessionError(f"the agent's generation {assignment.generation} has no rank for local rank "
                           f"{context.local_rank}")
    return dataclasses.replace(context, rank=rank, world_size=assignment.world_size, node_rank=assignment.group_rank,
                               master_addr=assignment.master_addr, master_port=assignment.master_port)


def torch_env(context: WorkerContext, assignment: Assignment) -> dict[str, str]:
    """torch's environment variables of a worker at ``context`` in ``assignment``'s generation:
    what the agent would give a worker it started into that generation. A worker kept through
    a re-formation (in-process recovery) writes them into its ``os.environ``, so that a script or
    library reading ``RANK``/``WORLD_SIZE`` sees the group it trains in.

    ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` do not change in place (a node keeps its workers);
    ``TORCHELASTIC_RESTART_COUNT`` counts the agent's restarts of its whole worker group, which
    an in-place re-formation is not. One role per job: its role rank and size are the global ones.
    """
    return {
        "RANK": str(context.rank),
        "WORLD_SIZE": str(context.world_size),
        "ROLE_RANK": str(context.rank),
        "ROLE_WORLD_SIZE": str(context.world_size),
        "GROUP_RANK": str(assignment.group_rank),
        "GROUP_WORLD_SIZE": str(assignment.group_world_size),
        "LOCAL_WORLD_SIZE": str(context.local_world_size),
        "MASTER_ADDR": assignment.master_addr,
        "MASTER_PORT": str(assignment.master_port),
    }


FORMATION_ATTEMPTS = 3
"""Groups in a row that may fail to form before the worker fails (see :func:`join_generation`)."""


def join_generation(context: WorkerContext, control: WorkerControl | None, assignment: Assignment | None, *,
                    backend: str | None, timeout: timedelta | float | None, device: Any = None,
                    recovery_timeout: timedelta) -> tuple[pg.Placement, WorkerContext, Assignment | None]:
    """Form the process group of ``assignment``, following the agent to a newer generation
    announced while it forms (two generations in quick succession: the peers went on).

    In-process, a group that fails to form (a peer died meanwhile, or rank 0 left the round
    and its store with it, before this worker's agent said anything) is no failure of this
    worker: it says it recovers, which makes its agent re-form, and joins the next generation;
    :data:`FORMATION_ATTEMPTS` failures in a row are (a peer that cannot be reached, a
    timeout), and the last one is raised.

    Returns:
        The placement, and the context and assignment it was formed with.
    """
    failed = 0
    while True:
        tag = None
        if control is not None and assignment is not None:
            tag = (f"round{assignment.round}-world{assignment.world_size}-{assignment.master_addr}:"
                   f"{assignment.master_port}", control.superseded)
        try:
            return pg.init_process_group(context, backend=backend, timeout=timeout, device=device,
                                         generation=tag), context, assignment
        except pg.GroupSuperseded as exc:
            assert control is not None  # noqa: S101 - only an in-process join can be superseded
            logger.info("%s: joining the newer one", exc)
        except Exception as exc:
            failed += 1
            if control is None or failed >= FORMATION_ATTEMPTS or not is_collective_failure(exc):
                raise
            logger.warning("the group of generation %d failed to form (%s): waiting for the next one",
                           control.generation, describe(exc))
        assignment = wait_for_generation(control, recovery_timeout)
        context = context_for(context, assignment)


RECOVERY_PHASES = ("wait_s", "group_s", "state_s", "ddp_s")
"""Where a re-formation's seconds go (the ``recovery`` event carries each): leaving the old group
and waiting for the agent's next generation; joining the new group (and any formation that
failed); agreeing on the state and receiving it from a peer (or restoring it); wrapping the
model (by the session's strategy: DDP's by default; 0 under ``run_elastic``, whose loop wraps it)."""


def describe_phases(phases: dict[str, float]) -> str:
    """``phases`` for a log line: ``waited 0.12 s, group 0.05 s, state 0.15 s, DDP 0.03 s``."""
    return (f"waited {phases['wait_s']:.2f} s, group {phases['group_s']:.2f} s, state {phases['state_s']:.2f} s, "
            f"DDP {phases['ddp_s']:.2f} s")


@dataclasses.dataclass(frozen=True, slots=True)
class Reformed:
    """What one re-formation in place did (:func:`reform_in_place`)."""

    cause: str
    """What made the group re-form, and any formation that failed on the way."""
    seconds: float
    """From the decision to re-form to the state and wrappers of the new group."""
    phases: dict[str, float]
    """Those seconds by :data:`RECOVERY_PHASES`."""
    received: bool
    """Whether this rank received the state from a peer."""


def reform_in_place(control: WorkerControl, cause: str, *, leave: Callable[[str], None],
                    join: Callable[[Assignment], None], form: Callable[[dict[str, float]], bool],
                    recovery_timeout: timedelta) -> Reformed:
    """Re-form the group in this process after ``cause``: the one path of a ``Session`` and of
    ``run_elastic``.

    Says this worker recovers (its agent re-forms meanwhile), then ``leave(cause)`` (drop the
    group and what was built on it, without a collective: peers may be dead), waits for the
    agent's next generation, ``join(assignment)`` (form its process group) and ``form(phases)``
    (agree on the newest state, receive it or restore it, rebuild on the group; it adds its
    seconds to ``phases``' ``state_s`` and ``ddp_s``, and returns whether this rank received the
    state). A collective that fails on the way (a peer died meanwhile) starts again from the
    leave, and is added to the cause; then the worker says it trains.

    Raises:
        JobEnded: The agent closed the group.
        TimeoutError: No generation came within ``recovery_timeout``.
        Whatever ``leave``, ``join`` or ``form`` raise that is no collective failure.
    """
    started = time.perf_counter()
    phases = dict.fromkeys(RECOVERY_PHASES, 0.0)
    while True:
        # Said before leaving, which waits for a save in flight: the agent re-forms meanwhile.
        control.set_state(WorkerState.RECOVERING)
        control.on_stuck(None)  # the old group's: the next one arms its own
        mark = time.perf_counter()
        leave(cause)
        assignment = wait_for_generation(control, recovery_timeout)
        phases["wait_s"] += time.perf_counter() - mark
        mark = time.perf_counter()
        try:
            join(assignment)
            phases["group_s"] += time.perf_counter() - mark
            mark = time.perf_counter()
            received = form(phases)
            break
        except Exception as exc:
            if not is_collective_failure(exc):
                raise
            phases["group_s"] += time.perf_counter() - mark  # a formation that failed counts as joining
            cause = f"{cause}; then the new group failed to form ({describe(exc)})"
    control.set_state(WorkerState.TRAINING)
    return Reformed(cause, time.perf_counter() - started, phases, received)


def announce_recovery(log: logging.Logger | logging.LoggerAdapter[Any], reformed: Reformed, *, generation: int,
                      assignment: Assignment | None, rank: int, old_world_size: int, world_size: int,
                      step: int, steps_redone: int = 0, state_from: str | None = None) -> None:
    """Say a re-formation in one line, and rank 0 in a ``recovery`` event (with the fault its agent
    handed it in ``assignment``, if any: this rank saw only its effect, the committed steps the
    group redoes: a restore from a checkpoint older than the step it had reached, or a roll back
    to an older step the ranks held whole in memory, and ``state_from``, where the state came
    from: ``"peers"``, the live ranks' memory, or ``"checkpoint"``)."""
    fault = Fault.from_json(assignment.fault) if assignment is not None else None
    said = f"{fault.describe()}; here: " if fault is not None else ""
    log.info("recovered in %.2fs (%s%s): generation %d, world size %d -> %d, step %d%s%s (%s)", reformed.seconds, said,
             reformed.cause, generation, old_world_size, world_size, step,
             f", {steps_redone} committed step(s) to redo" if steps_redone else "",
             f", state from {state_from}" if state_from else "", describe_phases(reformed.phases))
    if rank == 0:
        events.emit("recovery", cause=reformed.cause, generation=generation, seconds=round(reformed.seconds, 4),
                    old_world_size=old_world_size, world_size=world_size, step=step, steps_redone=steps_redone,
                    **({"state_from": state_from} if state_from is not None else {}),
                    **({"fault": fault.to_json()} if fault is not None else {}),
                    **{name: round(value, 4) for name, value in reformed.phases.items()})
