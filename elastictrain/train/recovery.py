"""In-process recovery of one worker: agree on a step boundary, then re-form the group in place.

The worker keeps its process, its CUDA context and its training state through a
fault; only the process group is rebuilt:

1. **When.** A membership change (a node joins, leaves, or a peer was replaced) takes
   effect at a step boundary every rank agrees on: each rank sets a flag when its
   agent says a new generation is due, and the flag rides on the step's own gradient
   all-reduce (one more element in DDP's first bucket), so after step *k* every rank
   knows the same sum and stops after step *k*. A collective that fails (a peer
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

import torch
import torch.distributed as dist

from elastictrain import process_group as pg
from elastictrain._control import Assignment, WorkerState
from elastictrain.errors import SessionError
from elastictrain.train.control import WorkerControl
from elastictrain.worker import WorkerContext

logger = logging.getLogger(__name__)

__all__ = ["BoundaryFlag", "context_for", "describe", "is_collective_failure", "join_generation", "wait_for_generation"]

# What gloo and NCCL say when a peer or the network is gone, besides torch's DistError types.
_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe", "connection refused",
            "closed by peer")


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a failed collective: a peer died or hung, the
    network broke, the communicator was aborted."""
    seen: set[int] = set()
    err: BaseException | None = exc
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, dist.DistError):
            return True
        if isinstance(err, RuntimeError) and any(m in str(err).lower() for m in _MARKERS):
            return True
        err = err.__cause__ or err.__context__
    return False


def describe(error: BaseException) -> str:
    """One line of ``error``: its type and the first line that says something (gloo's message
    is followed by a C++ backtrace, whose frames are not the reason)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    said = next((line for line in lines if not line.startswith(("Exception raised from", "frame #", "/"))), "")
    return f"{type(error).__name__}: {said[:200]}"


class BoundaryFlag:
    """The "re-form after this step" flag, carried by DDP's gradient all-reduce.

    Register :meth:`hook` with ``DistributedDataParallel.register_comm_hook(flag, BoundaryFlag.hook)``;
    call :meth:`arm` before each step's backward. The hook divides each bucket by the
    world size and all-reduces it, as DDP's default does; the first bucket (the
    smallest, by DDP's design) carries one more element: this rank's flag. After the
    backward, :attr:`raised` is the number of ranks that wanted to stop.
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.wanted = False
        self.raised = 0

    def arm(self, wanted: bool) -> None:
        self.wanted = wanted
        self.raised = 0

    @staticmethod
    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations here
        group = state.group
        world = dist.get_world_size(group)
        buffer = bucket.buffer()
        if bucket.index() != 0:
            buffer.div_(world)
            work = dist.all_reduce(buffer, group=group, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])
        flag = torch.full((1,), 1.0 if state.wanted else 0.0, dtype=buffer.dtype, device=buffer.device)
        combined = torch.cat([buffer.div(world), flag])
        work = dist.all_reduce(combined, group=group, async_op=True)

        def split(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            out = fut.value()[0]
            state.raised = int(round(float(out[-1])))
            buffer.copy_(out[:-1])
            return buffer

        return work.get_future().then(split)


def wait_for_generation(control: WorkerControl, timeout: float) -> Assignment:
    """Say this worker is recovering and wait for its agent's next generation.

    Raises:
        JobEnded: The agent closed the group.
        TimeoutError: No generation came within ``timeout`` seconds.
    """
    control.set_state(WorkerState.RECOVERING)
    return control.wait_for_next(timeout)


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


def join_generation(context: WorkerContext, control: WorkerControl | None, assignment: Assignment | None, *,
                    backend: str | None, timeout: timedelta | float | None, device: Any = None,
                    recovery_timeout: float) -> tuple[pg.Placement, WorkerContext, Assignment | None]:
    """Form the process group of ``assignment``, following the agent to a newer generation
    announced while it forms (two generations in quick succession: the peers went on).

    Returns:
        The placement, and the context and assignment it was formed with.
    """
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
            assignment = wait_for_generation(control, recovery_timeout)
            context = context_for(context, assignment)
