"""A model and its optimizer sharded with FSDP2 over a mesh: :func:`shard` and :class:`Sharded`.

::

    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)    # on the unsharded model
    sharded = shard(model, optimizer, ShardingConfig(sharding="hsdp", nproc_per_node=8, units=Block),
                    precision=MixedPrecision("bf16", device))
    for micro in accumulate(...):                                    # every micro-batch but the last
        with sharded.no_sync(): ...                                  # in no_sync, over its backward
    sharded.clip_grad_norm_(1.0)
    sharded.optimizer.step()
    manager.save(step, sharded.state())                              # sharded checkpoint
    weights = sharded.full_state_dict()                              # full tensors on rank 0
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from elastictrain.errors import ConfigError
from elastictrain.train.fsdp.failsafe_group import SwallowedFailure
from elastictrain.train.fsdp.gradients import clip_grad_norm_, no_sync
from elastictrain.train.fsdp.mesh import SHARDED_MODES, build_mesh
from elastictrain.train.fsdp.optimizer import OptimizerSpec, check_unstepped, parameter_fqns, shard_optimizer
from elastictrain.train.fsdp.precision import mixed_precision_policy
from elastictrain.train.fsdp.state import ModelState, OptimizerState, full_state_dict
from elastictrain.train.fsdp.units import UnitSpec, check_shardable, check_units, shard_model
from elastictrain.train.precision import MixedPrecision

__all__ = ["Sharded", "ShardingConfig", "shard"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardingConfig:
    """How to shard a model."""

    sharding: str = "fsdp"
    """``"fsdp"`` (shard over every rank) or ``"hsdp"`` (shard within a node, replicate across nodes)."""

    units: UnitSpec | None = None
    """The FSDP units: None for each direct child that holds parameters; a block class (or a
    collection of classes, or a predicate ``(fqn, module) -> bool``) for transformers. A unit never
    splits a shared parameter. See :mod:`~elastictrain.train.fsdp.units`."""

    nproc_per_node: int | None = None
    """hsdp: ranks per node, the width of a shard group (the launcher's ``--nproc-per-node``)."""

    reshard_after_forward: bool = True
    """Free each unit's gathered parameters after its forward (and gather them again for its backward)."""

    timeout: timedelta | None = None
    """hsdp: the collective timeout of its sub-groups, the default group's (see
    :func:`~elastictrain.train.fsdp.mesh.build_mesh`); None: ``ELASTICTRAIN_PG_TIMEOUT`` or 60 s."""

    def __post_init__(self) -> None:
        if self.sharding not in SHARDED_MODES:
            raise ConfigError(f"sharding must be one of {SHARDED_MODES}, got {self.sharding!r}")
        if self.units is not None:
            check_units(self.units)


@dataclass(frozen=True, slots=True)
class Sharded:
    """A sharded model, its optimizer over the shards, and the mesh; what training and checkpoints need."""

    module: FSDPModule
    """The model, sharded in place (the object passed to :func:`shard`); run forward passes through it."""

    optimizer: torch.optim.Optimizer
    """The optimizer over the sharded parameters (the object passed, when an optimizer was passed)."""

    mesh: DeviceMesh
    """The mesh the parameters are sharded (and under hsdp replicated) over."""

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """See :func:`~elastictrain.train.fsdp.gradients.no_sync`."""
        return no_sync(self.module)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the global gradient norm over every shard; return the norm before clipping."""
        return float(clip_grad_norm_(self.parameters(), max_norm))

    def parameters(self) -> list[torch.nn.Parameter]:
        """The sharded parameters (DTensors)."""
        return list(self.model.parameters())

    @property
    def model(self) -> torch.nn.Module:
        """:attr:`module` typed as a ``torch.nn.Module`` (``fully_shard`` keeps the module's class,
        adding ``FSDPModule`` to it)."""
        return cast(torch.nn.Module, self.module)

    def state(self) -> dict[str, Any]:
        """``{"model": ModelState, "optimizer": OptimizerState}`` for a checkpoint manager."""
        return {"model": ModelState(self.model), "optimizer": OptimizerState(self.model, self.optimizer)}

    def full_state_dict(self) -> dict[str, Any]:
        """See :func:`~elastictrain.train.fsdp.state.full_state_dict`: full tensors on rank 0, ``{}`` elsewhere."""
        return full_state_dict(self.model)


def _broadcast_module(model: torch.nn.Module, group: dist.ProcessGroup | None) -> None:
    """Rank 0's parameters and buffers on every rank of ``group``."""
    source = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=source, group=group)


