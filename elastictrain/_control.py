"""The channel between a node agent and its workers during in-process recovery.

A directory per agent (``ELASTICTRAIN_CONTROL_DIR``) holds:

- ``assignment.json``: what the agent tells its workers, rewritten atomically: the
  current *generation* (one per rendezvous round the agent joined), each local
  worker's rank, the world size, where rank 0's store listens, and ``pending`` once
  the agent knows the group must be re-formed (a node left or waits to join). A
  worker reads it at each step boundary (one ``stat`` while nothing changed).
- ``progress``: a small shared-memory table, one slot per local worker, that each
  worker writes and the agent reads: its pid, its step count, when it last
  finished a step and its typical step time, when its liveness thread last ran, what it is doing (training,
  recovering, busy in a long operation), which section of a step it is in (:class:`Section`) since when
  and until when it may stay there, and how much slower than its peers it computes. Writing a slot is a
  ``struct`` pack into an ``mmap``: nothing measurable per step.
- ``stacks-<slot>``: where a worker's Python stacks go when its agent asks for them (:data:`STACK_SIGNAL`).
- ``doorbell``: a FIFO that wakes the agent between its monitor ticks. A worker rings it
  when its slot's state changes (its slot opened, its collective failed), so that the agent
  acts on it at once rather than at its next tick; the agent's rendezvous rings it too.

Nothing here imports torch: the agent and the workers both use it.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import signal
import struct
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "CONTROL_DIR_ENV",
    "RECOVERY_MODES",
    "Assignment",
    "Doorbell",
    "ProgressTable",
    "CONTROL_PREFIX",
    "SLOT_SIZE",
    "STACK_SIGNAL",
    "Section",
    "WorkerState",
    "read_assignment",
    "stacks_path",
    "write_assignment",
]

CONTROL_DIR_ENV = "ELASTICTRAIN_CONTROL_DIR"
"""Environment variable naming the control directory (set by the agent for its workers)."""

RECOVERY_MODES = ("in-process", "restart")
"""How a node's agent recovers (``--recovery``): in the workers' processes, through this channel,
or by restarting them (torch's way)."""

_ASSIGNMENT = "assignment.json"
_PROGRESS = "progress"
_DOORBELL = "doorbell"
_SCHEMA = 1

STACK_SIGNAL = signal.SIGUSR2
"""The signal on which a worker writes the Python stack of each of its threads to its stacks file
(``faulthandler``, which needs no interpreter lock: a worker spinning in Python or blocked in a
native call answers it too)."""


def stacks_path(directory: str | os.PathLike[str], slot: int) -> Path:
    """Where the worker of ``slot`` writes its stacks (see :data:`STACK_SIGNAL`)."""
    return Path(directory) / f"stacks-{slot}"


class WorkerState:
    """What a worker says it is doing (the ``state`` of its progress slot)."""

    STARTING = 0
    TRAINING = 1
    RECOVERING = 2
    """Its group broke (a collective failed) or was told to re-form: it waits for the next generation."""
    BUSY = 3
    """Forming the next generation's group (waiting for its peers, agreeing on and receiving the
    state): not a hang, and not a request for another generation."""
    DONE = 4


class Section:
    """Where a training worker is in its step loop (the ``section`` of its progress slot).

    A worker in :attr:`STEP` or :attr:`SAVE` owes its peers a collective: past the slot's
    ``deadline`` it is hung, whatever its process is doing. :attr:`BETWEEN` is the user's code
    between two steps: past the deadline its agent only warns."""

    NONE = 0
    """Not in a step (starting, forming a group, recovering): judged by its process alone."""
    STEP = 1
    """A step was handed out (its data loading, forward and backward) and the rank has not yet
    reached the step's gradient collective."""
    SAVE = 2
    """Saving a checkpoint (its peers wait for it at the save's barrier)."""
    BETWEEN = 3
    """The user's code after a step's micro-batches, before it asks for the next step."""

    NAMES = {NONE: "none", STEP: "step", SAVE: "checkpoint save", BETWEEN: "between steps"}


@dataclass(frozen=True, slots=True)
class Assignment:
    """One generation of the agent's worker group."""

    generation: int
    round: int
    world_size: int
    master_addr: str
    master_port: int
    ranks: dict[str, int] = field(default_factory=dict)
    """Global rank of each local rank (JSON keys are strings)."""
    group_rank: int = 0
    group_world_size: int = 1
    pending: bool = False
    """The agent re-forms the group soon: stop at the next step boundary."""
    cause: str = ""
    """Why the last (or pending) re-formation happens, for events and logs."""
    closed: bool = False
    """The job is over (stopped, or the rendezvous closed): leave."""
    joined: bool = False
    """Nodes joined and none left: every peer of the previous generation lives on in this one."""
    fault: dict[str, Any] = field(default_factory=dict)
    """The fault that caused this re-formation, as the node that saw it said it
    (:meth:`elastictrain._fault.Fault.to_json`); empty when none is known."""

    def rank_of(self, local_rank: int) -> int | None:
        return self.ranks.get(str(local_rank))


def write_assignment(directory: str | os.PathLike[str], assignment: Assignment) -> None:
    """Publish ``assignment`` atomically (readers see the old or the new one, never half)."""
    path = Path(directory)
    fd, tmp = tempfile.mkstemp(dir=path, prefix=".assignment-")
    with os.fdopen(fd, "w") as out:
        json.dump({"schema": _SCHEMA, **asdict(assignment)}, out)
    os.replace(tmp, path / _ASSIGNMENT)


def read_assignment(directory: str | os.PathLike[str]) -> Assignment | None:
    """The current assignment, or ``None`` if the agent has published none yet."""
    try:
        raw: dict[str, Any] = json.loads((Path(directory) / _ASSIGNMENT).read_text())
    except FileNotFoundError:
        return None
    if raw.pop("schema", None) != _SCHEMA:
        raise ValueError(f"{Path(directory) / _ASSIGNMENT} is not an assignment of this elastictrain version")
    return Assignment(**raw)


class AssignmentWatch:
    """Reads the assignment again only when its file changed (one ``stat`` per call otherwise)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self._path = Path(directory) / _ASSIGNMENT
        self._directory = directory
        self._stamp: tuple[int, int] | None = None
        self._current: Assignment | None = None

    def current(self) -> Assignment | None:
        try:
            stat = self._path.stat()
        except FileNotFoundError:
            return None
        stamp = (stat.st_ino, stat.st_mtime_ns)
        if stamp != self._stamp:
            self._current = read_assignment(self._directory)
            self._stamp = stamp
        return self._current


# One slot per local worker: pid, step, step_at, step_s, alive_at, state, generation,
# section, section_at, deadline, straggle, collective_at.
_SLOT = struct.Struct("<qqdddqqqdddd")
SLOT_SIZE = _SLOT.size
"""Bytes a slot takes in the progress file (its size is this times the slots)."""

CONTROL_PREFIX = "elastictrain-control-"
"""How the name of an agent's control directory starts (in the system's temporary directory)."""


@dataclass(frozen=True, slots=True)
class Progress:
    """One worker's slot, as last written."""

    pid: int
    step: int
    step_at: float
    """``time.monotonic()`` when it last finished a step (0: none yet)."""
    step_s: float
    """Its typical step: the median of its recent intervals between steps (0: fewer than two steps)."""
    alive_at: float
    """``time.monotonic()`` when its liveness thread last ran."""
    state: int
    generation: int
    """The generation it trains in (or recovers from)."""
    section: int = Section.NONE
    """Where it is in its step loop (:class:`Section`)."""
    section_at: float = 0.0
    """When it entered that section."""
    deadline: float = 0.0
    """When it is hung if still in that section (0: no bound)."""
    straggle: float = 0.0
    """How many times its peers' median its recent steps' compute took (0: not measured yet)."""
    collective_at: float = 0.0
    """When it began to wait in a step's collective (0: it waits in none), as its liveness thread last wrote."""


