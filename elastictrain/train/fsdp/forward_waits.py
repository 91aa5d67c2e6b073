"""A sharded forward's waits for its peers, marked where the mesh's groups are torch's own:
:class:`ForwardWaits`.

Each FSDP unit gathers its parameters in its forward pre-hook (``fully_shard`` registers it first
of the unit's pre-hooks), and waits there for every rank of the mesh: a rank whose peer straggles
waits in the next unit's gathering, before the step's gradient collective, and that wait is not
its compute. Under in-process recovery the mesh's groups are failsafe wrappers
(:mod:`~elastictrain.train.fsdp.failsafe_group`) that enter the step loop's marker around each wait
for a collective. Under ``--recovery restart`` they are torch's own groups, and this module enters
the marker around each unit's gathering instead: from a pre-hook put before ``fully_shard``'s to
one after it. The window holds the gathering's copy into the unit's parameters as well, which
every rank does alike (the straggler watch compares ranks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle

__all__ = ["ForwardWaits"]

Marker = Callable[[], contextlib.AbstractContextManager[Any]]


class ForwardWaits:
    """Enters a marker around each FSDP unit's gathering of its parameters in ``module``'s forward,
    while :meth:`marking` is entered (a step's micro-batches); no collective of its own.

    Args:
        module: The sharded model (``fully_shard`` applied to its units).
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._marker: Marker | None = None
        self._open: contextlib.ExitStack | None = None
        self._handles: list[RemovableHandle] = []
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                self._handles.append(unit.register_forward_pre_hook(self._enter, prepend=True))
                self._handles.append(unit.register_forward_pre_hook(self._exit))

    @contextlib.contextmanager
    def marking(self, marker: Marker) -> Iterator[None]:
        """Inside, ``marker()`` is entered around each unit's gathering."""
        before, self._marker = self._marker, marker
        try:
            yield
        finally:
            self._close()  # a gathering that raised never reached the hook after it
            self._marker = before

    def remove(self) -> None:
        """Remove the hooks (the model is left)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        self._close()
        if self._marker is not None:
            self._open = contextlib.ExitStack()
            self._open.enter_context(self._marker())

    def _exit(self, module: torch.nn.Module, args: Any) -> None:
        self._close()

    def _close(self) -> None:
        opened, self._open = self._open, None
        if opened is not None:
            opened.close()
