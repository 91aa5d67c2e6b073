"""What a rank holds of the sharded state, region by region: :class:`Holding` and :func:`own_holdings`.

The in-place recovery of a sharded session fills a model rebuilt on a new mesh from what the
surviving ranks hold in memory: each one's own shards (:func:`own_holdings`) and the copies of
other ranks' shards that :mod:`~elastictrain.train.fsdp.redundancy` keeps. A holding names its
tensor by the key it has in the sharded state (``"model/<fqn>"``, ``"optimizer/<fqn>/<state name>"``)
and its box of the global tensor, as the sharded checkpoint's chunks do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from elastictrain._torch_compat import local_tensor
from elastictrain.checkpoint import region

__all__ = ["Holding", "Region", "Signature", "own_holdings", "shard_signature", "state_regions"]


@dataclass(frozen=True, slots=True)
class Holding:
    """A region of a tensor of the sharded state that a rank holds in host or device memory."""
    key: str                      # the tensor's key in the state ("model/<fqn>" or "optimizer/<fqn>/<state name>")
    offsets: tuple[int, ...]      # its box in the global tensor
    sizes: tuple[int, ...]
    step: int                     # the committed step whose value it is
    tensor: torch.Tensor          # the values (contiguous, CPU for copies)


@dataclass(frozen=True, slots=True)
class Region:
    """A box of a tensor of the sharded state (keys as :class:`Holding`'s)."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def _local(value: torch.Tensor) -> torch.Tensor:
    """``value``'s local tensor (itself for a plain tensor), read from the DTensor's slot: the
    storage and shape ``to_local`` gives (:func:`~elastictrain._torch_compat.local_tensor`)."""
    return local_tensor(value) if isinstance(value, DTensor) else value


def _holding(key: str, value: torch.Tensor, step: int, live: bool) -> Holding | None:
    """``value``'s local region as a holding; None for an empty one (an uneven share's last ranks)."""
    if isinstance(value, DTensor):
        coordinate = value.device_mesh.get_coordinate()
        if coordinate is None:  # this rank is not on the tensor's mesh
            return None
        offsets, sizes = region(tuple(value.shape), value.device_mesh.shape, coordinate, value.placements, key)
        local = value.to_local()
    else:  # a plain tensor of the state (Adam's step count): every rank holds all of it
        offsets, sizes, local = (0,) * value.dim(), tuple(value.shape), value
    if local.numel() == 0:
        return None
    if tuple(local.shape) != sizes:
        raise ValueError(f"{key}: the local shard has shape {tuple(local.shape)}, its placements say {sizes}")
    tensor = local.detach() if live else local.detach().contiguous()
    return Holding(key=key, offsets=offsets, sizes=sizes, step=step, tensor=tensor)


def _state_tensors(model: torch.nn.Module,
                   optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the parameters and the optimizer state, by its key (DTensors as they are)."""
    found: list[tuple[str, torch.Tensor]] = []
    fqns = {id(param): fqn for fqn, param in model.named_parameters()}
    found.extend((f"model/{fqn}", param) for fqn, param in model.named_parameters())
    for group in optimizer.param_groups:
        for param in group["params"]:
            for name, value in sorted(optimizer.state.get(param, {}).items()):
                if isinstance(value, torch.Tensor):
                    found.append((f"optimizer/{fqns[id(param)]}/{name}", value))
    return found


def own_holdings(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, *,
                 live: bool = False) -> list[Holding]:
    """This rank's own shards of the parameters and the optimizer state, as of ``step``.

    The tensors are the live local shards (not copies): take them before the next optimizer step
    changes them, or copy them. Buffers are not included: every rank holds them whole (the
    sharded strategy broadcasts them after each step). Non-tensor optimizer state is skipped.

    Args:
        model: The sharded model (its parameters DTensors; a plain parameter counts as whole).
        optimizer: Its optimizer, over those parameters.
        step: The committed step the values are of.
        live: Each tensor the local shard itself, even where it is not contiguous (a contiguous
            copy otherwise): for a caller that copies the values later, when they have changed.

    Raises:
        ValueError: A local shard whose shape is not the one its placements give.
        ConfigError: A placement other than ``Shard`` or ``Replicate`` (see ``checkpoint.region``).
    """
    found = [_holding(key, value, step, live) for key, value in _state_tensors(model, optimizer)]
    return [holding for holding in found if holding is not None]


Signature = tuple[tuple[str, str, int, tuple[int, ...]], ...]
"""Each state tensor's parameter name, state name (``""`` for the parameter), local storage
address and local shape (:func:`shard_signature`)."""


def shard_signature(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Signature:
    """What :func:`own_holdings` would hold, cheaply: each tensor's parameter and state name, the
    address of its local storage and its local shape, with no region worked out. While it stays
    equal, so do the holdings' keys, boxes and (with ``live``) storage: the optimizer updates the
    shards in place. One pass over the parameters and the optimizer state, each DTensor's local
    tensor read from its slot (:func:`~elastictrain._torch_compat.local_tensor`: the storage and
    shape ``to_local`` would give; a refresh checks this every time, on the training thread)."""
    found: list[tuple[str, str, int, tuple[int, ...]]] = []
    fqns: dict[int, str] = {}
    for fqn, param in model.named_parameters():
        fqns[id(param)] = fqn
        local = _local(param)
        found.append((fqn, "", local.data_ptr(), local.shape))
    for group in optimizer.param_groups:
        for param in group["params"]:
            for name, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    local = _local(value)
                    found.append((fqns[id(param)], name, local.data_ptr(), local.shape))
    return tuple(found)


def state_regions(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[Region]:
    """The whole state that :func:`own_holdings` takes shards of: one full box per tensor (global
    shapes), what a rebuild needs covered (see :func:`~elastictrain.train.fsdp.buddies.missing`)."""
    return [Region(key, (0,) * value.dim(), tuple(value.shape)) for key, value in _state_tensors(model, optimizer)]
