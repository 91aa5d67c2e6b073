"""A node's workers under in-process recovery: each its own process, restarted alone.

torch's agent runs a node's workers as one process context: one failure ends them
all, and a membership change restarts them all. For in-process recovery the agent
needs the opposite, and this module gives it:

- :class:`WorkerProcesses`: one torch process context per local worker, so that a
  dead worker is replaced alone and its healthy siblings keep their processes.
- :class:`Channel`: the agent's end of :mod:`elastictrain._control`: it publishes
  each generation's assignment and reads the workers' progress slots.
- :class:`HangDetector`: a worker whose process stopped running (its liveness thread
  is silent past a deadline that follows its measured step time, and it uses no CPU:
  stopped, or asleep for much longer) is hung. Killing it makes its peers' collectives
  fail at once instead of at their timeout (gloo cannot abort a blocked collective).
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

from elastictrain._control import Assignment, Doorbell, Progress, ProgressTable, WorkerState, write_assignment
from elastictrain._process import proc_stat

logger = logging.getLogger(__name__)

__all__ = ["Channel", "FailureBudget", "HangDetector", "WorkerProcesses", "continue_stopped", "exited_cleanly",
           "finished_without_a_word", "process_activity"]


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
    from elastictrain import _torch_compat  # noqa: PLC0415 - imports torch, and the CLI imports this module before it

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
        if fields is not None and fields[0] in _STOPPED:
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
        from elastictrain import _torch_compat  # noqa: PLC0415 - imports torch (see exited_cleanly)

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
                    from torch.distributed.elastic.multiprocessing import RunProcsResult  # noqa: PLC0415

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
        self.directory = tempfile.mkdtemp(prefix="elastictrain-control-")
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


def process_activity(pid: int) -> tuple[float, str] | None:
    """CPU time ``pid`` has used so far (all its threads) and its scheduler state (``R``,
    ``S``, ``D``, ``T``...), from ``/proc``; ``None`` if unknown."""
    fields = proc_stat(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), fields[0]  # utime + stime


_STOPPED = frozenset("Tt")
"""Scheduler states of a process that cannot run: stopped (SIGSTOP, a debugger)."""


_JUDGED = frozenset({WorkerState.TRAINING, WorkerState.RECOVERING})
"""The states in which a worker whose liveness thread falls silent may be hung."""


class HangDetector:
    """Decides which workers are hung, from their progress slots and their processes' activity.

    A worker is a suspect when it trains and its liveness thread (which runs every 0.2 s
    whatever the training loop does) has been silent for longer than its deadline, and
    it is hung if it still has not run ``confirm_s`` later: its process used no CPU time
    in the meantime and is stopped (``SIGSTOP``, a debugger). A process that is merely
    starved of CPU on a loaded machine uses CPU time and is left alone; one that sleeps
    (in a native call that holds the interpreter, a blocking wait on a peer or a store,
    or in the kernel on a disk) is given ``blocked_s``, since it may be waiting for a slow
    peer or device: killing a healthy worker is a false alarm that spends the node's
    failure budget. The deadline is ``factor`` times the worker's typical step (the median of its
    recent intervals between steps, which it measures itself, so that a pause between
    steps does not stretch it), at least ``floor_s``; before its second step (imports,
    model building, restoring) ``startup_s`` applies. A worker blocked in a collective
    that waits for a hung peer is not frozen (its liveness thread runs): it is left
    alone. One recovering is judged as one that
    trains: it says so before it leaves its group, which may freeze it (pytorch#75097), and
    its liveness thread runs while it then waits for the next generation.

    A worker that starts (``STARTING``, or not yet written its slot, which the worker it
    replaces wrote) or forms a group (``BUSY``) may rightly sleep for long, on its peers or
    building its model: it is hung only if its process is stopped, for ``confirm_s`` (and,
    while it has not written its slot, ``floor_s``) without using CPU time. Its peers wait
    for it in the group's formation, which no collective failure ends. A plain script writes
    no slot and is never judged.
    """

    def __init__(self, *, floor_s: float = 2.0, factor: float = 10.0, startup_s: float = 120.0,
                 confirm_s: float = 1.0, blocked_s: float = 60.0,
                 activity: Callable[[int], tuple[float, str] | None] = process_activity) -> None:
        self.floor_s, self.factor, self.startup_s = floor_s, factor, startup_s
        self.confirm_s, self.blocked_s = confirm_s, blocked_s
        self._activity = activity
        self._suspects: dict[int, tuple[int, float, float | None]] = {}  # slot: (pid, since, CPU time then)
        self._reasons: dict[int, str] = {}  # slot: why it was last found hung

    def deadline(self, progress: Progress) -> float:
        if progress.step_s <= 0:
            return self.startup_s
        return max(self.floor_s, self.factor * progress.step_s)

    def hung(self, progress: list[Progress], now: float, live: dict[int, int]) -> list[int]:
        """The slots of hung workers. ``live`` maps each slot to the pid of its running worker: a
        slot still holding a replaced worker's last words is not its replacement's (which has
        not written yet while it starts)."""
        found = []
        for slot, p in enumerate(progress):
            pid = live.get(slot)
            written = bool(p.pid) and p.pid == pid
            if written and p.state in _JUDGED:
                stopped_only, silent = False, now - p.alive_at > self.deadline(p)
            elif pid and p.pid and not (written and p.state == WorkerState.DONE):
                # Its slot was written, by it or by the worker it replaces: it recovers in place
                # (a plain script writes none, and is not judged).
                stopped_only, silent = True, not written or now - p.alive_at > self.floor_s
            else:
                stopped_only = silent = False
            activity = self._activity(pid) if silent and pid else None
            used, state = activity if activity is not None else (None, "?")
            if not silent or (stopped_only and state not in _STOPPED):
                self._suspects.pop(slot, None)
                continue
            suspect = self._suspects.get(slot)
            hold = self.confirm_s if written else max(self.confirm_s, self.floor_s)
            if suspect is None or suspect[0] != pid or used != suspect[2]:
                self._suspects[slot] = (pid, now, used)  # first seen silent, or it ran since
            elif now - suspect[1] >= hold and (state in _STOPPED or now - p.alive_at > self.blocked_s):
                found.append(slot)
                if stopped_only:
                    doing = "forms a group" if written and p.state == WorkerState.BUSY else "starts"
                    self._reasons[slot] = f"its process is stopped (state {state}) while it {doing}"
                else:
                    self._reasons[slot] = (f"its process has not run for {now - p.alive_at:.1f}s (deadline "
                                           f"{self.deadline(p):.1f}s, from its step time; process state {state})")
        return found

    def reason(self, slot: int) -> str:
        """Why :meth:`hung` last found ``slot``'s worker hung, in words."""
        return self._reasons.get(slot, "?")


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

