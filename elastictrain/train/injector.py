"""Faults placed from inside the training loop: :class:`FaultInjector` (as TorchFT's event injector).

A test or the chaos harness names faults in ``ELASTICTRAIN_INJECT``, each
``KIND@RANK:STEP`` (``;``-separated), and the :class:`~elastictrain.train.session.Session` of
every worker applies those of its rank as it starts the step's micro-batches (inside the step:
the rank owes its peers the step's collective):

- ``fail@1:30``: rank 1 raises :class:`InjectedFault` in step 30;
- ``hang_sleep@1:30``: rank 1 blocks in a call for good in step 30 (``time.sleep``: the
  interpreter lock released, process state ``S``);
- ``hang_spin@0:12``: rank 0 spins in Python for good in step 12 (state ``R``);
- ``slow@0:20x12+0.6``: rank 0 takes 0.6 s more in each of the 12 steps from step 20 (a straggler).

The rank may be written ``pidN`` instead: the worker whose process id is N (the chaos harness
picks its target by process). ``ELASTICTRAIN_INJECT_FILE`` names a file of such faults, one a
line, read again whenever it changes (one ``stat`` a step): faults placed while the job runs.

``fail`` and the hangs strike once in the job, not in the replacement that runs the step
again: the first worker to strike creates a marker file in ``ELASTICTRAIN_INJECT_STATE`` (a
directory every node sees; without it, in this worker's control directory, or once per process).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from elastictrain._control import CONTROL_DIR_ENV
from elastictrain.errors import ConfigError

__all__ = ["INJECT_ENV", "INJECT_FILE_ENV", "INJECT_STATE_ENV", "Fault", "FaultInjector", "InjectedFault"]

INJECT_ENV = "ELASTICTRAIN_INJECT"
INJECT_FILE_ENV = "ELASTICTRAIN_INJECT_FILE"
INJECT_STATE_ENV = "ELASTICTRAIN_INJECT_STATE"
KINDS = ("fail", "hang_sleep", "hang_spin", "slow")
_SPEC = re.compile(r"^(?P<kind>[a-z_]+)@(?P<pid>pid)?(?P<rank>\d+):(?P<step>\d+)(?:x(?P<steps>\d+))?"
                   r"(?:\+(?P<seconds>[0-9.]+))?$")


class InjectedFault(RuntimeError):
    """The failure a ``fail`` fault raises."""


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault: ``kind`` on ``rank`` (or the worker of process ``pid``) in ``step`` (and the
    ``steps - 1`` after it, for ``slow``)."""

    kind: str
    rank: int | None
    step: int
    steps: int = 1
    seconds: float = 0.0
    pid: int | None = None

    @classmethod
    def parse(cls, text: str) -> Fault:
        """Read ``KIND@RANK:STEP[xSTEPS][+SECONDS]``.

        Raises:
            ConfigError: Not of that form, or an unknown kind.
        """
        match = _SPEC.match(text.strip())
        if match is None or match["kind"] not in KINDS:
            raise ConfigError(f"{INJECT_ENV}: {text!r} is not KIND@RANK:STEP[xSTEPS][+SECONDS] with KIND one of "
                              f"{', '.join(KINDS)}")
        who = int(match["rank"])
        return cls(match["kind"], None if match["pid"] else who, int(match["step"]), int(match["steps"] or 1),
                   float(match["seconds"] or 0.0), who if match["pid"] else None)

    def strikes(self, rank: int, pid: int, step: int) -> bool:
        """Whether this fault strikes the worker of ``rank`` and ``pid`` in ``step``."""
        who = self.rank == rank if self.pid is None else self.pid == pid
        return who and self.step <= step < self.step + self.steps

    def __str__(self) -> str:
        extra = (f"x{self.steps}" if self.steps != 1 else "") + (f"+{self.seconds:g}" if self.seconds else "")
        who = f"pid{self.pid}" if self.pid is not None else str(self.rank)
        return f"{self.kind}@{who}:{self.step}{extra}"


class FaultInjector:
    """Applies the faults of a rank as its steps start.

    Args:
        faults: The job's faults.
        state_dir: Where a fault that strikes once leaves its marker (None: once per process).
    """

    def __init__(self, faults: list[Fault], state_dir: str | os.PathLike[str] | None,
                 file: str | os.PathLike[str] | None = None) -> None:
        self._fixed = faults
        self._file = Path(file) if file else None
        self._file_stamp: tuple[int, int] | None = None
        self._from_file: list[Fault] = []
        self._state_dir = Path(state_dir) if state_dir else None
        self._struck: set[str] = set()
        self._pid = os.getpid()

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        """The faults of ``ELASTICTRAIN_INJECT`` and ``ELASTICTRAIN_INJECT_FILE``, or None when
        neither is set."""
        spec = os.environ.get(INJECT_ENV, "").strip()
        file = os.environ.get(INJECT_FILE_ENV, "").strip()
        if not spec and not file:
            return None
        return cls(_parse_all(spec.split(";")), os.environ.get(INJECT_STATE_ENV) or os.environ.get(CONTROL_DIR_ENV),
                   file or None)

    @property
    def faults(self) -> list[Fault]:
        """The faults known now (the file's as last read)."""
        if self._file is not None:
            try:
                stat = self._file.stat()
            except FileNotFoundError:
                stat = None
            stamp = (stat.st_ino, stat.st_mtime_ns) if stat is not None else None
            if stamp != self._file_stamp:
                self._file_stamp = stamp
                self._from_file = _parse_all(self._file.read_text().splitlines()) if stat is not None else []
        return self._fixed + self._from_file

    def at_step(self, rank: int, step: int) -> None:
        """Apply the faults of ``rank`` in ``step`` (inside the step, before its micro-batches).

        Raises:
            InjectedFault: A ``fail`` fault.
        """
        for fault in self.faults:
            if not fault.strikes(rank, self._pid, step):
                continue
            if fault.kind == "slow":
                time.sleep(fault.seconds)
                continue
            if not self._strike(fault):
                continue
            if fault.kind == "fail":
                raise InjectedFault(f"injected failure ({fault}) on rank {rank} in step {step}")
            if fault.kind == "hang_sleep":
                while True:
                    time.sleep(3600)
            while True:  # hang_spin: busy in Python for good
                pass

    def _strike(self, fault: Fault) -> bool:
        """Whether ``fault`` strikes now: the first time in the job (or in this process)."""
        name = str(fault)
        if name in self._struck:
            return False
        self._struck.add(name)
        if self._state_dir is None:
            return True
        try:
            fd = os.open(self._state_dir / f"injected-{name}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return False
        os.close(fd)
        return True


def _parse_all(specs: list[str]) -> list[Fault]:
    return [Fault.parse(spec) for spec in specs if spec.strip()]
