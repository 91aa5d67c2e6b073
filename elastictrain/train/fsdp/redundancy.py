"""In-memory redundancy of a sharded model: each rank keeps a copy of another rank's shards.

::

    holders = buddies([rank // nproc_per_node for rank in range(world)])    # holders[r] keeps r's copy
    redundancy = Redundancy(model, optimizer, new_gloo_group(), new_gloo_group(), every=10,
                            holder=holders[rank], source=holders.index(rank))
    for step in ...:
        ...; redundancy.prepare(step)         # a refresh due after this step: its vote starts
        optimizer.step()
        redundancy.after_step(step)           # every 10 steps: snapshot, then send in the background
    ...                                       # peers lost: the copy is still in this process's memory
    redundancy.close()
    recovery_sources = redundancy.holdings()  # own shards + the copy of ``source``'s, each with its step

A refresh, every ``every`` steps after the optimizer step, agrees on going ahead (below) and
hands this rank's own shards of the parameters and the optimizer state (their live local
tensors) to a thread of its own, which copies them into a reusable host buffer, sends the buffer
to the holder and receives the copy of the source's shards over a gloo group of its own (never the
training group), while training goes on. The live shards keep their values until the next
optimizer step (the forward and backward only read them), so the copy runs beside the next step's
forward and backward; an optimizer step pre-hook holds the next optimizer step back only if the
copy has not finished by then.

Shards on CUDA are copied as the overlapped checkpoint copies them (its
:class:`~elastictrain.checkpoint.SideStreams`): into pinned host buffers, by ``non_blocking``
copies on a side stream of their device. The side stream first waits for an event recorded on the
training thread's current stream by :meth:`Redundancy.after_step` (after the optimizer step's
writes); once the copies are queued, an event recorded after them is what the optimizer step
pre-hook makes the training stream wait for (the next step's writes run after the copy, without
the CPU waiting for the transfer), and what the sending thread waits for before it sends the
pinned buffer. Pinned buffers released between refreshes (below) go back to torch's pinned-memory
cache, which the next refresh's allocation reuses. Which shards and where each lies in
the buffer is worked out once and reused while the tensors stay the same (a check of their keys
and storage per refresh), so the training thread's stall is the agreement, that check and the
capture of the replicated state (:class:`Kept`), not every tensor's region worked out again.

A refresh still in flight on any rank when the next one is due skips that one on every rank
(:attr:`Redundancy.skipped`), never queues it and never stalls the step: the ranks agree by a
one-integer all-reduce over a second gloo group of their own (the vote group, used by the training
thread alone), so that every rank starts the same refreshes and each exchange meets its peers'.
The vote starts before the optimizer step (:meth:`Redundancy.prepare`, in the background) and is
waited for after it: its round trip runs beside the optimizer step, not after it (on 2 busy
cores a round trip of two gloo threads' wake-ups each way took ~2 ms, the most of a refresh's
stall at a 50 ms step).

Every piece of a refresh stays whole until a newer one is: a received copy replaces the held one
only once complete (two buffers, swapped), and a snapshot goes to the send buffer that does not
hold the last completed refresh's. A refresh that fails half way (a peer died) ends the refreshes
(on every rank: the next agreement carries it) and leaves, on every survivor, its own shards and
the copy it holds as of the last refresh it completed; so the survivors together still hold the
whole state of one step when a rank dies during a refresh (the step before it, where the dead
rank's holder did not complete it). A rank that completed a refresh also keeps offering the copy
it replaced until the next refresh starts (every rank holds the newer one then): when a node is
lost during a refresh that one of its ranks' holders completed and another did not, the step
before is still held whole.

With each snapshot of its own shards, a rank keeps the replicated state of that step (the
sampler cursor, scheduler, scaler, step counter and extras the constructor's ``replicated``
gives, its RNG states and the model's buffers: :class:`Kept`), so that the group can roll back
to the step of a refresh (:meth:`Redundancy.roll_back`) when the survivors hold that step whole
and not the newest (:mod:`~elastictrain.train.fsdp.rollback`).

Host memory per rank, in shards (a shard: this rank's 1/world of the parameters and optimizer
state). A roll back to the step ``S`` of the last refresh needs, on every rank, its own snapshot of
``S`` and the copy of its source's ``S``: two shards, the minimum. While the refresh of ``S'`` is
in flight both stay (a rank may die before every holder has ``S'``: the survivors then go back to
``S``) beside the snapshot of ``S'`` being sent and the copy of ``S'`` being received: four at the
peak. With ``every`` >= :data:`RELEASE_FROM` steps, once every rank completed ``S'`` (a one-integer
all-reduce on the sending thread) the two buffers of ``S`` are released, so between refreshes a
rank holds two shards; below it they stay allocated for reuse (the next refresh is at most a few
steps away, and allocating them again would cost page faults each time): four.
(:attr:`Redundancy.host_bytes` now, :attr:`Redundancy.peak_host_bytes` the most.)

On the wire, per refresh and direction, one message while the shards stay the same tensors: the
buffer, a header (step, metadata length, length; int64) in its first 64 bytes, the regions' bytes
after it. When the layout is not the one sent last (the first refresh, a restore that replaced a
tensor), the first message has the length the holder expects (the last one's) for its header
alone, then come the metadata (JSON: each region's key, offsets, sizes, dtype and byte offset)
and the whole buffer. Nothing received is unpickled.

What a refresh costs the host, per rank (``benchmarks/redundancy_cost.py`` reports it): one copy
of the shard into the snapshot buffer (one ``foreach_copy`` call for all the tensors, into views
of the buffer worked out once, the GIL released), the sends and receives over the gloo group (the
socket's copies, mostly on gloo's transport thread), and on the training thread the agreement,
the layout check and the capture of the replicated state (:attr:`Redundancy.training_cpu`; the
sending thread's share is :attr:`Redundancy.thread_cpu`). No buffer is allocated per refresh
while the layout stays the same.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastictrain._torch_compat import foreach_copy
from elastictrain.checkpoint import SideStreams, capture_rng, load_state_into, restore_rng
from elastictrain.errors import ConfigError
from elastictrain.train import peer_connections, process_group as pg
from elastictrain.train.fsdp.buddies import buddies
from elastictrain.train.fsdp.holdings import Holding, Signature, own_holdings, shard_signature

__all__ = ["RELEASE_FROM", "Kept", "Redundancy", "RedundancyError", "start_redundancy"]

logger = logging.getLogger(__name__)

_ALIGN = 64
"""Each region starts at a multiple of this in a buffer (a view of any dtype is aligned)."""

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
}
"""The dtypes a copy carries, by their names in the metadata."""

_FIRST, _META, _PAYLOAD = 1, 2, 3
"""The p2p tags of a refresh's messages: the first (the whole copy while the layout is the one
sent last time; else as long as that one, for its header alone), then, when the layout changed,
its metadata and the whole copy."""

_HEADER_BYTES = 64
"""Each buffer starts with the header of the copy it holds (step, metadata length, length; int64),
its regions after it: a copy and its header travel as one message."""

RELEASE_FROM = 10
"""A refresh interval (``every``) from which the buffers of the previous refresh are released once
every rank completed the next one (see the module docstring); below it they are kept for reuse."""

_BUSY, _ENDED = 1, 2
"""A rank's vote on a due refresh (the maximum wins): one in flight here, the refreshes ended here
(a failed one); 0: go."""


class RedundancyError(RuntimeError):
    """A refresh did not complete: the copy received is malformed (its header or metadata does not
    describe its payload), or the refreshes ended on another rank."""


@dataclass(frozen=True, slots=True)
class _Slot:
    """Where one region lies in a buffer."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: str
    at: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * _DTYPES[self.dtype].itemsize

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """The region's values in ``buffer`` (a view)."""
        return buffer[self.at:self.at + self.nbytes].view(_DTYPES[self.dtype]).view(self.sizes)

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "offsets": list(self.offsets), "sizes": list(self.sizes), "dtype": self.dtype,
                "at": self.at}


