"""Overlapped snapshots: a save's tensors are copied in the background while training goes on.

With ``CheckpointManager(async_save=True, overlap=True)``, ``save`` captures the
structure of the state on the training thread (containers, scalars, references to
tensors: ``_snapshot.capture``) and returns. A ``SnapshotCopy`` then copies every
referenced storage to CPU memory on the save's background thread: on the CPU a
plain tensor copy (it releases the GIL), on CUDA a device-to-host copy on a side
stream into pinned memory, ordered after everything queued on the device's
current stream when ``save`` was called.

A referenced tensor must not change before its copy is made. What changes them in
a training loop waits for the copy instead:

- the forward of a saved module, which updates its buffers (BatchNorm's running
  statistics): a forward pre-hook waits for the copies of that module's own
  buffers, which are copied first;
- an optimizer step, which updates parameters and optimizer state: a global
  optimizer step pre-hook (registered by the manager) waits for the whole copy
  when the optimizer is part of the save or steps a parameter being copied.

Waiting means: on the CPU, blocking until the copy is made; on CUDA, blocking only
until the copy is queued, then making the current stream wait for an event
recorded after it on the side stream, so kernels queued afterwards (the optimizer
step) run after the copy without the CPU waiting for the transfer.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from . import _snapshot as snap

__all__ = ["SideStreams", "SnapshotCopy", "copy_sizes"]

logger = logging.getLogger(__name__)


class SideStreams:
    """The stream each CUDA device copies snapshots on, created on first use and kept."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def get(self, device: torch.device) -> torch.cuda.Stream:
        """Return ``device``'s copy stream."""
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device=device)
            return stream


class SnapshotCopy:
    """The copy of one overlapped save's tensors: made by ``run`` in the background, awaited by training.

    Construct it on the training thread, right after capturing the state: it
    marks where each device's current stream stands, and guards the buffers of
    ``modules`` with forward pre-hooks until ``release``.

    Args:
        references: The tensors ``capture`` left to copy (strided, CPU or CUDA).
        modules: The saved modules; their buffers are copied first and guarded.
        optimizers: The saved optimizers; a step of one waits for the whole copy.
        pool: Where the copies go (``pool.begin()`` already called).
        streams: The CUDA copy streams.
    """

    def __init__(
        self,
        references: Iterable[torch.Tensor],
        *,
        modules: Iterable[torch.nn.Module],
        optimizers: Iterable[torch.optim.Optimizer],
        pool: snap.CopyPool,
        streams: SideStreams,
    ) -> None:
        modules = _unique(m for root in modules for m in root.modules())
        buffers = {snap.storage_key(b) for m in modules for b in m.buffers(recurse=False)}
        unique: dict[snap.StorageKey, torch.Tensor] = {}
        for tensor in references:
            unique.setdefault(snap.storage_key(tensor), tensor)
        # Buffers first: the next forward updates them, long before the optimizer step.
        order = sorted(unique, key=lambda key: key not in buffers)
        self._sources = [unique[key] for key in order]
        self._index = {key: i for i, key in enumerate(order)}
        self._optimizers = {id(o) for o in optimizers}
        self._pool, self._streams = pool, streams
        self._cond = threading.Condition()
        self._issued = 0  # copies made (CPU) or queued with their fence recorded (CUDA)
        self._failed = False
        self._fences: list[tuple[torch.device, torch.cuda.Event] | None] = []
        # The side streams must see every kernel queued so far: the state as of save().
        self._ready: dict[torch.device, torch.cuda.Event] = {}
        for tensor in self._sources:
            if tensor.is_cuda and tensor.device not in self._ready:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(tensor.device))
                self._ready[tensor.device] = event
        self._hooks: list[RemovableHandle] = []
        for module in modules:
            indices = sorted(
                {i for b in module.buffers(recurse=False) if (i := self._index.get(snap.storage_key(b))) is not None}
            )
            if indices:
                self._hooks.append(module.register_forward_pre_hook(functools.partial(self._before_forward, indices)))

    def __len__(self) -> int:
        """The number of storages to copy."""
        return len(self._index)

    def run(self, before_each: Callable[[], None] = lambda: None) -> None:
        """Copy every storage into the pool, in order; on the background thread.

        Returns once the copies are complete in host memory. On failure every
        waiter is released (the snapshot is abandoned) and the error propagates.

        Args:
            before_each: Called before each storage's copy (a test seam).
        """
        used: dict[torch.device, torch.cuda.Stream] = {}
        try:
            for i, source in enumerate(self._sources):
                before_each()
                fence: tuple[torch.device, torch.cuda.Event] | None = None
                if source.is_cuda:
                    stream = used.get(source.device)
                    if stream is None:
                        stream = used[source.device] = self._streams.get(source.device)
                        stream.wait_event(self._ready[source.device])
                    with torch.cuda.stream(stream):
                        self._pool.copy_of(source, non_blocking=True)
                        event = torch.cuda.Event()
                        event.record(stream)
                    fence = (source.device, event)
                else:
                    self._pool.copy_of(source)
                with self._cond:
                    self._fences.append(fence)
                    self._issued = i + 1
                    self._cond.notify_all()
        except BaseException:
            with self._cond:
                self._failed = True
                self._issued = len(self._index)
                self._cond.notify_all()
            raise
        finally:
            # Only once no stream reads the sources may they be freed (the caching
            # allocator would hand their memory out again), and the host copies are
            # complete only then.
            for stream in used.values():
                stream.synchronize()
            self._sources = []

    def wait_all(self) -> None:
        """Block until every copy is made (CPU) or ordered before what the current streams run next (CUDA)."""
        with self._cond:
            self._cond.wait_for(lambda: self._issued == len(self._index))
            if self._failed:
                return
            last = {fence[0]: fence[1] for fence in self._fences if fence is not None}
        for device, event in last.items():
            torch.cuda.current_stream(device).wait_event(event)

    def wait_for(self, indices: list[int]) -> None:
        """Like ``wait_all``, for the storages at these (ascending) positions only."""
        with self._cond:
            self._cond.wait_for(lambda: self._issued > indices[-1])
            if self._failed:
                return
            fences = [self._fences[i] for i in indices]
        for fence in fences:
            if fence is not None:
                torch.cuda.current_stream(fence[0]).wait_event(fence[1])

    def concerns(self, optimizer: torch.optim.Optimizer) -> bool:
        """Return whether a step of ``optimizer`` could change something this snapshot copies."""
        if id(optimizer) in self._optimizers:
            return True
        return any(snap.storage_key(p) in self._index for group in optimizer.param_groups for p in group["params"])

    def release(self) -> None:
        """Remove the forward pre-hooks; on the training thread, once the copy is awaited."""
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook.remove()

    def _before_forward(self, indices: list[int], module: torch.nn.Module, args: Any) -> None:
        self.wait_for(indices)


def copy_sizes(values: Mapping[str, Any]) -> list[tuple[int, bool]]:
    """Return the (bytes, pinned) size of each storage an overlapped save of ``values`` would copy.

    Args:
        values: The state dicts and extras of a save, by name.

    Raises:
        ConfigError: A value holds something a checkpoint cannot.
    """
    sizes: dict[snap.StorageKey, tuple[int, bool]] = {}
    for value in values.values():
        for tensor in snap.tensors(value):
            if snap.deferred(tensor):
                sizes[snap.storage_key(tensor)] = (tensor.untyped_storage().nbytes(), tensor.is_cuda)
    return list(sizes.values())


def _unique(modules: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    seen: dict[int, torch.nn.Module] = {}
    for module in modules:
        seen.setdefault(id(module), module)
    return list(seen.values())
