"""A model built on the meta device (no storage) and given its values by ``init_weights``.

``Session(..., sharding="fsdp" | "hsdp", init_weights=fn)`` trains a model built with
``torch.device("meta")``: a model that does not fit one device. ``fn`` is a ``Module.apply``
function; the values are those of ``torch.manual_seed(seed); model.apply(fn)`` on the whole model,
whoever computes them: the sharded strategy, shard by shard, unit by unit
(:mod:`~elastictrain.train.fsdp.initialize`), or one process that trains the whole model
(:func:`materialize`: a world of one, where no group shards it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from elastictrain.errors import ConfigError

__all__ = [
    "InitWeights", "built_on_meta", "check_set", "empty_whole", "failed_error", "materialize", "on_meta_device",
    "reset_parameters", "seeded",
]

InitWeights = Callable[[torch.nn.Module], object]
"""``fn(module)``: sets ``module``'s own parameters and buffers, as a ``Module.apply`` function does."""


def reset_parameters(module: torch.nn.Module) -> None:
    """An ``init_weights`` that sets each module's own tensors as torch's constructors do:
    ``reset_parameters()`` where a module has one, and ``nn.MultiheadAttention``'s in-projection and
    biases (its reset has no public name). With the seed the model was built under, a model whose
    modules set their own tensors at the end of their constructors (torch's do, in ``Module.apply``'s
    order) gets the values it would have been built with. A tied weight gets the init of the last
    module holding it, as ``model.apply`` gives it, not the first's, as the constructors do."""
    if isinstance(module, torch.nn.MultiheadAttention):
        if module.in_proj_weight is not None:
            torch.nn.init.xavier_uniform_(module.in_proj_weight)
        else:
            for weight in (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight):
                torch.nn.init.xavier_uniform_(weight)
        if module.in_proj_bias is not None:
            torch.nn.init.zeros_(module.in_proj_bias)
            torch.nn.init.zeros_(module.out_proj.bias)  # its child's, which the child's reset drew
        for bias in (module.bias_k, module.bias_v):
            if bias is not None:
                torch.nn.init.xavier_normal_(bias)
    elif callable(reset := getattr(module, "reset_parameters", None)):
        reset()


def on_meta_device(module: torch.nn.Module) -> bool:
    """Whether ``module`` was built on the meta device (its parameters hold no storage)."""
    return any(p.is_meta for p in module.parameters())


def built_on_meta(model: torch.nn.Module) -> bool:
    """Whether ``model`` was built on the meta device, checked whole (the session's check at start):
    its parameters hold no storage.

    Raises:
        ConfigError: Some are and some are not, or a persistent buffer is on the meta device while
            the parameters are not.
    """
    params = [p.is_meta for p in model.parameters()]
    buffers = [b.is_meta for b in model.state_dict(keep_vars=True).values() if isinstance(b, torch.Tensor)]
    meta = bool(params) and all(params)
    if any(params) and not meta:
        raise ConfigError("the model has parameters on the meta device and others not: build all of them on it "
                          "(with torch.device('meta')) or none")
    if any(buffers) and not meta:
        raise ConfigError("the model has buffers on the meta device and its parameters are not: build the whole "
                          "model on it (with torch.device('meta')) or none of it")
    return meta


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Inside, torch's RNG (the CPU's, and ``device``'s when it is a GPU) seeded from ``seed``;
    restored after."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.manual_seed(seed)
        yield


def check_set(fqn: str, tensor: torch.Tensor) -> None:
    """Refuse a floating-point or complex tensor ``init_weights`` left unset (still NaN, as
    :func:`empty_whole` made it).

    Raises:
        ConfigError: It is (one line naming ``fqn``).
    """
    if (tensor.dtype.is_floating_point or tensor.dtype.is_complex) and bool(torch.isnan(tensor).any()):
        raise ConfigError(f"init_weights left {fqn} unset: it must set each module's own parameters and buffers "
                          "(as a Module.apply function does; reset_parameters() where a module has one)")


def failed_error(where: str, exc: Exception) -> ConfigError:
    """The one line for ``init_weights`` raising ``exc`` on ``where``."""
    return ConfigError(f"init_weights failed on {where}: {type(exc).__name__}: {exc}")


def empty_whole(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor of ``meta``'s shape and dtype on ``device``, NaN (0 for integers) until set; a
    ``Parameter`` for a parameter."""
    fill = float("nan") if meta.dtype.is_floating_point or meta.dtype.is_complex else 0
    value = torch.full(meta.shape, fill, dtype=meta.dtype, device=device)
    if isinstance(meta, torch.nn.Parameter):
        return torch.nn.Parameter(value, requires_grad=meta.requires_grad)
    return value


def materialize(module: torch.nn.Module, init_weights: InitWeights, *, seed: int, device: torch.device) -> None:
    """Allocate a model built on the meta device whole on ``device`` and set it: ``module.apply(init_weights)``
    with torch's RNG seeded from ``seed``. Its tensors stay the same objects (their storage is
    swapped in, ``torch.utils.swap_tensors``): an optimizer built on the model keeps them.

    Raises:
        ConfigError: ``init_weights`` raised, or left a tensor unset (one line).
    """
    done: set[int] = set()
    for owner in module.modules():
        own: tuple[dict[str, Any], dict[str, Any]] = (owner._parameters, owner._buffers)  # noqa: SLF001 - by slot
        for slots in own:
            for tensor in slots.values():
                if tensor is not None and tensor.is_meta and id(tensor) not in done:
                    done.add(id(tensor))
                    torch.utils.swap_tensors(tensor, empty_whole(tensor, device))

    def call(each: torch.nn.Module) -> None:
        init_weights(each)

    with seeded(seed, device), torch.no_grad():
        try:
            module.apply(call)
        except Exception as exc:  # noqa: BLE001 - the user's function: its failure in one line
            raise failed_error("the model", exc) from None
    for fqn, tensor in [*module.named_parameters(), *module.named_buffers()]:
        check_set(fqn, tensor)
