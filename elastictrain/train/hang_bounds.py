"""How long a worker may stay in each section of its step loop: :class:`HangBounds` (the policy)
and :class:`SectionClock` (the bounds it learns from the sections it has seen).

A rank whose step was handed out and that has not reached the step's gradient collective
owes its peers that collective: they wait in it. Past its bound it is hung, whether it is
blocked in a call, deadlocked, spinning in Python or stuck loading data (its agent captures
its stacks, kills it and replaces it; see :class:`~elastictrain.launch.worker_group.HangDetector`).
The bound follows what this rank has seen, as NVIDIA's resiliency extension does: a safety
``factor`` over the longest recent section of the kind, warm-up excluded, never under a
floor, so that it fits a 50 ms step and a 30 s step alike. The first step of a process
(compilation, warming caches) has a bound of its own, and a script widens the bound around a
long call of its own with :meth:`Session.long_call <elastictrain.train.session.Session.long_call>`.

Nothing here imports torch.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from datetime import timedelta

from elastictrain._control import Section
from elastictrain.errors import ConfigError

__all__ = ["HangBounds", "SectionClock"]

_REMEMBERED = 200
"""Sections of each kind whose durations the bound follows (the most recent)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HangBounds:
    """When a rank that owes its peers a collective is hung (``Session(hang_bounds=...)``)."""

    factor: float = 10.0
    """The bound of a section is this many times the longest of its recent kind (at least its floor)."""

    step_floor: timedelta = timedelta(seconds=5)
    """The least time a step may take until its gradient collective before the rank is hung."""

    first_step: timedelta = timedelta(minutes=10)
    """The bound of a process's first ``warmup_steps`` steps (compilation, warming caches)."""

    save_floor: timedelta = timedelta(minutes=10)
    """The least time a checkpoint save may take on a rank before the rank is hung."""

    between_floor: timedelta = timedelta(seconds=60)
    """The least time the user's code may run between two steps before its agent warns (with the
    rank's stacks); it is never killed for it: until the group's collective timeout it is the
    script's business."""

    warmup_steps: int = 2
    """A process's first steps, whose durations the step bound does not learn."""

    def __post_init__(self) -> None:
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) or not self.factor >= 1:
            raise ConfigError(f"hang_bounds.factor must be a number >= 1, got {self.factor!r}")
        for name in ("step_floor", "first_step", "save_floor", "between_floor"):
            value = getattr(self, name)
            if not isinstance(value, timedelta) or value <= timedelta(0):
                raise ConfigError(f"hang_bounds.{name} must be a positive timedelta, got {value!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 1:
            raise ConfigError(f"hang_bounds.warmup_steps must be a positive int, got {self.warmup_steps!r}")


class SectionClock:
    """The bound of each section, from ``bounds`` and the sections this process has seen.

    Args:
        bounds: The policy.
    """

    def __init__(self, bounds: HangBounds) -> None:
        self.bounds = bounds
        self._seen: dict[int, collections.deque[float]] = {
            section: collections.deque(maxlen=_REMEMBERED) for section in (Section.STEP, Section.SAVE, Section.BETWEEN)}
        self.steps = 0
        """Steps this process has entered."""

    def bound(self, section: int) -> float:
        """Seconds a rank may stay in ``section`` (0: no bound)."""
        bounds = self.bounds
        if section == Section.STEP:
            if self.steps <= bounds.warmup_steps:
                return bounds.first_step.total_seconds()
            floor = bounds.step_floor
        elif section == Section.SAVE:
            floor = bounds.save_floor
        elif section == Section.BETWEEN:
            floor = bounds.between_floor
        else:
            return 0.0
        seen = self._seen[section]
        return max(floor.total_seconds(), bounds.factor * max(seen, default=0.0))

    def entered(self, section: int) -> None:
        """Count a section entered (the warm-up counts steps)."""
        if section == Section.STEP:
            self.steps += 1

    def observe(self, section: int, seconds: float) -> None:
        """Learn a section that ended after ``seconds`` (a step of the warm-up teaches nothing)."""
        if section in self._seen and not (section == Section.STEP and self.steps <= self.bounds.warmup_steps):
            self._seen[section].append(seconds)
