"""The sharded model and optimizer as checkpointable state, and their full forms.

:class:`ModelState` and :class:`OptimizerState` are the ``Stateful`` objects a
:class:`~elastictrain.checkpoint.CheckpointManager` saves and restores. Their dicts have the
keys of a DDP job's own (``module.state_dict()``, ``optimizer.state_dict()``), with DTensors
where the values are sharded:

- the model: FQN-keyed (``get_model_state_dict``), parameters as DTensors with the live
  placements, buffers as plain tensors;
- the optimizer: torch's own form, ``{"state": {id: {...}}, "param_groups": [{..., "params":
  [id, ...]}]}``, its state tensors DTensors (built by ``get_optimizer_state_dict``, whose FQN
  keys become the ids the optimizer numbers its parameters by: each group's, in order). The same
  keys as a DDP job's, so that a DDP checkpoint restores into a sharded job and a sharded one into
  a DDP job by the checkpoint manager's own resharding, with no conversion on either side. It is
  complete even before the first step (every state tensor there, zero), so a restore has a
  template to fill; building it leaves the optimizer as it was.

``load_state_dict()`` applies such a dict, or one of full tensors held by every rank (a DDP
checkpoint's), or the optimizer's FQN-keyed form (``get_optimizer_state_dict``'s): a dict holding
any DTensor is taken as sharded.

:func:`full_state_dict` and :func:`full_optimizer_state_dict` gather the full tensors on rank 0,
for export, evaluation, or a DDP job to load.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from elastictrain.errors import ConfigError

__all__ = [
    "ModelState", "OptimizerState", "full_optimizer_state_dict", "full_state_dict", "optimizer_order",
    "optimizer_state_by_fqn", "optimizer_state_by_id",
]

_GATHERED = StateDictOptions(full_state_dict=True, cpu_offload=True)
"""Full tensors, gathered to rank 0's CPU memory (other ranks get an empty dict)."""


def _holds_dtensor(value: Any) -> bool:
    if isinstance(value, DTensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_dtensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_dtensor(v) for v in value)
    return False


def _load_options(state_dict: Mapping[str, Any]) -> StateDictOptions:
    """Sharded if ``state_dict`` holds a DTensor; else full tensors, which every rank holds."""
    return StateDictOptions(full_state_dict=not _holds_dtensor(state_dict))


def optimizer_order(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The FQN of each parameter id of ``optimizer.state_dict()``: its groups' parameters, in order
    (for an optimizer built on ``model.parameters()``, ``model.named_parameters()`` order)."""
    fqns = {id(param): fqn for fqn, param in model.named_parameters()}
    return [fqns[id(p)] for group in optimizer.param_groups for p in group["params"]]


def optimizer_state_by_fqn(state_dict: Mapping[str, Any], order: list[str]) -> dict[str, Any]:
    """torch's id-keyed ``optimizer.state_dict()`` form (a DDP job's) as the FQN-keyed one.

    Args:
        state_dict: ``{"state": {id: {...}}, "param_groups": [{..., "params": [id, ...]}]}``.
        order: :func:`optimizer_order` of the optimizer that loads it.

    Raises:
        ConfigError: Its parameter ids or groups do not fit this optimizer.
    """
    def name(index: Any) -> str:
        if not isinstance(index, int) or not 0 <= index < len(order):
            raise ConfigError(f"the optimizer state names parameter {index!r}; "
                              f"this optimizer has {len(order)} (ids 0 to {len(order) - 1})")
        return order[index]

    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or sum(len(g.get("params", ())) for g in groups) != len(order):
        raise ConfigError(f"the optimizer state's param groups do not hold this optimizer's {len(order)} "
                          "parameters: it was saved for another model or optimizer")
    return {
        "state": {name(index): value for index, value in state_dict.get("state", {}).items()},
        "param_groups": [{**group, "params": [name(i) for i in group["params"]]} for group in groups],
    }


def optimizer_state_by_id(state_dict: Mapping[str, Any], order: list[str]) -> dict[str, Any]:
    """An FQN-keyed optimizer state dict as torch's id-keyed form (the inverse of
    :func:`optimizer_state_by_fqn`)."""
    index = {fqn: i for i, fqn in enumerate(order)}
    state = {index[fqn]: value for fqn, value in state_dict["state"].items()}
    return {
        "state": dict(sorted(state.items())),
        "param_groups": [{**group, "params": [index[fqn] for fqn in group["params"]]}
                         for group in state_dict["param_groups"]],
    }


@contextlib.contextmanager
def _grads_aside(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Set the gradients of ``optimizer``'s parameters aside meanwhile (a save or load in the middle
    of a step, between a backward and the optimizer step), and put them back."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad


@contextlib.contextmanager
def _complete_state(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Let torch's state-dict functions build every state tensor of an optimizer that has not
    stepped, and leave it as it was afterwards.

    ``get_optimizer_state_dict`` and ``set_optimizer_state_dict`` build missing state by one
    ``step()`` at lr 0 over zero gradients, and only when no parameter has a gradient (else they
    see no state: no template to fill, none to place a loaded state by). That step is not
    harmless: Adam's ``step`` count becomes 1, so the first real step would use the bias
    correction of the second and the run would no longer equal DDP's. Building a state dict
    drops the state it built (the dict keeps its tensors, as a template).
    """
    fresh = not optimizer.state
    with _grads_aside(optimizer):
        try:
            yield
        finally:
            if fresh:
                optimizer.state.clear()