class ProgressTable:
    """The shared progress slots of a node's workers (an ``mmap`` of a file in the control directory).

    Args:
        directory: The control directory.
        slots: Local workers of the node.
        create: The agent creates (and zeroes) the table; workers open it.
    """

    def __init__(self, directory: str | os.PathLike[str], slots: int, *, create: bool = False) -> None:
        path = Path(directory) / _PROGRESS
        size = _SLOT.size * max(1, slots)
        if create:
            path.write_bytes(b"\0" * size)
        self._file = open(path, "r+b")  # noqa: SIM115 - lives as long as the table
        self._map = mmap.mmap(self._file.fileno(), size)
        self.slots = slots

    def write(self, slot: int, *, pid: int, step: int, step_at: float, step_s: float, alive_at: float, state: int,
              generation: int, section: int = Section.NONE, section_at: float = 0.0, deadline: float = 0.0,
              straggle: float = 0.0, collective_at: float = 0.0) -> None:
        _SLOT.pack_into(self._map, slot * _SLOT.size, pid, step, step_at, step_s, alive_at, state, generation,
                        section, section_at, deadline, straggle, collective_at)

    def read(self, slot: int) -> Progress:
        return Progress(*_SLOT.unpack_from(self._map, slot * _SLOT.size))

    def close(self) -> None:
        self._map.close()
        self._file.close()


class Doorbell:
    """The control directory's FIFO (see the module docstring): :meth:`ring` makes it readable
    (:meth:`fileno`) until the agent drains it (:meth:`drain`). Many rings before a drain wake
    the agent once: a ring says "look again", not what changed.

    Args:
        directory: The control directory.
        create: The agent creates the FIFO and waits on it; workers only ring it.
    """

    def __init__(self, directory: str | os.PathLike[str], *, create: bool = False) -> None:
        path = Path(directory) / _DOORBELL
        self._lock = threading.Lock()  # ring() runs on other threads too (the rendezvous' watches)
        self._reader: int | None = None
        if create:
            os.mkfifo(path, 0o600)
            # First: opening a FIFO to write, without blocking, needs a reader.
            self._reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            # The agent keeps a writer open too: with none, a FIFO reads as at its end, at once.
            self._writer: int | None = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no FIFO, or no agent to read it: the agent sees the slot at its next tick
            self._writer = None

    def ring(self) -> None:
        """Wake the agent (never blocks; nothing happens if nobody reads)."""
        with self._lock:
            if self._writer is None:
                return
            # Full (BlockingIOError): rings are pending anyway. No reader (BrokenPipeError): nobody to wake.
            with contextlib.suppress(OSError):
                os.write(self._writer, b"\0")

    def fileno(self) -> int:
        """What the agent waits on (``poll``): readable once rung."""
        assert self._reader is not None  # noqa: S101 - the agent's end only
        return self._reader

    def drain(self) -> None:
        """Take every ring so far (the next wait waits for a new one)."""
        with contextlib.suppress(BlockingIOError):
            os.read(self.fileno(), 65536)

    def close(self) -> None:
        with self._lock:
            for fd in (self._reader, self._writer):
                if fd is not None:
                    os.close(fd)
            self._reader = self._writer = None


def now() -> float:
    """The clock progress slots use (system-wide monotonic, the same for agent and workers)."""
    return time.monotonic()
