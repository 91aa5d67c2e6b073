"""DistributedDataParallel behind the :class:`~elastictrain.train.strategy.ParallelStrategy` seam:
:class:`DDPStrategy` (``sharding="ddp"``, the default).

Every rank holds the whole model and optimizer; DDP all-reduces the gradients in buckets
during the last micro-batch's backward. Under in-process recovery the step-boundary vote
rides on that all-reduce (:class:`BoundaryFlag`: no collective of its own), DDP makes no
collective inside the user's forward (its bucket order is rebuilt and the buffers are
broadcast at the step boundary, where a failure is a recovery), and a rank that lacks the
state receives it from a live replica (the replicated transfer).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastictrain import _torch_compat
from elastictrain.errors import SessionError
from elastictrain.train import process_group as pg
from elastictrain.train.strategy import GroupView, ParallelStrategy, register_strategy

if TYPE_CHECKING:
    from elastictrain.train.session_config import SessionConfig

__all__ = ["BoundaryFlag", "DDPStrategy", "wrap_in_ddp"]


class DDPStrategy(ParallelStrategy):
    """DistributedDataParallel over each generation's group (see the module docstring).

    Args:
        ddp_kwargs: Extra keyword arguments of ``DistributedDataParallel``
            (``SessionConfig.ddp_kwargs``).
        piggyback_vote: Carry the step-boundary vote on DDP's gradient all-reduce (the
            default); False takes it in an all-reduce of its own at the boundary, as a strategy
            that cannot piggyback does (the base class's default).
    """

    name = "ddp"

    def __init__(self, ddp_kwargs: Mapping[str, Any] | None = None, *, piggyback_vote: bool = True) -> None:
        super().__init__()
        self._kwargs = dict(ddp_kwargs or {})
        self._piggyback = piggyback_vote
        self._ddp: DistributedDataParallel | None = None
        self._flag: BoundaryFlag | None = None
        self._module: torch.nn.Module | None = None
        self._sync_buffers = False

    def _wrap(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, view: GroupView, *,
              identical: bool) -> torch.nn.Module:
        """See base class."""
        self._ddp, self._flag, self._sync_buffers = wrap_in_ddp(
            module, self._kwargs, view.placement, view.group, in_process=view.in_process, identical=identical,
            piggyback_vote=self._piggyback)
        self._module = module
        return self._ddp

    def _leave(self) -> None:
        """See base class."""
        self._ddp = self._flag = self._module = None
        self._sync_buffers = False

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """See base class."""
        if self._ddp is None:
            raise SessionError("the ddp strategy is not wrapped over a group")
        return self._ddp.no_sync()

    def _arm_vote(self, wanted: bool) -> None:
        if self._flag is None:
            super()._arm_vote(wanted)
        else:
            self._flag.arm(wanted)

    def _votes(self) -> int:
        return super()._votes() if self._flag is None else self._flag.raised

    def after_step(self, step: int) -> None:
        """See base class. Under in-process recovery DDP's bucket rebuild (DDP would broadcast its
        bucket order in the next forward, out of reach of recovery: a peer lost then would fail
        the training instead of this step), and the buffers broadcast from rank 0 when DDP does
        not synchronize them in the forward."""
        view = self.view
        assert self._ddp is not None and self._module is not None  # noqa: S101 - set with the view
        if view.in_process:
            _torch_compat.rebuild_ddp_buckets(self._ddp)
        if self._sync_buffers:
            for buffer in self._module.buffers():
                dist.broadcast(buffer, src=0, group=view.group)

    def state_objects(self, module: torch.nn.Module,
                      optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        """See base class: the module and the optimizer themselves (every rank holds them whole)."""
        return module, optimizer

    @property
    def live_transfer(self) -> bool:
        """See base class: True, every rank holds a replica."""
        return True

    def full_state_dict(self, module: torch.nn.Module) -> dict[str, Any]:
        """See base class: the module's own (whole on every rank; no collective)."""
        return dict(module.state_dict())


def _from_config(config: SessionConfig) -> DDPStrategy:
    return DDPStrategy(config.ddp_kwargs)


register_strategy("ddp", _from_config)


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
        # The model's dtype and device: the flag shares a bucket with its gradients.
        device = first.device if first is not None else None
        dtype = first.dtype if first is not None and first.is_floating_point() else None
        self.flag = torch.nn.Parameter(torch.zeros(1, device=device, dtype=dtype))
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
                in_process: bool, identical: bool, piggyback_vote: bool = True,
                ) -> tuple[DistributedDataParallel, BoundaryFlag | None, bool]:
    """``module`` in DDP over this generation's group (``group``; None: the default one).

    With in-process recovery the module is wrapped in a :class:`BoundaryFlag` first (unless
    ``piggyback_vote`` is False: the vote is then taken apart), and DDP makes no collective
    inside a forward, where a failure would escape the step loop: rank 0's
    buffers are to be broadcast at each step boundary instead, if the user wants them
    synchronized (DDP's default). ``identical``: every rank already holds the same state (the
    agreement made it so), so DDP need not broadcast it once more; otherwise DDP broadcasts rank
    0's parameters and buffers here: identical replicas whether they were initialized or restored.

    Returns:
        The DDP module, the flag (None without in-process recovery or ``piggyback_vote``), and whether the buffers
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
    if not piggyback_vote:
        return DistributedDataParallel(module, **kwargs), None, sync_buffers
    flag = BoundaryFlag(module, group)
    return DistributedDataParallel(flag, **kwargs), flag, sync_buffers
