"""elastictrain: fault-tolerant elastic training for PyTorch.

What a training script imports. ``import elastictrain`` loads torch but not the
etcd client (only the launcher needs that).
"""

from elastictrain.accumulation import accumulate, no_sync
from elastictrain.checkpoint import CheckpointManager, RestoreInfo
from elastictrain.errors import ElasticTrainError, SessionError
from elastictrain.hooks import HookDispatcher, Hooks
from elastictrain.precision import MixedPrecision
from elastictrain.process_group import Placement, destroy_process_group, init_process_group, process_group_scope
from elastictrain.rank_logging import RankLoggerAdapter, get_logger, setup_logging
from elastictrain.sampler import ElasticBatchSampler, ElasticSampler, MicroBatch, StepPlan
from elastictrain.train.elastic import ElasticState, run_elastic
from elastictrain.train.session import MicroStep, Session, SessionConfig, Step
from elastictrain.worker import WorkerContext

__version__ = "0.1.0"

__all__ = [
    "CheckpointManager",
    "ElasticBatchSampler",
    "ElasticSampler",
    "ElasticState",
    "ElasticTrainError",
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
    "run_elastic",
    "setup_logging",
]
