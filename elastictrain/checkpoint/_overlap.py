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
  optimizer step pre-hook (``Overlap``'s) waits for the whole copy when the
  optimizer is part of the save or steps a parameter being copied.

Waiting means: on the CPU, blocking until the copy is made; on CUDA, blocking only
until the copy is queued, then making the current stream wait for an event
recorded after it on the side stream, so kernels queued afterwards (the optimizer
step) run after the copy without the CPU waiting for the transfer.

The first save would copy into fresh memory, whose page faults cost several times
the copy; ``Overlap`` reserves that memory on a background thread once every saved
optimizer has built its state (at its first step after ``restore``).
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from elastictrain.errors import ConfigError

from . import _sharded as sharded
from . import _snapshot as snap

__all__ = ["Overlap", "SideStreams", "SnapshotCopy", "copy_sizes"]

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
            self.abandon()
            raise
        finally:
            # Only once no stream reads the sources may they be freed (the caching
            # allocator would hand their memory out again), and the host copies are
            # complete only then.
            for stream in used.values():
                stream.synchronize()
            self._sources = []

    def abandon(self) -> None:
        """Give the copy up (it failed, or will never run): release everyone waiting for it."""
        with self._cond:
            self._failed = True
            self._issued = len(self._index)
            self._cond.notify_all()

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


@dataclass(slots=True)
class _Reservation:
    """Copy memory to allocate once the saved optimizers have built their state."""

    state: dict[str, Any]
    waiting: set[int] = field(default_factory=set)  # ids of the optimizers yet to step


class Overlap:
    """What a manager with ``overlap=True`` keeps between saves, on every rank (rank 0 copies the
    replicated state, every rank the local shards it writes of sharded state).

    The copy in flight, the global optimizer step hooks that wait for it (a plain
    loop's optimizer need not be part of the save, its parameters are), and the
    reservation of copy memory. Use it from the training thread; ``close`` it.

    Args:
        pool: Where copies go (the manager's).
        replicated: Whether this rank copies the replicated state (rank 0).
    """

    def __init__(self, pool: snap.CopyPool, *, replicated: bool) -> None:
        self._pool = pool
        self._replicated = replicated
        self._streams = SideStreams()
        self._copy: SnapshotCopy | None = None
        self._reservation: _Reservation | None = None
        self._reserver: threading.Thread | None = None
        # Weak references: the hooks must not keep a forgotten manager alive.
        ref = weakref.ref(self)
        self._hooks = [
            register_optimizer_step_pre_hook(functools.partial(_before_optimizer_step, ref)),
            register_optimizer_step_post_hook(functools.partial(_after_optimizer_step, ref)),
        ]

    def start(self, references: list[torch.Tensor], state: Mapping[str, Any]) -> SnapshotCopy:
        """Guard and return the copy of ``references`` for a save of ``state``; ``run`` it in the background.

        The previous copy must be awaited (``wait``) and its pool storages free (``pool.begin()``).
        """
        self._reservation = None  # this save allocates what it needs
        self._copy = SnapshotCopy(
            references,
            modules=[obj for obj in state.values() if isinstance(obj, torch.nn.Module)],
            optimizers=[obj for obj in state.values() if isinstance(obj, torch.optim.Optimizer)],
            pool=self._pool,
            streams=self._streams,
        )
        return self._copy

    def wait(self) -> None:
        """Wait for the copy in flight (``SnapshotCopy.wait_all``), if any, and remove its guards."""
        copy, self._copy = self._copy, None
        if copy is not None:
            copy.wait_all()
            copy.release()

    def plan_reservation(self, state: Mapping[str, Any]) -> None:
        """Reserve the copy memory a save of ``state`` needs, once every optimizer in it has stepped."""
        if not self._pool.empty():  # a pool that has served a save is warm already
            return
        # Optimizers build their state (most of a checkpoint) at their first step.
        waiting = {id(obj) for obj in state.values() if isinstance(obj, torch.optim.Optimizer) and not obj.state}
        self._reservation = _Reservation(state=dict(state), waiting=waiting)
        if not waiting:
            self._reserve()

    def close(self) -> None:
        """Remove the hooks and wait for a reservation in progress; after ``wait``."""
        hooks, self._hooks, self._reservation = self._hooks, [], None
        for hook in hooks:
            hook.remove()
        if self._reserver is not None:
            self._reserver.join()

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        copy = self._copy
        if copy is not None and copy.concerns(optimizer):
            self.wait()

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        reservation = self._reservation
        if reservation is not None:
            reservation.waiting.discard(id(optimizer))
            if not reservation.waiting:
                self._reserve()

    def _reserve(self) -> None:
        reservation, self._reservation = self._reservation, None
        if reservation is None or self._reserver is not None:
            return
        try:
            sizes = copy_sizes({name: obj if isinstance(obj, dict) else obj.state_dict()
                                for name, obj in reservation.state.items()}, replicated=self._replicated)
        except ConfigError:
            return  # save() will say what is wrong with the state
        if not sizes:
            return
        self._reserver = threading.Thread(
            target=self._reserve_in_background, args=(sizes,), name="elastictrain-checkpoint-reserve", daemon=True
        )
        self._reserver.start()

    def _reserve_in_background(self, sizes: list[tuple[int, bool]]) -> None:
        try:
            self._pool.reserve(sizes)
        except Exception as exc:  # noqa: BLE001 - an optimization: the first save allocates instead
            logger.warning("could not reserve checkpoint copy memory (%d bytes): %s", sum(n for n, _ in sizes), exc)


def _before_optimizer_step(ref: weakref.ref[Overlap], optimizer: torch.optim.Optimizer, *_: Any) -> None:
    overlap = ref()
    if overlap is not None:
        overlap._before_optimizer_step(optimizer)


def _after_optimizer_step(ref: weakref.ref[Overlap], optimizer: torch.optim.Optimizer, *_: Any) -> None:
    overlap = ref()
    if overlap is not None:
        overlap._after_optimizer_step(optimizer)


def copy_sizes(values: Mapping[str, Any], *, replicated: bool) -> list[tuple[int, bool]]:
    """Return the (bytes, pinned) size of each storage an overlapped save of ``values`` would copy on this rank.

    Args:
        values: The state dicts and extras of a save, by name.
        replicated: Whether this rank copies the replicated state (rank 0); every rank copies
            the local shards of DTensors it writes.

    Raises:
        ConfigError: A value holds something a checkpoint cannot.
    """
    plain: list[torch.Tensor] = []
    leaves = []
    for name, value in values.items():
        rest, found = sharded.split(value, (name,))
        leaves += found
        if replicated:
            plain += snap.tensors(rest)
    local = [chunk.tensor for chunk in sharded.local_chunks(leaves)[1]] if leaves else []
    sizes: dict[snap.StorageKey, tuple[int, bool]] = {}
    for tensor in plain + local:
        if snap.deferred(tensor):
            sizes[snap.storage_key(tensor)] = (tensor.untyped_storage().nbytes(), tensor.is_cuda)
    return list(sizes.values())


def _unique(modules: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    seen: dict[int, torch.nn.Module] = {}
    for module in modules:
        seen.setdefault(id(module), module)
    return list(seen.values())
