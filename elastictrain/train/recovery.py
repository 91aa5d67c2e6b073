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

On NCCL a collective that waits for a dead peer can be aborted: when the agent
publishes a new generation while this worker trains, the liveness thread aborts the
communicator so that the stuck collective fails now. gloo cannot abort a blocked
collective (pytorch/pytorch#130345); there the agent kills a hung peer instead, and
the collectives waiting for it fail at once.
"""

from __future__ import annotations

import dataclasses
import logging
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from elastictrain.train import process_group as pg
from elastictrain._control import Assignment, WorkerState
from elastictrain._torch_compat import is_collective_failure
from elastictrain.errors import SessionError
from elastictrain.train.control import WorkerControl
from elastictrain.train.worker import WorkerContext

logger = logging.getLogger(__name__)

__all__ = [
    "abort_default_group", "context_for", "describe", "is_collective_failure", "join_generation", "torch_env",
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
