"""The structure of the user's unsharded model, kept at no memory cost: :class:`Skeleton`.

``fully_shard`` can be applied to a module once: a group that re-forms in place cannot shard the
same module over its new mesh. So before the first ``fully_shard`` the strategy keeps a skeleton
of the model (a deep copy whose parameters and persistent buffers are on the meta device: no
storage), and each later generation builds a fresh module from it (:meth:`Skeleton.build`), shards
that over its mesh, and fills it from the survivors' memory or the newest checkpoint.
Non-persistent buffers (caches a module computes when built, saved by no checkpoint) are kept
with their values: they are small, and nothing else could bring them back.
"""

from __future__ import annotations

import copy

import torch

__all__ = ["Skeleton"]


class Skeleton:
    """A storage-less copy of an unsharded model (see the module docstring).

    Args:
        model: The unsharded model, before any ``fully_shard``.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        memo: dict[int, object] = {}
        for param in model.parameters():
            memo[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="meta"),
                                                 requires_grad=param.requires_grad)
        for tensor in model.state_dict(keep_vars=True).values():  # parameters and persistent buffers
            if id(tensor) not in memo:
                memo[id(tensor)] = torch.empty_like(tensor, device="meta")
        self._model = copy.deepcopy(model, memo)

    def keep_buffers(self, module: torch.nn.Module) -> None:
        """Take ``module``'s values of the non-persistent buffers the skeleton holds on the meta device
        (a model built there: its first generation's ``init_weights`` or live peers set them, and no
        checkpoint holds them), so that every module built later has them as well.

        Args:
            module: A generation's module of this model (the FQNs of its buffers are the model's).
        """
        live = dict(module.named_buffers())
        for prefix, owner in self._model.named_modules():
            for name in owner._non_persistent_buffers_set:  # noqa: SLF001 - no public name for the set
                buffer = owner._buffers.get(name)  # noqa: SLF001
                if buffer is not None and buffer.is_meta:
                    owner._buffers[name] = live[f"{prefix}.{name}" if prefix else name].detach().clone()  # noqa: SLF001

    def build(self, device: torch.device, *, allocate: bool = True) -> torch.nn.Module:
        """A fresh module of the model's structure on ``device``: parameters and persistent buffers
        allocated but not initialised (the caller fills them), non-persistent buffers as they were
        when the skeleton was taken. A shared parameter stays shared.

        Args:
            allocate: False: the parameters and persistent buffers stay on the meta device (no
                storage; :func:`~elastictrain.train.fsdp.sharded.shard` allocates the shards alone),
                the non-persistent buffers on ``device``.
        """
        where = device if allocate else torch.device("meta")
        fresh = copy.deepcopy(self._model)
        made: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for module in fresh.modules():
                for name, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
                    if id(param) not in made:
                        made[id(param)] = torch.nn.Parameter(torch.empty_like(param, device=where),
                                                             requires_grad=param.requires_grad)
                    setattr(module, name, made[id(param)])
                for name, buffer in list(module.named_buffers(recurse=False, remove_duplicate=False)):
                    if id(buffer) not in made:
                        made[id(buffer)] = (torch.empty_like(buffer, device=where) if buffer.is_meta
                                            else buffer.to(device))
                    setattr(module, name, made[id(buffer)])  # a buffer stays one, persistent or not
        return fresh
