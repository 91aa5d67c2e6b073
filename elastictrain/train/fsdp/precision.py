"""The project's :class:`~elastictrain.train.precision.MixedPrecision` as FSDP2's ``MixedPrecisionPolicy``.

Under FSDP2 the parameters themselves are cast, not each op: each unit's all-gather casts the
fp32 sharded parameters to the compute dtype (bf16 or fp16) for the forward and backward; the
sharded parameters that the optimizer updates (the master copy) and its state stay fp32.
Gradients are cast to **fp32 before the reduce-scatter** (``reduce_dtype``), so the sum over
ranks rounds no more than DDP's fp32 all-reduce and lands in the fp32 sharded gradient. The
model's output is left in the compute dtype, as autocast would give it. fp16 still needs the
loss scaling of ``MixedPrecision``'s GradScaler: its inf/NaN check over DTensor gradients
agrees across the ranks of the mesh (torch's DTensor rule for the check reduces it).
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from elastictrain.train.precision import MixedPrecision

__all__ = ["REDUCE_DTYPE", "mixed_precision_policy"]

REDUCE_DTYPE = torch.float32
"""The dtype of the gradients' reduce-scatter (and hsdp's all-reduce) under bf16 or fp16."""


def mixed_precision_policy(precision: MixedPrecision) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``precision``: compute in its dtype, reduce in fp32; fp32: no casting."""
    if precision.dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=precision.dtype, reduce_dtype=REDUCE_DTYPE)
