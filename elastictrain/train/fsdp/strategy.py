"""FSDP2 and HSDP behind the :class:`~elastictrain.train.strategy.ParallelStrategy` seam:
``Session(..., sharding="fsdp" | "hsdp")``.

:class:`FsdpStrategy` shards the session's model over the group with
:func:`~elastictrain.train.fsdp.sharded.shard` (one unit per direct child that holds parameters,
then the root); :class:`HsdpStrategy` over a 2-D mesh, sharded within each node
(``local_world_size`` wide) and replicated across nodes. The session's optimizer object is kept,
re-pointed at the shards. Accumulation (:meth:`~FsdpStrategy.no_sync`), mixed precision (FSDP2's
policy from the session's ``precision``, beside its autocast and GradScaler), global-norm
clipping, the scheduler, the sampler and hooks work as under DDP; buffers are broadcast from
rank 0 after each step (FSDP2 does not synchronize them; DDP broadcasts them in its forward).

State: a rank holds shards, no replica, so there is no live transfer to a rank that lacks the
state (:attr:`~FsdpStrategy.live_transfer` is False). The session restores a checkpoint before
it wraps, into the still unsharded model and optimizer (full tensors, assembled from a sharded
checkpoint at any world size and mesh, or a DDP one's); :meth:`~FsdpStrategy.wrap` shards the
model and moves the restored optimizer state onto the shards. From then on the model and the
optimizer are saved through :class:`~elastictrain.train.fsdp.state.ModelState` and
:class:`~elastictrain.train.fsdp.state.OptimizerState`: each rank writes its own shards.

Not yet: recovery in place. With ``redundancy_every`` (fsdp), each rank keeps a copy of a buddy's
shards in host memory (:attr:`FsdpStrategy.redundancy`), for that recovery to rebuild from.
``fully_shard`` turns the model into shards of one mesh for good, so
a group cannot re-form in the same process; under in-process recovery :meth:`~FsdpStrategy.wrap`
refuses in one line, a ``ConfigError`` (run with ``--recovery restart``: the agent restarts the workers, which
restore from the newest checkpoint at the new world size).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from elastictrain.errors import ConfigError, SessionError
from elastictrain.train.fsdp.gradients import clip_grad_norm_, no_sync
from elastictrain.train.fsdp.redundancy import Redundancy, start_redundancy
from elastictrain.train.fsdp.sharded import Sharded, ShardingConfig, shard
from elastictrain.train.fsdp.state import ModelState, OptimizerState, full_state_dict
from elastictrain.train.precision import MixedPrecision
from elastictrain.train.strategy import GroupView, ParallelStrategy, register_strategy

if TYPE_CHECKING:
    from collections.abc import Iterable

    from elastictrain.train.session_config import SessionConfig

__all__ = ["FsdpStrategy", "HsdpStrategy"]


class FsdpStrategy(ParallelStrategy):
    """FSDP2 over the whole group (see the module docstring).

    Args:
        precision: The session's precision (``SessionConfig.precision``): bf16 and fp16 become
            FSDP2's mixed precision policy.
        redundancy_every: Keep a copy of a buddy's shards in host memory, refreshed after every
            this many steps (:mod:`~elastictrain.train.fsdp.redundancy`); None: no copies.
    """

    name = "fsdp"

    def __init__(self, precision: str = "fp32", redundancy_every: int | None = None) -> None:
        super().__init__()
        self._precision = precision
        self._sharded: Sharded | None = None
        self._redundancy_every = redundancy_every
        self.redundancy: Redundancy | None = None
        """The copies of the last generation (kept after it is left: they outlive the group)."""

    def _config(self, view: GroupView) -> ShardingConfig:
        return ShardingConfig(sharding="fsdp")

    def _wrap(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, view: GroupView, *,
              identical: bool) -> torch.nn.Module:
        """See base class. Shards ``module`` in place and returns it; a restored optimizer state
        moves onto the shards.

        Raises:
            ConfigError: In-process recovery, or a world the hsdp mesh does not tile (one line).
            SessionError: The model was sharded by an earlier group.
        """
        if view.in_process:
            # A ConfigError: the launcher fails the job at once rather than restart into it again.
            raise ConfigError(f"sharding={self.name!r} does not recover in process yet: run with --recovery "
                              "restart (or Session(recovery='restart')), and a fault restarts from the checkpoint")
        if isinstance(module, FSDPModule):
            raise SessionError(f"the model is already sharded by an earlier group: sharding={self.name!r} cannot "
                               "re-form its group in this process")
        # A restore before the first wrap filled the unsharded optimizer (full tensors): set it
        # aside, shard, and load it onto the shards.
        restored = optimizer.state_dict() if optimizer.state else None
        optimizer.state.clear()
        precision = MixedPrecision(self._precision, view.placement.device)
        self._sharded = shard(module, optimizer, self._config(view), precision=precision, group=view.group,
                              broadcast=not identical)
        if restored is not None:
            OptimizerState(module, optimizer).load_state_dict(restored)
        if self._redundancy_every is not None:
            self.redundancy = start_redundancy(module, optimizer, every=self._redundancy_every,
                                               nproc_per_node=view.local_world_size,
                                               timeout=view.placement.timeout, group=view.group)
        return module

    def _leave(self) -> None:
        """See base class. The model stays sharded (see the module docstring); the redundancy's
        refreshes stop, its copies stay (:attr:`redundancy`)."""
        if self.redundancy is not None:
            self.redundancy.close()

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """See base class: ``set_requires_gradient_sync(False)`` over the backward passes inside."""
        _ = self.view  # SessionError when not wrapped
        assert self._sharded is not None  # noqa: S101 - set with the view
        return no_sync(self._sharded.module)

    def after_step(self, step: int) -> None:
        """See base class: the buffers broadcast from rank 0 (FSDP2 leaves them to each rank), then
        the redundancy's refresh when one is due (its snapshot; the copy is sent in the background)."""
        view = self.view
        assert self._sharded is not None  # noqa: S101 - set with the view
        source = dist.get_global_rank(view.group, 0) if view.group is not None else 0
        for buffer in self._sharded.model.buffers():
            dist.broadcast(buffer, src=source, group=view.group)
        if self.redundancy is not None:
            self.redundancy.after_step(step)

    def clip_grad_norm(self, parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """See base class: the norm over every shard (a collective over the mesh)."""
        return clip_grad_norm_(parameters, max_norm)

    def state_objects(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        """See base class: the sharded adapters once the model is sharded; before (a restore at
        the start), the unsharded model and optimizer themselves."""
        if not isinstance(module, FSDPModule):
            return module, optimizer
        return ModelState(module), OptimizerState(module, optimizer)

    @property
    def live_transfer(self) -> bool:
        """See base class: False, a rank holds shards, not a replica."""
        return False

    def full_state_dict(self, module: torch.nn.Module) -> dict[str, Any]:
        """See base class: gathered to rank 0's CPU memory, ``{}`` on other ranks; a collective."""
        if not isinstance(module, FSDPModule):
            return dict(module.state_dict())
        return full_state_dict(module)


class HsdpStrategy(FsdpStrategy):
    """Hybrid sharding: shard within each node (``local_world_size`` ranks), replicate across nodes.

    No redundancy option: the other nodes are its replicas."""

    name = "hsdp"

    def _config(self, view: GroupView) -> ShardingConfig:
        return ShardingConfig(sharding="hsdp", nproc_per_node=view.local_world_size, timeout=view.placement.timeout)


def _fsdp(config: SessionConfig) -> FsdpStrategy:
    return FsdpStrategy(config.precision, config.redundancy_every)


def _hsdp(config: SessionConfig) -> HsdpStrategy:
    return HsdpStrategy(config.precision)


register_strategy("fsdp", _fsdp)
register_strategy("hsdp", _hsdp)