def _shared_names(model: torch.nn.Module) -> list[list[str]]:
    """The FQNs of each parameter that ``model`` holds under more than one name (tied weights)."""
    names: dict[int, list[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(fqn)
    return [fqns for fqns in names.values() if len(fqns) > 1]


class ModelState:
    """The sharded model as checkpointable state (see the module docstring).

    Args:
        model: The sharded model.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        """FQN-keyed; parameters as DTensors with the live placements, buffers as plain tensors. A
        shared (tied) parameter is one object under each of its names, which a checkpoint writes once."""
        state = get_model_state_dict(self.model)
        for first, *others in _shared_names(self.model):
            for name in others:
                if first in state and name in state:
                    state[name] = state[first]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Apply a sharded dict (DTensor values) or a full one (plain tensors on every rank).

        Raises:
            RuntimeError: torch's, for missing or unexpected keys.
        """
        set_model_state_dict(self.model, state_dict, options=_load_options(state_dict))


class OptimizerState:
    """The optimizer of a sharded model as checkpointable state (see the module docstring).

    Args:
        model: The sharded model.
        optimizer: Its optimizer, over the sharded parameters.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        """torch's id-keyed form with DTensor state; every state tensor present even before the
        first step (zeros then: a template), without changing the optimizer."""
        with _complete_state(self.optimizer):
            by_fqn = get_optimizer_state_dict(self.model, self.optimizer)
        return optimizer_state_by_id(by_fqn, optimizer_order(self.model, self.optimizer))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Apply the id-keyed form (sharded, or a DDP checkpoint's full tensors) or the FQN-keyed one.

        Raises:
            ConfigError: An id-keyed dict that does not fit this optimizer.
        """
        groups = state_dict.get("param_groups") or [{}]
        if any(isinstance(i, int) for i in groups[0].get("params", ())):
            state_dict = optimizer_state_by_fqn(state_dict, optimizer_order(self.model, self.optimizer))
        with _grads_aside(self.optimizer):  # torch builds the state to load into; the load replaces it
            set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=_load_options(state_dict))


def full_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The model's full tensors, FQN-keyed, gathered to rank 0's CPU memory; ``{}`` on other
    ranks. A collective: every rank calls it."""
    return dict(get_model_state_dict(model, options=_GATHERED))


def full_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state in the form a DDP job's ``optimizer.load_state_dict`` takes (ids,
    full tensors), on rank 0; ``{}`` on other ranks. A collective: every rank calls it.

    An optimizer that has not stepped has no state, as in DDP (not the zero template of
    :meth:`OptimizerState.state_dict`)."""
    fresh = not optimizer.state
    with _complete_state(optimizer):
        gathered = get_optimizer_state_dict(model, optimizer, options=_GATHERED)
    if not gathered:
        return {}
    if fresh:
        gathered = {**gathered, "state": {}}
    return optimizer_state_by_id(gathered, optimizer_order(model, optimizer))
