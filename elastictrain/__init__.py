"""elastictrain: fault-tolerant elastic training for PyTorch.

What a training script imports. Names are imported on first use: ``import elastictrain``
alone loads neither torch nor the etcd client.
"""

from typing import TYPE_CHECKING

# Each public name and the module that defines it, imported on first use (PEP 562): the
# ``elastictrain`` command imports this package, and ``--help``, ``status`` and ``stop``
# must not pay for importing torch.
_EXPORTS = {
    "accumulate": "elastictrain.train.accumulation",
    "no_sync": "elastictrain.train.accumulation",
    "CheckpointManager": "elastictrain.checkpoint",
    "RestoreInfo": "elastictrain.checkpoint",
    "ElasticTrainError": "elastictrain.errors",
    "SessionError": "elastictrain.errors",
    "HangBounds": "elastictrain.train.hang_bounds",
    "HookDispatcher": "elastictrain.train.hooks",
    "Hooks": "elastictrain.train.hooks",
    "MixedPrecision": "elastictrain.train.precision",
    "Placement": "elastictrain.train.process_group",
    "destroy_process_group": "elastictrain.train.process_group",
    "init_process_group": "elastictrain.train.process_group",
    "process_group_scope": "elastictrain.train.process_group",
    "RankLoggerAdapter": "elastictrain.train.rank_logging",
    "get_logger": "elastictrain.train.rank_logging",
    "setup_logging": "elastictrain.train.rank_logging",
    "ElasticBatchSampler": "elastictrain.train.sampler",
    "ElasticSampler": "elastictrain.train.sampler",
    "MicroBatch": "elastictrain.train.sampler",
    "StepPlan": "elastictrain.train.sampler",
    "ElasticState": "elastictrain.train.elastic",
    "run_elastic": "elastictrain.train.elastic",
    "MicroStep": "elastictrain.train.session",
    "Session": "elastictrain.train.session",
    "SessionConfig": "elastictrain.train.session",
    "Step": "elastictrain.train.session",
    "WorkerContext": "elastictrain.train.worker",
    "reset_parameters": "elastictrain.train.meta_init",
}

if TYPE_CHECKING:
    from elastictrain.train.accumulation import accumulate, no_sync
    from elastictrain.checkpoint import CheckpointManager, RestoreInfo
    from elastictrain.errors import ElasticTrainError, SessionError
    from elastictrain.train.hang_bounds import HangBounds
    from elastictrain.train.hooks import HookDispatcher, Hooks
    from elastictrain.train.precision import MixedPrecision
    from elastictrain.train.process_group import Placement, destroy_process_group, init_process_group, process_group_scope
    from elastictrain.train.rank_logging import RankLoggerAdapter, get_logger, setup_logging
    from elastictrain.train.sampler import ElasticBatchSampler, ElasticSampler, MicroBatch, StepPlan
    from elastictrain.train.elastic import ElasticState, run_elastic
    from elastictrain.train.session import MicroStep, Session, SessionConfig, Step
    from elastictrain.train.worker import WorkerContext
    from elastictrain.train.meta_init import reset_parameters


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'elastictrain' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__version__ = "0.1.0"

__all__ = [
    "CheckpointManager",
    "ElasticBatchSampler",
    "ElasticSampler",
    "ElasticState",
    "ElasticTrainError",
    "HangBounds",
    "HookDispatcher",
    "Hooks",
    "MicroBatch",
    "MicroStep",
    "MixedPrecision",
    "Placement",
    "RankLoggerAdapter",
    "RestoreInfo",
    "Session",
    "SessionConfig",
    "SessionError",
    "Step",
    "StepPlan",
    "WorkerContext",
    "__version__",
    "accumulate",
    "destroy_process_group",
    "get_logger",
    "init_process_group",
    "no_sync",
    "process_group_scope",
    "reset_parameters",
    "run_elastic",
    "setup_logging",
]
