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

__all__ = ["INJECT_ENV", "INJECT_STATE_ENV", "Fault", "FaultInjector", "InjectedFault"]

INJECT_ENV = "ELASTICTRAIN_INJECT"
INJECT_STATE_ENV = "ELASTICTRAIN_INJECT_STATE"
KINDS = ("fail", "hang_sleep", "hang_spin", "slow")
_SPEC = re.compile(r"^(?P<kind>[a-z_]+)@(?P<rank>\d+):(?P<step>\d+)(?:x(?P<steps>\d+))?(?:\+(?P<seconds>[0-9.]+))?$")


class InjectedFault(RuntimeError):
    """The failure a ``fail`` fault raises."""


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault: ``kind`` on ``rank`` in ``step`` (and the ``steps - 1`` after it, for ``slow``)."""

    kind: str
    rank: int
    step: int
    steps: int = 1
    seconds: float = 0.0

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
        return cls(match["kind"], int(match["rank"]), int(match["step"]), int(match["steps"] or 1),
                   float(match["seconds"] or 0.0))

    def __str__(self) -> str:
        extra = (f"x{self.steps}" if self.steps != 1 else "") + (f"+{self.seconds:g}" if self.seconds else "")
        return f"{self.kind}@{self.rank}:{self.step}{extra}"


class FaultInjector:
    """Applies the faults of a rank as its steps start.

    Args:
        faults: The job's faults.
        state_dir: Where a fault that strikes once leaves its marker (None: once per process).
    """

    def __init__(self, faults: list[Fault], state_dir: str | os.PathLike[str] | None) -> None:
        self.faults = faults
        self._state_dir = Path(state_dir) if state_dir else None
        self._struck: set[int] = set()

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        """The faults of ``ELASTICTRAIN_INJECT``, or None when it names none."""
        spec = os.environ.get(INJECT_ENV, "").strip()
        if not spec:
            return None
        faults = [Fault.parse(part) for part in spec.split(";") if part.strip()]
        return cls(faults, os.environ.get(INJECT_STATE_ENV) or os.environ.get(CONTROL_DIR_ENV))

    def at_step(self, rank: int, step: int) -> None:
        """Apply the faults of ``rank`` in ``step`` (inside the step, before its micro-batches).

        Raises:
            InjectedFault: A ``fail`` fault.
        """
        for index, fault in enumerate(self.faults):
            if fault.rank != rank or not fault.step <= step < fault.step + fault.steps:
                continue
            if fault.kind == "slow":
                time.sleep(fault.seconds)
                continue
            if not self._strike(index):
                continue
            if fault.kind == "fail":
                raise InjectedFault(f"injected failure ({fault}) on rank {rank} in step {step}")
            if fault.kind == "hang_sleep":
                while True:
                    time.sleep(3600)
            while True:  # hang_spin: busy in Python for good
                pass

    def _strike(self, index: int) -> bool:
        """Whether fault ``index`` strikes now: the first time in the job (or in this process)."""
        if index in self._struck:
            return False
        self._struck.add(index)
        if self._state_dir is None:
            return True
        try:
            fd = os.open(self._state_dir / f"injected-{index}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return False
        os.close(fd)
        return True