def _allocate_shards(model: torch.nn.Module, device: torch.device) -> None:
    """Allocate the shards of a model sharded on the meta device on ``device`` (``to_empty``: only
    the local shards), keeping the values of the buffers that were not on the meta device."""
    kept = {name: buffer for name, buffer in model.named_buffers() if not buffer.is_meta}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in kept:
                buffer.copy_(kept[name])


def shard(model: torch.nn.Module, optimizer: OptimizerSpec, config: ShardingConfig | None = None, *,
          precision: MixedPrecision | None = None, group: dist.ProcessGroup | None = None,
          broadcast: bool = True, failures: SwallowedFailure | None = None,
          device: torch.device | None = None) -> Sharded:
    """Shard ``model`` over a mesh of ``group`` and move ``optimizer`` onto its shards; a collective.

    Rank 0's parameters and buffers are broadcast first, as DDP does when it wraps a model: each
    rank then keeps its share of the same model, whatever each initialised.

    Args:
        model: The unsharded model, on the device it trains on.
        optimizer: An optimizer built on ``model`` that has not stepped, or a callable
            ``params -> optimizer`` (see :mod:`~elastictrain.train.fsdp.optimizer`).
        config: What to shard and over which mesh; default fsdp, one unit per direct child.
        precision: bf16 or fp16 become FSDP2's mixed precision policy (fp32 master parameters,
            fp32 reduction); None or fp32: no casting.
        group: The process group; default the default group.
        broadcast: Broadcast rank 0's model first; False when every rank already holds the same.
        failures: Shard over failsafe groups that record a collective failure here while it
            swallows (see :func:`~elastictrain.train.fsdp.mesh.build_mesh`).
        device: Where the shards live; default the parameters' device. A model whose parameters
            are on the meta device (a skeleton's, :meth:`~elastictrain.train.fsdp.skeleton.Skeleton.build`
            with ``allocate=False``) is sharded there and only its shards are allocated on
            ``device``, their values unset (fill them: a restore, the region exchange); its
            non-persistent buffers keep their values. No rank allocates the full model.

    Raises:
        ConfigError: A bad config, a mesh the world does not tile, an optimizer that has stepped or
            trains another model, a model without parameters.
    """
    config = config or ShardingConfig()
    param = check_shardable(model)
    on_meta = param.is_meta
    device = device or param.device
    if on_meta and (broadcast or device.type == "meta"):
        raise ConfigError("a model on the meta device has no values to broadcast: shard it with broadcast=False "
                          "and a device for its shards")
    fqns = parameter_fqns(model)
    if isinstance(optimizer, torch.optim.Optimizer):
        check_unstepped(optimizer, fqns)
    mesh = build_mesh(config.sharding, device.type, nproc_per_node=config.nproc_per_node, group=group,
                      timeout=config.timeout, failures=failures)
    if broadcast:
        _broadcast_module(model, group)
    policy = mixed_precision_policy(precision) if precision is not None else None
    sharded_model = shard_model(model, mesh, units=config.units, mp_policy=policy,
                                reshard_after_forward=config.reshard_after_forward)
    if on_meta:
        _allocate_shards(model, device)
    moved = shard_optimizer(optimizer, fqns, dict(model.named_parameters()))
    return Sharded(sharded_model, moved, mesh)
