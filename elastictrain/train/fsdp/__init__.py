"""Sharded data parallelism: FSDP2 (``fully_shard``) over a 1-D mesh, HSDP over a 2-D one.

Kept apart from the DDP path, as TorchFT keeps ``torchft/fsdp`` apart. See ``docs/sharding.md``.
Importing it registers ``sharding="fsdp"`` and ``"hsdp"`` for ``Session``
(:mod:`~elastictrain.train.fsdp.strategy`).
"""

from elastictrain._torch_compat import check_dtensor
from elastictrain.train.fsdp.buddies import buddies, missing
from elastictrain.train.fsdp.failsafe_group import AbandonedStep, FailsafeGroup, SwallowedFailure
from elastictrain.train.fsdp.gradients import clip_grad_norm_, no_sync
from elastictrain.train.fsdp.holdings import Holding, Region, own_holdings, state_regions
from elastictrain.train.fsdp.mesh import FSDP_DIMS, HSDP_DIMS, SHARDED_MODES, build_mesh, mesh_shape
from elastictrain.train.fsdp.optimizer import OptimizerSpec, parameter_fqns, shard_optimizer
from elastictrain.train.fsdp.precision import REDUCE_DTYPE, mixed_precision_policy
from elastictrain.train.fsdp.redundancy import Redundancy, RedundancyError, start_redundancy
from elastictrain.train.fsdp.sharded import Sharded, ShardingConfig, shard
from elastictrain.train.fsdp.state import (
    ModelState, OptimizerState, full_optimizer_state_dict, full_state_dict, optimizer_order,
    optimizer_state_by_fqn, optimizer_state_by_id,
)
from elastictrain.train.fsdp.strategy import FsdpStrategy, HsdpStrategy
from elastictrain.train.fsdp.units import UnitSpec, shard_model, sharding_units

check_dtensor()  # the DTensor private names the sharded path reads, checked once it is imported

__all__ = [
    "FSDP_DIMS", "HSDP_DIMS", "REDUCE_DTYPE", "SHARDED_MODES",
    "AbandonedStep", "FailsafeGroup", "FsdpStrategy", "Holding", "HsdpStrategy", "ModelState", "OptimizerSpec",
    "OptimizerState",
    "Redundancy", "RedundancyError", "Region", "Sharded", "ShardingConfig", "SwallowedFailure", "UnitSpec",
    "buddies", "build_mesh", "clip_grad_norm_", "full_optimizer_state_dict", "full_state_dict", "mesh_shape",
    "missing", "mixed_precision_policy", "no_sync", "optimizer_order", "optimizer_state_by_fqn",
    "optimizer_state_by_id", "own_holdings", "parameter_fqns", "shard", "shard_model", "shard_optimizer",
    "sharding_units", "start_redundancy", "state_regions",
]
