"""What a rank holds of the sharded state: :class:`Holding`, and :func:`own_holdings`.

A re-formed group rebuilds its shards from the regions its ranks hold (their own shards of the
previous generation, and any copies a redundancy source keeps): see
:mod:`~elastictrain.train.fsdp.exchange`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Shard

from elastictrain.errors import ConfigError
from elastictrain.train.fsdp.regions import chunk_box

__all__ = ["Holding", "own_holdings"]


@dataclass(frozen=True, slots=True)
class Holding:
    """A region of a tensor of the sharded state that a rank holds in host or device memory."""
    key: str                      # the tensor's key in the state ("model/<fqn>" or "optimizer/<fqn>/<state name>")
    offsets: tuple[int, ...]      # its box in the global tensor
    sizes: tuple[int, ...]
    step: int                     # the committed step whose value it is
    tensor: torch.Tensor          # the values (contiguous, CPU for copies)


def _holding(key: str, value: torch.Tensor, step: int) -> Holding:
    """``value``'s local region: a DTensor's own shard (uneven ``Shard(0)`` as ``torch.chunk``
    makes them, replicated along any ``Replicate`` mesh dimension), a plain tensor's whole box."""
    if not isinstance(value, DTensor):
        tensor = value.detach().contiguous()
        return Holding(key, (0,) * tensor.dim(), tuple(tensor.shape), step, tensor)
    mesh, shape = value.device_mesh, tuple(value.shape)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ConfigError(f"{key}: this rank is not on the mesh it is sharded over")
    index, count = 0, 1
    for dim, placement in enumerate(value.placements):
        if isinstance(placement, Shard):
            if placement.dim != 0 or count != 1:
                raise ConfigError(f"{key}: only one Shard(0) mesh dimension is supported, got {value.placements}")
            index, count = coordinate[dim], mesh.size(dim)
        elif not placement.is_replicate():
            raise ConfigError(f"{key}: placement {placement} is neither Shard(0) nor Replicate")
    offsets, sizes = chunk_box(shape, index, count)
    local = value.to_local().detach().contiguous()
    if tuple(local.shape) != sizes:
        raise ConfigError(f"{key}: the local shard is {tuple(local.shape)}, torch.chunk's share is {sizes}")
    return Holding(key, offsets, sizes, step, local)


def own_holdings(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> list[Holding]:
    """This rank's own regions of the sharded state at ``step``: its shards of each parameter and
    of each optimizer state tensor (under hsdp, its shard group's share), and the buffers whole
    (FSDP2 does not shard them).

    Args:
        model: The sharded model.
        optimizer: Its optimizer, over the sharded parameters.
        step: The committed step the state is at.

    Raises:
        ConfigError: A tensor sharded otherwise than FSDP2 shards (one ``Shard(0)`` mesh dimension).
    """
    held = [_holding(f"model/{fqn}", param, step) for fqn, param in model.named_parameters()]
    held += [_holding(f"model/{fqn}", buffer, step) for fqn, buffer in model.named_buffers()]
    names = {id(param): fqn for fqn, param in model.named_parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            for name, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    held.append(_holding(f"optimizer/{names[id(param)]}/{name}", value, step))
    return held
