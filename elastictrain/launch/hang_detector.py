"""Which of a node's workers are hung: :class:`HangDetector`, and what they were doing then
(:func:`capture_stacks`).

A worker is hung in either of two ways:

- **By progress.** A training worker says in its progress slot which section of its step
  loop it is in and until when it may stay there (:class:`~elastictrain._control.Section`,
  :mod:`~elastictrain.train.hang_bounds`). One still inside a step (its peers wait for it in
  the step's collective) or in a checkpoint save past that deadline is hung, whatever its
  process is doing: blocked in a call, deadlocked, spinning in Python, stuck loading data.
  One past its deadline between two steps (the script's own code) is only warned about.
- **By its process.** A worker whose process stopped running (its liveness thread is
  silent past a deadline that follows its measured step time, and it uses no CPU: stopped,
  or asleep for much longer) is hung; so is one stopped while it starts or forms a group.

Killing a hung worker makes its peers' collectives fail at once instead of at their timeout
(gloo cannot abort a blocked collective); its agent replaces it, and its peers keep their
processes. Before that, its agent asks it for its threads' Python stacks
(:data:`~elastictrain._control.STACK_SIGNAL`), so that the report says where it was stuck.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from elastictrain._control import STACK_SIGNAL, Progress, Section, WorkerState
from elastictrain._process import proc_stat

__all__ = ["STOPPED", "HangDetector", "Stacks", "capture_stacks", "process_activity"]


def process_activity(pid: int) -> tuple[float, str] | None:
    """CPU time ``pid`` has used so far (all its threads) and its scheduler state (``R``,
    ``S``, ``D``, ``T``...), from ``/proc``; ``None`` if unknown."""
    fields = proc_stat(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), fields[0]  # utime + stime


STOPPED = frozenset("Tt")
"""Scheduler states of a process that cannot run: stopped (SIGSTOP, a debugger)."""


_JUDGED = frozenset({WorkerState.TRAINING, WorkerState.RECOVERING})
"""The states in which a worker whose liveness thread falls silent may be hung."""

_OWED = frozenset({Section.STEP, Section.SAVE})
"""The sections in which a worker owes its peers a collective."""


class HangDetector:
    """Decides which workers are hung, from their progress slots and their processes' activity.

    **By progress**: a training worker in a section that owes its peers a collective (a step
    before its gradient collective, a checkpoint save) past the deadline it wrote is hung at
    once; its bound was learnt from its own sections (see :mod:`~elastictrain.train.hang_bounds`).
    One between two steps past its deadline is *overdue* (:meth:`overdue`): warned about once.

    **By its process**: a worker is a suspect when it trains and its liveness thread (which runs
    every 0.2 s whatever the training loop does) has been silent for longer than its deadline, and
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
        self._warned: set[tuple[int, float]] = set()  # (pid, section_at) of the overdue ones said

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
            if written and p.state == WorkerState.TRAINING and p.section in _OWED and 0 < p.deadline < now:
                found.append(slot)
                self._suspects.pop(slot, None)
                self._reasons[slot] = (f"{_where(p)} for {now - p.section_at:.1f}s, past its bound of "
                                       f"{p.deadline - p.section_at:.1f}s, while its peers wait for it")
                continue
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
            if not silent or (stopped_only and state not in STOPPED):
                self._suspects.pop(slot, None)
                continue
            suspect = self._suspects.get(slot)
            hold = self.confirm_s if written else max(self.confirm_s, self.floor_s)
            if suspect is None or suspect[0] != pid or used != suspect[2]:
                self._suspects[slot] = (pid, now, used)  # first seen silent, or it ran since
            elif now - suspect[1] >= hold and (state in STOPPED or now - p.alive_at > self.blocked_s):
                found.append(slot)
                if stopped_only:
                    doing = "forms a group" if written and p.state == WorkerState.BUSY else "starts"
                    self._reasons[slot] = f"its process is stopped (state {state}) while it {doing}"
                else:
                    self._reasons[slot] = (f"its process has not run for {now - p.alive_at:.1f}s (deadline "
                                           f"{self.deadline(p):.1f}s, from its step time; process state {state})")
        return found

    def overdue(self, progress: list[Progress], now: float, live: dict[int, int]) -> list[int]:
        """The slots of workers whose script has run between two steps past their deadline, each
        once per stretch: not hung (their peers wait in no collective of theirs yet), but worth a
        word."""
        found = []
        for slot, p in enumerate(progress):
            pid = live.get(slot)
            if (pid and p.pid == pid and p.state == WorkerState.TRAINING and p.section == Section.BETWEEN
                    and 0 < p.deadline < now and (pid, p.section_at) not in self._warned):
                self._warned.add((pid, p.section_at))
                found.append(slot)
        return found

    def reason(self, slot: int) -> str:
        """Why :meth:`hung` last found ``slot``'s worker hung, in words."""
        return self._reasons.get(slot, "?")


def _where(p: Progress) -> str:
    if p.section == Section.STEP:
        return f"inside step {p.step + 1} (before its gradient collective)"
    if p.section == Section.SAVE:
        return f"in the checkpoint save after step {p.step}"
    return f"{Section.NAMES.get(p.section, '?')} after step {p.step}"


_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.MULTILINE)
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>.*)$')


@dataclass(frozen=True, slots=True)
class Stacks:
    """A worker's Python stacks, as ``faulthandler`` wrote them."""

    text: str
    """Every thread's stack, innermost frame first."""

    def main_thread(self, frames: int = 6) -> list[str]:
        """The innermost ``frames`` frames of the thread that runs the script (the one with a
        module's frame: other threads start in ``threading``), as ``file:line in function``; the
        first thread's if none has one."""
        threads = []
        for block in _THREAD.split(self.text)[3::3]:
            parsed = [m for m in map(_FRAME.match, block.splitlines()) if m]
            threads.append([f"{m['file']}:{m['line']} in {m['func']}" for m in parsed])
        main = next((t for t in threads if any(f.endswith(" in <module>") for f in t)), threads[0] if threads else [])
        return main[:frames]


def capture_stacks(pid: int, path: str | os.PathLike[str], timeout: float = 1.0) -> Stacks | None:
    """Ask worker ``pid`` for its threads' Python stacks (:data:`~elastictrain._control.STACK_SIGNAL`)
    and read what it wrote to ``path`` (its stacks file); None if it wrote nothing within
    ``timeout`` seconds (a stopped process, or one that registered no handler)."""
    fields = proc_stat(pid)
    if fields is None or fields[0] in STOPPED:
        return None  # it could not answer: the signal would wait for a SIGCONT
    file = Path(path)
    try:
        offset = file.stat().st_size
        os.kill(pid, STACK_SIGNAL)
    except (FileNotFoundError, ProcessLookupError):
        return None
    deadline, size, settled = time.monotonic() + timeout, offset, 0
    while time.monotonic() < deadline:
        time.sleep(0.02)
        grown = file.stat().st_size
        settled = settled + 1 if grown == size and grown > offset else 0
        size = grown
        if settled >= 3:  # written, and nothing more for 60 ms
            break
    if size <= offset:
        return None
    with open(file, "rb") as stacks:
        stacks.seek(offset)
        return Stacks(stacks.read().decode(errors="replace"))

