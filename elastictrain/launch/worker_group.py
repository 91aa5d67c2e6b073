"""A node's workers under in-process recovery: each its own process, restarted alone.

torch's agent runs a node's workers as one process context: one failure ends them
all, and a membership change restarts them all. For in-process recovery the agent
needs the opposite, and this module gives it:

- :class:`WorkerProcesses`: one torch process context per local worker, so that a
  dead worker is replaced alone and its healthy siblings keep their processes.
- :class:`Channel`: the agent's end of :mod:`elastictrain._control`: it publishes
  each generation's :class:`Assignment` and reads the workers' progress slots; a worker finds
  its channel's directory in the environment variable :data:`CONTROL_DIR_ENV`.
- :class:`FailureBudget`: how many of this node's own worker failures a job survives
  within a time window, and how long to back off before replacing one.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import shutil
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from elastictrain._control import (
    CONTROL_DIR_ENV,
    CONTROL_PREFIX,
    Assignment,
    Doorbell,
    Progress,
    ProgressTable,
    write_assignment,
)
from elastictrain._process import proc_stat
from elastictrain.launch.hang_detector import STOPPED

logger = logging.getLogger(__name__)

__all__ = ["CONTROL_DIR_ENV", "Assignment", "Channel", "FailureBudget", "WorkerProcesses", "continue_stopped",
           "exited_cleanly", "finished_without_a_word"]


def exited_cleanly(context: Any) -> bool:
    """Whether every worker process of ``context`` (a torch process context) exited with code 0,
    as their parent reported it. A process that is still running, or whose end its parent has not
    reported yet, has no code: a worker SIGKILLed a moment ago is a zombie until its forkserver
    reaps it, and that is no clean exit.

    Asked when the context's ``wait(0)`` found no result. If its workers all exited cleanly, ask
    ``wait(0)`` once more: a worker that returned from its entrypoint just before has its value
    there. Still none: they left without handing back a return value, as a worker that leaves
    through ``os._exit(0)`` (its own code, or a library's) does, and torch's context would wait for
    that value forever (stock torchrun runs a script as a plain child process, with no such wait):
    the caller takes them as finished (:func:`finished_without_a_word`).
    """
    from elastictrain import _torch_compat

    codes = _torch_compat.worker_exit_codes(context)
    return bool(codes) and all(code == 0 for code in codes)


def continue_stopped(context: Any) -> None:
    """SIGCONT each stopped process (SIGSTOP, a debugger) of ``context`` (a torch process context).

    Called just before the context is closed: a stopped process cannot act on the death
    signal until it is continued, and torch's close waits 30 s for it before it sends
    SIGKILL, while the node's peers form a round without it.
    """
    for pid in context.pids().values():
        fields = proc_stat(pid)
        if fields is not None and fields[0] in STOPPED:
            logger.info("worker pid %d is stopped (state %s): continuing it so that it can act on the "
                        "signal that stops it", pid, fields[0])
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def finished_without_a_word(context: Any) -> None:
    """Close ``context``, whose workers :func:`exited_cleanly` without a result, and say so."""
    logger.info("worker(s) %s exited with code 0 without returning from their entrypoint (os._exit?): "
                "taken as finished", sorted(context.pids().values()))
    context.close()


class WorkerProcesses:
    """The process contexts of a node's workers, one per local rank.

    Args:
        start: Starts the worker of one local rank and returns its process context
            (torch's ``PContext``).
    """

    def __init__(self, start: Callable[[int], Any]) -> None:
        self._start = start
        self.contexts: dict[int, Any] = {}

    def start(self, local_ranks: list[int]) -> dict[int, int]:
        """Start the workers of ``local_ranks`` (each in a context of its own); returns their pids."""
        pids: dict[int, int] = {}
        for local_rank in local_ranks:
            context = self._start(local_rank)
            self.contexts[local_rank] = context
            pids[local_rank] = context.pids()[0]
        return pids

    def ends(self) -> dict[int, int]:
        """For each running worker, by pid, a file descriptor that becomes readable once its end
        is known (see :meth:`Channel.wait`)."""
        from elastictrain import _torch_compat

        return {pid: fd for context in self.contexts.values()
                for pid, fd in _torch_compat.worker_sentinels(context).items()}

    def poll(self) -> dict[int, Any]:
        """The result of every worker that ended since it was started, by local rank."""
        ended = {}
        for local_rank, context in list(self.contexts.items()):
            result = context.wait(0)
            if result is None and exited_cleanly(context):
                result = context.wait(0)  # one that returned just before: its value (see exited_cleanly)
                if result is None:
                    # Imported here: the CLI imports this module (node_setup) before torch.
                    from torch.distributed.elastic.multiprocessing import RunProcsResult

                    finished_without_a_word(context)
                    result = RunProcsResult(return_values={0: None})
            if result is not None:
                ended[local_rank] = result
        return ended

    def pids(self) -> dict[int, int]:
        """The pid of each running worker, by local rank."""
        return {local_rank: context.pids()[0] for local_rank, context in self.contexts.items()}

    def forget(self, local_rank: int) -> None:
        """Drop an ended worker's context (its process is gone)."""
        context = self.contexts.pop(local_rank, None)
        if context is not None:
            context.close()

    def kill(self, local_rank: int) -> None:
        """SIGKILL one worker (a hung one): its peers' collectives fail at once."""
        pid = self.contexts[local_rank].pids()[0] if local_rank in self.contexts else None
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        """Stop every worker: ``death_sig``, then SIGKILL after ``timeout`` (a stopped one is continued)."""
        for context in self.contexts.values():
            continue_stopped(context)
            context.close(death_sig, timeout)
        self.contexts.clear()


class Channel:
    """The agent's end of the control channel (:mod:`elastictrain._control`)."""

    def __init__(self, local_world_size: int) -> None:
        self.directory = tempfile.mkdtemp(prefix=CONTROL_PREFIX)
        self.table = ProgressTable(self.directory, local_world_size, create=True)
        self.doorbell = Doorbell(self.directory, create=True)
        """Rung by the workers when their slots' states change, and by the rendezvous when its
        membership does (see :meth:`wait`)."""
        self._ended: set[int] = set()
        """Worker processes whose end woke a :meth:`wait` already."""
        self.local_world_size = local_world_size
        self.assignment: Assignment | None = None

    def publish(self, assignment: Assignment) -> None:
        self.assignment = assignment
        write_assignment(self.directory, assignment)

    def mark_pending(self, cause: str) -> None:
        """Tell the workers to stop at their next step boundary: the group is about to re-form."""
        if self.assignment is not None and not self.assignment.pending:
            self.publish(replace(self.assignment, pending=True, cause=cause, joined=False))

    def wait(self, timeout: float, ends: dict[int, int] | None = None) -> None:
        """Wait ``timeout`` seconds (a monitor tick), or less: until a worker or the rendezvous
        rings the doorbell, or a worker process ends (``ends``: by pid, a file descriptor that
        becomes readable then, see :meth:`WorkerProcesses.ends`; each end wakes one wait)."""
        ends = ends or {}
        self._ended &= ends.keys()
        poller = select.poll()  # not select(): no limit on the descriptors' numbers
        for fd in [self.doorbell.fileno(), *(fd for pid, fd in ends.items() if pid not in self._ended)]:
            poller.register(fd, select.POLLIN)
        ready = {fd for fd, _ in poller.poll(timeout * 1000)}
        if self.doorbell.fileno() in ready:
            self.doorbell.drain()
        self._ended |= {pid for pid, fd in ends.items() if fd in ready}

    def progress(self) -> list[Progress]:
        return [self.table.read(i) for i in range(self.local_world_size)]

    def close(self) -> None:
        self.table.close()
        self.doorbell.close()
        shutil.rmtree(self.directory, ignore_errors=True)


@dataclass
class FailureBudget:
    """This node's own worker failures a job survives: ``limit`` within ``window_s`` seconds.

    Peers' failures and membership changes never spend it (in-process recovery keeps
    this node's workers running through them). A crash loop, failures in a row of workers
    that never finished a step, waits a back-off before each replacement after the first
    (doubling from ``backoff_first_s`` to ``backoff_max_s``), so that it does not spin. A
    worker that trained before it failed (killed, out of memory, its host's fault) is
    replaced at once: waiting would hold up the whole job, and it is no loop.
    """

    limit: int
    window_s: float = 3600.0
    backoff_first_s: float = 1.0
    backoff_max_s: float = 30.0
    _failures: collections.deque[float] = field(default_factory=collections.deque)
    _streak: int = 0
    """The failures of the crash loop under way: the last failure of a worker that trained
    (or the window's first), and those after it of workers that never finished a step."""

    def _trim(self, now: float) -> None:
        while self._failures and now - self._failures[0] > self.window_s:
            self._failures.popleft()

    def spend(self, now: float, *, trained: bool = False) -> float | None:
        """Record a failure; returns the back-off before replacing the worker, or ``None`` if
        the budget is spent (the job should fail).

        Args:
            now: ``time.monotonic()``.
            trained: Whether the failed worker finished a step in its process (which ends a
                crash loop).
        """
        self._trim(now)
        if len(self._failures) >= self.limit:
            return None
        self._failures.append(now)
        self._streak = 1 if trained else min(self._streak + 1, len(self._failures))
        n = self._streak
        return 0.0 if n <= 1 else min(self.backoff_max_s, self.backoff_first_s * 2 ** (n - 2))

    def used(self, now: float) -> int:
        self._trim(now)
        return len(self._failures)

