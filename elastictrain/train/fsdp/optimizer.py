"""The user's optimizer, moved onto the sharded parameters.

The user builds the optimizer on the unsharded model, as for DDP. ``fully_shard`` replaces every
parameter by a new DTensor parameter of the same FQN, so the optimizer must train those instead.
Two ways:

- an optimizer instance: the **same object** keeps its class, ``defaults``, param groups and each
  group's options; each group's parameters are replaced, in place and in order, by the sharded
  parameter of the same FQN (parameter identity -> FQN, recorded before sharding -> sharded
  parameter). Keeping the object keeps what refers to it working: a learning-rate scheduler built
  on it, hooks registered on it, the script's own reference. It must not have stepped yet
  (state built for the full parameters would not fit the shards).
- a callable ``params -> optimizer``: called with the sharded parameters, for optimizers that
  precompute per-parameter data when they are built.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from elastictrain.errors import ConfigError

__all__ = ["OptimizerSpec", "check_unstepped", "parameter_fqns", "shard_optimizer"]

OptimizerSpec = torch.optim.Optimizer | Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
"""An optimizer built on the unsharded model, or a callable that builds one from parameters."""


def parameter_fqns(model: torch.nn.Module) -> dict[int, str]:
    """``id(parameter) -> FQN`` of ``model``'s parameters (a shared parameter under its first name)."""
    return {id(param): fqn for fqn, param in model.named_parameters()}


def check_unstepped(optimizer: torch.optim.Optimizer, fqns: Mapping[int, str]) -> None:
    """Refuse an optimizer that cannot be moved onto the shards.

    Raises:
        ConfigError: It has state (it has stepped), or holds a parameter that is not the model's.
    """
    if optimizer.state:
        raise ConfigError(f"the {type(optimizer).__name__} already has state (it has stepped): pass it before "
                          "training, or pass a callable params -> optimizer")
    foreign = sum(id(p) not in fqns for group in optimizer.param_groups for p in group["params"])
    if foreign:
        raise ConfigError(f"the optimizer holds {foreign} parameter(s) that are not the model's: build it on "
                          "the model that is sharded")


def shard_optimizer(optimizer: OptimizerSpec, fqns: Mapping[int, str],
                    sharded: Mapping[str, torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer over the sharded parameters (see the module docstring).

    Args:
        optimizer: An optimizer built on the unsharded model (checked by :func:`check_unstepped`
            before sharding), or a callable ``params -> optimizer``.
        fqns: :func:`parameter_fqns` of the model, taken before sharding.
        sharded: ``dict(model.named_parameters())`` after sharding.

    Raises:
        ConfigError: The callable did not return an optimizer.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        built = optimizer(list(sharded.values()))
        if not isinstance(built, torch.optim.Optimizer):
            raise ConfigError(f"the optimizer callable returned a {type(built).__name__}, not a torch.optim.Optimizer")
        return built
    for group in optimizer.param_groups:
        # In place: an optimizer may hold on to the list (LBFGS keeps param_groups[0]["params"]).
        group["params"][:] = [sharded[fqns[id(p)]] for p in group["params"]]
    return optimizer
