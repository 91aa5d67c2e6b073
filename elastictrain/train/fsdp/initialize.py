"""A model built on the meta device, initialised into its shards one unit at a time: :func:`initialize`.

A model that does not fit one device is built without storage (``with torch.device("meta"):``,
as torchtitan builds its models) and given to ``Session(..., sharding="fsdp", init_weights=fn)``.
No rank ever holds its full state: the session shards the storage-less model, allocates each
rank's shards, and then, when the state comes neither from live peers nor from a checkpoint
(a fresh start), sets their values here.

``fn`` is a ``Module.apply`` function (nanoGPT's and HuggingFace's ``_init_weights``): called on each
module, it sets that module's parameters and buffers (``reset_parameters()`` where a module has
one). :func:`initialize` calls it in ``Module.apply``'s order (each module after its submodules)
on a storage-less copy of the model whose tensors it materializes whole, unit by unit: the
tensors of an FSDP unit (those it manages, outside its nested units) exist whole from the first
visit of one of its modules until the visit of the unit's root, then each rank copies its own
shard out of each and drops them. At most the units on one path from the root are whole at
once: the peak FSDP's own forward reaches. A function may therefore also set a submodule's
tensors when that submodule is in its unit (``nn.MultiheadAttention`` sets its ``out_proj``'s bias).

Every rank draws the same values: torch's RNG is seeded from the session's ``seed`` for the pass
(and restored after it), so the shards put together equal ``torch.manual_seed(seed);
model.apply(fn)`` on the full model, at any world size and mesh, with no collective. A tensor
that ``fn`` leaves unset is named in one line (each float tensor starts as NaN and is checked when
its unit is dropped).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from elastictrain.train.meta_init import InitWeights, check_set, empty_whole, failed_error, seeded

__all__ = ["initialize"]


def _apply_order(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.nn.Module]]:
    """``(fqn, module)`` in the order ``module.apply(fn)`` calls ``fn``: each module after its children."""
    for name, child in module.named_children():
        yield from _apply_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def _unit_of(fqn: str, units: frozenset[str]) -> str:
    """The FQN of the unit that manages ``fqn``'s own tensors: its nearest unit ancestor (or itself)."""
    while fqn and fqn not in units:
        fqn = fqn.rpartition(".")[0]
    return fqn


_Slots = dict[str, Any]
"""A module's ``_parameters`` or ``_buffers``: its own tensors by name."""


@dataclass
class _Whole:
    """A tensor of the copy, materialized whole while its unit is."""

    fqn: str
    """Where the sharded model holds it (the first FQN naming it, as ``named_parameters`` gives it)."""

    meta: torch.Tensor
    """The storage-less original, put back on each holder when the tensor is dropped."""

    holders: list[tuple[_Slots, str]] = field(default_factory=list)
    """Each ``(module._parameters or module._buffers, name)`` that holds it."""

    value: torch.Tensor | None = None

    def materialize(self, device: torch.device) -> None:
        """Make the whole tensor (NaN, or 0 for integers) if it is not yet, and put it on every holder."""
        if self.value is None:
            self.value = empty_whole(self.meta, device)
        for slots, name in self.holders:
            slots[name] = self.value

    def drop(self) -> None:
        """Put the storage-less original back on every holder: the whole tensor is freed."""
        for slots, name in self.holders:
            slots[name] = self.meta
        self.value = None


def initialize(model: torch.nn.Module, structure: torch.nn.Module, init_weights: InitWeights, *,
               units: frozenset[str], seed: int, device: torch.device) -> None:
    """Set the shards of ``model`` (sharded from a meta-device model, its shards allocated) to
    ``init_weights`` applied to the full model; no collective (see the module docstring).

    Args:
        model: The sharded model (FQNs as the unsharded model's).
        structure: A storage-less copy of the unsharded model (its tensors on the meta device;
            :meth:`~elastictrain.train.fsdp.skeleton.Skeleton.build` with ``allocate=False``). Its
            tensors are materialized and dropped in turn; it is not usable after.
        init_weights: See :data:`InitWeights`.
        units: The FQNs of the FSDP units (the root, ``""``, is one whichever are given).
        seed: Seeds torch's RNG for the pass (every rank alike); the caller's RNG is restored after.
        device: Where the whole tensors are made (the shards' device).

    Raises:
        ConfigError: ``init_weights`` left a tensor unset (NaN), or raised (one line each).
    """
    targets: dict[str, torch.Tensor] = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    wholes: dict[int, _Whole] = {}
    for fqn, tensor in [*structure.named_parameters(), *structure.named_buffers()]:
        wholes.setdefault(id(tensor), _Whole(fqn, tensor))
    order = list(_apply_order(structure))
    last_visit = {fqn: i for i, (fqn, _module) in enumerate(order)}
    units = units | {""}
    owned: list[list[tuple[_Whole, _Slots, str]]] = [[] for _ in order]
    drop_at: dict[int, int] = {}  # id(whole) -> the visit after which it is dropped: its units' roots, the latest
    for i, (fqn, module) in enumerate(order):
        own: tuple[_Slots, _Slots] = (module._parameters, module._buffers)  # noqa: SLF001 - by slot
        for slots in own:
            for name, held in slots.items():
                if held is None:
                    continue
                whole = wholes[id(held)]
                whole.holders.append((slots, name))
                owned[i].append((whole, slots, name))
                at = last_visit[_unit_of(fqn, units)]
                drop_at[id(whole)] = max(drop_at.get(id(whole), at), at)
    dropping: dict[int, list[_Whole]] = {}
    for whole in wholes.values():
        dropping.setdefault(drop_at[id(whole)], []).append(whole)
    with seeded(seed, device), torch.no_grad():
        for i, (fqn, module) in enumerate(order):
            for whole, _slots, _name in owned[i]:
                whole.materialize(device)
            try:
                init_weights(module)
            except Exception as exc:  # noqa: BLE001 - the user's function: its failure in one line
                raise failed_error(f"{fqn or 'the root module'} ({type(module).__name__})", exc) from None
            for whole, slots, name in owned[i]:  # the function may have replaced a tensor rather than set it
                whole.value = slots[name]
            for whole in dropping.get(i, ()):
                _copy_shard(whole, targets[whole.fqn])
                whole.drop()


def _copy_shard(whole: _Whole, target: torch.Tensor) -> None:
    """Copy this rank's part of ``whole``'s value into ``target`` (a DTensor's local shard, or a whole buffer)."""
    value = whole.value
    assert value is not None  # noqa: S101 - materialized before its unit is dropped
    check_set(whole.fqn, value)
    if isinstance(target, DTensor):
        part = distribute_tensor(value.detach(), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(part.to_local())
    else:
        target.copy_(value)
