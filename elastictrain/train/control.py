"""A worker's end of the control channel: liveness, progress, and the agent's assignments.

See :mod:`elastictrain._control` for the channel itself. A daemon thread refreshes
this worker's liveness stamp every ``LIVENESS_PERIOD`` seconds; a process that is
stopped (``SIGSTOP``) or whose interpreter is held by a thread stops refreshing it.
The training loop says which section of a step it is in (:meth:`WorkerControl.enter`) and
until when it may stay there (:mod:`~elastictrain.train.hang_bounds`): a rank that owes its
peers a collective past that deadline is hung, whatever its process does. On
:data:`~elastictrain._control.STACK_SIGNAL` the worker writes every thread's Python stack
for its agent (``faulthandler``).
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator

from elastictrain._control import (
    CONTROL_DIR_ENV,
    STACK_SIGNAL,
    Assignment,
    AssignmentWatch,
    Doorbell,
    ProgressTable,
    Section,
    WorkerState,
    now,
    stacks_path,
)
from elastictrain.train.hang_bounds import HangBounds, SectionClock

logger = logging.getLogger(__name__)

__all__ = ["JobEnded", "WorkerControl"]

LIVENESS_PERIOD = 0.2
_POLL = 0.01
_STUCK_STEPS = 3
"""Typical steps a step may take, with the next generation announced, before its collective is
taken for stuck on a peer that is gone."""


class JobEnded(Exception):  # noqa: N818 - a signal to leave, not an error
    """The agent closed the group (the job was stopped, or its rendezvous closed)."""


class WorkerControl:
    """This worker's slot in its agent's control channel.

    Args:
        directory: The agent's control directory.
        local_rank: This worker's local rank (its slot).
        local_world_size: Workers on this node.
        hang_bounds: How long it may stay in each section of a step (:meth:`enter`).
    """

    def __init__(self, directory: str, local_rank: int, local_world_size: int, *,
                 hang_bounds: HangBounds | None = None) -> None:
        self._table = ProgressTable(directory, local_world_size)
        self._assignments = AssignmentWatch(directory)
        self._slot = local_rank
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.step = 0
        self.step_at = 0.0
        self.step_s = 0.0
        self._intervals: collections.deque[float] = collections.deque(maxlen=21)
        self.state = WorkerState.STARTING
        current = self._assignments.current()
        self.generation = current.generation if current is not None else 0
        self._on_stuck: Callable[[], None] | None = None
        self._stuck_lost: Callable[[], bool] | None = None
        self._stuck_after = 1.0
        self._in_collective = False
        self._collective_at = 0.0
        self._collective_depth = 0
        self._stuck_in_collective_only = False
        self._clock = SectionClock(hang_bounds or HangBounds())
        self.section = Section.NONE
        self._section_at = 0.0
        self._deadline = 0.0
        self._learns = True  # whether the section's duration teaches its bound (not after a long call)
        self.straggle = 0.0
        self._stacks = open(stacks_path(directory, local_rank), "w")  # noqa: SIM115 - faulthandler keeps writing it
        faulthandler.register(STACK_SIGNAL, file=self._stacks, all_threads=True, chain=False)
        self._closed = threading.Event()
        self._doorbell = Doorbell(directory)
        self._announce()  # the slot is open: the agent learns it at once, not at its next tick
        self._thread = threading.Thread(target=self._liveness, name="elastictrain-liveness", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, local_rank: int, local_world_size: int, *,
                 hang_bounds: HangBounds | None = None) -> WorkerControl | None:
        """The channel of this worker's agent, or ``None`` when the agent recovers by restarting
        (torchrun, or ``--recovery restart``)."""
        directory = os.environ.get(CONTROL_DIR_ENV)
        if not directory or not os.path.isdir(directory):
            return None
        return cls(directory, local_rank, local_world_size, hang_bounds=hang_bounds)

    def _write(self) -> None:
        with self._lock:
            self._table.write(self._slot, pid=self._pid, step=self.step, step_at=self.step_at, step_s=self.step_s,
                              alive_at=now(), state=self.state, generation=self.generation,
                              section=self.section, section_at=self._section_at, deadline=self._deadline,
                              straggle=self.straggle, collective_at=self._collective_at if self._in_collective else 0.0)

    def enter(self, section: int) -> float:
        """Say that this worker is now in ``section`` (a :class:`~elastictrain._control.Section`),
        with the deadline its bound gives; the section it leaves teaches that section's bound.

        Returns:
            The seconds spent in the section it left.
        """
        at = now()
        spent = at - self._section_at if self.section != Section.NONE else 0.0
        if self.section != Section.NONE and self._learns:
            self._clock.observe(self.section, spent)
        self._clock.entered(section)
        bound = self._clock.bound(section)
        self.section, self._section_at, self._learns = section, at, True
        self._deadline = at + bound if bound else 0.0
        self._write()
        return spent

    @contextlib.contextmanager
    def long_call(self, timeout: float) -> Iterator[None]:
        """Let this worker stay in its section for ``timeout`` seconds more than its bound, for a
        long call of the script's own; the section's clock starts again when it returns."""
        self._deadline = max(self._deadline, now() + timeout) if self._deadline else 0.0
        self._learns = False  # the call is no measure of the section
        self._write()
        try:
            yield
        finally:
            bound = self._clock.bound(self.section)
            self._section_at = now()
            self._deadline = self._section_at + bound if bound else 0.0
            self._write()

    def set_straggle(self, factor: float) -> None:
        """Record how many times its peers' median this worker's recent steps took (a gauge)."""
        self.straggle = factor
        self._write()

    def _announce(self) -> None:
        """Write the slot and wake the agent: its state changed."""
        self._write()
        self._doorbell.ring()

    def _liveness(self) -> None:
        while not self._closed.wait(LIVENESS_PERIOD):
            self._write()
            with self._lock:  # the collective neither ends nor a callback changes meanwhile
                self._check_stuck()

    def _check_stuck(self) -> None:
        callback = self._on_stuck
        # A checkpoint save waits for its peers in collectives of its own (its barrier, its broadcasts).
        saving = self.section == Section.SAVE
        if callback is None or self.state != WorkerState.TRAINING or (self._stuck_in_collective_only
                                                                      and not (self._in_collective or saving)):
            return
        current = self._assignments.current()
        # A generation that only adds nodes keeps every peer: none is gone, whatever the wait.
        if (current is None or current.generation <= self.generation
                or (current.joined and current.generation == self.generation + 1)):
            return
        # In flight for several typical steps, not a slow step: since the last step ended, or
        # since the collective (or the save) began (the first step after a re-formation or a save).
        began = self._collective_at if self._in_collective else self._section_at
        since = max(self.step_at, began if self._stuck_in_collective_only else 0.0) or now()
        stalled = now() - since > max(self._stuck_after, _STUCK_STEPS * self.step_s)
        # A peer's connection closed (it died): the wait is doomed, however short so far.
        if stalled or (self._stuck_lost is not None and self._stuck_lost()):
            self._on_stuck = None  # once per generation; set again when training resumes
            try:
                callback()
            except Exception:
                logger.exception("the stuck-collective callback failed")

    def on_stuck(self, callback: Callable[[], None] | None, *, after: float = 1.0,
                 in_collective_only: bool = False, lost: Callable[[], bool] | None = None) -> None:
        """Call ``callback`` (on the liveness thread) if this worker trains, its agent already
        published a newer generation (not one that only adds nodes), and no step finished for
        ``after`` seconds (and :data:`_STUCK_STEPS` of its typical steps; with
        ``in_collective_only``, counted from the collective's start too): a collective waits
        for a peer that is gone. A checkpoint save counts as a collective: it waits for its peers.
        The callback makes it fail now (NCCL's abort, gloo's connections shut down). With
        ``in_collective_only``, only while the worker waits in a step's own collectives (see
        :meth:`collective`): gloo's block the calling thread there, where NCCL's are
        asynchronous and block it at the next synchronization, wherever that is. With ``lost``
        (whether a peer closed one of the group's connections: it died), at once when it says so,
        the newer generation published: a survivor's send to a peer killed mid-transfer fails
        nothing in gloo until its connections are shut down."""
        with self._lock:
            self._on_stuck, self._stuck_after = callback, after
            self._stuck_in_collective_only, self._stuck_lost = in_collective_only, lost

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """Mark the step's own collectives (its backward, its application): only a wait there
        may be taken for stuck (:meth:`on_stuck`), not one in the caller's code between steps
        (an evaluation's), which the next step boundary ends in order.

        One inside a step's compute (:attr:`Section.STEP`: fsdp's all-gathers in the forward)
        owes its peers nothing they are not waiting in too: while in it the worker
        is judged by its process alone (as in :attr:`Section.NONE`), else a peer that waits there
        for a hung rank would pass for hung itself; the step's clock starts again when it returns."""
        owed = self.section == Section.STEP
        if owed:
            self.section, self._deadline = Section.NONE, 0.0
            self._write()
        outer = self._collective_depth > 0  # nested: a wait for the backward's collective inside it
        self._collective_depth += 1
        if not outer:
            self._in_collective, self._collective_at = True, now()
        try:
            yield
        finally:
            self._collective_depth -= 1
            if not outer:
                with self._lock:
                    self._in_collective = False
            if owed:
                self.section, self._section_at = Section.STEP, now()
                bound = self._clock.bound(Section.STEP)
                self._deadline = self._section_at + bound if bound else 0.0
                self._write()

    def set_state(self, state: int) -> None:
        self.state = state
        if state != WorkerState.TRAINING:  # its sections are a training loop's
            self.section, self._deadline = Section.NONE, 0.0
        self._announce()

    def step_done(self, step: int) -> None:
        """Record a finished step and the typical step time (a ``struct`` pack into shared memory)."""
        at = now()
        if self.step_at > 0 and step > self.step:
            self._intervals.append((at - self.step_at) / (step - self.step))
            # The median: a pause between two steps (an evaluation, a wait) does not stretch it.
            self.step_s = statistics.median(self._intervals)
        self.step, self.step_at = step, at
        self._write()

    def due(self) -> Assignment | None:
        """The assignment if the group must re-form at this step boundary (a newer generation
        exists, or the agent said one is coming), else ``None``."""
        current = self._assignments.current()
        if current is not None and (current.pending or current.closed or current.generation > self.generation):
            return current
        return None

    def current(self) -> Assignment | None:
        """The agent's newest assignment."""
        return self._assignments.current()

    def superseded(self) -> bool:
        """Whether the agent announced a generation newer than this worker's (or closed the group)."""
        current = self._assignments.current()
        return current is not None and (current.closed or current.generation > self.generation)

    def wait_for_next(self, timeout: float) -> Assignment:
        """Wait for a generation newer than this worker's; adopt it.

        Raises:
            JobEnded: The agent closed the group.
            TimeoutError: None came within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            current = self._assignments.current()
            if current is not None and current.closed:
                raise JobEnded(current.cause or "the job ended")
            # Adopted even if already marked pending: every local worker forms this generation,
            # then meets the pending mark at its first step boundary and re-forms again.
            if current is not None and current.generation > self.generation:
                self.generation = current.generation
                self.state = WorkerState.BUSY  # forming the new group: not a request for another one
                self._announce()
                return current
            if time.monotonic() > deadline:
                raise TimeoutError(f"no new assignment from the agent within {timeout:g}s "
                                   f"(generation {self.generation})")
            time.sleep(_POLL)

    def close(self) -> None:
        self._closed.set()
        self.state = WorkerState.DONE
        self._announce()
        self._thread.join(timeout=1.0)
        faulthandler.unregister(STACK_SIGNAL)
        self._stacks.close()
        self._table.close()
        self._doorbell.close()
