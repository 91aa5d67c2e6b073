"""A worker's end of the control channel: liveness, progress, and the agent's assignments.

See :mod:`elastictrain._control` for the channel itself. A daemon thread refreshes
this worker's liveness stamp every ``LIVENESS_PERIOD`` seconds; a process that is
stopped (``SIGSTOP``) or whose interpreter is held by a thread stops refreshing it,
which is how the agent tells a hung worker from one that waits in a collective.
"""

from __future__ import annotations

import collections
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable

from elastictrain._control import CONTROL_DIR_ENV, Assignment, AssignmentWatch, ProgressTable, WorkerState, now

logger = logging.getLogger(__name__)

__all__ = ["JobEnded", "WorkerControl"]

LIVENESS_PERIOD = 0.2
_POLL = 0.01


class JobEnded(Exception):  # noqa: N818 - a signal to leave, not an error
    """The agent closed the group (the job was stopped, or its rendezvous closed)."""


class WorkerControl:
    """This worker's slot in its agent's control channel.

    Args:
        directory: The agent's control directory.
        local_rank: This worker's local rank (its slot).
        local_world_size: Workers on this node.
    """

    def __init__(self, directory: str, local_rank: int, local_world_size: int) -> None:
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
        self._stuck_after = 1.0
        self._closed = threading.Event()
        self._write()
        self._thread = threading.Thread(target=self._liveness, name="elastictrain-liveness", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, local_rank: int, local_world_size: int) -> WorkerControl | None:
        """The channel of this worker's agent, or ``None`` when the agent recovers by restarting
        (torchrun, or ``--recovery restart``)."""
        directory = os.environ.get(CONTROL_DIR_ENV)
        if not directory or not os.path.isdir(directory):
            return None
        return cls(directory, local_rank, local_world_size)

    def _write(self) -> None:
        with self._lock:
            self._table.write(self._slot, pid=self._pid, step=self.step, step_at=self.step_at, step_s=self.step_s,
                              alive_at=now(),
                              state=self.state, generation=self.generation)

    def _liveness(self) -> None:
        while not self._closed.wait(LIVENESS_PERIOD):
            self._write()
            callback = self._on_stuck
            if callback is None or self.state != WorkerState.TRAINING:
                continue
            current = self._assignments.current()
            stalled = now() - (self.step_at or now()) > self._stuck_after
            if current is not None and current.generation > self.generation and stalled:
                self._on_stuck = None  # once per generation; set again when training resumes
                try:
                    callback()
                except Exception:  # noqa: BLE001 - the liveness thread must live on
                    logger.exception("the stuck-collective callback failed")

    def on_stuck(self, callback: Callable[[], None] | None, *, after: float = 1.0) -> None:
        """Call ``callback`` (on the liveness thread) if this worker trains, its agent already
        published a newer generation, and no step finished for ``after`` seconds: a collective
        waits for a peer that is gone. NCCL can then abort its communicator so that the
        collective fails now (gloo cannot: the agent kills a hung peer instead)."""
        self._on_stuck, self._stuck_after = callback, after

    def set_state(self, state: int) -> None:
        self.state = state
        self._write()

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
                self._write()
                return current
            if time.monotonic() > deadline:
                raise TimeoutError(f"no new assignment from the agent within {timeout:g}s "
                                   f"(generation {self.generation})")
            time.sleep(_POLL)

    def close(self) -> None:
        self._closed.set()
        self.state = WorkerState.DONE
        self._write()
        self._thread.join(timeout=1.0)
        self._table.close()
