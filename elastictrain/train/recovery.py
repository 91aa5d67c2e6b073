"""In-process recovery of one worker: agree on a step boundary, then re-form the group in place.

The worker keeps its process, its CUDA context and its training state through a
fault; only the process group is rebuilt:

1. **When.** A membership change (a node joins, leaves, or a peer was replaced) takes
   effect at a step boundary every rank agrees on: each rank sets a flag when its
   agent says a new generation is due, and the flag rides on the step's own gradient
   all-reduce (the gradient of one more parameter, in DDP's first bucket), so after step *k* every rank
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

import copy
import dataclasses
import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastictrain.train import process_group as pg
from elastictrain._control import Assignment, WorkerState
from elastictrain._torch_compat import is_collective_failure
from elastictrain.errors import SessionError
from elastictrain.train.control import WorkerControl
from elastictrain.train.worker import WorkerContext

logger = logging.getLogger(__name__)

__all__ = [
    "BoundaryFlag", "abort_default_group", "context_for", "describe", "is_collective_failure", "join_generation",
    "torch_env", "wait_for_generation", "wrap_in_ddp",
]
# is_collective_failure is defined in elastictrain._torch_compat, with torch's exception types it
# reads; the train side imports it from here.


def describe(error: BaseException) -> str:
    """One line of ``error``: its type and the first line that says something (gloo's message
    is followed by a C++ backtrace, whose frames are not the reason)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    said = next((line for line in lines if not line.startswith(("Exception raised from", "frame #", "/"))), "")
    return f"{type(error).__name__}: {said[:200]}"


class BoundaryFlag(torch.nn.Module):
    """The model that DDP trains, plus the "re-form after this step" flag, carried by DDP's own
    gradient all-reduce.

    It holds the user's model and one extra one-element parameter, ``flag``. Its forward
    runs the model and passes the outputs through an identity whose backward gives
    ``flag`` this rank's vote (1 if it wants to stop after this step, else 0) as its
    gradient. DDP reduces that gradient in its first bucket with the others, in its own
    C++ all-reduce: no extra collective, no Python communication hook, no copy of a
    bucket. After the step's backward, :attr:`raised` is the number of ranks that voted.
    The flag is not the user's: it is in no optimizer, no checkpoint, no clipping.

    Call :meth:`arm` before each step's first forward. The model's outputs must be tensors,
    or tuples, lists or dicts of them (one of them must be used in the loss, as DDP asks).
    Attributes of the model are reachable through it (``session.model.module.generate``).
    """

    def __init__(self, module: torch.nn.Module, group: Any = None) -> None:
        super().__init__()
        self.module = module
        first = next(module.parameters(), None)
        floating = first is not None and first.is_floating_point()
        # The model's dtype and device: the flag shares a bucket with its gradients.
        self.flag = torch.nn.Parameter(torch.zeros(1, device=first.device if first is not None else None,
                                                   dtype=first.dtype if floating else None))
        self._group = group
        self._vote = 0.0

    def arm(self, wanted: bool) -> None:
        """This rank's vote for the step about to run."""
        self._vote = 1.0 if wanted else 0.0
        self.flag.grad = None

    @property
    def raised(self) -> int:
        """The number of ranks that voted to stop after the step whose backward just ran
        (DDP averaged the votes over the group)."""
        grad = self.flag.grad
        if grad is None:
            return 0
        return int(round(float(grad.float().item()) * dist.get_world_size(self._group)))

    def take_vote(self) -> float:
        """The vote for this backward: once per step, however many micro-batches it has."""
        vote, self._vote = self._vote, 0.0
        return vote

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.module(*args, **kwargs)
        if not torch.is_grad_enabled():
            return out
        tensors: list[torch.Tensor] = []
        _collect(out, tensors)
        if not tensors:
            raise SessionError(f"in-process recovery needs the model's output as tensors, or tuples, lists or dicts "
                               f"of them, with one that requires grad; it returned {type(out).__name__}")
        carried = iter(_Vote.apply(self, self.flag, *tensors))
        return _replace(out, carried)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)


class _Vote(torch.autograd.Function):
    """Identity on the model's outputs; its backward gives the flag parameter this rank's vote."""

    @staticmethod
    def forward(ctx: Any, carrier: BoundaryFlag, flag: torch.Tensor, *outputs: torch.Tensor) -> Any:
        ctx.carrier = carrier
        ctx.set_materialize_grads(False)
        return tuple(out.view_as(out) for out in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        carrier: BoundaryFlag = ctx.carrier
        vote = torch.full_like(carrier.flag, carrier.take_vote())
        return (None, vote, *grads)


def _collect(out: Any, into: list[torch.Tensor]) -> None:
    if isinstance(out, torch.Tensor):
        if out.requires_grad:
            into.append(out)
    elif isinstance(out, (tuple, list)):
        for item in out:
            _collect(item, into)
    elif isinstance(out, dict):
        for item in out.values():
            _collect(item, into)


def _replace(out: Any, carried: Any) -> Any:
    """``out`` with each tensor :func:`_collect` found replaced by the next of ``carried``."""
    if isinstance(out, torch.Tensor):
        return next(carried) if out.requires_grad else out
    if isinstance(out, tuple):
        items = [_replace(item, carried) for item in out]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    if isinstance(out, list):
        return type(out)(_replace(item, carried) for item in out)
    if isinstance(out, dict):
        copied = copy.copy(out)
        for key, item in out.items():
            copied[key] = _replace(item, carried)
        return copied
    return out


def wrap_in_ddp(module: torch.nn.Module, ddp_kwargs: Mapping[str, Any], placement: pg.Placement, group: Any, *,
                in_process: bool, identical: bool) -> tuple[DistributedDataParallel, BoundaryFlag | None, bool]:
    """``module`` in DDP over this generation's group (``group``; None: the default one).

    With in-process recovery the module is wrapped in a :class:`BoundaryFlag` first, and DDP
    makes no collective inside a forward, where a failure would escape the step loop: rank 0's
    buffers are to be broadcast at each step boundary instead, if the user wants them
    synchronized (DDP's default). ``identical``: every rank already holds the same state (the
    agreement made it so), so DDP need not broadcast it once more; otherwise DDP broadcasts rank
    0's parameters and buffers here: identical replicas whether they were initialized or restored.

    Returns:
        The DDP module, the flag (None without in-process recovery), and whether the buffers
        are to be broadcast at each step boundary.
    """
    kwargs = dict(ddp_kwargs)
    if placement.device.type == "cuda":
        kwargs.setdefault("device_ids", [placement.device.index])
        kwargs.setdefault("output_device", placement.device.index)
    if group is not None:
        kwargs["process_group"] = group
    if not in_process:
        return DistributedDataParallel(module, **kwargs), None, False
    legacy, wanted = kwargs.pop("broadcast_buffers", None), kwargs.pop("forward_sync_buffers", None)
    wanted = wanted if wanted is not None else (legacy if legacy is not None else True)
    sync_buffers = bool(wanted) and any(True for _ in module.buffers())
    kwargs["forward_sync_buffers"] = False
    if identical:
        kwargs.setdefault("init_sync", False)
    flag = BoundaryFlag(module, group)
    return DistributedDataParallel(flag, **kwargs), flag, sync_buffers


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