def _layout(holdings: list[Holding]) -> tuple[list[_Slot], int]:
    """Each holding's slot in a buffer (after its header), and the buffer's length."""
    slots, end = [], _HEADER_BYTES
    for h in holdings:
        name = str(h.tensor.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise ValueError(f"{h.key}: dtype {h.tensor.dtype} cannot be kept as a redundant copy")
        end = -(-end // _ALIGN) * _ALIGN
        slots.append(_Slot(h.key, h.offsets, h.sizes, name, end))
        end += slots[-1].nbytes
    return slots, end


def _parse_slots(meta: bytes, length: int) -> list[_Slot]:
    """The slots a peer's metadata names, checked against its payload's ``length``.

    Raises:
        RedundancyError: Malformed metadata, or a region outside the payload.
    """
    try:
        raw = json.loads(meta.decode())
        slots = [_Slot(str(e["key"]), tuple(int(o) for o in e["offsets"]), tuple(int(s) for s in e["sizes"]),
                       str(e["dtype"]), int(e["at"])) for e in raw]
    except (ValueError, KeyError, TypeError) as exc:
        raise RedundancyError(f"a redundant copy's metadata is malformed: {exc}") from exc
    for slot in slots:
        if (slot.dtype not in _DTYPES or len(slot.offsets) != len(slot.sizes) or min((*slot.sizes, 0)) < 0
                or slot.at < _HEADER_BYTES or slot.at % _ALIGN or slot.at + slot.nbytes > length):
            raise RedundancyError(f"a redundant copy's region {slot.key!r} does not fit its {length}-byte payload")
    return slots


@dataclass(frozen=True, slots=True)
class Kept:
    """The replicated state of one step, kept with the snapshot of this rank's shards of that step:
    what a roll back to it restores besides the shards (:meth:`Redundancy.roll_back`)."""

    stateful: dict[str, Any]
    """Each object's ``state_dict()`` (the sampler cursor, scheduler, scaler, step counter), a deep copy."""
    extras: dict[str, Any]
    """The plain-dict state (the user's dict extras), a deep copy."""
    rng: dict[str, Any]
    """This process's RNG states (as a checkpoint keeps them)."""
    buffers: list[Holding]
    """The model's buffers, whole (every rank holds them; FSDP2 does not shard them), cloned."""

    @classmethod
    def capture(cls, objects: Mapping[str, Any], model: torch.nn.Module, step: int) -> Kept:
        """``objects``' state (dicts as extras, the others by ``state_dict()``), this process's RNG
        and ``model``'s buffers, copied now (the objects go on changing)."""
        stateful = {n: copy.deepcopy(o.state_dict()) for n, o in objects.items() if not isinstance(o, dict)}
        extras = {n: copy.deepcopy(o) for n, o in objects.items() if isinstance(o, dict)}
        buffers = [Holding(f"model/{fqn}", (0,) * b.dim(), tuple(b.shape), step, b.detach().to("cpu", copy=True))
                   for fqn, b in model.named_buffers()]
        return cls(stateful, extras, capture_rng(), buffers)


def _host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


_Events = dict[torch.device, torch.cuda.Event]
"""A CUDA event per device (empty on the CPU)."""


def _mark_streams(devices: Iterable[torch.device]) -> _Events:
    """An event recorded now on the current stream of each CUDA device of ``devices`` (those the
    shards lie on; on the training thread, after the optimizer step: its writes come before the event)."""
    ready: _Events = {}
    for device in devices:
        if device.type == "cuda":
            ready[device] = torch.cuda.Event()
            ready[device].record(torch.cuda.current_stream(device))
    return ready


@dataclass(frozen=True, slots=True)
class _Layout:
    """This rank's own shards as a refresh copies them: the live local tensors, where each lies in
    a buffer, and the metadata sent with them; worked out once per :func:`shard_signature`."""

    signature: Signature
    sources: list[Holding]
    slots: list[_Slot]
    length: int
    meta: torch.Tensor
    by_device: dict[torch.device, tuple[list[int], list[torch.Tensor]]]
    """The sources by device: their indices in :attr:`slots` and their tensors (one copy call each)."""

    @classmethod
    def of(cls, signature: Signature, sources: list[Holding]) -> _Layout:
        """The layout of ``sources`` (the live local shards, as :func:`own_holdings` gives them)."""
        slots, length = _layout(sources)
        meta = json.dumps([s.to_json() for s in slots]).encode()
        by_device: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}
        for index, holding in enumerate(sources):
            indices, tensors = by_device.setdefault(holding.tensor.device, ([], []))
            indices.append(index)
            tensors.append(holding.tensor)
        return cls(signature, sources, slots, length, torch.frombuffer(bytearray(meta), dtype=torch.uint8), by_device)


class Redundancy:
    """Keeps a copy of the ``source`` rank's shards and sends this rank's to the ``holder`` (see the
    module docstring). Starts its thread, and registers an optimizer step pre-hook, when built;
    :meth:`close` stops and removes them.

    Args:
        model: The sharded model (parameters DTensors).
        optimizer: Its optimizer.
        group: A gloo group of its own over the ranks, for the sending thread (never the training
            group: its collectives would interleave with training's from another thread).
        vote_group: Another gloo group over the same ranks, for the training thread's agreement
            on which refreshes run.
        every: Refresh after every this many steps (:meth:`after_step`).
        holder: The rank of ``group`` that keeps this rank's copy; None: no one (a group of one).
        source: The rank of ``group`` whose copy this rank keeps; None with ``holder``.
        replicated: The replicated state a roll back restores besides the shards (the sampler
            cursor, scheduler, scaler, step counter, extras; by name, as a checkpoint names them):
            each snapshot keeps a copy of it (:class:`Kept`), with the RNG and the buffers.
            None: the snapshots keep the shards alone.

    Raises:
        ValueError: ``every`` is not positive, or only one of ``holder`` and ``source`` is None.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, group: dist.ProcessGroup,
                 vote_group: dist.ProcessGroup, *, every: int, holder: int | None, source: int | None,
                 replicated: Callable[[], Mapping[str, Any]] | None = None) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        if (holder is None) != (source is None):
            raise ValueError(f"holder and source are both ranks or both None, got {holder!r} and {source!r}")
        self._model, self._optimizer = model, optimizer
        self._group, self._vote_group = group, vote_group
        self.every, self.holder, self.source = every, holder, source
        self._replicated = replicated
        self._release = every >= RELEASE_FROM
        self._pin = torch.cuda.is_available() and any(p.is_cuda for p in model.parameters())
        self._cond = threading.Condition()
        self._due: int | None = None  # the step of the refresh in flight
        self._copying: tuple[_Layout, Kept | None, _Events] | None = None  # what the thread copies, until queued
        self._copied: _Events = {}  # CUDA: the events after the queued copies, which the next optimizer step awaits
        self._streams = SideStreams()
        self._closing = False
        self._step = -1  # the last step given to after_step: the live shards' values are of it
        self._vote: tuple[torch.Tensor, dist.Work] | None = None  # the vote prepare() started, for after_step
        self._plan: _Layout | None = None
        self._own = [_Snapshot(self._pin), _Snapshot(self._pin)]
        self._sending = self._own[0]
        self._completed: int | None = None  # the step of the last refresh this rank completed
        self._held: list[Holding] = []
        self._previous: list[Holding] = []  # the copy the last swap replaced, while its buffer is kept
        self._their_layout: tuple[tuple[bytes, int], list[_Slot]] | None = None  # the source's metadata, parsed
        self._sent: tuple[torch.Tensor, int] | None = None  # the metadata and length the holder has (it expects them)
        self._held_buffer = _Snapshot(False)  # the buffer of the held copy
        self._incoming = _Snapshot(False)
        self.started = 0
        """Refreshes started (the shards handed to the sending thread)."""
        self.refreshed = 0
        """Refreshes completed (a copy received and swapped in)."""
        self.skipped = 0
        """Refreshes not started because one was still in flight (on some rank) when they were due."""
        self.failure: BaseException | None = None
        """Why the refreshes ended (a peer lost), or None."""
        self.stalled = 0.0
        """Seconds the training thread spent on refreshes: the agreements, handing the shards over,
        and any wait of an optimizer step for a copy not finished yet."""
        self.training_cpu = 0.0
        """CPU seconds the training thread spent in :meth:`after_step` (the agreements, the layout
        check, the capture of the replicated state): what the refreshes take from it, whatever the load."""
        self.thread_cpu = 0.0
        """CPU seconds the sending thread spent on refreshes (the copies, the sends and receives,
        the bookkeeping; gloo's own transport threads not counted)."""
        self.peak_host_bytes = 0
        """The most host memory the buffers held at once (see :attr:`host_bytes`)."""
        self._thread: threading.Thread | None = None
        self._hook: Any = None
        if holder is not None:
            self._hook = optimizer.register_step_pre_hook(self._before_optimizer_step)
            self._thread = threading.Thread(target=self._run, name="elastictrain-redundancy", daemon=True)
            self._thread.start()

    # --- the training thread --------------------------------------------------------------------

    def prepare(self, step: int) -> None:
        """Before the optimizer step of ``step`` (every rank calls it, with the same steps): when a
        refresh is due after it, start the vote on it (the all-reduce in the background, its
        round trip beside the optimizer step), which :meth:`after_step` then waits for instead of
        voting itself. A rank's vote is whether it has a refresh in flight now: none starts before
        :meth:`after_step`, so a rank with none now has none then (one that ends meanwhile only
        makes the vote skip a refresh it could have started).

        Raises:
            torch's backend error: The vote could not start (a peer lost): a collective failure.
        """
        if self.holder is None or step % self.every or self._vote is not None:
            return
        with self._cond:
            if self._closing:
                return
            vote = self._ballot()
        with self._on_training_thread():
            work = dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self._vote_group, async_op=True)
            assert work is not None  # noqa: S101 - async_op, and this rank is in the group
            self._vote = (vote, work)

    @contextlib.contextmanager
    def _on_training_thread(self) -> Iterator[None]:
        """Counts the time inside as the training thread's stall (:attr:`stalled`) and its CPU
        (:attr:`training_cpu`)."""
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.stalled += time.perf_counter() - started
            self.training_cpu += time.thread_time() - cpu

    def _ballot(self) -> torch.Tensor:
        """This rank's vote on a due refresh (under the lock). A rank whose refreshes ended still
        votes (2), so that every rank ends them with it."""
        return torch.tensor([_ENDED if self.failure is not None else _BUSY if self._due is not None else 0])

    def after_step(self, step: int) -> bool:
        """After the optimizer step of ``step`` (every rank calls it, with the same steps): when a
        refresh is due and no rank has one in flight, hand this rank's shards (and the replicated
        state, copied now) to the sending thread, which copies and sends them. Returns whether a
        refresh started. The vote is the one :meth:`prepare` started, else an all-reduce now. Once
        a refresh failed on a rank, the next vote ends the refreshes on every rank (:attr:`failure`).

        Raises:
            torch's backend error: The vote's all-reduce failed (a peer lost): a collective failure.
        """
        self._step = step
        pending, self._vote = self._vote, None
        if self.holder is None or (step % self.every and pending is None):
            return False
        with self._cond:
            if self._closing:
                return False
            vote = self._ballot() if pending is None else pending[0]
        with self._on_training_thread():
            if pending is None:
                dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self._vote_group)
            else:
                pending[1].wait()  # every rank that started one waits for it, so the votes stay matched
                if step % self.every:  # the step is not the one prepare() was told (no rank's is)
                    return False
            if vote.item() == _ENDED:
                with self._cond:
                    if self.failure is None:
                        self.failure = RedundancyError("the refreshes ended on another rank")
                        logger.warning("redundancy: the refreshes ended on another rank; they end here at step %d "
                                       "(this rank keeps the state of step %s)", step, self._completed)
                return False
            if vote.item() == _BUSY:
                self.skipped += 1
                logger.info("redundancy: a refresh is still in flight; step %d's is skipped", step)
                return False
            layout = self._current_layout()
            kept = Kept.capture(self._replicated(), self._model, step) if self._replicated is not None else None
            ready = _mark_streams(layout.by_device)  # CUDA: where the training streams stand after the step
            with self._cond:
                # The buffer that does not hold the last completed refresh's snapshot (it stays whole).
                self._sending = next(s for s in self._own if s.step is None or s.step != self._completed)
                self._sending.clear()
                self._previous = []  # its buffer receives this refresh: every rank holds the last one now
                self._copying = (layout, kept, ready)
                self._due = step
                self.started += 1
                self._cond.notify_all()
        return True

    def adopt_buffers(self, previous: Redundancy) -> None:
        """Take the host buffers of ``previous`` (the redundancy of the group this one's re-formed
        from, closed, its copies consumed by the rebuild) for this one's refreshes, before the
        first: its first two refreshes then write into memory already mapped, not into fresh
        buffers whose every page faults in (at ~80 MB a shard, ~0.1 s of CPU a rank, right after a
        re-formation). A buffer too small for a refresh is replaced then, as always. Nothing is
        taken while ``previous``'s sending thread lives on (left behind by :meth:`close`, it may
        still write), once this one has started a refresh, or across pinned and pageable memory.
        ``previous`` holds nothing after (:meth:`holdings`: its live shards only)."""
        thread = previous._thread
        if (thread is not None and thread.is_alive()) or previous._pin != self._pin:
            return
        # This one holds no copy yet: the buffer of previous's copy (whole-sized once it completed
        # a refresh) receives the first refresh; its spare, swapped in after it, the second.
        olds = (*previous._own, previous._held_buffer, previous._incoming)
        with previous._cond:
            buffers = [old.buffer for old in olds]
            for old in olds:
                old.release()
            previous._held, previous._previous = [], []
        with self._cond:
            if self.started:
                return
            for snapshot, buffer in zip((*self._own, self._incoming, self._held_buffer), buffers, strict=True):
                snapshot.buffer = buffer

    def _current_layout(self) -> _Layout:
        """This rank's shards as a refresh copies them: the last layout while the tensors are the
        same ones (the optimizer updates them in place), else worked out again."""
        signature = shard_signature(self._model, self._optimizer)
        if self._plan is None or self._plan.signature != signature:
            self._plan = _Layout.of(signature, own_holdings(self._model, self._optimizer, self._step, live=True))
        return self._plan

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The optimizer step pre-hook: the shards change in this step, so a copy of the previous
        step's not finished yet is waited for (only then does the training thread stall here). On
        CUDA, waited for until it is queued; then the current streams wait for its events, so the
        step's kernels run after the copy while the CPU goes on."""
        with self._cond:
            if self._copying is not None:
                started = time.perf_counter()
                self._cond.wait_for(lambda: self._copying is None)
                self.stalled += time.perf_counter() - started
            copied, self._copied = self._copied, {}
        for device, event in copied.items():
            torch.cuda.current_stream(device).wait_event(event)

    def holdings(self) -> list[Holding]:
        """What this rank holds: its live shards (of the last step given to :meth:`after_step`),
        its snapshots of other steps, and the copy of the source's shards of the last refresh it
        completed (none before the first), with the copy it replaced until the next refresh
        starts (then every rank holds the newer one). Each with its step.

        The snapshots' and the copy's tensors are views of buffers that later refreshes write
        into: :meth:`close` first to keep them."""
        with self._cond:
            held = [*self._held, *self._previous]
            snapshots = [h for s in self._own if s.step is not None and s.step != self._step for h in s.holdings()]
        return [*own_holdings(self._model, self._optimizer, self._step), *snapshots, *held]

    def held(self) -> list[Holding]:
        """The copy of the source's shards of the last refresh completed, alone (see :meth:`holdings`)."""
        with self._cond:
            return list(self._held)

    def kept_holdings(self) -> list[Holding]:
        """What a roll back can rebuild from, each with its step: this rank's snapshots of its own
        shards (with the buffers kept with them) and the copies of the source's (see
        :meth:`holdings`); not the live shards
        (their step is the caller's to say: a step that failed after its optimizer step may not
        have reached :meth:`after_step`)."""
        with self._cond:
            snapshots = [s for s in self._own if s.step is not None]
            held = [*self._held, *self._previous]
        return [*(h for s in snapshots for h in s.holdings()),
                *(h for s in snapshots if s.kept is not None for h in s.kept.buffers), *held]

    def kept_steps(self) -> list[int]:
        """The steps whose replicated state this rank kept (:class:`Kept`), newest first."""
        with self._cond:
            return sorted((s.step for s in self._own if s.step is not None and s.kept is not None), reverse=True)

    def roll_back(self, step: int, objects: Mapping[str, Any]) -> None:
        """Load the replicated state kept at ``step`` into ``objects`` (by name, as given to the
        constructor's ``replicated``) and set this process's RNG to that step's; no collective.
        The kept copy stays as it was (a re-formation that fails later rolls back again).

        Raises:
            ValueError: No replicated state kept at ``step``.
            CheckpointMismatchError: It does not fit ``objects``.
        """
        with self._cond:
            kept = next((s.kept for s in self._own if s.step == step and s.kept is not None), None)
        if kept is None:
            raise ValueError(f"no replicated state kept at step {step} (kept: {self.kept_steps()})")
        load_state_into(objects, copy.deepcopy(kept.stateful), copy.deepcopy(kept.extras), step)
        restore_rng({"rng": kept.rng}, where=f"the redundancy's snapshot of step {step}")

    @property
    def in_flight(self) -> bool:
        """Whether a refresh is being copied, sent or received now."""
        with self._cond:
            return self._due is not None

    @property
    def host_bytes(self) -> int:
        """Host memory of the buffers now: the snapshots of this rank's shards, the held copy and
        the incoming one (released ones count 0; see the module docstring)."""
        with self._cond:
            return self._host_bytes()

    def _host_bytes(self) -> int:
        return sum(s.buffer.numel() for s in (*self._own, self._held_buffer, self._incoming))

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait until no refresh is in flight here; returns False if one still is after ``timeout``."""
        with self._cond:
            return self._cond.wait_for(lambda: self._due is None,
                                       None if timeout is None else timeout.total_seconds())

    def close(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Stop refreshing, without a collective (peers may be dead), and remove the optimizer
        hook. A refresh in flight is given ``timeout`` to end; if it does not, its thread is left
        (a daemon) and its copy never swapped in. What this rank holds stays (:meth:`holdings`).

        The connections of the two groups are severed
        (:func:`~elastictrain.train.peer_connections.sever`): a peer blocked on this rank in a vote
        (this rank left to re-form instead) or in a refresh fails at once, not after the groups'
        timeout. The vote group's first; the sending thread's once the refresh in flight ended (a
        peer's copy of it completes where it can)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._vote = None  # a vote prepare() started fails once its group is severed; nobody waits for it
        if self._hook is not None:
            self._hook.remove()
        peer_connections.sever(self._vote_group)
        if self._thread is not None:
            self._thread.join(timeout.total_seconds())
            if self._thread.is_alive():
                logger.warning("redundancy: a refresh is still in flight after %s; left behind", timeout)
        peer_connections.sever(self._group)

    def groups(self) -> tuple[dist.ProcessGroup, ...]:
        """Its two gloo groups: the sending thread's and the vote's."""
        return self._group, self._vote_group

    # --- the sending thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._due is not None or self._closing)
                step, copying, sending = self._due, self._copying, self._sending
                if self._closing:
                    self._copying = None  # an optimizer step waiting for the copy goes on
                    self._cond.notify_all()
                    return
            assert step is not None and copying is not None  # noqa: S101 - the wait's predicate, set together
            layout, kept, ready = copying
            cpu = time.thread_time()
            try:
                copied: _Events = {}
                try:
                    copied = self._copy(sending, layout, ready)
                finally:
                    with self._cond:
                        self._copying = None  # the live shards may change now (on CUDA: after `copied`)
                        self._copied = copied
                        self.peak_host_bytes = max(self.peak_host_bytes, self._host_bytes())
                        self._cond.notify_all()
                sending.complete(copied, step, kept)
                received = self._exchange(step)
            except Exception as exc:  # noqa: BLE001 - a lost peer (or memory) must end the refreshes, not the process
                logger.warning("redundancy: the refresh of step %d failed, refreshes end (this rank keeps "
                               "the state of step %s): %s", step, self._completed, exc)
                with self._cond:
                    self.failure = exc
                    self.thread_cpu += time.thread_time() - cpu
                    self._due = None
                    self._cond.notify_all()
                if self._release and isinstance(exc, RedundancyError):
                    self._everyone_completed(False)  # the peers are there and wait for this rank's word
                return
            with self._cond:
                if not self._closing:  # a copy completed after close() is not swapped in
                    self._previous = self._held  # still whole, in what becomes the incoming buffer
                    self._held, self._held_buffer, self._incoming = received, self._incoming, self._held_buffer
                    self._completed = step
                    self.refreshed += 1
                self.peak_host_bytes = max(self.peak_host_bytes, self._host_bytes())
            if self._release and self._everyone_completed(True):
                with self._cond:
                    if not self._closing and self._completed == step:
                        self._release_previous()
            with self._cond:
                self.thread_cpu += time.thread_time() - cpu
                self._due = None
                self._cond.notify_all()

    def _copy(self, snapshot: _Snapshot, layout: _Layout, ready: _Events) -> _Events:
        """Copy the live shards ``layout`` names into ``snapshot`` (before the next optimizer step);
        on CUDA queue the copies after ``ready`` and return the events after them."""
        return snapshot.take(layout, ready, self._streams)

    def _everyone_completed(self, completed: bool) -> bool:
        """Whether every rank completed the refresh in flight (an all-reduce over the sending
        thread's group); False, and the refreshes end, if a peer is lost meanwhile."""
        flag = torch.tensor([1 if completed else 0])
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        except Exception as exc:  # noqa: BLE001 - a lost peer must end the refreshes, not the process
            logger.warning("redundancy: a peer was lost after the refresh of step %s; refreshes end: %s",
                           self._completed, exc)
            with self._cond:
                self.failure = exc
            return False
        return bool(flag.item())

    def _release_previous(self) -> None:
        """Every rank holds the refresh just completed: the buffers of the one before (this rank's
        snapshot of it and the copy it replaced) are no longer needed by any roll back."""
        for snapshot in self._own:
            if snapshot is not self._sending:
                snapshot.release()
        self._incoming, self._previous = _Snapshot(False), []

    def _exchange(self, step: int) -> list[Holding]:
        """Send the snapshot of ``step`` to the holder, receive the source's into the incoming
        buffer; return the received regions (views of that buffer).

        Raises:
            RedundancyError: The source's copy is malformed.
            torch's backend error: A peer is lost.
        """
        sending, incoming = self._sending, self._incoming
        # Sent: the whole copy, its header in front, as one message while the layout is the one
        # sent last (the holder expects that length); else a first message of that length for
        # the header alone, then the metadata and the whole copy.
        changed = self._sent is None or self._sent[0] is not sending.meta
        sending.buffer[:_HEADER_BYTES].view(torch.int64)[:3] = torch.tensor(
            [step, sending.meta.numel() if changed else 0, sending.length])
        messages = [sending.buffer[:sending.length]]
        if changed:
            prior = _HEADER_BYTES if self._sent is None else self._sent[1]
            first = sending.buffer[:prior]  # the header, and whatever follows it
            if first.numel() < prior:  # the layout shrank below the last one: pad the header
                first = torch.zeros(prior, dtype=torch.uint8)
                first[:_HEADER_BYTES] = sending.buffer[:_HEADER_BYTES]
            messages = [first, sending.meta, *messages]
        sends = [self._send(message, tag) for message, tag in zip(messages, (_FIRST, _META, _PAYLOAD))]
        # Received: the same, from the source.
        known = self._their_layout
        expected = _HEADER_BYTES if known is None else known[0][1]
        incoming.reserve(expected)
        self._receive(incoming.buffer[:expected], _FIRST)
        their_step, meta_length, length = (int(v) for v in incoming.buffer[:_HEADER_BYTES].view(torch.int64)[:3])
        if their_step != step or meta_length < 0 or length < _HEADER_BYTES:
            raise RedundancyError(f"a redundant copy's header is not step {step}'s: "
                                  f"{[their_step, meta_length, length]}")
        if meta_length:
            meta = torch.empty(meta_length, dtype=torch.uint8)
            self._receive(meta, _META)
            incoming.reserve(length)
            self._receive(incoming.buffer[:length], _PAYLOAD)
            said = (bytes(meta.numpy()), length)
            self._their_layout = (said, _parse_slots(*said))
        elif known is None or length != expected:
            raise RedundancyError(f"a redundant copy of {length} bytes came without the metadata that describes it "
                                  f"(the last one had {expected})")
        for work in sends:
            work.wait()
        self._sent = (sending.meta, sending.length)
        assert self._their_layout is not None  # noqa: S101 - known, or parsed above
        incoming.slots = self._their_layout[1]
        return [Holding(key=s.key, offsets=s.offsets, sizes=s.sizes, step=step, tensor=view)
                for s, view in zip(incoming.slots, incoming.views(), strict=True)]

    def _send(self, message: torch.Tensor, tag: int) -> dist.Work:
        """Start sending ``message`` to the holder."""
        work = dist.isend(message, group=self._group, group_dst=self.holder, tag=tag)
        assert work is not None  # noqa: S101 - this rank is in the group
        return work

    def _receive(self, into: torch.Tensor, tag: int) -> None:
        """Receive the source's message ``tag`` into ``into`` (its length)."""
        work = dist.irecv(into, group=self._group, group_src=self.source, tag=tag)
        assert work is not None  # noqa: S101 - this rank is in the group
        work.wait()


class _Snapshot:
    """A reusable host buffer with a rank's shards of one step: this rank's snapshot of its own,
    or a copy received from the source (reallocated only when their layout grows, or after
    :meth:`release`)."""

    def __init__(self, pin: bool) -> None:
        self._pin = pin
        self.buffer = _host_buffer(0, pin)
        self.slots: list[_Slot] = []
        self.meta = torch.empty(0, dtype=torch.uint8)
        self.length = 0
        self.step: int | None = None
        self.kept: Kept | None = None
        """The replicated state of :attr:`step`, when the redundancy keeps it."""
        self._views: tuple[torch.Tensor, list[_Slot], list[torch.Tensor]] | None = None

    def clear(self) -> None:
        """Not a snapshot of any step (it is about to be written)."""
        self.step, self.kept = None, None

    def release(self) -> None:
        """Give the buffer back (an empty one; the next :meth:`take` allocates again)."""
        self.clear()
        self.buffer, self.slots, self.length, self._views = _host_buffer(0, self._pin), [], 0, None

    def reserve(self, length: int) -> None:
        """Make the buffer hold at least ``length`` bytes (a new one if it is shorter)."""
        if length > self.buffer.numel():
            self.buffer, self._views = _host_buffer(length, self._pin), None

    def views(self) -> list[torch.Tensor]:
        """Each slot's values in the buffer, worked out once while the buffer and the slots stay
        the same ones (a refresh reuses both)."""
        if self._views is None or self._views[0] is not self.buffer or self._views[1] is not self.slots:
            self._views = (self.buffer, self.slots, [slot.view(self.buffer) for slot in self.slots])
        return self._views[2]

    def take(self, layout: _Layout, ready: _Events, streams: SideStreams) -> _Events:
        """Copy the live shards ``layout`` names in, into their views of the buffer, one call per
        device (:func:`~elastictrain._torch_compat.foreach_copy`): the CPU shards now; the CUDA
        shards queued on their device's side stream of ``streams``, after the device's ``ready``
        event, non-blocking into the pinned buffer. Returns, per device, an event recorded after
        its copies (none on the CPU); :meth:`complete` once they are queued."""
        self.clear()
        self.reserve(layout.length)
        self.slots, self.length, self.meta = layout.slots, layout.length, layout.meta
        views = self.views()
        # The sources are not freed while a side stream reads them: ``layout`` holds them until
        # the refresh is complete (no other starts before), so no record_stream is needed.
        used: dict[torch.device, torch.cuda.Stream] = {}
        for device, (indices, sources) in layout.by_device.items():
            into = views if len(indices) == len(views) else [views[i] for i in indices]
            if device.type != "cuda":
                foreach_copy(into, sources)
                continue
            stream = used[device] = streams.get(device)
            stream.wait_event(ready[device])
            with torch.cuda.stream(stream):
                foreach_copy(into, sources, non_blocking=True)
        copied: _Events = {}
        for device, stream in used.items():
            copied[device] = torch.cuda.Event()
            copied[device].record(stream)
        return copied

    def complete(self, copied: _Events, step: int, kept: Kept | None) -> None:
        """Wait for the copies :meth:`take` queued (``copied``), then mark the buffer a snapshot
        of ``step``, with ``kept``, its replicated state."""
        for event in copied.values():
            event.synchronize()
        self.step, self.kept = step, kept

    def holdings(self) -> list[Holding]:
        """The snapshot's regions (views of the buffer)."""
        assert self.step is not None  # noqa: S101 - only asked of a taken snapshot
        return [Holding(key=s.key, offsets=s.offsets, sizes=s.sizes, step=self.step, tensor=view)
                for s, view in zip(self.slots, self.views(), strict=True)]


def start_redundancy(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, every: int,
                     nproc_per_node: int, timeout: timedelta | None = None,
                     group: dist.ProcessGroup | None = None,
                     replicated: Callable[[], Mapping[str, Any]] | None = None) -> Redundancy:
    """A :class:`Redundancy` over the default group, buddies on other nodes; a collective (it
    makes its two gloo groups).

    Args:
        model: The sharded model.
        optimizer: Its optimizer.
        every: Refresh after every this many steps.
        nproc_per_node: Ranks per node (the launcher numbers a node's ranks contiguously).
        timeout: The gloo groups' timeout (a refresh to a lost peer fails after it at most).
        group: The training group; None or the default group (another is refused).
        replicated: The replicated state each snapshot keeps a copy of (see :class:`Redundancy`).

    Raises:
        ConfigError: A training group other than the default one.
    """
    if group is not None and group is not dist.group.WORLD:
        raise ConfigError("redundancy_every trains over the default process group; got an explicit process_group")
    rank, world = dist.get_rank(), dist.get_world_size()
    holders = buddies([r // max(nproc_per_node, 1) for r in range(world)])
    source = holders.index(rank) if holders[rank] is not None else None
    return Redundancy(model, optimizer, pg.new_gloo_group(timeout), pg.new_gloo_group(timeout), every=every,
                      holder=holders[rank], source=source, replicated=replicated)
