"""Which submodules become FSDP units, and ``fully_shard`` applied to them.

A unit is what FSDP2 gathers in one all-gather before its forward and frees after it: the
fewer the parameters of the largest unit, the lower the peak memory; the more units, the more
(smaller) collectives.

Default: each direct child module of the model that holds parameters is a unit, then the root
(which takes the parameters held by the root itself). For transformers, pass the block class (or a
predicate ``(fqn, module) -> bool``): every matching module, at any depth, is a unit, then the root.
Units are sharded bottom-up (a unit nested in another is sharded first), as ``fully_shard`` requires.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from elastictrain.errors import ConfigError

__all__ = ["UnitSpec", "check_shardable", "shard_model", "sharding_units"]

UnitSpec = type[torch.nn.Module] | tuple[type[torch.nn.Module], ...] | Callable[[str, torch.nn.Module], bool]
"""A module class (or tuple of classes) whose instances are units, or a predicate on ``(fqn, module)``."""


def _post_order(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.nn.Module]]:
    """``(fqn, module)`` of every submodule, each after its own submodules, in definition order."""
    for name, child in module.named_children():
        fqn = f"{prefix}.{name}" if prefix else name
        yield from _post_order(child, fqn)
        yield fqn, child


def _matcher(units: UnitSpec) -> Callable[[str, torch.nn.Module], bool]:
    if isinstance(units, type) or (isinstance(units, tuple) and all(isinstance(u, type) for u in units)):
        classes = units
        return lambda _fqn, module: isinstance(module, classes)
    if callable(units):
        return units
    raise ConfigError(f"units must be a module class, a tuple of them or a predicate (fqn, module) -> bool, "
                      f"got {type(units).__name__}")


def sharding_units(model: torch.nn.Module, units: UnitSpec | None = None) -> list[tuple[str, torch.nn.Module]]:
    """The ``(fqn, module)`` units of ``model`` other than the root, in the order to shard them.

    Args:
        model: The unsharded model.
        units: None for the default (each direct child that holds parameters), else see :data:`UnitSpec`.

    Raises:
        ConfigError: ``units`` is neither a class nor a predicate.
    """
    if units is None:
        return [(name, child) for name, child in model.named_children()
                if next(child.parameters(), None) is not None]
    matches = _matcher(units)
    return [(fqn, module) for fqn, module in _post_order(model)
            if matches(fqn, module) and next(module.parameters(), None) is not None]


def check_shardable(model: torch.nn.Module) -> torch.nn.Parameter:
    """The model's first parameter (its device is where the mesh lives).

    Raises:
        ConfigError: The model has no parameters, or is already sharded.
    """
    if isinstance(model, FSDPModule):
        raise ConfigError("the model is already sharded: pass the plain model")
    param = next(model.parameters(), None)
    if param is None:
        raise ConfigError("the model has no parameters to shard")
    return param


def shard_model(model: torch.nn.Module, mesh: DeviceMesh, *, units: UnitSpec | None = None,
                mp_policy: MixedPrecisionPolicy | None = None, reshard_after_forward: bool = True) -> FSDPModule:
    """Apply ``fully_shard`` to ``model``'s units, then to ``model`` itself; in place, with no collective.

    The parameters become DTensors sharded on dim 0 over ``mesh`` (uneven shares are fine: FSDP2
    pads the last shards); their FQNs are unchanged. Each rank keeps its own share of its own copy:
    every rank must hold the same model before (the session makes them equal first).

    Args:
        model: The unsharded model, on its device.
        mesh: See :func:`~elastictrain.train.fsdp.mesh.build_mesh`.
        units: See :func:`sharding_units`.
        mp_policy: FSDP2's mixed precision (see :func:`~elastictrain.train.fsdp.precision.mixed_precision_policy`).
        reshard_after_forward: Free each unit's gathered parameters after its forward (gather them
            again for the backward): less memory, one more all-gather per unit.

    Returns:
        ``model``, now also an ``FSDPModule``.

    Raises:
        ConfigError: See :func:`check_shardable`.
    """
    check_shardable(model)
    policy = mp_policy or MixedPrecisionPolicy()
    for _fqn, unit in sharding_units(model, units):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
