"""Gradient accumulation: skip the gradient synchronization on all but the last micro-batch.

With the sampler's plans the global batch stays the same whatever the world
size: a step is ``len(plan.micro_batches)`` forward/backward passes on every
rank. DDP would all-reduce gradients after each of them; inside
``model.no_sync()`` it only accumulates, so :func:`accumulate` wraps every
micro-batch but the last in ``no_sync()`` and the step costs one all-reduce.

DDP reads the flag in the *forward* pass, so the forward must run inside the
loop body, while the micro-batch is current. :func:`accumulate_with` takes any such
context (a session's parallelism strategy gives its own: FSDP2's gradient sync switch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

__all__ = ["accumulate", "accumulate_with", "no_sync"]

T = TypeVar("T")


def no_sync(model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
    """``model.no_sync()`` for a DDP model, a no-op context for anything else."""
    method = getattr(model, "no_sync", None)
    return method() if callable(method) else contextlib.nullcontext()


def accumulate(model: torch.nn.Module, micro_batches: Iterable[T]) -> Iterator[T]:
    """Yield ``micro_batches``, each but the last inside ``no_sync(model)``.

    Works with any iterable (it looks one item ahead to find the last), e.g.
    ``plan.micro_batches`` or ``zip(plan.micro_batches, loader_iter)``, with
    the plan first so that the look-ahead never pulls an extra batch.

    Example::

        for plan in sampler.iter_steps():
            optimizer.zero_grad()
            for micro in elastictrain.accumulate(ddp_model, plan.micro_batches):
                x, y = next(batches)
                loss = loss_fn(ddp_model(x), y)
                (loss * micro.loss_scale).backward()
            optimizer.step()
            sampler.commit_step(plan)
    """
    return accumulate_with(lambda: no_sync(model), micro_batches)


def accumulate_with(unsynced: Callable[[], contextlib.AbstractContextManager[Any]],
                    micro_batches: Iterable[T]) -> Iterator[T]:
    """Yield ``micro_batches``, each but the last inside a fresh ``unsynced()`` context (see
    :func:`accumulate`, which is this with ``no_sync(model)``)."""
    items = iter(micro_batches)
    try:
        current = next(items)
    except StopIteration:
        return
    for upcoming in items:
        with unsynced():
            yield current
        current = upcoming
    yield current
