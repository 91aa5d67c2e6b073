"""Gradient accumulation and global-norm clipping on a sharded model.

Accumulation: FSDP2 reduce-scatters each unit's gradient in its post-backward hook, unless the
module was told not to (``set_requires_gradient_sync(False)``): then the unsharded gradients
accumulate locally, and the last micro-batch's backward reduce-scatters (and under hsdp
all-reduces across replicas) their sum once. Unlike DDP, FSDP2 reads the flag in the *backward*
pass, so the context must be open over the backward.

Clipping: the gradients are DTensors, and ``torch.nn.utils.clip_grad_norm_`` (torch 2.13) computes
their norm as a DTensor: each rank's share of the sum of squares, reduced over the mesh (the
shard dimension; replicas hold equal shares). Every rank gets the same global norm and the same
scale, as under DDP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_", "no_sync"]


@contextlib.contextmanager
def no_sync(model: FSDPModule) -> Iterator[None]:
    """No gradient reduction for the backward passes inside; the next one outside reduces the sum."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their global 2-norm is at most ``max_norm``; return the norm
    before, as a plain one-element tensor (the same on every rank).

    Args:
        parameters: The sharded model's parameters (DTensors; plain tensors are clipped locally).
        max_norm: The largest norm kept.
    """
    norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
