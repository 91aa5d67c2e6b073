"""Which submodules become FSDP units, and ``fully_shard`` applied to them.

A unit is what FSDP2 gathers in one all-gather before its forward and frees after it: the
fewer the parameters of the largest unit, the lower the peak memory; the more units, the more
(smaller) collectives.

Default: each direct child module of the model that holds parameters is a unit, then the root
(which takes the parameters held by the root itself). For transformers, pass the block class, a
collection of classes (``{TransformerBlock}``, as torchtitan wraps each block) or a predicate
``(fqn, module) -> bool``: every matching module that holds parameters, at any depth, is a unit,
then the root. Units are sharded bottom-up (a unit nested in another is sharded first), as
``fully_shard`` requires.

A shared parameter (tied weights: an embedding and an output projection holding one
``Parameter``, GPT-2 style) is never split across units: FSDP2 refuses one managed by two units. A
unit that would hold it while a module outside the unit holds it too is not sharded on its own,
so the parameter goes to the nearest unit that holds every module sharing it (their common
ancestor unit; the root at the latest), as FSDP2 users do by hand; its units nested inside stay.
A parameter used in a forward outside the modules that hold it (``h @ self.embed.weight.T`` in the
root) is not seen here: hold it in the module that uses it (``self.head.weight = self.embed.weight``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from elastictrain.errors import ConfigError

__all__ = ["UnitSpec", "check_shardable", "check_units", "shard_model", "sharding_units"]

logger = logging.getLogger(__name__)

UnitSpec = type[torch.nn.Module] | Collection[type[torch.nn.Module]] | Callable[[str, torch.nn.Module], bool]
"""A module class (or a tuple, set, frozenset or list of them) whose instances are units, or a
predicate on ``(fqn, module)``."""


def _post_order(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.nn.Module]]:
    """``(fqn, module)`` of every submodule, each after its own submodules, in definition order."""
    for name, child in module.named_children():
        fqn = f"{prefix}.{name}" if prefix else name
        yield from _post_order(child, fqn)
        yield fqn, child


def check_units(units: object, *, name: str = "units") -> Callable[[str, torch.nn.Module], bool]:
    """The predicate on ``(fqn, module)`` that ``units`` (a :data:`UnitSpec`) stands for.

    Args:
        units: A module class, a non-empty collection of them, or a predicate ``(fqn, module) -> bool``.
        name: The option's name, for the message.

    Raises:
        ConfigError: Anything else (one line naming the value).
    """
    if isinstance(units, torch.nn.Module):  # callable, but a module, not a predicate
        raise ConfigError(f"{name} must name module classes, got a {type(units).__name__} instance: "
                          f"pass {type(units).__name__} itself")
    if isinstance(units, type):
        classes: tuple[object, ...] = (units,)
    elif isinstance(units, (tuple, list, set, frozenset)):
        classes = tuple(units)
        if not classes:
            raise ConfigError(f"{name} is an empty {type(units).__name__}: name at least one module class")
    elif callable(units):
        return units  # a predicate (fqn, module) -> bool, as documented
    else:
        classes = ()
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, torch.nn.Module))]
    if not classes or bad:
        got = bad[0] if bad else units
        raise ConfigError(" ".join(f"{name} must be a torch.nn.Module subclass, a collection of them or a predicate "
                                   f"(fqn, module) -> bool, got {type(got).__name__} {got!r}".split())[:300])
    types = tuple(c for c in classes if isinstance(c, type))
    return lambda _fqn, module: isinstance(module, types)


def _holders(model: torch.nn.Module) -> dict[int, list[str]]:
    """``id(parameter) -> the FQNs of every module that holds it`` (two or more for a shared one)."""
    holders: dict[int, list[str]] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append(fqn)
    return holders


def _inside(fqn: str, unit: str) -> bool:
    return fqn == unit or fqn.startswith(f"{unit}.")


def _shared_outside(fqn: str, unit: torch.nn.Module, holders: dict[int, list[str]]) -> tuple[str, str] | None:
    """A parameter of ``unit`` (at ``fqn``) that a module outside it holds too, with that module's FQN."""
    for name, param in unit.named_parameters():
        outside = [h for h in holders[id(param)] if not _inside(h, fqn)]
        if outside:
            return f"{fqn}.{name}", outside[0] or "the root"
    return None


def sharding_units(model: torch.nn.Module, units: UnitSpec | None = None) -> list[tuple[str, torch.nn.Module]]:
    """The ``(fqn, module)`` units of ``model`` other than the root, in the order to shard them.

    Args:
        model: The unsharded model.
        units: None for the default (each direct child that holds parameters), else see :data:`UnitSpec`.

    Returns:
        The units, less those that would split a shared parameter (see the module docstring).

    Raises:
        ConfigError: ``units`` is not a :data:`UnitSpec` (see :func:`check_units`).
    """
    if units is None:
        candidates = list(model.named_children())
    else:
        matches = check_units(units)
        candidates = [(fqn, module) for fqn, module in _post_order(model) if matches(fqn, module)]
    holders = _holders(model)
    chosen = []
    for fqn, module in candidates:
        if next(module.parameters(), None) is None:
            continue
        shared = _shared_outside(fqn, module, holders)
        if shared is not None:
            logger.info("%r is not a sharding unit of its own: its parameter %r is shared with %r outside it, "
                        "so a unit holding both holds it", fqn, shared[0], shared[1])
            continue
        chosen.append((fqn, module))
    return chosen


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
